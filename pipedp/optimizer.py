"""The user's optimizer: checked against the model it trains, and its state kept beside its parameters."""

from __future__ import annotations

import inspect
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
    _check_steps_alone(optimizer)
    mine = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's: "
            f"build it on model.parameters() of the model you wrap (or pass a factory)"
        )
    return optimizer


def _check_steps_alone(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs an argument (LBFGS's closure): pipedp calls ``step()`` bare."""
    # The class's step, past its wrappers (torch's profiling hook on every optimizer class, an LR scheduler's
    # wrapper on the instance, both functools.wraps): what a bare call finally reaches. Its first parameter is self.
    try:
        signature = inspect.signature(type(optimizer).step)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to read, as torch's own are not
        return
    needed = [p.name for p in list(signature.parameters.values())[1:]
              if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                    p.KEYWORD_ONLY)]
    if needed:
        what = "a closure" if needed == ["closure"] else f"the argument(s) {', '.join(repr(n) for n in needed)}"
        raise ValueError(
            f"{type(optimizer).__name__}.step() needs {what}, but pipedp steps the optimizer once per batch, "
            f"after the batch's backward, as optimizer.step() without a closure (a closure would run the "
            f"forward and backward again inside the step). Use an optimizer that steps without one (SGD, Adam, "
            f"AdamW, ...), or train with a plain PyTorch loop for {type(optimizer).__name__}")


def move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put each parameter's state tensors on that parameter's device (after the model moved to its stages)."""
    for p, state in optimizer.state.items():
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and v.device != p.device and v.dim() > 0:
                state[k] = v.to(p.device)
