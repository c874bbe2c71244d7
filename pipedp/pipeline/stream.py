"""Streams and events, with a stand-in for devices that run work in host order.

Each stage issues its work on a :class:`Lane`: a CUDA stream on a CUDA device,
or, elsewhere, a stand-in whose operations are no-ops because the device runs
everything in the order the host issues it. A CPU lane may instead own a
:class:`~pipedp.pipeline.cpu_lane.CpuWorker` (its own thread, intra-op thread
count and cores): the executor then queues the stage's work to it, so CPU
stages run concurrently. Lanes are ordered with events only,
never by synchronising the host, so a whole step stays asynchronous (and
capturable as a CUDA graph).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..device import canonical_device
from .cpu_lane import CpuWorker

__all__ = ["Lane", "new_lane", "current_lane"]


class Lane:
    """Where a stage's work is issued: a device plus (on CUDA) a stream.

    ``device`` is kept with its index (``cuda`` becomes ``cuda:<current>``), as
    tensors report theirs, so that lanes compare equal to tensors' devices.
    """

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream | None", name: str,
                 worker: CpuWorker | None = None) -> None:
        self.device = canonical_device(device)
        self.stream = stream
        self.name = name
        self.worker = worker  # a CPU lane's own thread (None: work runs on the host thread, in issue order)

    @property
    def is_cuda(self) -> bool:
        return self.stream is not None

    @contextlib.contextmanager
    def use(self) -> Iterator["Lane"]:
        """Make this lane the current stream of its device for the block."""
        if self.stream is None:
            yield self
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield self

    def record(self) -> "torch.cuda.Event | None":
        """An event marking all work issued on this lane so far."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, event: "torch.cuda.Event | None") -> None:
        """Make later work on this lane wait for ``event`` (device-side)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def wait_lane(self, other: "Lane") -> None:
        """Make later work on this lane wait for all work issued on ``other``."""
        if self.stream is not None and other.stream is not None and self.stream != other.stream:
            self.stream.wait_stream(other.stream)

    def keep(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that ``tensor`` is used on this lane.

        A tensor allocated on another stream would otherwise be reused as soon as
        Python drops it, while this lane may still be reading it.
        """
        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(self.stream)

    def __repr__(self) -> str:
        extra = f", threads={self.worker.threads}" if self.worker is not None else ""
        return f"Lane({self.name}, {self.device}{extra})"


def new_lane(device: torch.device, name: str, threads: int | None = None,
             cores: Sequence[int] | None = None) -> Lane:
    """A fresh lane on ``device``: a new CUDA stream, or the in-order stand-in.

    ``threads`` (CPU only) gives the lane its own worker thread with that many
    intra-op threads, pinned to ``cores`` when given.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if threads is not None:
            raise ValueError(f"threads= sets CPU stages' thread counts; stage {name} is on {device}: pass threads=None")
        with torch.cuda.device(device):
            return Lane(device, torch.cuda.Stream(device), name)
    worker = CpuWorker(threads, cores, name) if threads is not None else None
    return Lane(device, None, name, worker)


def current_lane(device: torch.device) -> Lane:
    """The lane of the current stream (the caller's) on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return Lane(device, torch.cuda.current_stream(device), "current")
    return Lane(device, None, "current")
