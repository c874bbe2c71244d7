"""Writing results files: whole or not at all (a temp file renamed into place)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

__all__ = ["write_json", "write_text"]


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the new one, never half of it."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def write_json(path: str, data: Any, indent: int = 1) -> None:
    """Strict JSON (NaN and infinities, e.g. a failed measurement, become null), written atomically."""
    write_text(path, json.dumps(_finite(data), indent=indent, allow_nan=False) + "\n")
