"""Checkpoint files that are whole or absent, read back as data only, and RNG streams.

A crash in the middle of ``torch.save`` must not destroy the previous
checkpoint: :func:`save` writes through :mod:`pipedp.atomic`. :func:`load` uses
``weights_only=True``: unpickling a checkpoint cannot run code. RNG states are
stored as tensors and plain Python values so they pass that loader.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np
import torch

from .atomic import replace_atomically, require_folder

__all__ = ["save", "load", "rng_state", "set_rng_state"]


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


def rng_state() -> dict[str, Any]:
    """torch (CPU and every initialised CUDA device), Python and NumPy RNG states, loadable as data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "python": [version, list(internal), gauss],
        "numpy": [str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda:
        if torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            for i, s in enumerate(cuda):
                torch.cuda.set_rng_state(s, i)
        else:
            warnings.warn(
                f"the checkpoint has CUDA RNG states for {len(cuda)} device(s), this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: CUDA RNG not restored",
                stacklevel=2,
            )
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
