"""One job at a time in a child process with a time limit: a candidate that crashes or hangs fails, the run goes on.

A generated kernel can read out of bounds and take its process down with a
segfault, or loop for ever; in the tuning process either would end the run
and lose its state. So candidates are built and run in a :class:`Worker`:
a child process that takes one job (a module-level function and picklable
arguments) at a time. The parent waits for the result at most ``timeout``
seconds; a child that dies is a ``crash``, one that does not answer in time
is killed and is a ``timeout`` (:class:`CandidateFailed` with that
``status``), and the next job gets a fresh child.

Rules, and why:

- Children are spawned, not forked: the parent has torch's OpenMP team (and
  maybe CUDA) initialised, and a forked copy of those can deadlock.
- A child is started, and its ``init`` run, before a job's clock starts:
  starting Python and importing torch (and TVM) is not the candidate's time.
- An exception inside a job is that job's failure, reported with its
  ``status`` attribute when it has one (``wrong`` for a kernel that differs
  from torch) and the child keeps serving, unless the exception says the
  process itself is broken: a CUDA error (an illegal memory access, a
  launch failure, a device-side assert) is sticky, every later CUDA call of
  that process fails with it, so the child reports it and exits at once
  (``os._exit``: no destructor touches the broken context) and the next job
  gets a fresh child. ``Worker(restart_after_error=True)`` gives every job
  after any failure a fresh child, and :meth:`Worker.restart` does so on the
  caller's word (e.g. after a kernel that computed a wrong result, which may
  have written where it should not).
- Children ignore Ctrl-C: the parent decides what an interrupt stops, and
  closes its worker.

Torch-free and TVM-free itself: the tuner (compiler side) and the measuring
command of a GPU host (:mod:`.measure`, runtime only) both use it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from typing import Any, Callable

__all__ = ["Worker", "CandidateFailed", "breaks_process"]

_BROKEN_EXIT = 75  # a child's exit status after a job broke its process (see breaks_process)


class CandidateFailed(RuntimeError):
    """A job that failed: ``status`` is ``crash``, ``timeout``, or what the job's own exception said."""

    def __init__(self, message: str, status: str = "error") -> None:
        super().__init__(message)
        self.status = status


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


# What the message of an exception that leaves a CUDA context unusable contains (torch's AcceleratorError and
# RuntimeError, TVM's runtime errors): the error is sticky, every later call of the process fails with it.
_BROKEN_CONTEXT = ("CUDA error", "CUDA Runtime Error", "cudaError", "CUDA_ERROR", "CUDALaunch", "CUDA driver error",
                   "illegal memory access", "illegal address", "unspecified launch failure", "device-side assert")


def breaks_process(e: BaseException) -> bool:
    """Whether ``e`` leaves its process unfit for another job (a CUDA error: its context is gone for good)."""
    if type(e).__name__ == "AcceleratorError":
        return True
    text = str(e)
    return any(s in text for s in _BROKEN_CONTEXT)


def _serve(conn: Connection, init: Callable[..., object] | None, init_args: tuple[Any, ...]) -> None:
    """The child's loop: run ``init``, say ready, then answer each job until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if init is not None:
            init(*init_args)
    except Exception as e:
        conn.send(("failed", _first_line(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        fn, args = job
        try:
            result = fn(*args)
        except Exception as e:
            broken = breaks_process(e)
            conn.send(("error", (str(getattr(e, "status", "error")), _first_line(e), broken)))
            if broken:  # a broken CUDA context: every later job would fail with it; go, and run nothing more
                conn.close()
                os._exit(_BROKEN_EXIT)
        else:
            conn.send(("ok", result))


def _died(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Worker:
    """A child process that runs jobs one at a time (see the module docstring); restarted after a failure.

    ``init(*init_args)`` runs once in each child before its first job (a
    module-level function: the child imports it by name).
    """

    def __init__(self, init: Callable[..., object] | None = None, init_args: tuple[Any, ...] = (),
                 start_timeout: float = 300.0, restart_after_error: bool = False) -> None:
        self.init, self.init_args, self.start_timeout = init, init_args, start_timeout
        self.restart_after_error = restart_after_error  # a fresh child after any failed job, not only a broken one
        self._process: Any = None  # a multiprocessing.Process while a child runs
        self._conn: Connection | None = None
        self.starts = 0  # children started so far (the first, and one after each crash or timeout)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        """``fn(*args)`` in the child, its result; :class:`CandidateFailed` if it raised, crashed or took too long."""
        conn = self._ready()
        try:
            conn.send((fn, args))
        except (BrokenPipeError, ConnectionResetError):  # the child died since its last answer: start another
            self._stop()
            conn = self._ready()
            conn.send((fn, args))
        if not conn.poll(timeout):
            self._stop()
            raise CandidateFailed(f"no result within the time limit of {timeout:g} s: the worker was killed",
                                  "timeout")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            raise CandidateFailed(f"the worker process died ({_died(self._stop())})", "crash") from None
        if status == "error":
            if payload[2] or self.restart_after_error:
                self._stop()  # (a child whose process broke is exiting by itself: reaped here)
            raise CandidateFailed(payload[1], payload[0])
        return payload

    def restart(self) -> None:
        """Stop the child, if one runs: the next job gets a fresh one (its ``init`` run again)."""
        self._stop()

    def close(self) -> None:
        """Stop the child, if one runs."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._process.join(timeout=5)
        self._stop()

    def _ready(self) -> Connection:
        """The connection to a running child, starting one (and waiting for its ``init``) if there is none."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self._stop()
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(theirs, self.init, self.init_args), daemon=True,
                              name="pipedp-candidate-worker")
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        self.starts += 1
        if not ours.poll(self.start_timeout):
            self._stop()
            raise RuntimeError(f"a worker process did not start within {self.start_timeout:g} s")
        try:
            status, payload = ours.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"a worker process died while starting ({_died(self._stop())})") from None
        if status != "ready":
            self._stop()
            raise RuntimeError(f"a worker process failed to start: {payload}")
        return ours

    def _stop(self) -> int | None:
        """Kill the child if it still runs, reap it, and return its exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
        code = process.exitcode
        if code is not None:
            process.close()
        return code
