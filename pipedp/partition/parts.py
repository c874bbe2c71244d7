"""A model cut into blocks, as planning and lowering take it, and the one-block form profiling times.

Both the planner (which profiles and times the blocks) and the lowering
(which makes stages of them) read this value: it lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .blocks import Block
from .reads import BakedReads

__all__ = ["Parts", "OneTensor", "measurable", "surrogate_loss", "tensors_in"]


def tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors inside a stage's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for item in items for t in tensors_in(item)]


@dataclass(frozen=True)
class Parts:
    """The model cut into blocks, in order."""

    blocks: list[Block]
    copy_input: list[bool]  # per block: its forward changes its input in place
    # The user's model itself, which a plan of one stage runs instead of the blocks (None: the blocks are it).
    whole: nn.Module | None = None
    baked: BakedReads | None = None  # what the blocks' traced forwards read as constants (None: nothing)

    @property
    def trains(self) -> bool:
        """Has a step anything to train: a parameter that requires grad?

        A frozen model (a distillation teacher) or one without parameters can
        only run forward: an engine of one serves inference, and its trials
        time the forward (a backward would have nothing to reach).
        """
        return any(p.requires_grad for b in self.blocks for p in b.module.parameters())


class OneTensor(nn.Module):
    """A whole model as one block that returns one tensor, so that profiling can time its backward.

    On a single stage the model's output goes straight to ``loss_fn``, so it
    may be a tuple or a dict; only profiling needs one tensor, and the flat
    concatenation of the floating-point tensors in it reaches all of them.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            return out
        flat = [t.reshape(-1) for t in tensors_in(out) if t.is_floating_point()]
        if not flat:
            raise ValueError(
                f"{type(self.model).__name__}.forward returns {type(out).__name__} without a floating-point "
                f"tensor in it: there is nothing for loss_fn to train. Return the model's output tensor(s)"
            )
        return torch.cat(flat)


def measurable(blocks: Sequence[Block]) -> list[Block]:
    """The blocks to profile: a lone block is the whole model, whose output only ``loss_fn`` sees."""
    if len(blocks) == 1:
        return [Block(blocks[0].name, OneTensor(blocks[0].module))]
    return list(blocks)


def surrogate_loss(out: object, _: torch.Tensor) -> torch.Tensor:
    """The loss of profiling and trials: reaches every output element, costs next to nothing.

    A one-stage plan's output is the model's own, which may be a tuple or a dict of tensors.
    """
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    return torch.stack([t.float().mean() for t in tensors_in(out) if t.is_floating_point()]).sum()
