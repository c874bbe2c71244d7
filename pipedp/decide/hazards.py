"""Configurations a device cannot run safely, kept out of the search before anything is timed.

A trial runs the user's model for real, so a lever that crashes or corrupts
memory on some shapes must not be tried there at all. Each hazard names the
torch version range it was seen in and the test that shows it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.swap import TunedDepthwiseConv2d

__all__ = ["channels_last_hazard"]


def channels_last_hazard(model: nn.Module, device: torch.device, batch: torch.Tensor) -> str | None:
    """Why channels_last must not be tried for ``model`` on ``device`` with ``batch`` (None: it may).

    Only a 4-d batch (NCHW) is tried in channels-last: other ranks keep their
    layout under ``"auto"`` (a 5-d batch runs channels-last-3d only when the
    user asks for ``channels_last=True``).

    A depthwise layer that must run tuned kernels (``kernels="tvm"``) runs
    them in the layout they were tuned for: another layout would be an error
    at the first step, so the model keeps its own.

    torch 2.13's CPU backward of a strided 1x1 convolution with 2..7 input
    channels per group in channels-last format corrupts the heap (seen as
    ``free(): invalid next size`` or a hang; 1 and 8+ channels, and other
    kernel sizes, are fine). Such layers occur in narrow test models, rarely
    in real ones; the user may still ask for ``channels_last=True``.
    """
    if batch.dim() != 4:
        return (f"channels_last=auto: kept the model's layout: the input is {batch.dim()}-d, and channels-last "
                f"is tried for 4-d (NCHW) inputs only (channels_last=True runs a 5-d one channels-last-3d)")
    for name, m in model.named_modules():
        if isinstance(m, TunedDepthwiseConv2d) and m.kernels is not None and m.kernels.strict:
            return (f"channels_last=auto: kept the model's layout: '{name}' runs tuned kernels only "
                    f"(kernels='tvm'), in the layout they were tuned for")
    if device.type != "cpu":
        return None
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and max(m.stride) > 1 \
                and 1 < m.in_channels // m.groups < 8:
            return (f"channels_last=auto: kept NCHW: '{name}' is a strided 1x1 convolution with "
                    f"{m.in_channels // m.groups} input channels, whose channels-last backward corrupts memory in "
                    f"torch {torch.__version__.split('+')[0]} on a CPU")
    return None
