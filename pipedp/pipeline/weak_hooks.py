"""Hooks on the user's modules that neither keep an engine alive nor travel with a copy of the model.

A hook registered with a bound method holds its object: the user's model then
keeps a dropped engine's state reachable, and ``copy.deepcopy``, ``pickle``
and ``torch.save`` of the model try to copy that state (a thread-local, a
CUDA stream) and fail. A :class:`WeakHook` reaches its owner through a weak
reference and pickles as an inert hook: a copy of the model computes as the
plain model does, and the owner's finalizer takes the hooks off when it dies.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

from torch.utils.hooks import RemovableHandle

__all__ = ["WeakHook", "remove_all"]


class WeakHook:
    """Calls ``owner.<method>(*bound, *hook_args)`` while ``owner`` lives; a no-op after, and in any copy."""

    __slots__ = ("_owner", "_method", "_bound")

    def __init__(self, owner: object | None, method: str, *bound: Any) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._method = method
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            return None
        return getattr(owner, self._method)(*self._bound, *args)

    def __reduce__(self) -> tuple[type, tuple[None, str]]:
        # A copy of the model gets an inert hook: the engine's state stays with the engine.
        return WeakHook, (None, self._method)


def remove_all(handles: Iterable[RemovableHandle]) -> None:
    """Remove every hook in ``handles`` (a finalizer's callback: it must not refer to the hooks' owner)."""
    for h in list(handles):
        h.remove()
    if isinstance(handles, list):
        handles.clear()
