"""fp16 loss scaling as ``torch.amp.GradScaler`` does it, for a pipeline whose gradients may live on several ranks.

fp16 represents gradients down to about 6e-8 (6e-5 at full precision); small
gradients of a real model fall below that and become zero. Scaling the loss by
``S`` scales every gradient by ``S`` on its way back through the stages (the
activation gradients that cross stage boundaries too); the parameters'
gradients are divided by ``S`` again before the update. A step whose
gradients overflowed (inf/NaN anywhere, on any rank) is skipped and ``S``
halves; after ``growth_interval`` good steps in a row ``S`` doubles. The
numbers and the kernels (``torch._amp_foreach_non_finite_check_and_unscale_``,
``torch._amp_update_scale_``) are GradScaler's, so a step equals plain
training with ``GradScaler`` and the same microbatches.

All of the scale's state stays on the device; only the decision to skip
reads the host (one flag a step, as GradScaler does).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

__all__ = ["LossScaler", "check_scaler_state"]

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


def check_scaler_state(state: Any) -> dict[str, Any] | None:
    """A checkpoint's loss-scaler entry, checked (None when it has none); ``ValueError`` if malformed."""
    if state is None:
        return None
    scale = state.get("scale") if isinstance(state, Mapping) else None
    tracker = state.get("growth_tracker") if isinstance(state, Mapping) else None
    ok = (
        isinstance(scale, float) and math.isfinite(scale) and scale > 0
        and isinstance(tracker, int) and not isinstance(tracker, bool) and tracker >= 0
    )
    if not ok:
        raise ValueError(
            f"the checkpoint's loss-scaler entry ('scaler') is malformed ({state!r}): it needs a positive finite "
            f"float 'scale' and an int 'growth_tracker' >= 0. Nothing was loaded; drop the entry "
            f"(ckpt['engine'].pop('scaler')) to start from the initial scale"
        )
    return {"scale": scale, "growth_tracker": tracker}


class LossScaler:
    """The scale of the loss and its growth counter, kept on one device (the loss's)."""

    def __init__(self, init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR, growth_interval: int = GROWTH_INTERVAL) -> None:
        self.scale = torch.full((), float(init_scale), dtype=torch.float32)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.found_inf: torch.Tensor | None = None  # of the last unscale, summed over devices (and ranks)

    def to(self, device: torch.device) -> "LossScaler":
        """Keep the scale on ``device`` (the last local stage's)."""
        self.scale = self.scale.to(device)
        self.growth_tracker = self.growth_tracker.to(device)
        return self

    def unscale_(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide the gradients of ``params`` by the scale in place; returns this rank's found-inf flag (0. or > 0)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                continue
            if p.grad.dtype == torch.float16:
                raise ValueError(
                    "precision='fp16' found fp16 gradients: keep the model's parameters in fp32 (autocast runs "
                    "the layers in fp16 and the loss scaling needs fp32 gradients), e.g. model.float()"
                )
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        inv = self.scale.double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        for (device, _), grads in groups.items():
            here = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inv.to(device, non_blocking=True))
            found += here.to(found.device, non_blocking=True)
        self.found_inf = found
        return found

    def update(self) -> None:
        """After the step: back off on an overflow (the skipped step's), else count towards growth."""
        if self.found_inf is None:
            return
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.found_inf = None

    def get_scale(self) -> float:
        """The current scale (reads the device)."""
        return float(self.scale.item())

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.get_scale(), "growth_tracker": int(self.growth_tracker.item())}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint of another precision) restarts at the initial scale."""
        checked = check_scaler_state(state) or {"scale": INIT_SCALE, "growth_tracker": 0}
        self.scale.fill_(checked["scale"])
        self.growth_tracker.fill_(checked["growth_tracker"])
        self.found_inf = None
