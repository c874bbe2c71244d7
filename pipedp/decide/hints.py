"""Hints: what a lever the plan may not pull (another precision, accumulation) would have given on this device.

Each is timed once, after the choice, and never applied: the plan keeps the
user's precision and math. A line is given only where the step ran at least
``HINT_FACTOR`` faster (more than trial noise), and a trial that fails gives
no hint rather than an error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .config import Config
from .timings import Timings, bar_of

if TYPE_CHECKING:
    from .search import Budget, Space

__all__ = ["precision_hint", "accumulation_hint", "HINT_FACTOR"]

HINT_FACTOR = 1.10  # another precision is hinted at only when it ran at least this much faster


def precision_hint(space: Space, trials: Timings, budget: Budget, eager: Config) -> str:
    """One line when ``space.hint``'s precision ran the plain step measurably faster (timed, never applied)."""
    if space.hint is None or eager not in trials.ms:
        return ""
    other = replace(eager, precision=space.hint)
    if budget.left() < trials.cost_s(other):
        return ""
    try:
        trials.time(other, 1)  # a rough factor is enough for a hint
        if other in trials.cold and eager not in trials.cold and budget.left() >= trials.best(other) / 1e3:
            trials.time(other, 1)  # a warm plain step against a warm one (a first call is an upper bound)
    except Exception:  # noqa: BLE001 - a model that cannot run in that precision gets no hint, not an error
        return ""
    # First call against first call where the plain step has no other timing; warm against warm, or, where
    # the budget refused the second timing, warm against a first call: understated, never overstated.
    factor = trials.best(eager) / trials.best(other)
    if factor < HINT_FACTOR:
        return ""
    return (f"hint: {space.hint} autocast ran the plain step {factor:.2f}x faster here; pass "
            f"precision='{space.hint}' if the model trains well in it (the plan keeps your precision)")


def accumulation_hint(space: Space, trials: Timings, budget: Budget, chosen: Config) -> str:
    """One line when accumulating over ``space.accumulate`` microbatches ran measurably faster than the plan
    that keeps the user's math (timed once, never applied: it would change what BatchNorm normalises over)."""
    if space.accumulate is None:
        return ""
    ms = trials.best(chosen) if chosen in trials.ms else trials.best(bar_of(trials))
    other = space.plan(1, space.accumulate, chosen.channels_last, False)
    if other in trials.ms or budget.left() < trials.cost_s(other):
        return ""
    try:
        trials.time(other, 1)
    except Exception:  # noqa: BLE001 - a configuration that cannot run gives no hint, not an error
        return ""
    factor = ms / trials.best(other)
    if factor < HINT_FACTOR:
        return ""
    return (f"hint: accumulation over {space.accumulate} microbatches ran the step {factor:.2f}x faster here "
            f"(BatchNorm then normalises per microbatch, not over the batch); pass microbatches='auto' to let the "
            f"plan choose it")
