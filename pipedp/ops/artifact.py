"""What identifies an exported library and where it can run; pure Python, shared by tuner and runtime."""

from __future__ import annotations

import hashlib
import platform

__all__ = ["sha256", "cpu_flags", "cpu_name"]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux); a CPU library needs its build host's vector extensions."""
    flags = _cpuinfo("flags")
    return set(flags.split()) if flags else set()


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """This CPU's model name, for the machine named beside every figure."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()
