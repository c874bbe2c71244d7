"""The user's optimizer: checked against the model it trains, and its state kept beside its parameters."""

from __future__ import annotations

from typing import Callable, Iterable, Union

import torch
from torch import nn

__all__ = ["OptimizerSpec", "check_optimizer", "move_optimizer_state"]

OptimizerSpec = Union[None, torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]


def check_optimizer(model: nn.Module, optimizer: OptimizerSpec) -> torch.optim.Optimizer | None:
    """The user's optimizer (or the one its factory builds), checked to hold only ``model``'s parameters."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, "
                f"got {type(optimizer).__name__}"
            )
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    mine = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's: "
            f"build it on model.parameters() of the model you wrap (or pass a factory)"
        )
    return optimizer


def move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put each parameter's state tensors on that parameter's device (after the model moved to its stages)."""
    for p, state in optimizer.state.items():
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and v.device != p.device and v.dim() > 0:
                state[k] = v.to(p.device)
