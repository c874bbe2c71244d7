"""CPU lanes that run concurrently: a worker thread per stage with its own intra-op thread team.

One intra-op team over all cores scales sub-linearly, so stages that run at
the same time on disjoint core sets, each with the thread count it uses best,
can beat one stage on all cores: the CUDA-stream pipeline, on cores.

Why threads and not processes (checked on torch's OpenMP build): OpenMP's
thread-count setting is per thread and libgomp keeps a team per master thread,
so ``torch.set_num_threads(k)`` called inside a worker gives that worker a team
of k (k - 1 new OpenMP threads appear) while other threads keep their counts;
MKL's count is thread-local too. Two traps: torch initialises a thread's count
lazily from the count last set by *any* thread, so a worker forces its own
initialisation before setting k (else a later set elsewhere overwrites it),
and the host restores that shared last-set value once the worker is ready, so
threads started later still get the host's count. A worker pins itself to
its core set with ``sched_setaffinity``; the OpenMP threads it spawns inherit
the mask, so stages do not compete for cores.

Work reaches a worker as closures in issue order; dependencies between lanes
are :class:`threading.Event` s (a :class:`Flight` per step). Autograd runs a
CPU backward on the calling thread, so backward in a worker is plain torch.
Grad mode is thread-local: each closure runs under the mode the host had
when it issued it. A failing closure makes the rest of the step's closures
skip (so no worker waits forever) and :meth:`Flight.wait` re-raises it with
the stage named; the workers stay idle and usable. Random ops draw from the
shared CPU generator in an order that depends on timing, so exactness holds
for models without them (dropout) only.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from typing import Callable, Hashable, Iterable, Sequence

import torch

from ..device import available_cores

__all__ = ["CpuWorker", "Flight", "available_cores", "core_sets"]

_STOP = None


def core_sets(threads: Sequence[int], cores: Sequence[int] | None = None) -> list[tuple[int, ...] | None]:
    """Disjoint core sets, in order, for stages with ``threads`` threads each (None: no pinning).

    Stages are pinned only when their threads fit the cores: oversubscribed
    threads do better left to the OS scheduler.
    """
    cores = list(cores) if cores is not None else available_cores()
    if sum(threads) > len(cores):
        return [None] * len(threads)
    out, start = [], 0
    for k in threads:
        out.append(tuple(cores[start : start + k]))
        start += k
    return out


class _Job:
    __slots__ = ("fn", "after", "done", "flight", "label", "grad", "inference")

    def __init__(self, fn: Callable[[], object], after: list[threading.Event], done: threading.Event,
                 flight: "Flight", label: str) -> None:
        self.fn, self.after, self.done, self.flight, self.label = fn, after, done, flight, label
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(self) -> None:
        try:
            for ev in self.after:
                ev.wait()
            if self.flight.failed:
                return
            with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
                self.fn()
        except BaseException as e:  # noqa: B036 - handed to the host, which re-raises it
            self.flight.fail(e, self.label)
        finally:
            self.done.set()


def _serve(jobs: "queue.SimpleQueue[_Job | None]", threads: int, cores: tuple[int, ...] | None,
           ready: threading.Event, report: list) -> None:
    """The worker's loop (holds no reference to its :class:`CpuWorker`, so that one can be collected)."""
    try:
        if cores is not None:
            os.sched_setaffinity(threading.get_native_id(), cores)
        torch.get_num_threads()  # initialise this thread's count now, so no later set elsewhere overrides it
        torch.set_num_threads(threads)
        report.append(torch.get_num_threads())
    except BaseException as e:  # noqa: B036 - reported to the constructor
        report.append(e)
    finally:
        ready.set()
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        job.run()
        del job  # an idle worker must not keep the last step (and through it, its own lane) alive


class CpuWorker:
    """A thread that runs the closures given to it in order, with ``threads`` intra-op threads on ``cores``.

    Stops on :meth:`close` or when the worker is garbage collected.
    """

    def __init__(self, threads: int, cores: Iterable[int] | None = None, name: str = "stage") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"a CPU worker needs a positive int thread count, got {threads!r}")
        self.threads = threads
        self.cores = tuple(cores) if cores is not None else None
        self.name = name
        self._jobs: "queue.SimpleQueue[_Job | None]" = queue.SimpleQueue()
        ready, report = threading.Event(), []
        host = torch.get_num_threads()  # the host's own count is initialised before any worker sets one
        self._thread = threading.Thread(target=_serve, args=(self._jobs, threads, self.cores, ready, report),
                                        name=f"pipedp-{name}", daemon=True)
        self._thread.start()
        ready.wait()
        torch.set_num_threads(host)  # the count threads started later inherit stays the host's
        if isinstance(report[0], BaseException):
            self._jobs.put(_STOP)
            raise RuntimeError(f"CPU worker for {name} could not start with {threads} threads on cores "
                               f"{self.cores}: {report[0]}") from report[0]
        self._finalizer = weakref.finalize(self, self._jobs.put, _STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, job: _Job) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"the CPU worker of {self.name} was closed")
        self._jobs.put(job)

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the worker and return its result (raising what it raised): for profiling and tests."""
        flight, out = Flight(), []
        flight.submit(self, "call", lambda: out.append(fn()), label=self.name)
        flight.wait()
        return out[0]

    def close(self, wait: bool = True) -> None:
        """Stop the thread once the queued closures are done."""
        self._finalizer()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def __repr__(self) -> str:
        return f"CpuWorker({self.name}, threads={self.threads}, cores={self.cores})"


class Flight:
    """The closures of one step issued to workers: their completion events and the first failure."""

    def __init__(self) -> None:
        self.done: dict[Hashable, threading.Event] = {}
        self.error: tuple[BaseException, str] | None = None
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, error: BaseException, label: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = (error, label)

    def submit(self, worker: CpuWorker, key: Hashable, fn: Callable[[], object], after: Iterable[Hashable] = (),
               label: str = "") -> None:
        """Queue ``fn`` on ``worker``, to start once the closures keyed ``after`` (issued before) are done."""
        deps = [self.done[k] for k in after if k in self.done]
        done = self.done[key] = threading.Event()
        worker.put(_Job(fn, deps, done, self, label))

    def wait(self) -> None:
        """Wait for every closure issued; re-raise the first failure with where it happened.

        Interrupted (Ctrl-C), it makes the closures not yet started skip and
        waits for the running ones, so no worker touches the model afterwards.
        """
        try:
            for ev in list(self.done.values()):
                ev.wait()
        except BaseException as e:
            self.fail(e, "the host, waiting for the step")
            for ev in list(self.done.values()):
                ev.wait()
            raise
        if self.error is not None:
            error, label = self.error
            self.error = None
            error.add_note(f"(raised in {label}, on its CPU worker thread)")
            raise error
