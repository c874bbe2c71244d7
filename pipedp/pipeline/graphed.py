"""Whole training steps captured as CUDA graphs and replayed.

At CIFAR sizes a step is hundreds of small kernels per microbatch and the
host cannot launch them as fast as the GPU runs them; microbatching multiplies
the launches. Because the executor orders its streams with events only and
never synchronises the host, a whole step - every stage on its stream, the
loss, the optimizer update - can be captured once and replayed with a single
launch per step.

The rules that keep replays equal to eager steps:

* capture only after ``warmup`` eager steps with the same signature (input
  shapes and dtypes, optimizer hyper-parameters), so lazily created state
  (optimizer momentum, cuDNN plans) exists before capture;
* a new signature runs eagerly; a changed hyper-parameter (an LR schedule, say)
  is a new signature, so its value is never stale inside a graph;
* gradients live in the graph's memory: once a graph exists they are zeroed
  in place, never set to None, so ``param.grad`` stays the graph's buffer;
* everything the graph embeds must outlive it. PyTorch keeps cuBLAS
  workspaces per stream outside any graph, and a later capture on the same
  stream frees them under an earlier graph (pytorch/pytorch#193402: replays
  then fault). So each capture runs on its own stream, and the workspaces are
  dropped just before capture so the ones it uses are allocated inside the
  graph's private memory pool, which lives as long as the graph;
* a capture that fails must not outlive itself (:func:`capturing`). PyTorch
  checks ``cudaStreamEndCapture`` before it tells the caching allocator that
  the capture is over, so after an invalidated capture the allocator believes,
  for the rest of the process, that a capture is under way: blocks freed after
  ``record_stream`` (every lane's ``keep``) are never reused, an allocation
  that fails no longer releases cached blocks first, and the failed capture's
  pool is never released. Later allocations then run out of memory with most
  of the GPU "reserved by PyTorch but unallocated".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Iterator

import torch

from ..device import canonical_device

__all__ = ["StepGraph", "hyper_signature", "fresh_cublas_workspaces", "captured_call", "capturing",
           "end_failed_capture"]

Body = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def hyper_signature(optimizer: torch.optim.Optimizer) -> Hashable:
    """The optimizer's scalar hyper-parameters: a graph bakes them in at capture."""
    out = []
    for g in optimizer.param_groups:
        items = []
        for k, v in sorted(g.items()):
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                continue  # a tensor hyper-parameter is read by the graph at replay
            items.append((k, v if isinstance(v, (int, float, bool, str, type(None))) else repr(v)))
        out.append(tuple(items))
    return tuple(out)


def fresh_cublas_workspaces() -> None:
    """Drop cached cuBLAS workspaces so the next capture allocates its own in its pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def end_failed_capture(device: torch.device, pool: tuple[int, int]) -> bool:
    """Finish, on the allocator's side, a capture into ``pool`` whose ``capture_end`` raised.

    True when the allocator still routed allocations to ``pool`` (its capture
    never told it the capture was over): that routing is ended and the pool
    released, so its memory returns at the next ``empty_cache``. False when the
    capture had got that far (the graph releases its pool itself) or this torch
    lacks the hooks.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return False
    index = canonical_device(device).index
    try:
        end(index, pool)
    except RuntimeError:  # "not currently recording to mempool_id": capture_end ended it
        return False
    release(index, pool)
    return True


@contextlib.contextmanager
def capturing(graph: "torch.cuda.CUDAGraph", device: torch.device, stream: "torch.cuda.Stream") -> Iterator[None]:
    """``torch.cuda.graph(graph, stream=stream)`` that leaves the process as it was when the capture fails.

    The capture gets a pool of its own (``graph_pool_handle``) so that a failed
    one can be ended by :func:`end_failed_capture`; the current stream, which
    ``torch.cuda.graph`` leaves set to ``stream`` when ``capture_end`` raises, is
    put back. The body's own error propagates where it raised one, not the
    "operation failed due to a previous error during capture" that
    ``capture_end`` raises over it, which names no cause.
    """
    pool = torch.cuda.graph_pool_handle()
    current = torch.cuda.current_stream(device)
    first: list[BaseException] = []
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            try:
                yield
            except BaseException as e:
                first.append(e)
                raise
    except BaseException as e:
        end_failed_capture(device, pool)
        torch.cuda.set_stream(current)
        if first and e is not first[0]:
            raise first[0]  # chained to capture_end's error, which followed it
        raise


def captured_call(fn: Callable[[], object], device: torch.device, before: Callable[[], object], warmup: int = 2):
    """``fn`` run ``warmup`` times eagerly, then captured; returns the replay (for timing trials).

    ``before`` runs just before capture (set gradients to None there, so the
    captured backward allocates them inside the graph's own memory).
    """
    for _ in range(warmup):
        fn()
    before()
    torch.cuda.synchronize(device)
    fresh_cublas_workspaces()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, device, torch.cuda.Stream(device)):
        fn()
    return graph.replay


def _signature(x: torch.Tensor, y: torch.Tensor, hyper: Hashable) -> Hashable:
    return (tuple(x.shape), x.dtype, x.device, tuple(x.stride()), tuple(y.shape), y.dtype, y.device, hyper)


class StepGraph:
    """One captured step (for the latest signature) plus the bookkeeping to know when to (re)capture."""

    def __init__(self, body: Body, *, warmup: int = 2) -> None:
        if warmup < 1:
            raise ValueError(f"cuda_graph needs at least one eager warm-up step, got warmup={warmup}")
        self.body = body
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.sig: Hashable = None
        self.static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._seen: Hashable = None
        self._eager = 0
        self.captures = 0
        self.replays = 0
        self._stream: torch.cuda.Stream | None = None

    def reset(self) -> None:
        """Forget the captured step (e.g. after the optimizer's state tensors were replaced)."""
        self.graph = None
        self.static = None
        self.sig = None
        self._seen = None
        self._eager = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def replayable(self, x: torch.Tensor, y: torch.Tensor, hyper: Hashable) -> bool:
        return self.graph is not None and _signature(x, y, hyper) == self.sig

    def note_eager(self, x: torch.Tensor, y: torch.Tensor, hyper: Hashable) -> None:
        sig = _signature(x, y, hyper)
        self._eager = self._eager + 1 if sig == self._seen else 1
        self._seen = sig

    def due(self, x: torch.Tensor, y: torch.Tensor, hyper: Hashable) -> bool:
        """Enough eager steps with this signature to capture it."""
        return _signature(x, y, hyper) == self._seen and self._eager >= self.warmup

    def capture(self, x: torch.Tensor, y: torch.Tensor, hyper: Hashable, before: Callable[[], Any]) -> None:
        """Capture ``body`` on static copies of ``x``, ``y`` (nothing runs until :meth:`replay`)."""
        self.graph = None
        self.static = None
        static_x, static_y = x.clone(), y.clone()
        before()
        torch.cuda.synchronize(x.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(x.device)
        fresh_cublas_workspaces()
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, x.device, self._stream):
                loss = self.body(static_x, static_y)
        except Exception as e:
            raise RuntimeError(
                f"capturing the training step as a CUDA graph failed ({type(e).__name__}: {e}). "
                f"Optimizers with step counters need capturable=True (e.g. torch.optim.Adam(..., "
                f"capturable=True)); code that syncs the host cannot be captured. "
                f"Or wrap with cuda_graph=False."
            ) from e
        self.graph, self.sig, self.static = graph, _signature(x, y, hyper), (static_x, static_y, loss)
        self.captures += 1

    def replay(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self.graph is not None and self.static is not None
        static_x, static_y, loss = self.static
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return loss.clone()
