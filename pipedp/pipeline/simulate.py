"""Dry-run simulator for pipeline schedules.

It executes per-stage action lists symbolically: every action waits for the
actions it depends on (the forward of the previous stage, the backward of the
next one) and for its stage (and, optionally, a device shared by several
stages) to be free. It reports schedules that cannot finish — deadlocks and
dependency violations — with the stages and actions involved, and otherwise
returns a timeline. The executor issues work in the simulated start order, so a
schedule the simulator accepts is one the executor can run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from .schedule import Action, Schedule

__all__ = ["ScheduleError", "Slot", "Simulation", "simulate"]


class ScheduleError(ValueError):
    """A schedule that is malformed, violates a dependency or deadlocks."""


@dataclass(frozen=True)
class Slot:
    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """Result of a dry run: slots in issue order (by start time, dependencies first)."""

    slots: tuple[Slot, ...]
    stages: int
    makespan: float
    peak_activations: tuple[int, ...]

    @property
    def order(self) -> list[tuple[int, Action]]:
        return [(s.stage, s.action) for s in self.slots]

    @property
    def bubble(self) -> float:
        """Fraction of stage time spent idle within the makespan."""
        if self.makespan <= 0:
            return 0.0
        busy = sum(s.end - s.start for s in self.slots)
        return 1.0 - busy / (self.stages * self.makespan)


def _default_duration(stage: int, action: Action) -> float:
    return 1.0 if action.kind == "F" else 2.0


def _validate(schedule: Schedule, training: bool) -> int:
    if not schedule:
        raise ScheduleError("schedule has no stages")
    kinds = ("F", "B") if training else ("F",)
    reference: set[int] | None = None
    for s, acts in enumerate(schedule):
        for a in acts:
            if not isinstance(a, Action) or a.kind not in kinds:
                raise ScheduleError(f"stage {s}: action {a!r} is not one of {kinds} (with a microbatch index)")
        counts = Counter(acts)
        dup = [str(a) for a, k in counts.items() if k > 1]
        if dup:
            raise ScheduleError(f"stage {s} runs {', '.join(sorted(dup))} more than once")
        for kind in kinds:
            mbs = {a.microbatch for a in acts if a.kind == kind}
            if reference is None:
                reference = mbs
            if mbs != reference:
                missing = sorted(reference - mbs)
                extra = sorted(mbs - reference)
                raise ScheduleError(
                    f"stage {s}: {kind} actions cover microbatches {sorted(mbs)}, expected {sorted(reference)}"
                    f" (missing {missing}, unexpected {extra})"
                )
    assert reference is not None
    if reference != set(range(len(reference))):
        raise ScheduleError(f"microbatches must be numbered 0..m-1, got {sorted(reference)}")
    return len(reference)


def _deps(stage: int, action: Action, stages: int) -> list[tuple[int, Action]]:
    if action.kind == "F":
        return [(stage - 1, action)] if stage > 0 else []
    deps = [(stage, Action("F", action.microbatch))]
    if stage < stages - 1:
        deps.append((stage + 1, action))
    return deps


def _blocked_report(schedule: Schedule, ptr: list[int], done: dict) -> str:
    stages = len(schedule)
    lines = []
    violation = False
    for s, acts in enumerate(schedule):
        if ptr[s] >= len(acts):
            continue
        head = acts[ptr[s]]
        missing = [(ds, da) for ds, da in _deps(s, head, stages) if (ds, da) not in done]
        for ds, da in missing:
            if ds == s:
                violation = True
                lines.append(f"stage {s} runs {head} before its own {da} (dependency violation)")
            else:
                lines.append(f"stage {s} waits at {head} for {da} of stage {ds}")
    kind = "dependency violation" if violation else "deadlock"
    return f"{kind}: " + "; ".join(lines)


def simulate(
    schedule: Schedule,
    *,
    training: bool = True,
    duration: Callable[[int, Action], float] | None = None,
    resources: Sequence[int] | None = None,
    transfer: Callable[[int, Action], float] | None = None,
) -> Simulation:
    """Run ``schedule`` symbolically and return its timeline.

    ``duration(stage, action)`` gives each action's time (default: forward 1,
    backward 2). ``resources[s]`` names the device stage s runs on; stages with
    the same resource never overlap (a serial device). By default every stage
    has its own. ``transfer(stage, action)``: the time the action's result
    takes to reach the stage that needs it (a forward's to the next stage, a
    backward's to the previous one) over a link of its own per stage and
    direction, one message at a time, while both stages go on computing
    (default: it is there when the action ends). Raises :class:`ScheduleError`
    if the schedule cannot finish.
    """
    stages = len(schedule) if schedule else 0
    _validate(schedule, training)
    dur = duration or _default_duration
    res = list(resources) if resources is not None else list(range(stages))
    if len(res) != stages:
        raise ScheduleError(f"resources has {len(res)} entries for {stages} stages")

    ptr = [0] * stages
    stage_free = [0.0] * stages
    res_free: dict[int, float] = {}
    done: dict[tuple[int, Action], float] = {}
    arrive: dict[tuple[int, Action], float] = {}  # where another stage can take the result
    link_free: dict[tuple[int, str], float] = {}
    slots: list[Slot] = []
    remaining = sum(len(a) for a in schedule)
    while remaining:
        best: tuple[float, int] | None = None
        for s in range(stages):
            if ptr[s] >= len(schedule[s]):
                continue
            head = schedule[s][ptr[s]]
            deps = _deps(s, head, stages)
            if any(d not in done for d in deps):
                continue
            start = max([stage_free[s], res_free.get(res[s], 0.0)] + [arrive[d] if d[0] != s else done[d]
                                                                        for d in deps])
            if best is None or start < best[0]:
                best = (start, s)
        if best is None:
            raise ScheduleError(_blocked_report(schedule, ptr, done))
        start, s = best
        act = schedule[s][ptr[s]]
        d = float(dur(s, act))
        if d < 0:
            raise ScheduleError(f"duration of {act} on stage {s} is negative ({d})")
        end = start + d
        done[(s, act)] = arrive[(s, act)] = end
        if transfer is not None and (s < stages - 1 if act.kind == "F" else s > 0):
            # Messages leave in the order the stage made them: its actions are taken in order.
            t = float(transfer(s, act))
            if t < 0:
                raise ScheduleError(f"transfer of {act} from stage {s} is negative ({t})")
            arrive[(s, act)] = link_free[(s, act.kind)] = max(end, link_free.get((s, act.kind), 0.0)) + t
        stage_free[s] = end
        res_free[res[s]] = end
        slots.append(Slot(s, act, start, end))
        ptr[s] += 1
        remaining -= 1

    # Stable sort by start: ties keep processing order, which is topological
    # (an action is processed only after everything it depends on).
    slots.sort(key=lambda sl: sl.start)
    peaks = []
    for acts in schedule:
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    makespan = max((sl.end for sl in slots), default=0.0)
    return Simulation(tuple(slots), stages, makespan, tuple(peaks))
