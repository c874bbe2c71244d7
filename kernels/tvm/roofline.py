"""The memory-bandwidth bound of a depthwise operator: a copy of the same bytes on the same device.

Depthwise convolutions do a few multiply-adds per byte, so moving their
operands once is the floor. On a CPU the floor depends on where those bytes
live: a problem that fits the last-level cache runs from it, a larger one
from DRAM, so the copy is timed at the problem's own size. The copy uses plain stores,
which read each line before writing it (write-allocate); a kernel that
writes a large output with streaming stores (:mod:`.streaming`) skips that
read and lands past this bound, by up to half of its write traffic. On a
GPU the bound is HBM's: the copy is timed on a buffer far larger than L2.
"""

from __future__ import annotations

import functools
import time

import torch

from pipedp.ops.problem import DepthwiseConv

__all__ = ["copy_us", "bound_us"]

_GPU_COPY_BYTES = 1 << 30  # read + write, well past any L2


@functools.lru_cache(maxsize=256)
def copy_us(nbytes: int, device: torch.device) -> float:
    """Best-of-5 µs to read ``nbytes / 2`` and write ``nbytes / 2`` (a copy between preallocated buffers)."""
    half = max(nbytes // 2, 64)
    src = torch.empty(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    cuda = device.type == "cuda"
    number = max(1, int(2e-3 / max(half / 5e9, 1e-7)))  # about 2 ms a run at a few GB/s
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(number):
            dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def bound_us(problem: DepthwiseConv, op: str, device: torch.device) -> float:
    """µs to move ``op``'s operands once at the copy speed of the memory they live in."""
    nbytes = problem.min_bytes(op)
    if device.type == "cuda":
        return copy_us(_GPU_COPY_BYTES, device) * nbytes / _GPU_COPY_BYTES
    return copy_us(nbytes, device)
