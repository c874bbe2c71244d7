"""Synthetic batches for the example scripts: the same images and labels in every run of one seed."""

from __future__ import annotations

import torch


def batches(seed: int, epoch: int, steps: int, batch: int, size: int, classes: int
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (images, labels) batches of one epoch, from a generator of their own (the RNG is the loop's)."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return [(torch.randn((batch, 3, size, size), generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]
