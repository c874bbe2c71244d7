"""The cheapest plan that meets a time limit and an accuracy target, in one phase or in stages.

A plan is a sequence of phases; phase k trains ``epochs_k`` epochs at its own
configuration. Its time is ``steps x seconds per step`` with ``steps =
epochs x (dataset_size // batch)`` (the last partial batch dropped, as the
loaders here do); its cost is ``resources x time``. A plan's time and cost
are the sums over its phases (switching is taken as free: on a CPU changing
cores is; under torchrun it is a restart from a checkpoint, which the user
should add to the time limit).

Accuracy comes from a conservative :class:`~.accuracy.AccuracyBound`. One
phase at ``(batch, epochs)`` reaches at least ``lower(batch, epochs)``. A
staged plan carries progress over by equivalence: a phase that starts at
accuracy ``a`` on ``batch`` counts as having already trained the fewest
epochs ``c`` at which even the *upper* bound at ``batch`` reaches ``a`` (so
the credit never overstates the progress), and ends at ``lower(batch, c +
epochs)``. Staging pays off when, say, cheap large-batch epochs get most of
the way and a few small-batch epochs finish; the chooser finds out, and a
one-phase plan is always among the staged candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..checks import positive_int, positive_number
from .accuracy import AccuracyBound
from .space import Config

__all__ = ["Targets", "Phase", "TrainingPlan", "steps_per_epoch", "cheapest", "cheapest_staged", "NoPlan"]


_TIE = 1e-9  # accuracies this close are one value (the isotonic fit's pooled values differ in their last bits)


class NoPlan(ValueError):
    """No configuration is predicted to meet the targets; the message names the nearest miss and what would help."""


@dataclass(frozen=True)
class Targets:
    """What a plan must meet: test ``accuracy`` (0..1) within ``time_limit_s`` seconds, in at most ``max_epochs``."""

    accuracy: float
    time_limit_s: float
    max_epochs: int = 50

    def __post_init__(self) -> None:
        if not (isinstance(self.accuracy, (int, float)) and 0.0 < self.accuracy <= 1.0):
            raise ValueError(f"the accuracy target must be in (0, 1], got {self.accuracy!r}")
        positive_number("time_limit_s", self.time_limit_s, "seconds")
        positive_int("max_epochs", self.max_epochs)


@dataclass(frozen=True)
class Phase:
    config: Config
    epochs: int
    step_s: float
    steps: int

    @property
    def time_s(self) -> float:
        return self.steps * self.step_s

    @property
    def cost(self) -> float:
        """Resource-seconds: cores (or ranks) x seconds."""
        return self.config.resources * self.time_s


@dataclass(frozen=True)
class TrainingPlan:
    """Phases run one after another, and the accuracy they are predicted to reach at least."""

    phases: tuple[Phase, ...]
    accuracy: float

    @property
    def time_s(self) -> float:
        return sum(p.time_s for p in self.phases)

    @property
    def cost(self) -> float:
        return sum(p.cost for p in self.phases)

    @property
    def epochs(self) -> int:
        return sum(p.epochs for p in self.phases)

    def __str__(self) -> str:
        parts = " then ".join(f"{p.epochs} epoch(s) at {p.config}" for p in self.phases)
        return f"{parts}: {self.time_s:.1f} s, cost {self.cost:.1f} resource-s, accuracy >= {self.accuracy:.3f}"


def steps_per_epoch(dataset_size: int, batch: int) -> int:
    positive_int("dataset_size", dataset_size)
    if batch > dataset_size:
        raise ValueError(f"batch {batch} is larger than the dataset ({dataset_size} examples): drop that batch size")
    return dataset_size // batch


StepSeconds = Callable[[Config], float]


def _phase(config: Config, epochs: int, step_s: StepSeconds, dataset_size: int) -> Phase:
    return Phase(config, epochs, step_s(config), epochs * steps_per_epoch(dataset_size, config.batch))


def _no_plan(candidates: Sequence[Config], step_s: StepSeconds, accuracy: AccuracyBound, dataset_size: int,
             targets: Targets) -> NoPlan:
    reach = [(c, e) for c in candidates if (e := _epochs_to_reach(accuracy, c.batch, targets)) is not None]
    if not reach:
        best = [(lo, b, e) for b in sorted({c.batch for c in candidates}) for e in range(1, targets.max_epochs + 1)
                if (lo := accuracy.lower(b, e)) is not None]
        top = max(best, key=lambda t: (t[0], -t[2])) if best else None
        near = (f"the best is {top[0]:.3f} (batch {top[1]}, {top[2]} epochs)" if top
                else "no batch size of the grid is covered by the accuracy runs")
        return NoPlan(f"no configuration is predicted to reach accuracy {targets.accuracy:.3f} within "
                      f"{targets.max_epochs} epochs ({near}): profile accuracy for more epochs (accuracy_epochs) "
                      f"or at smaller batches, or lower the accuracy target")
    fastest = min((_phase(c, e, step_s, dataset_size) for c, e in reach), key=lambda p: p.time_s)
    return NoPlan(f"no configuration meets both targets: the fastest to reach accuracy {targets.accuracy:.3f} "
                  f"({fastest.epochs} epochs at {fastest.config}) takes {fastest.time_s:.1f} s, over the "
                  f"{targets.time_limit_s:.1f} s limit: raise the time limit, allow more resources, or lower the "
                  f"accuracy target")


def _epochs_to_reach(accuracy: AccuracyBound, batch: int, targets: Targets) -> int | None:
    for e in range(1, targets.max_epochs + 1):
        lo = accuracy.lower(batch, e)
        if lo is not None and lo >= targets.accuracy:
            return e
    return None


def cheapest(candidates: Sequence[Config], step_s: StepSeconds, accuracy: AccuracyBound, dataset_size: int,
             targets: Targets) -> TrainingPlan:
    """The cheapest one-phase plan meeting ``targets`` (ties: the faster); :class:`NoPlan` when none does.

    For each configuration the fewest epochs that reach the target are the
    cheapest (cost grows with epochs), so only those are considered.
    """
    best: TrainingPlan | None = None
    for c in candidates:
        e = _epochs_to_reach(accuracy, c.batch, targets)
        if e is None:
            continue
        p = _phase(c, e, step_s, dataset_size)
        if p.time_s <= targets.time_limit_s and (best is None or (p.cost, p.time_s) < (best.cost, best.time_s)):
            best = TrainingPlan((p,), accuracy.lower(c.batch, e))  # type: ignore[arg-type]
    if best is None:
        raise _no_plan(candidates, step_s, accuracy, dataset_size, targets)
    return best


def _pareto(candidates: Sequence[Config], step_s: StepSeconds, dataset_size: int) -> list[Config]:
    """Per batch, the configurations no other one beats on both time and cost per epoch (the rest never pay)."""
    per_epoch = {c: (step_s(c) * steps_per_epoch(dataset_size, c.batch)) for c in candidates}
    keep = []
    for c in candidates:
        t, k = per_epoch[c], per_epoch[c] * c.resources
        if not any(o.batch == c.batch and o != c and per_epoch[o] <= t and per_epoch[o] * o.resources <= k
                   and (per_epoch[o], per_epoch[o] * o.resources) != (t, k) for o in candidates):
            keep.append(c)
    return keep


def cheapest_staged(candidates: Sequence[Config], step_s: StepSeconds, accuracy: AccuracyBound, dataset_size: int,
                    targets: Targets) -> TrainingPlan:
    """The cheapest plan of one or two phases meeting ``targets`` (see the module's rule for carried progress)."""
    single = cheapest(candidates, step_s, accuracy, dataset_size, targets)
    front = _pareto(candidates, step_s, dataset_size)
    emax = targets.max_epochs
    batches = sorted({c.batch for c in front})
    lower = {b: [accuracy.lower(b, e) if e else None for e in range(emax + 1)] for b in batches}
    upper = {b: [accuracy.upper(b, e) for e in range(emax + 1)] for b in batches}

    def credit(batch: int, reached: float) -> int:
        for e, hi in enumerate(upper[batch]):
            if hi is None or hi >= reached - _TIE:  # a pooled value on both sides: equal, whatever its last bits
                return e
        return emax

    best = single
    for first in front:
        for e1 in range(1, emax):
            a1 = lower[first.batch][e1]
            if a1 is None:
                continue
            p1 = _phase(first, e1, step_s, dataset_size)
            if p1.cost >= best.cost or p1.time_s > targets.time_limit_s:
                break  # more epochs of this phase only cost more
            for second in front:
                if second == first:
                    continue
                c = credit(second.batch, a1)
                for e2 in range(1, emax - e1 + 1):
                    if c + e2 > emax:
                        break
                    a2 = lower[second.batch][c + e2]
                    if a2 is None or a2 < targets.accuracy:
                        continue
                    p2 = _phase(second, e2, step_s, dataset_size)
                    plan = TrainingPlan((p1, p2), a2)
                    if plan.time_s <= targets.time_limit_s and plan.cost < best.cost:
                        best = plan
                    break  # the fewest epochs of the second phase that reach the target are its cheapest
    return best
