"""A named schedule as each pipeline rank's order of compute actions, on its placement of stages.

Most schedules are per stage (:mod:`.schedule`): every stage's list of
actions, and a rank holding several consecutive stages runs them in the
simulator's start order. Interleaved 1F1B is per rank (:mod:`.interleaved`):
a rank holds stages spread along the pipeline and its one order interleaves
them. This module gives both the same shape, so the lowering, the planner's
predictions and the executor ask one place for where each stage lives and in
which order each rank runs its actions.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..checks import positive_int
from .interleaved import interleaved, interleaved_placement
from .schedule import SCHEDULES, Action, Schedule, get_schedule
from .simulate import Program, Simulation, simulate, simulate_ranks

__all__ = ["PER_RANK", "NAMES", "check_schedule", "placement", "rank_orders", "split_backwards", "join_backwards", "per_stage",
           "simulate_schedule"]

PER_RANK = ("interleaved",)  # the schedules ordered per rank: a rank interleaves the actions of its stages
NAMES = (*SCHEDULES, *PER_RANK)

Duration = Callable[[int, Action], float]


def check_schedule(name: str) -> str:
    """``name`` if it names a schedule (clear error otherwise)."""
    if name not in NAMES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {sorted(NAMES)}")
    return name


def _per_rank(stages: int, ranks: int) -> int:
    positive_int("stages", stages)
    positive_int("ranks", ranks)
    if stages % ranks:
        raise ValueError(f"{stages} stages cannot be spread over {ranks} pipeline ranks: use a multiple of {ranks}")
    return stages // ranks


def placement(schedule: str, stages: int, ranks: int = 1) -> list[int]:
    """The pipeline rank of each stage: consecutive stages per rank, or stage s on rank s mod ``ranks`` for an
    interleaved schedule."""
    k = _per_rank(stages, ranks)
    if check_schedule(schedule) in PER_RANK:
        return interleaved_placement(ranks, k)
    return [s // k for s in range(stages)]


def rank_orders(schedule: str, stages: int, microbatches: int, ranks: int = 1, *,
                duration: Duration | None = None) -> list[Program]:
    """Per pipeline rank, its (stage, action) pairs in the order it runs them (a per-stage schedule in the
    simulator's start order with ``duration``)."""
    k = _per_rank(stages, ranks)
    if check_schedule(schedule) in PER_RANK:
        return interleaved(ranks, k, microbatches)
    place = placement(schedule, stages, ranks)
    out: list[list[tuple[int, Action]]] = [[] for _ in range(ranks)]
    for s, a in simulate(get_schedule(schedule)(stages, microbatches), duration=duration).order:
        out[place[s]].append((s, a))
    return list(out)


def split_backwards(orders: Sequence[Program]) -> list[Program]:
    """``orders`` with every whole backward B given as its input gradient I and, right after it, its weight
    gradients W (``split_grads``: the interpreter runs that W on the stage's side lane, beside the next action).

    Nothing moves: I takes B's place, so every dependency and message of the
    order stays where it was, and W needs only its own I.
    """
    return [[x for s, a in prog for x in ([(s, Action("I", a.microbatch)), (s, Action("W", a.microbatch))]
                                          if a.kind == "B" else [(s, a)])] for prog in orders]


def join_backwards(orders: Sequence[Program], concurrent: Callable[[int, int], bool] = lambda a, b: False
                   ) -> list[Program]:
    """``orders`` with each I directly followed by its own W given back as one B, where nothing waits for the I
    alone: the stage is the first, or the stage before it runs on the same rank and not at once with it
    (``concurrent(a, b)``: stages a and b run side by side, on CUDA streams of their own; there the stage
    before would wait for W too).

    A zero-bubble order leaves I and W adjacent where it has nothing to run
    between them (the first stage, which sends no gradient back, in most of
    its steps). Split, the two halves cost more than the whole backward they
    make (the held nodes in the forward, two kernels that each read the
    output gradient; ResNet-50 on a 2-core CPU: about 6% of a microbatch's
    forward and backward), for nothing. Joined, the stage runs the same
    work in the same place as one backward.
    """
    rank_of = {s: r for r, prog in enumerate(orders) for s, _ in prog}
    out: list[Program] = []
    for r, prog in enumerate(orders):
        joined: Program = []
        k = 0
        while k < len(prog):
            s, a = prog[k]
            if (a.kind == "I" and k + 1 < len(prog) and prog[k + 1] == (s, Action("W", a.microbatch))
                    and (s == 0 or (rank_of.get(s - 1) == r and not concurrent(s - 1, s)))):
                joined.append((s, Action("B", a.microbatch)))
                k += 2
                continue
            joined.append((s, a))
            k += 1
        out.append(joined)
    return out


def per_stage(orders: Sequence[Program], stages: int) -> Schedule:
    """Every stage's actions, in the order its rank runs them."""
    out: Schedule = [[] for _ in range(stages)]
    for prog in orders:
        for s, a in prog:
            out[s].append(a)
    return out


def simulate_schedule(schedule: str, stages: int, microbatches: int, ranks: int = 1, *,
                      duration: Duration | None = None, resources: Sequence[int] | None = None,
                      transfer: Duration | None = None) -> Simulation:
    """The step's timeline: a per-stage schedule with each stage (or ``resources``, a device several stages
    share) running one action at a time; an interleaved one with each rank doing so."""
    if check_schedule(schedule) in PER_RANK:
        return simulate_ranks(rank_orders(schedule, stages, microbatches, ranks), duration=duration,
                              transfer=transfer)
    return simulate(get_schedule(schedule)(stages, microbatches), duration=duration, resources=resources,
                    transfer=transfer)

