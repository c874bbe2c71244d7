"""Checkpoint files that are whole or absent, read back as data only.

A crash in the middle of ``torch.save`` must not destroy the previous
checkpoint: :func:`save` writes through :mod:`pipedp.atomic`. :func:`load` uses
``weights_only=True``: unpickling a checkpoint cannot run code (RNG states are
stored as tensors and plain values for it: :mod:`pipedp.snapshot`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .atomic import replace_atomically, require_folder

__all__ = ["save", "load"]


def save(obj: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, atomically: the old file stays until the new one is complete."""
    require_folder(path, "save a checkpoint to")
    with replace_atomically(path) as f:
        torch.save(obj, f)


def load(path: str | os.PathLike, map_location: Any = None) -> dict[str, Any]:
    """Read a checkpoint as data (``weights_only=True``); a clear error for a missing or bad file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(
            f"cannot read the checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            f"It is truncated or corrupt, or holds more than tensors and plain containers "
            f"(a pipedp checkpoint holds only those)"
        ) from e
