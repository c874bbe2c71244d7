"""What passes between blocks and stages: one tensor, or a tuple of tensors where a cut crosses several.

Most cuts of a CNN pass one tensor; inside a long multi-path stretch (the
branches of an HRNet stage, the growing feature list of a DenseNet block)
every point has several values live, and a cut there passes them all as a
tuple, as torchgpipe and torch.distributed.pipelining do. Everything that
moves a boundary value (the executor, the transport between ranks, the
profiler, the chain check) goes through these helpers, so a tensor and a
tuple are handled alike.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

__all__ = ["Value", "tensors", "is_value", "leaf", "map_tensors", "nbytes"]

Value = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def is_value(v: object) -> bool:
    """Can ``v`` pass a boundary: a tensor, or a non-empty tuple of tensors?"""
    return isinstance(v, torch.Tensor) or (
        isinstance(v, tuple) and bool(v) and all(isinstance(t, torch.Tensor) for t in v))


def tensors(v: Value) -> tuple[torch.Tensor, ...]:
    """The tensors of a boundary value, in order."""
    return (v,) if isinstance(v, torch.Tensor) else tuple(v)


def map_tensors(v: Value, fn: Callable[[torch.Tensor], torch.Tensor]) -> Value:
    """``fn`` applied to every tensor of ``v``, the structure kept."""
    return fn(v) if isinstance(v, torch.Tensor) else tuple(fn(t) for t in v)


def leaf(v: Value, requires_grad: bool | Sequence[bool]) -> Value:
    """Detached copies of ``v``'s tensors as graph leaves, as the next stage receives them.

    ``requires_grad`` per tensor (or one flag for all); only floating-point
    tensors can require grad.
    """
    flags = [requires_grad] * len(tensors(v)) if isinstance(requires_grad, bool) else list(requires_grad)
    it = iter(flags)
    return map_tensors(v, lambda t: t.detach().requires_grad_(next(it) and t.is_floating_point()))


def nbytes(v: Value) -> int:
    """Bytes of the tensors of ``v``."""
    return sum(t.numel() * t.element_size() for t in tensors(v))
