"""Pipeline schedules as data.

A schedule is, for every stage, the ordered list of actions that stage runs in
one training step. Keeping it as plain data lets the simulator check it
(deadlocks, dependency order) without a GPU and lets the executor walk it
without knowing which schedule it is.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..checks import positive_int

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "forward_only", "SCHEDULES", "get_schedule"]


class Action(NamedTuple):
    """One unit of stage work on a microbatch: its forward ("F") and backward, whole ("B") or split into the
    input gradient ("I") and the weight gradients ("W")."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = list[list[Action]]


def _check(stages: int, microbatches: int) -> None:
    positive_int("stages", stages)
    positive_int("microbatches", microbatches)


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Fill-drain (GPipe): all forwards, then all backwards.

    Every stage holds the activations of all microbatches at the peak. The drain
    runs microbatches in forward order: the bubble is the same as draining in
    reverse, and gradients accumulate in the order plain gradient accumulation
    uses, so results match it bit for bit on deterministic devices.
    """
    _check(stages, microbatches)
    fwd = [Action("F", i) for i in range(microbatches)]
    bwd = [Action("B", i) for i in range(microbatches)]
    return [fwd + bwd for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Stage s runs ``stages - 1 - s`` warm-up forwards, so it never holds more than
    ``stages - s`` microbatches of activations (GPipe holds all of them), with the
    same bubble as GPipe.
    """
    _check(stages, microbatches)
    out: Schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(warmup, microbatches):
            acts.append(Action("F", i))
            acts.append(Action("B", i - warmup))
        acts.extend(Action("B", i) for i in range(microbatches - warmup, microbatches))
        out.append(acts)
    return out


def forward_only(stages: int, microbatches: int) -> Schedule:
    """Inference: every stage runs the forwards in order, no backward."""
    _check(stages, microbatches)
    return [[Action("F", i) for i in range(microbatches)] for _ in range(stages)]


def _zb_h1(stages: int, microbatches: int) -> Schedule:
    from .zero_bubble import zb_h1  # it builds on Action and Schedule, defined here

    return zb_h1(stages, microbatches)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": _zb_h1}
SPLIT = ("zb-h1",)  # the schedules whose backwards run as I and W


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The schedule function registered under ``name`` (clear error otherwise)."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown schedule {name!r}: choose one of {sorted(SCHEDULES)}") from None
