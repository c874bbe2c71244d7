"""A pipeline stage: a contiguous run of blocks, the device it runs on and its lane."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..partition.blocks import Chain
from .stream import Lane

__all__ = ["Stage"]


@dataclass
class Stage:
    index: int
    chain: Chain
    device: torch.device
    lane: Lane
    copy_input: bool = False  # the first block modifies its input in place


    @property
    def names(self) -> list[str]:
        return self.chain.names

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A leaf that requires grad cannot be modified in place: give such a
        # first block a (non-leaf) copy; gradients still reach the leaf.
        if self.copy_input and x.requires_grad and x.is_leaf:
            x = x.clone()
        return self.chain(x)
