"""A pipeline stage: a contiguous run of blocks, the device it runs on and its lane."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from ..device import canonical_device
from ..partition.blocks import Chain
from ..partition.boundary import Value, map_tensors
from .stream import Lane

__all__ = ["Stage"]


@dataclass
class Stage:
    """``chain`` is the stage's modules; ``body``, when set, runs them instead (compiled and/or recomputed).

    ``autocast``: the dtype the forward (and, at the last stage, the loss)
    runs in under ``torch.autocast``; None runs as the model is. ``autocast_cache``:
    autocast's cache of cast weights, off under CUDA-graph capture (cached casts
    made outside a graph and used inside it do not mix).
    """

    index: int
    chain: Chain
    device: torch.device
    lane: Lane
    copy_input: bool = False  # the first block modifies its input in place
    autocast: torch.dtype | None = None
    autocast_cache: bool = True
    body: Callable[[Value], Any] | None = None

    def __post_init__(self) -> None:
        # With its index, as the tensors it makes report it (``cuda`` != ``cuda:0``).
        self.device = canonical_device(self.device)

    @property
    def names(self) -> list[str]:
        return self.chain.names

    def precision(self) -> ContextManager[Any]:
        """The stage's autocast region (a no-op in fp32)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast, cache_enabled=self.autocast_cache)

    def __call__(self, x: Value) -> Value:
        # A first block that modifies its input in place gets a copy: a leaf that requires grad cannot be
        # modified (the copy is no leaf; gradients still reach the leaf), and the first stage's microbatches are
        # views of the user's batch that share one version counter (a change to one would spoil what autograd
        # saved of another), and the user's batch stays as it was.
        if self.copy_input:
            x = map_tensors(x, torch.clone)
        with self.precision():
            return (self.body if self.body is not None else self.chain)(x)
