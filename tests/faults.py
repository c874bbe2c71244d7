"""Jobs for worker processes that crash, hang or fail, for the tests of isolation (the tuner's and the measuring
side's).

They run in a child process, which imports them by name, so they live in a module of their own. The jobs that wrap a
real one fail once per fault: the first job to find no marker file for a fault in the folder ``$PIPEDP_TEST_FAULTS``
names (the environment reaches the child) creates it and fails, so a crash and a hang happen once each, whichever
worker runs them, and every later candidate runs for real.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

FAULTS = "PIPEDP_TEST_FAULTS"


def pid() -> int:
    return os.getpid()


def crash() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)  # as a kernel that reads out of bounds


def hang() -> None:
    time.sleep(3600)


class _Wrong(ValueError):
    status = "wrong"


def wrong() -> None:
    raise _Wrong("differs from torch by 1")


class AcceleratorError(RuntimeError):
    """As torch raises it after a kernel read out of bounds: the process's CUDA context is gone for good."""


_BROKEN = False


def illegal_access() -> None:
    """A job that faults as a kernel reading out of bounds does on a GPU: it raises, and every later job of its
    process fails with the same error (a CUDA error is sticky)."""
    global _BROKEN
    _BROKEN = True
    raise AcceleratorError("CUDA error: an illegal memory access was encountered")


def pid_unless_broken() -> int:
    """:func:`pid`, or the sticky error where an earlier job of this process broke it."""
    if _BROKEN:
        raise AcceleratorError("CUDA error: an illegal memory access was encountered")
    return os.getpid()


def _first(fault: str) -> bool:
    folder = os.environ.get(FAULTS)
    if not folder:
        return False
    try:
        os.close(os.open(os.path.join(folder, fault), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _crash_then_hang_once() -> None:
    if _first("crash"):
        crash()
    if _first("hang"):
        hang()


def synthetic(job: Any, device: str, min_ms: float, repeat: int) -> float:
    """A :class:`~pipedp.kernels.tvm.isolated.ProcessRunner` job that compiles nothing: µs from the config."""
    _crash_then_hang_once()
    return 1.0 + job.config["tile_w"]


def build_and_measure(job: Any, device: str, min_ms: float, repeat: int) -> float:
    """The tuner's real job, after one crash and one hang."""
    _crash_then_hang_once()
    from pipedp.kernels.tvm.isolated import build_and_measure as real  # (in the child: not the test's stand-in)

    return real(job, device, min_ms, repeat)


def measure_candidate(*args: Any) -> dict[str, Any]:
    """The measuring command's real job, after one crash (no hang: the tests of the round keep short)."""
    if _first("crash"):
        crash()
    from pipedp.ops.measure import measure_candidate as real

    return real(*args)
