"""What happens between a step's last backward and ``optimizer.step()``: unscale, agree on overflow, the
user's gradient hook, clip.

With fp16 loss scaling the gradients are divided by the scale and checked
for inf/NaN; every rank must take the same decision (a rank that stepped
while another skipped would leave the replicas apart, and pipeline ranks
would skip only part of the model), so the overflow flag is combined over
all ranks. Gradient clipping scales every gradient by
``max_norm / total_norm`` where the total L2 norm runs over the whole model:
each pipeline rank holds the gradients of its own stages, so the squared
norms are summed over the pipeline ranks (data-parallel replicas hold the
same averaged gradients already). With one pipeline rank this is exactly
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from .comm import Communicator
from .options import GradHook
from .precision import LossScaler

__all__ = ["GradientStep", "clip_grad_norm"]


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float, comm: Communicator) -> torch.Tensor:
    """Clip the gradients of ``params`` (this rank's) to total L2 norm ``max_norm`` over all pipeline ranks.

    Returns the total norm before clipping, on the device (no host read).
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if comm.pp == 1:
        total = local
    else:
        squares = local.double().square()
        comm.all_reduce(squares, "sum", "pipeline", "summing the squared gradient norms of the pipeline ranks")
        total = squares.sqrt().to(local.dtype)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter once, frozen ones too: what acts is decided at each step by which have a ``.grad``."""
    return list({id(p): p for p in params}.values())


class GradientStep:
    """Unscaling, the overflow decision and clipping of this rank's parameters (a no-op when neither is asked).

    ``params``: the parameters of this rank's stages. ``scaler``: fp16 loss
    scaling (None otherwise). ``clip``: the total-norm bound (None: no clipping).
    Like ``GradScaler`` and ``clip_grad_norm_``, both act on every parameter
    that has a gradient this step, so a layer unfrozen after the engine was
    built is unscaled and clipped too (a frozen one has ``.grad`` None).
    """

    def __init__(self, params: Iterable[torch.Tensor], comm: Communicator, *, scaler: LossScaler | None = None,
                 clip: float | None = None, hook: GradHook | None = None) -> None:
        self.params = _unique(params)
        self.comm, self.scaler, self.clip, self.hook = comm, scaler, clip, hook
        self.skipped = 0  # steps skipped for inf/NaN gradients
        self.last_norm: torch.Tensor | None = None  # the last clipped step's total norm (before clipping)

    @classmethod
    def of(cls, stages: Sequence[Any], comm: Communicator, scaler: LossScaler | None,
           clip: float | None, hook: GradHook | None = None) -> "GradientStep":
        """For this rank's ``stages``; the scale lives on the last local stage's device (where the loss is)."""
        params = [p for st in stages for p in st.chain.parameters()]
        return cls(params, comm, scaler=scaler.to(stages[-1].device) if scaler is not None else None, clip=clip,
                   hook=hook)

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """What each microbatch's loss is multiplied by before its backward (None: nothing)."""
        return self.scaler.scale if self.scaler is not None else None

    def prepare(self, step: int) -> bool:
        """After the gradients are final (synced): unscale and clip them; whether the optimizer should step.

        Collective when distributed (every rank calls it at the same point).
        """
        if self.scaler is not None:
            found = self.scaler.unscale_(self.params)
            self.comm.all_reduce(found, "max", "world", f"agreeing whether step {step}'s gradients overflowed")
            if found.item() > 0:  # the one host read of loss scaling, as in GradScaler.step
                self.skipped += 1
                return False
        if self.hook is not None:  # the user's own, on final, unscaled gradients
            self.hook(self.params)
        if self.clip is not None:
            self.last_norm = clip_grad_norm(self.params, self.clip, self.comm)
        return True

    def finish(self) -> None:
        """After a step that did not fail: the scale backs off (skipped step) or grows."""
        if self.scaler is not None:
            self.scaler.update()
