"""Dry-run simulator for pipeline schedules.

It executes per-stage action lists (or each rank's program: its stages'
actions in one order, :func:`simulate_ranks`) symbolically: every action waits
for the actions it depends on (:mod:`~pipedp.pipeline.deps`: the forward of the
previous stage, the input gradient of the next one, a W its own I) and for its
stage or rank (and, optionally, a device shared by several stages) to be free. It reports schedules that cannot finish — deadlocks and
dependency violations — with the stages and actions involved, and otherwise
returns a timeline. The executor issues work in the simulated start order, so a
schedule the simulator accepts is one the executor can run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from .deps import grad_kinds, needs, peaks, sends
from .schedule import Action, Schedule

__all__ = ["ScheduleError", "Slot", "Simulation", "simulate", "simulate_ranks"]

Program = Sequence[tuple[int, Action]]  # a rank's (stage, action) pairs in the order it runs them


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
    lanes: int = 0  # what runs one action at a time: the stages, or the ranks (0: the stages)

    @property
    def order(self) -> list[tuple[int, Action]]:
        return [(s.stage, s.action) for s in self.slots]

    @property
    def bubble(self) -> float:
        """Fraction of stage (or rank) time spent idle within the makespan."""
        if self.makespan <= 0:
            return 0.0
        busy = sum(s.end - s.start for s in self.slots)
        return 1.0 - busy / ((self.lanes or self.stages) * self.makespan)


_DEFAULT_MS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _default_duration(stage: int, action: Action) -> float:
    return _DEFAULT_MS[action.kind]


def _covers(s: int, label: str, mbs: set[int], reference: set[int]) -> None:
    if mbs != reference:
        raise ScheduleError(
            f"stage {s}: {label} actions cover microbatches {sorted(mbs)}, expected {sorted(reference)}"
            f" (missing {sorted(reference - mbs)}, unexpected {sorted(mbs - reference)})"
        )


def _validate(schedule: Sequence[Sequence[Action]], training: bool) -> int:
    """Each stage runs every microbatch's F once and, training, its backward once: B, or I and W."""
    if not schedule:
        raise ScheduleError("schedule has no stages")
    kinds = ("F", "B", "I", "W") if training else ("F",)
    reference: set[int] | None = None
    for s, acts in enumerate(schedule):
        for a in acts:
            if not isinstance(a, Action) or a.kind not in kinds:
                raise ScheduleError(f"stage {s}: action {a!r} is not one of {kinds} (with a microbatch index)")
        counts = Counter(acts)
        dup = [str(a) for a, k in counts.items() if k > 1]
        if dup:
            raise ScheduleError(f"stage {s} runs {', '.join(sorted(dup))} more than once")
        of = {k: {a.microbatch for a in acts if a.kind == k} for k in kinds}
        if reference is None:
            reference = of["F"]
        _covers(s, "F", of["F"], reference)
        if not training:
            continue
        both = of["B"] & of["I"]
        if both:
            raise ScheduleError(f"stage {s} runs both B and I of microbatch(es) {sorted(both)}: a backward is whole "
                                f"(B) or split (I, then W)")
        _covers(s, "B/I" if of["I"] else "B", of["B"] | of["I"], reference)
        if of["W"] != of["I"]:
            raise ScheduleError(f"stage {s}: W actions cover microbatches {sorted(of['W'])}, expected those it runs "
                                f"I of, {sorted(of['I'])}")
    assert reference is not None
    if reference != set(range(len(reference))):
        raise ScheduleError(f"microbatches must be numbered 0..m-1, got {sorted(reference)}")
    return len(reference)


