"""Writing results files: whole or not at all (a temp file renamed into place)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pipedp import atomic

__all__ = ["write_json", "write_text"]


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (creating its folder): never half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic.write_text(path, text)


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
