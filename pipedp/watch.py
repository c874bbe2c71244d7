"""Noticing, at each step, how the model changed since the last one: follow what can be followed, refuse the rest.

A user keeps changing the model after wrap: layers are frozen and unfrozen
for fine-tuning, ``model.double()`` converts it, checkpoints are loaded. Each
step (and each ``engine(x)``) must run what the model holds *now*.
:class:`ModelWatch` compares the model's parameters with those of the last
step, in a few list passes (0.1-0.2 ms for ResNet-50's 161 parameters on a
busy 2-core CPU):

* which require grad, their dtypes and shapes: *followed* — the engine packs
  the gradient buckets again and pipeline ranks renew the metadata of what
  crosses their boundaries (:meth:`ModelWatch.changed` says so);
* a parameter or submodule replaced by another object (``load_state_dict(...,
  assign=True)``, ``model.fc = nn.Linear(...)``) or a parameter moved to
  another device: *refused* with a ``ValueError`` naming it, because the
  optimizer, the pipeline's blocks and its stage devices hold what was there
  at wrap, and a step would silently train the old objects.

Buffers need no watching: the step's rollback copy finds them by module and
name (:class:`~pipedp.snapshot.BufferSnapshot`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

__all__ = ["ModelWatch"]

_FLAGS = operator.attrgetter("requires_grad", "dtype", "device", "shape")
_REWRAP = "build a new optimizer on model.parameters() and wrap the model again"


def _qual(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class ModelWatch:
    """The model's submodules and parameter tensors as at wrap, and the parameters' flags as at the last step."""

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_modules())
        self._places = [(m._modules, name) for _, m in named for name in m._modules]  # where each child sits
        self._children = [m._modules[name] for _, m in named for name in m._modules]
        self._child_names = [_qual(q, name) for q, m in named for name in m._modules]
        self._dicts = [(m._modules, m._parameters) for _, m in named]
        self._module_names = [q for q, _ in named]
        self._sizes = [(len(a), len(b)) for a, b in self._dicts]
        self._slots = [(m, name) for _, m in named for name, p in m._parameters.items() if p is not None]
        self._names = [_qual(q, name) for q, m in named for name, p in m._parameters.items() if p is not None]
        self._params: list[Any] = [m._parameters[name] for m, name in self._slots]
        self._flags = list(map(_FLAGS, self._params))
        self._placed = False  # devices are checked once the build placed the stages

    def accept(self) -> None:
        """Take the parameters' flags as they are now (after the build moved the model to its devices)."""
        self._flags = list(map(_FLAGS, self._params))
        self._placed = True

    def changed(self) -> bool:
        """Whether a parameter's requires_grad, dtype or shape changed since the last call (then follow it).

        ``ValueError`` naming the change when the model holds other objects than
        at wrap, or a parameter moved to another device.
        """
        self._check_modules()
        current = [m._parameters.get(name) for m, name in self._slots]
        if any(map(operator.is_not, current, self._params)):
            self._refuse_replaced(current)
        flags = list(map(_FLAGS, current))
        if flags == self._flags:
            return False
        for name, (_, _, was, _), (_, _, now, _) in zip(self._names, self._flags, flags):
            if was != now and self._placed:
                raise ValueError(
                    f"parameter '{name}' moved from {was} to {now} after wrap(): each pipeline stage runs on the "
                    f"device it was planned for. Move the model back (model.to({str(was)!r})), or {_REWRAP}"
                )
        self._flags = flags
        return True

    def _check_modules(self) -> None:
        now = [d.get(name) for d, name in self._places]
        if any(map(operator.is_not, now, self._children)):
            k = next(i for i, (a, b) in enumerate(zip(now, self._children)) if a is not b)
            what = "was removed" if now[k] is None else f"was replaced by another {type(now[k]).__name__}"
            raise ValueError(
                f"module '{self._child_names[k]}' {what} after wrap(): the pipeline's stages run the modules the "
                f"model held when it was wrapped, and the optimizer holds their parameters. Keep the modules and "
                f"change their values instead (load_state_dict, requires_grad_), or {_REWRAP}"
            )
        sizes = [(len(a), len(b)) for a, b in self._dicts]
        if sizes != self._sizes:
            k = next(i for i, (a, b) in enumerate(zip(sizes, self._sizes)) if a != b)
            raise ValueError(
                f"module '{self._module_names[k] or '(the model)'}' got new submodules or parameters after wrap(): "
                f"the pipeline's stages and the optimizer do not know them. Add them before wrap(), or {_REWRAP}"
            )

    def _refuse_replaced(self, current: list[torch.Tensor | None]) -> None:
        k = next(i for i, (a, b) in enumerate(zip(current, self._params)) if a is not b)
        what = "was removed" if current[k] is None else "is another tensor object than at wrap()"
        raise ValueError(
            f"parameter '{self._names[k]}' {what}: load_state_dict(..., assign=True) and assigning a new "
            f"nn.Parameter replace parameters, and the optimizer (and the gradient buckets) still hold the old "
            f"ones, so its updates would not reach the model. Load without assign=True (it copies into the "
            f"existing parameters), or {_REWRAP}"
        )