def _blocked_report(lanes: Sequence[Program], ptr: list[int], done: dict, stages: int,
                    split: set[tuple[int, int]], by_rank: bool) -> str:
    lines = []
    violation = False
    for r, prog in enumerate(lanes):
        if ptr[r] >= len(prog):
            continue
        s, head = prog[ptr[r]]
        who = f"rank {r} (stage {s})" if by_rank else f"stage {s}"
        for ds, da in needs(s, head, stages, split):
            if (ds, da) in done:
                continue
            if ds == s:
                violation = True
                lines.append(f"{who} runs {head} before its own {da} (dependency violation)")
            else:
                lines.append(f"{who} waits at {head} for {da} of stage {ds}")
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
    backward 2, its halves I and W 1 each). ``resources[s]`` names the device
    stage s runs on; stages with the same resource never overlap (a serial
    device). By default every stage has its own. ``transfer(stage, action)``:
    the time the action's result takes to reach the stage that needs it (a
    forward's to the next stage, an input gradient to the previous one) over
    a link of its own per stage and direction, one message at a time, while
    both stages go on computing (default: it is there when the action ends).
    Raises :class:`ScheduleError` if the schedule cannot finish.
    """
    stages = len(schedule) if schedule else 0
    _validate(schedule, training)
    res = list(resources) if resources is not None else list(range(stages))
    if len(res) != stages:
        raise ScheduleError(f"resources has {len(res)} entries for {stages} stages")
    lanes = [[(s, a) for a in acts] for s, acts in enumerate(schedule)]
    slots = _timeline(lanes, res, stages, duration or _default_duration, transfer, by_rank=False)
    return Simulation(slots, stages, max((sl.end for sl in slots), default=0.0), peaks(schedule))


def simulate_ranks(
    programs: Sequence[Program],
    *,
    training: bool = True,
    duration: Callable[[int, Action], float] | None = None,
    transfer: Callable[[int, Action], float] | None = None,
) -> Simulation:
    """Run each rank's program (its stages' actions in the one order that rank runs them) symbolically.

    A rank runs one action at a time, strictly in its program's order; a
    stage's actions are all on one rank (any placement: interleaved stages
    too). Durations and transfers as in :func:`simulate`. Raises
    :class:`ScheduleError` where a program cannot finish.
    """
    if not programs:
        raise ScheduleError("no rank has a program")
    stage_rank: dict[int, int] = {}
    for r, prog in enumerate(programs):
        for s, _ in prog:
            if stage_rank.setdefault(s, r) != r:
                raise ScheduleError(f"stage {s} has actions on ranks {stage_rank[s]} and {r}: a stage lives on one")
    stages = max(stage_rank, default=-1) + 1
    if sorted(stage_rank) != list(range(stages)):
        raise ScheduleError(f"the programs run stages {sorted(stage_rank)}: they must be numbered 0..n-1")
    per_stage: list[list[Action]] = [[] for _ in range(stages)]
    for prog in programs:
        for s, a in prog:
            per_stage[s].append(a)
    _validate(per_stage, training)
    slots = _timeline(programs, list(range(len(programs))), stages, duration or _default_duration, transfer,
                      by_rank=True)
    return Simulation(slots, stages, max((sl.end for sl in slots), default=0.0), peaks(per_stage), len(programs))


def _timeline(lanes: Sequence[Program], res: Sequence[int], stages: int,
              dur: Callable[[int, Action], float], transfer: Callable[[int, Action], float] | None,
              by_rank: bool) -> tuple[Slot, ...]:
    """Every action's slot: each lane takes its actions in order, the earliest start first."""
    split = grad_kinds([x for prog in lanes for x in prog])
    ptr = [0] * len(lanes)
    lane_free = [0.0] * len(lanes)
    res_free: dict[int, float] = {}
    done: dict[tuple[int, Action], float] = {}
    arrive: dict[tuple[int, Action], float] = {}  # where another stage can take the result
    link_free: dict[tuple[int, bool], float] = {}
    slots: list[Slot] = []
    remaining = sum(len(p) for p in lanes)
    while remaining:
        best: tuple[float, int] | None = None
        for r, prog in enumerate(lanes):
            if ptr[r] >= len(prog):
                continue
            s, head = prog[ptr[r]]
            deps = needs(s, head, stages, split)
            if any(d not in done for d in deps):
                continue
            start = max([lane_free[r], res_free.get(res[r], 0.0)] + [arrive[d] if d[0] != s else done[d]
                                                                     for d in deps])
            if best is None or start < best[0]:
                best = (start, r)
        if best is None:
            raise ScheduleError(_blocked_report(lanes, ptr, done, stages, split, by_rank))
        start, r = best
        s, act = lanes[r][ptr[r]]
        d = float(dur(s, act))
        if d < 0:
            raise ScheduleError(f"duration of {act} on stage {s} is negative ({d})")
        end = start + d
        done[(s, act)] = arrive[(s, act)] = end
        if transfer is not None and sends(s, act, stages) is not None:
            # Messages leave in the order the stage made them: its actions are taken in order.
            t = float(transfer(s, act))
            if t < 0:
                raise ScheduleError(f"transfer of {act} from stage {s} is negative ({t})")
            link = (s, act.kind == "F")
            arrive[(s, act)] = link_free[link] = max(end, link_free.get(link, 0.0)) + t
        lane_free[r] = end
        res_free[res[r]] = end
        slots.append(Slot(s, act, start, end))
        ptr[r] += 1
        remaining -= 1
    # Stable sort by start: ties keep processing order, which is topological
    # (an action is processed only after everything it depends on).
    slots.sort(key=lambda sl: sl.start)
    return tuple(slots)
