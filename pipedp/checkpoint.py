"""Checkpoint files that are whole or absent, checked when read, read back as data only.

A crash in the middle of ``torch.save`` must not destroy the previous
checkpoint: :func:`save` writes through :mod:`pipedp.atomic`. :func:`load`
first checks every entry of the archive against the CRC-32 the zip format
stores beside it: ``torch.load`` does not, so a flipped bit inside a weight
would load as a wrong number. Then it reads with ``weights_only=True``:
unpickling a checkpoint cannot run code (RNG states are stored as tensors
and plain values for it: :mod:`pipedp.snapshot`).
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch

from .atomic import replace_atomically, require_folder

__all__ = ["save", "load", "verify"]


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
    verify(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(
            f"cannot read the checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            f"It is truncated or corrupt, or holds more than tensors and plain containers "
            f"(a pipedp checkpoint holds only those)"
        ) from e


def verify(path: str | os.PathLike) -> None:
    """Check every entry of the checkpoint archive at ``path`` against its stored CRC-32.

    A ValueError names the damaged entry; a file that is not a zip archive (a
    truncated file, or torch's legacy format, which has no checksums) is refused.
    """
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise ValueError(
            f"cannot read the checkpoint {path}: it is not a complete zip archive ({e}). It is truncated or "
            f"corrupt, or was written in torch's legacy format, which has no checksums: save it again with "
            f"engine.save() or torch.save() (zip format, the default)"
        ) from e
    if bad is not None:
        raise ValueError(
            f"the checkpoint {path} is corrupt: its entry {bad!r} does not match the checksum stored with it "
            f"(damaged on disk or in transfer); nothing was loaded. Use an earlier checkpoint or copy it again"
        )
