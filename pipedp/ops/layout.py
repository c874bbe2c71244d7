"""Activation layouts of the kernels, and how torch tensors are handed to them (torch only, no TVM).

An NCHW kernel takes contiguous tensors. An NHWC kernel takes (n, h, w, c)
buffers: a channels_last tensor permuted to (0, 2, 3, 1) is exactly that,
so a channels_last model runs NHWC kernels without a copy. Weights keep
torch's (o, 1, kh, kw) layout in both.

TVM compiles every kernel for buffers aligned to :data:`ALIGNMENT` bytes
(its allocation alignment): vector loads (a CUDA ``float4``, eight halves,
a CPU vector) of a buffer that is not fault (a misaligned address on a GPU
is a sticky CUDA error, as an out-of-bounds one is). torch's allocations
are aligned; a view that starts inside one (a batch slice, a microbatch)
need not be, so inputs go through :func:`aligned`.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["LAYOUTS", "ALIGNMENT", "layout_of_tensor", "arrange", "aligned", "empty"]

LAYOUTS = ("NCHW", "NHWC")
ALIGNMENT = 64  # bytes: what TVM assumes of the data of every buffer a kernel is passed


def layout_of_tensor(t: torch.Tensor) -> str:
    """NHWC for a channels_last tensor (that is not also plain contiguous), else NCHW."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "NHWC"
    return "NCHW"


def _format(layout: str) -> torch.memory_format:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    return torch.channels_last if layout == "NHWC" else torch.contiguous_format


def arrange(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The buffer a ``layout`` kernel is passed for activation ``t`` (copies only if ``t`` is in another layout)."""
    t = t.contiguous(memory_format=_format(layout))
    return t.permute(0, 2, 3, 1) if layout == "NHWC" else t


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` where its data starts on an :data:`ALIGNMENT` boundary, else a copy that does (same strides): for a
    kernel's inputs (an output must be aligned itself: a copy would take the results)."""
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


def empty(shape: Sequence[int], like: torch.Tensor, layout: str) -> torch.Tensor:
    """A fresh NCHW-shaped activation stored in ``layout``."""
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device, memory_format=_format(layout))
