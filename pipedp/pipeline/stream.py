"""Streams and events, with a stand-in for devices that run work in host order.

Each stage issues its work on a :class:`Lane`: a CUDA stream on a CUDA device,
or, elsewhere, a stand-in whose operations are no-ops because the device runs
everything in the order the host issues it. Lanes are ordered with events only,
never by synchronising the host, so a whole step stays asynchronous (and
capturable as a CUDA graph).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["Lane", "new_lane", "current_lane"]


class Lane:
    """Where a stage's work is issued: a device plus (on CUDA) a stream."""

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream | None", name: str) -> None:
        self.device = device
        self.stream = stream
        self.name = name

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
        return f"Lane({self.name}, {self.device})"


def new_lane(device: torch.device, name: str) -> Lane:
    """A fresh lane on ``device``: a new CUDA stream, or the in-order stand-in."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return Lane(device, torch.cuda.Stream(device), name)
    return Lane(device, None, name)


def current_lane(device: torch.device) -> Lane:
    """The lane of the current stream (the caller's) on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return Lane(device, torch.cuda.current_stream(device), "current")
    return Lane(device, None, "current")
