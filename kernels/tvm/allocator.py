"""Timing kernels, not the allocator: freed memory kept for reuse in measuring processes.

glibc serves blocks above 32 MiB with a fresh mmap and unmaps them on free,
so every large output of every op page-faults all its pages again (which
can cost more than the convolution itself), and the cost swings from call
to call with the allocator's state. Tuned under that, a large problem's
configs are ranked by fault noise, and torch's time (its oneDNN path
allocates more) comes out too slow, so ``kernels="auto"`` would take
kernels that lose in training. jemalloc and tcmalloc, which PyTorch's
CPU guide recommends, reuse freed memory; :func:`reuse_freed_memory` makes
glibc do the same (no mmap'd blocks, no heap trimming; its bins settle
after about eight allocations of a size, well inside a timing loop whose
median is taken). ``tune-kernels`` and the benchmarks call it before
measuring; it is process-wide and lasting, so library code never calls it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import platform

__all__ = ["reuse_freed_memory", "add_argument", "measure_with"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h


def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse; False (nothing changed) where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(name)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--allocator reuse|default``, as tune-kernels and the benchmarks take it."""
    parser.add_argument("--allocator", choices=["reuse", "default"], default="reuse",
                        help="reuse: freed memory is kept for reuse while measuring, as jemalloc/tcmalloc "
                             "do, so large outputs do not page-fault on every call and rank candidates by noise; "
                             "default: glibc as configured")


def measure_with(choice: str) -> bool:
    """Apply ``--allocator``; False where ``reuse`` was asked for and there is no glibc to ask."""
    return choice != "reuse" or reuse_freed_memory()
