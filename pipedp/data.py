"""Input prefetching: the next batch's host-to-device copy runs while this step computes.

On a CUDA device, :class:`Prefetcher` issues the copy of batch i+1 on a side
stream as soon as batch i is handed out, so the copy overlaps the step instead
of stalling it. The consumer's stream waits for the copy (an event, never the
host), and every copied tensor is ``record_stream``-ed on the consumer's
stream so the caching allocator cannot hand its memory out early.

A copy is only asynchronous from pinned (page-locked) memory; from pageable
memory ``non_blocking=True`` silently degrades to a synchronous copy. Pin once,
in the loader (``DataLoader(..., pin_memory=True)``, PyTorch's guidance), not
per batch here. On the CPU batches pass through unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Iterator

import torch

from .device import parse_device

__all__ = ["Prefetcher", "prefetch"]


def _map(batch: Any, fn: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict/namedtuple batch."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(b, fn) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, _map(v, fn)) for k, v in batch.items())
    return batch


class Prefetcher:
    """Iterates ``loader`` with each batch already on ``device`` (copied ahead on a side stream)."""

    def __init__(self, loader: Iterable, device: torch.device | str, *, non_blocking: bool = True) -> None:
        self.loader = loader
        self.device = parse_device(device, "prefetch")
        self.non_blocking = non_blocking
        self._warned = False
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        if self.stream is not None and t.device.type == "cpu" and not t.is_pinned() and not self._warned:
            self._warned = True
            warnings.warn(
                "prefetch: a batch tensor is in pageable memory, so its copy to the GPU is synchronous; "
                "pin it once in the loader: DataLoader(..., pin_memory=True)",
                stacklevel=3,
            )
        return t.to(self.device, non_blocking=self.non_blocking)

    def _issue(self, batch: Any) -> tuple[Any, Any]:
        if self.stream is None:
            return _map(batch, self._copy), None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = _map(batch, self._copy)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return out, ev

    def _hand_out(self, batch: Any, ev: Any) -> Any:
        if ev is None:
            return batch
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev)

        def keep(t: torch.Tensor) -> torch.Tensor:
            if t.is_cuda:
                t.record_stream(cur)
            return t

        return _map(batch, keep)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        try:
            nxt = self._issue(next(it))
        except StopIteration:
            return
        while True:
            batch, ev = nxt
            try:
                nxt = self._issue(next(it))
            except StopIteration:
                yield self._hand_out(batch, ev)
                return
            except BaseException:
                yield self._hand_out(batch, ev)  # the batch before the error still arrives
                raise
            yield self._hand_out(batch, ev)


def prefetch(loader: Iterable, device: torch.device | str, *, non_blocking: bool = True) -> Prefetcher:
    """Wrap ``loader`` so the next batch's copy to ``device`` overlaps the current step."""
    return Prefetcher(loader, device, non_blocking=non_blocking)
