"""Undoing a failed ``optimizer.step()``, with the copy taken only where the step can still fail.

A copy of parameters and optimizer state before every update costs a pass
over twice the model's bytes each step (a CIFAR VGG-11's 28M parameters
with momentum: 225 MB, some 8% of its data-parallel step on a 2-core CPU)
and the memory of one more copy. But torch's own optimizers raise only on
*structure*: a gradient's or state's dtype, shape, device or layout (sparse),
a hyperparameter's type (a tensor ``lr``), state they must create. Once one
update of a given structure went through, the next update of the same
structure takes the same path and goes through too; so :class:`Rollback`
copies while the structure is new (the first steps, and after a change:
``load_state_dict``, a frozen layer, a new param group) and frees the copy
once such an update succeeded. Where it cannot know what runs (an optimizer
not from ``torch.optim``, a subclass, a ``step`` replaced on the instance,
step hooks), it copies before every update. An update that fails later
without a copy (out of memory midway through a foreach update) is not
undone; the error says so, and the next update is copied again.
"""

from __future__ import annotations

import operator
from typing import Any, Hashable

import torch
from torch.optim import optimizer as _optimizer_module

from .snapshot import UpdateSnapshot

__all__ = ["Rollback", "structure", "proven_by_structure"]

_META = operator.attrgetter("dtype", "shape", "device", "layout")
_GRAD = operator.attrgetter("grad")


def _kind(value: Any) -> Hashable:
    """What of ``value`` a torch optimizer's code path depends on: a tensor's metadata, else the type."""
    if isinstance(value, torch.Tensor):
        return _META(value)
    if isinstance(value, (tuple, list)):
        return tuple(map(_kind, value))
    return type(value)


def structure(optimizer: torch.optim.Optimizer) -> tuple:
    """The structure of ``optimizer``'s next update: parameters, gradients, state and hyperparameter kinds.

    A few list passes, like :class:`~pipedp.watch.ModelWatch`'s.
    """
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    hyper = tuple(tuple((k, _kind(v)) for k, v in g.items() if k != "params") for g in groups)
    grads = tuple(None if g is None else _META(g) for g in map(_GRAD, params))
    state = tuple(None if s is None else tuple((k, _kind(v)) for k, v in s.items())
                  for s in map(optimizer.state.get, params))
    return tuple(map(id, params)), tuple(map(_META, params)), grads, hyper, state


def proven_by_structure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update is torch's own code alone, so that its structure decides if it raises."""
    cls = type(optimizer)
    return (cls.__module__.startswith("torch.optim.") and cls is not torch.optim.LBFGS
            and getattr(cls.step, "__module__", "").startswith("torch.optim.") and "step" not in vars(optimizer)
            and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
            and not _optimizer_module._global_optimizer_pre_hooks
            and not _optimizer_module._global_optimizer_post_hooks)


class Rollback:
    """Puts parameters and optimizer state back when ``optimizer.step()`` raises (see the module's docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.snapshot = UpdateSnapshot(optimizer)
        self.proven: tuple | None = None  # the structure of an update that went through without a copy needed
        self._next: tuple | None = None
        self.copied = False  # whether the update under way was copied

    def before(self) -> None:
        """Called just before ``optimizer.step()``: copy what it may change unless its structure is proven."""
        self._next = structure(self.optimizer) if proven_by_structure(self.optimizer) else None
        self.copied = self._next is None or self._next != self.proven
        if self.copied:
            self.snapshot.save()

    def succeeded(self) -> None:
        """The update went through: its structure is proven, and a copy taken for it is freed."""
        if self._next is not None and self.copied:
            self.proven = self._next
            self.snapshot.release()

    def failed(self) -> bool:
        """The update raised: put back what was copied; False when nothing was (the update stays partial)."""
        self.proven = None
        if not self.copied:
            return False
        self.snapshot.restore()
        return True
