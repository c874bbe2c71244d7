"""``pipedp.advise``: profile a few configurations briefly, fit the monotone models, choose the cheapest plan.

The alternative a user has is a grid search: train every configuration and
keep the cheapest that met the targets. The advisor measures the step time
of a few configurations (:meth:`SearchSpace.design`) and the accuracy of a few
short runs, fits a monotone step-time law (:class:`~.monotone.MonotoneLaw`)
and a conservative accuracy bound (:class:`~.accuracy.AccuracyModel`), and
chooses from predictions; what it spent profiling is reported in
resource-seconds so it can be set against the grid search's cost.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from ..checks import positive_int
from .accuracy import AccuracyModel, AccuracyRun
from .choose import NoPlan, Targets, TrainingPlan, cheapest, cheapest_staged, steps_per_epoch
from .explore import next_probe
from .monotone import MonotoneLaw
from .profile import StepTimer
from .space import Config, SearchSpace

__all__ = ["Profiling", "Advice", "advise", "fit_step_model"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Profiling:
    """Which short runs the advisor makes.

    ``step_configs``: the configurations whose step time is measured
    (default: the grid's corners and middles, :meth:`SearchSpace.design`).
    ``accuracy_batches``: the batch sizes trained for up to ``accuracy_epochs``
    epochs each, stopping once the accuracy target is reached (default: the
    grid's largest batch, which bounds every smaller one from below, and its
    middle one). A target reached only after more epochs than these runs
    measured is not predicted: the bound assumes no gain past them.
    ``explore``: then train other batch sizes, each only while it could still
    beat the best plan so far (:mod:`.explore`).
    """

    step_configs: tuple[Config, ...] | None = None
    accuracy_batches: tuple[int, ...] | None = None
    accuracy_epochs: int = 3
    explore: bool = True

    def __post_init__(self) -> None:
        positive_int("accuracy_epochs", self.accuracy_epochs)

    def steps_for(self, space: SearchSpace) -> list[Config]:
        return sorted(set(self.step_configs)) if self.step_configs else space.design()

    def batches_for(self, space: SearchSpace) -> list[int]:
        if self.accuracy_batches:
            return sorted(set(self.accuracy_batches))
        b = space.batches
        return sorted({b[-1], b[len(b) // 2]})


@dataclass(frozen=True)
class Advice:
    """The chosen plan (and the staged one, if asked), the fitted models, and what profiling measured and cost."""

    plan: TrainingPlan
    staged: TrainingPlan | None
    step_model: MonotoneLaw
    accuracy_model: AccuracyModel
    measured_step_s: Mapping[Config, float]
    predicted_step_s: Mapping[Config, float]
    profiling_cost: float  # resource-seconds spent in the short runs
    profiling_s: float
    dataset_size: int
    targets: Targets = field(repr=False)

    def table(self) -> str:
        """Every candidate: measured or predicted step time, epochs to the target, time and cost; the choice marked."""
        chosen = {p.config for p in self.plan.phases}
        lines = [f"{'config':22s} {'step ms':>9s} {'':4s} {'epochs':>6s} {'time s':>9s} {'cost':>10s}"]
        for c, t in sorted(self.predicted_step_s.items()):
            e = self.accuracy_model.epochs_to_reach(c.batch, self.targets.accuracy, self.targets.max_epochs)
            src = "meas" if c in self.measured_step_s else "pred"
            if e is None:
                tail = f"{'-':>6s} {'-':>9s} {'-':>10s}"
            else:
                total = e * steps_per_epoch(self.dataset_size, c.batch) * t
                tail = f"{e:6d} {total:9.1f} {total * c.resources:10.1f}"
            lines.append(f"{str(c):22s} {t * 1e3:9.2f} {src:4s} {tail}{'  <- chosen' if c in chosen else ''}")
        lines.append(f"chosen: {self.plan}")
        if self.staged is not None:
            lines.append(f"staged: {self.staged}")
        lines.append(f"profiling cost: {self.profiling_cost:.1f} resource-s ({self.profiling_s:.1f} s)")
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict[str, Any]:
        def plan(p: TrainingPlan | None) -> dict[str, Any] | None:
            if p is None:
                return None
            return {"phases": [{"resources": q.config.resources, "batch": q.config.batch,
                                "microbatches": q.config.microbatches, "epochs": q.epochs, "step_s": q.step_s,
                                "time_s": q.time_s, "cost": q.cost} for q in p.phases],
                    "time_s": p.time_s, "cost": p.cost, "accuracy_at_least": p.accuracy}

        return {"plan": plan(self.plan), "staged": plan(self.staged),
                "targets": {"accuracy": self.targets.accuracy, "time_limit_s": self.targets.time_limit_s,
                            "max_epochs": self.targets.max_epochs},
                "measured_step_s": [[*c.point(), t] for c, t in sorted(self.measured_step_s.items())],
                "accuracy_runs": {str(b): list(a) for b, a in self.accuracy_model.runs.items()},
                "profiling_cost": self.profiling_cost, "profiling_s": self.profiling_s}


def fit_step_model(measured: Mapping[Config, float], space: SearchSpace) -> MonotoneLaw:
    """The monotone step-time law through measured ``config -> seconds per step``."""
    configs = sorted(measured)
    return MonotoneLaw.fit([c.point() for c in configs], [measured[c] for c in configs], space.directions)


def advise(step_timer: StepTimer, accuracy_run: AccuracyRun, *, space: SearchSpace, targets: Targets,
           dataset_size: int, profiling: Profiling = Profiling(), accuracy_resources: int | None = None,
           staged: bool = False) -> Advice:
    """Profile briefly, then the cheapest plan predicted to meet ``targets`` (see the module docstring).

    ``accuracy_resources``: what the accuracy runs occupy, for the profiling
    cost (default: the largest resource count of ``space``). Raises
    :class:`~.choose.NoPlan` (a ``ValueError``) naming the nearest miss when
    nothing is predicted to meet the targets.
    """
    positive_int("dataset_size", dataset_size)
    too_big = [b for b in space.batches if b > dataset_size]
    if too_big:
        raise ValueError(f"batch sizes {too_big} exceed the dataset ({dataset_size} examples): drop them")
    acc_r = max(space.resources) if accuracy_resources is None else positive_int("accuracy_resources",
                                                                                 accuracy_resources)
    spent = [0.0, 0.0]  # resource-seconds, seconds

    def timed(resources: int, fn: Callable[[], _T]) -> _T:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        spent[0], spent[1] = spent[0] + resources * dt, spent[1] + dt
        return out

    measured = {c: float(timed(c.resources, lambda c=c: step_timer(c))) for c in profiling.steps_for(space)}
    runs: dict[int, list[float]] = {}

    def train(batch: int, cap: int) -> None:
        runs[batch] = [float(a) for a in timed(acc_r, lambda: accuracy_run(batch, cap, targets.accuracy))]
        full = len(runs[batch]) == cap
        stopped = 0 < len(runs[batch]) < cap and runs[batch][-1] >= targets.accuracy
        if not (full or stopped):
            raise ValueError(f"the accuracy run at batch {batch} gave {len(runs[batch])} accuracies for {cap} "
                             f"epochs: it must give one after each epoch, stopping early only once the target "
                             f"{targets.accuracy} is reached")

    for b in profiling.batches_for(space):
        train(b, profiling.accuracy_epochs)
    model = fit_step_model(measured, space)
    candidates = space.configs()
    predicted = {c: measured.get(c, model.predict(c.point())) for c in candidates}
    step_s = predicted.__getitem__
    while True:
        accuracy = AccuracyModel.from_runs(runs)
        try:
            plan: TrainingPlan | None = cheapest(candidates, step_s, accuracy, dataset_size, targets)
        except NoPlan:
            plan = None
        probe = next_probe(candidates, step_s, accuracy, dataset_size, targets,
                           plan.cost if plan else math.inf, runs, profiling.accuracy_epochs) \
            if profiling.explore else None
        if probe is None:
            break
        train(probe.batch, probe.cap)
    if plan is None:
        plan = cheapest(candidates, step_s, accuracy, dataset_size, targets)  # raises NoPlan, naming the miss
    staged_plan = cheapest_staged(candidates, step_s, accuracy, dataset_size, targets) if staged else None
    cost, wall = spent
    return Advice(plan, staged_plan, model, accuracy, measured, predicted, cost, wall, dataset_size, targets)
