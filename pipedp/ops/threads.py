"""TVM's CPU thread pool sized like torch's intra-op pool: the fallback to :mod:`.parallel`.

Kernels whose parallel loops cannot run on torch's OpenMP team (no C
compiler for the launcher) run them on TVM's pool. Left alone, that pool
takes half of ``hardware_concurrency`` on x86 (it assumes two hyper-threads
per core): one thread on a 2-vCPU machine while torch uses both. Tuning
measures and training runs both call :func:`match_torch`, so such a kernel is
timed with the threads it later gets, and ``torch.set_num_threads`` (or
``OMP_NUM_THREADS``) governs both. The workers may run on every CPU this
process may use (its affinity mask).

TVM's workers also spin (300k polls) after each kernel waiting for the next,
which takes a core from the torch op that follows; in a training step that
cost more than the kernels saved (the README has the figures). Unless
``TVM_THREAD_POOL_SPIN_COUNT`` is set, the pool is created with no spin.

Needs the TVM runtime loaded (``import tvm`` on the compiler side,
:mod:`pipedp.ops.runtime` on the training side).
"""

from __future__ import annotations

import os
import threading

import torch

from ..checks import positive_int

__all__ = ["match_torch", "configure"]

# TVM's ThreadPool::AffinityMode: workers share all of the listed CPUs.
_SHARE_ALL_CPUS = 3
_lock = threading.Lock()
_configured: int | None = None


def configure(threads: int) -> None:
    """Make TVM's pool ``threads`` wide (raises ``ValueError`` for fewer than 1)."""
    global _configured
    positive_int("threads", threads)
    import tvm_ffi

    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")  # read when the pool starts its workers
    cpus = [str(c) for c in sorted(os.sched_getaffinity(0))] if hasattr(os, "sched_getaffinity") else []
    with _lock:
        tvm_ffi.get_global_func("runtime.config_threadpool")(_SHARE_ALL_CPUS, threads, cpus)
        _configured = threads


def match_torch() -> int:
    """Size TVM's pool to ``torch.get_num_threads()`` if it is not already; returns that count.

    Cheap when nothing changed (one comparison), so it runs before every CPU kernel call.
    """
    want = torch.get_num_threads()
    if want != _configured:
        configure(want)
    return want
