"""What identifies an exported library and where it can run; pure Python, shared by tuner and runtime."""

from __future__ import annotations

import hashlib

__all__ = ["sha256", "cpu_flags"]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux); a CPU library needs its build host's vector extensions."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
