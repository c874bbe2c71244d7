"""Plain autocast training (with GradScaler for fp16, clip_grad_norm_ for clipping) that pipedp must match."""

from __future__ import annotations

import torch
from torch import nn

from pipedp.pipeline import microbatch


def plain_amp_steps(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    microbatches: int,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    scaler: "torch.amp.GradScaler | None" = None,
    clip: float | None = None,
    lr: float = 0.05,
    momentum: float = 0.9,
    loss_fn=None,
) -> list[dict]:
    """SGD-momentum steps with gradient accumulation over the same microbatches, the recipe of torch's AMP docs.

    Each microbatch's forward and loss run under ``torch.autocast`` (when ``dtype``), its backward outside;
    with a ``scaler`` the loss is scaled and the step goes through ``scaler.step``. Returns per step the
    loss, the total gradient norm before clipping (when ``clip``) and the scale after the step.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    out = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        xs, ys = microbatch.split(x, microbatches), microbatch.split(y, microbatches)
        total = 0.0
        for xi, yi, w in zip(xs, ys, microbatch.shares([t.shape[0] for t in xs])):
            with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(xi), yi) * w
            total = total + loss.detach()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        out.append({"loss": total, "norm": norm, "scale": scaler.get_scale() if scaler is not None else None})
    return out
