"""Running compiled kernels for the tuner: the :class:`Runner` protocol and the in-process runner.

Checking a kernel against torch and timing it is torch only
(:mod:`pipedp.ops.harness`, re-exported here): the measuring command of a
machine without the compiler (:mod:`pipedp.ops.measure`) judges candidates
with the same functions. The harness's rules: a kernel is called as the
runtime op calls it (a fresh output every call), it must match torch before
it is timed, a timing is the median of runs of enough calls to last
``min_ms``, and on a CPU TVM's pool is made as wide as torch's first.

:class:`Runner` is what the tuner asks of this part: check and time one
built kernel. :class:`LocalRunner` does it in this process;
:class:`~.isolated.ProcessRunner` builds and measures each candidate in a
worker process with a time limit, so a crash or a hang fails one candidate
and not the run; a runner on another machine implements the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pipedp.ops.harness import (Kernel, WrongResult, call, check, kernel_fn, measure_us, prepare, reference, torch_fn,
                                torch_us)
from pipedp.ops.problem import DepthwiseConv

__all__ = ["Kernel", "Runner", "LocalRunner", "WrongResult", "reference", "prepare", "check", "call", "kernel_fn",
           "torch_fn", "measure_us", "torch_us"]

K_contra = TypeVar("K_contra", contravariant=True)


class Runner(Protocol[K_contra]):
    """Checks one built kernel against torch and returns its µs per call; raises if it is wrong.

    An exception with a ``status`` attribute (``wrong``, ``crash``,
    ``timeout``) says how the candidate failed; any other is ``error``.
    """

    def run(self, kernel: K_contra, conv: DepthwiseConv, op: str, layout: str, device: torch.device,
            min_ms: float) -> float: ...


@dataclass(frozen=True)
class LocalRunner:
    """Check, then time, in this process on ``device`` (the median of ``repeat`` runs)."""

    repeat: int = 3

    def run(self, kernel: Kernel, conv: DepthwiseConv, op: str, layout: str, device: torch.device,
            min_ms: float) -> float:
        check(kernel, conv, op, device, layout)
        return measure_us(kernel, conv, op, device, repeat=self.repeat, min_ms=min_ms, layout=layout)

