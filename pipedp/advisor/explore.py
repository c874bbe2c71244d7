"""Which batch size to train next for accuracy: only one that could still beat the best plan so far.

The accuracy model is a lower bound, so a batch size no run measured looks
worse than it may be: a smaller batch than every run is bounded by the runs
at larger batches, though it may reach the target in fewer epochs. Its
*optimistic* epochs are the fewest at which the model's upper bound allows
the target (no upper bound: one epoch). If even that optimistic plan costs
less than the best plan found so far, the batch is worth a run; and that run
can stop as soon as it could no longer win: after ``cap`` epochs, the most
whose cost still undercuts the best plan. This is branch and bound over batch
sizes, and it keeps accuracy profiling to a few truncated runs where a grid
search trains every batch size to the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from .accuracy import AccuracyBound
from .choose import Targets, steps_per_epoch
from .space import Config

__all__ = ["Probe", "next_probe"]


@dataclass(frozen=True)
class Probe:
    """Train ``batch`` for at most ``cap`` epochs; ``optimistic_cost``: the least a plan at it could cost."""

    batch: int
    cap: int
    optimistic_cost: float


def _optimistic_epochs(accuracy: AccuracyBound, batch: int, targets: Targets) -> int | None:
    for e in range(1, targets.max_epochs + 1):
        hi = accuracy.upper(batch, e)
        if hi is None or hi >= targets.accuracy:
            return e
    return None


def next_probe(candidates: Sequence[Config], step_s: Callable[[Config], float], accuracy: AccuracyBound,
               dataset_size: int, targets: Targets, best_cost: float, measured: Collection[int],
               max_cap: int) -> Probe | None:
    """The unmeasured batch whose optimistic plan is cheapest, if it undercuts ``best_cost`` (None: none does).

    ``max_cap`` bounds a run's epochs when there is no plan yet (``best_cost`` infinite).
    """
    best: Probe | None = None
    for batch in sorted({c.batch for c in candidates} - set(measured)):
        e = _optimistic_epochs(accuracy, batch, targets)
        if e is None:
            continue
        per_epoch = [(c.resources * steps_per_epoch(dataset_size, batch) * step_s(c), c) for c in candidates
                     if c.batch == batch]
        fits = [(k, c) for k, c in per_epoch if e * k / c.resources <= targets.time_limit_s]
        if not fits:
            continue
        k = min(k for k, _ in fits)
        if e * k >= best_cost:
            continue
        cap = min(targets.max_epochs, max_cap if math.isinf(best_cost) else math.ceil(best_cost / k) - 1)
        if cap >= e and (best is None or e * k < best.optimistic_cost):
            best = Probe(batch, cap, e * k)
    return best
