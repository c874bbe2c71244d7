"""Building and measuring each candidate in a worker process with a time limit (``tune-kernels``' default).

A candidate that segfaults, aborts or never returns would take an
in-process tuning run with it; here it is one failed candidate, recorded
with its status (``crash``, ``timeout``), and the search goes on in a fresh
worker (:class:`pipedp.ops.worker.Worker`).

The builder/runner split of :mod:`.tuner` stays: :class:`DeferredBuilder`
validates a config (an invalid one costs microseconds and no process) and
hands on a :class:`BuildJob`, plain data; :class:`ProcessRunner` builds and
measures that job in its worker, in one step, because a loaded kernel does
not cross processes. The worker builds and loads the kernel exactly as
:class:`~.builder.LocalBuilder` and :class:`~.runner.LocalRunner` do in
the tuning process (a CPU kernel's parallel loops on torch's OpenMP team,
TVM's pool as wide as torch's), with the tuning process's torch thread count
and allocator setting, so a candidate is timed as training will run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from pipedp.ops.problem import DepthwiseConv
from pipedp.ops.worker import Worker

from .space import Config
from .template import get_template, layout_of

if TYPE_CHECKING:  # (TVM is imported by the job that compiles, not by every worker that unpickles this module)
    from .target import Target

__all__ = ["BuildJob", "DeferredBuilder", "ProcessRunner", "build_and_measure"]


@dataclass(frozen=True)
class BuildJob:
    """What a worker builds: a problem, an operator, a config and the target (as its JSON)."""

    conv: DepthwiseConv
    op: str
    config: Config
    target: str


@dataclass(frozen=True)
class DeferredBuilder:
    """A builder whose "kernel" is a :class:`BuildJob` for :class:`ProcessRunner` (invalid configs raise here)."""

    def build(self, conv: DepthwiseConv, op: str, config: Config, target: Target) -> BuildJob:
        tmpl = get_template(target, layout_of(config))
        tmpl.validate(conv, op, tmpl.space(conv, op).complete(config))
        return BuildJob(conv, op, dict(config), str(target))


def build_and_measure(job: BuildJob, device: str, min_ms: float, repeat: int) -> float:
    """Build ``job`` and check and time it (runs in the worker): µs per call."""
    from .builder import LocalBuilder
    from .runner import LocalRunner
    from .target import Target

    kernel = LocalBuilder().build(job.conv, job.op, job.config, Target(job.target))
    return LocalRunner(repeat).run(kernel, job.conv, job.op, layout_of(job.config), torch.device(device), min_ms)


def _start(threads: int, reuse_memory: bool, compiler: bool) -> None:
    """A worker's setup: the tuning process's torch thread count and allocator setting (see :mod:`.allocator`),
    and, for the jobs that compile, TVM imported (seconds that are no candidate's time)."""
    torch.set_num_threads(threads)
    if reuse_memory:
        from .allocator import reuse_freed_memory

        reuse_freed_memory()
    if compiler:
        from . import builder  # noqa: F401


@dataclass
class ProcessRunner:
    """Builds and measures each :class:`BuildJob` in a worker process, each within ``timeout`` seconds.

    ``job`` is the function the worker runs (module-level; by default
    :func:`build_and_measure`, looked up when called); tests give one that
    crashes or hangs. Close it (or use it as a context manager) to stop the
    worker.
    """

    timeout: float = 60.0
    repeat: int = 3
    threads: int = field(default_factory=torch.get_num_threads)
    reuse_memory: bool = False
    job: Callable[[BuildJob, str, float, int], float] | None = None
    worker: Worker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"a candidate's time limit must be positive, got {self.timeout}")
        self.worker = Worker(_start, (self.threads, self.reuse_memory, self.job is None))

    def __enter__(self) -> "ProcessRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, kernel: BuildJob, conv: DepthwiseConv, op: str, layout: str, device: torch.device,
            min_ms: float) -> float:
        fn = self.job or build_and_measure
        return float(self.worker.call(fn, (kernel, str(device), min_ms, self.repeat), self.timeout))

    def close(self) -> None:
        self.worker.close()
