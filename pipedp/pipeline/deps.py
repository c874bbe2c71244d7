"""What each pipeline action waits for: the one dependency rule.

The simulator, the per-rank lowering and the executor's CPU workers all ask
this module, so a schedule the simulator accepts is one the ranks and the
workers order the same way.

* ``F`` of stage s, microbatch i: the forward of stage s-1, microbatch i.
* ``B`` (whole backward) or ``I`` (input gradient only) of stage s: its own
  ``F`` of i, and the input gradient that stage s+1 sent back, made by that
  stage's ``B`` or ``I`` of i, whichever it runs.
* ``W`` (weight gradient) of stage s: its own ``I`` of i (the gradients
  flowing out of the stage's output are kept from it).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .schedule import Action

__all__ = ["ACCUMULATES", "BACKWARD", "I_SHARE", "action_ms", "grad_kinds", "needs", "peaks", "sends"]

BACKWARD = ("B", "I")  # the actions that make a stage's input gradient
ACCUMULATES = ("B", "W")  # the actions that finish a microbatch's weight gradients (and free its activations)
# The input gradient's share of a split backward, for predictions: a convolution's or linear layer's two
# gradients cost about one forward each, and the rest of a CNN's backward (BatchNorm, activations) is small.
I_SHARE = 0.5


def action_ms(kind: str, forward_ms: float, backward_ms: float) -> float:
    """An action's time from its stage's forward and whole-backward times (I and W split the backward)."""
    if kind == "F":
        return forward_ms
    if kind == "I":
        return backward_ms * I_SHARE
    if kind == "W":
        return backward_ms * (1.0 - I_SHARE)
    return backward_ms


def grad_kinds(per_stage: Iterable[tuple[int, Action]]) -> set[tuple[int, int]]:
    """The (stage, microbatch) pairs whose backward is split into I and W."""
    return {(s, a.microbatch) for s, a in per_stage if a.kind == "I"}


def needs(stage: int, action: Action, stages: int, split: set[tuple[int, int]] = frozenset()  # type: ignore[assignment]
          ) -> list[tuple[int, Action]]:
    """The (stage, action) pairs ``action`` of ``stage`` waits for, in a pipeline of ``stages`` stages whose
    backwards in ``split`` (:func:`grad_kinds`) run as I then W."""
    i = action.microbatch
    if action.kind == "F":
        return [(stage - 1, action)] if stage > 0 else []
    if action.kind == "W":
        return [(stage, Action("I", i))]
    out = [(stage, Action("F", i))]
    if stage < stages - 1:
        out.append((stage + 1, Action("I" if (stage + 1, i) in split else "B", i)))
    return out


def sends(stage: int, action: Action, stages: int) -> int | None:
    """The stage that takes what ``action`` of ``stage`` makes (an activation forward, an input gradient back),
    or None (the pipeline's ends, and W, which makes only this stage's weight gradients)."""
    if action.kind == "F":
        return stage + 1 if stage < stages - 1 else None
    if action.kind in BACKWARD:
        return stage - 1 if stage > 0 else None
    return None


def peaks(per_stage: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations it holds at once: from F until B or W."""
    out = []
    for acts in per_stage:
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1 if a.kind in ACCUMULATES else 0
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)
