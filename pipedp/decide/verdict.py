"""The verdict on the timed search: a plan is chosen only where it beats the bar by the margin.

Otherwise the plan is the plain step (the bar's, or one nearer the user's
own within the noise), or, where the user fixed the microbatches, the
fastest plan with them. Ties within the noise go to the configuration
nearest the user's step, so the same command chooses alike on every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import Config
from .timings import Timings, bar_of

if TYPE_CHECKING:
    from .search import Space

__all__ = ["verdict", "distance"]


def verdict(space: Space, trials: Timings, ranked: list[Config], margin: float, on: str,
            notes: list[str]) -> tuple[Config, Config]:
    """The chosen configuration and the bar: a plan only if it beats the bar by ``margin``."""
    bar = bar_of(trials)
    bar_ms = trials.best(bar)
    best = ranked[0] if ranked else None
    if best is not None and trials.best(best) <= bar_ms * (1 - margin):
        best = _nearest(trials, [c for c in ranked if trials.best(c) <= bar_ms * (1 - margin)], margin)
        notes.append(f"stages=auto chose {best.label} by {on}: {trials.best(best):.2f} ms per step, "
                     f"{bar_ms / trials.best(best):.2f}x the strongest alternative, {bar.label} ({bar_ms:.2f} ms)")
        return best, bar
    if space.walk_kernels and best is not None and (bar.run_by_pipedp(kernels=True) in trials.ms
                                                    or 1 not in space.microbatches):
        notes.append(f"stages=auto: no plan beat the strongest alternative, {bar.label} ({bar_ms:.2f} ms), by "
                     f"{margin:.0%} in {on}; kernels='tvm' runs every plan on the tuned kernels: kept the fastest "
                     f"of them, {best.label} ({trials.best(best):.2f} ms)")
        return best, bar
    if 1 in space.microbatches or best is None:
        # The bar itself always competes (its first call, if cold, is an upper bound and still the fastest).
        own = _nearest(trials, [c for c in trials.ms if c.own and c.precision is None
                                and (c not in trials.cold or c == bar)], margin)
        if own == bar:
            notes.append(f"stages=auto: no plan beat the strongest alternative, {bar.label} ({bar_ms:.2f} ms), "
                         f"by {margin:.0%} in {on}: the plan is that step itself")
        else:
            notes.append(f"stages=auto: no plan beat the strongest alternative, {bar.label} ({bar_ms:.2f} ms), "
                         f"by {margin:.0%} in {on}: the plan is your step as {own.label} ({trials.best(own):.2f} ms), "
                         f"within {margin:.0%} of it and nearer your own (a tie within the noise goes the same way "
                         f"every run)")
        return own.run_by_pipedp(kernels=space.walk_kernels), bar
    notes.append(f"stages=auto: no plan beat the strongest alternative, {bar.label} ({bar_ms:.2f} ms), by "
                 f"{margin:.0%} in {on}; kept the fastest with the given microbatches, {best.label} "
                 f"({trials.best(best):.2f} ms, {bar_ms / trials.best(best):.2f}x the bar: the measured cost of "
                 f"that count): microbatches=None (your step's math) or 'auto' lets the plan be the plain step")
    return best, bar


def distance(c: Config) -> int:
    """How many levers ``c`` pulls that the user's own step does not: stages, microbatches, layout, compile,
    concurrency, thread teams, tuned kernels."""
    return sum((len(c.counts) > 1, c.microbatches > 1, c.channels_last, c.compiled, c.concurrent,
                c.threads is not None, c.kernels))


def _nearest(trials: Timings, candidates: list[Config], margin: float) -> Config:
    """Of ``candidates``, the nearest the user's step among those within ``margin`` of the fastest.

    A tie within the trial noise then goes the same way on every run of one
    command (the fewest levers pulled, then the fewest stages and
    microbatches, then the faster), where the fastest alone would flip with
    the noise.
    """
    fastest = min(trials.best(c) for c in candidates)
    close = [c for c in candidates if trials.best(c) <= fastest * (1 + margin)]
    return min(close, key=lambda c: (distance(c), len(c.counts), c.microbatches, trials.best(c)))
