"""Checking a compiled kernel against torch and timing it: torch only, no TVM, so both sides of tuning use it.

The tuner (``pipedp.kernels.tvm.runner``) and the measuring command of a
machine that has no compiler (:mod:`.measure`) check and time candidates
with these functions, so a kernel is judged the same way wherever it runs.

Rules, and why:

- A kernel is called as the runtime op calls it: NCHW-shaped torch tensors
  arranged for its layout (:func:`~.layout.arrange`, no copy for
  channels_last) and a fresh output on every call, so a timing includes
  what training pays for the output, as torch's op does.
- A kernel must match torch on random data before it is timed
  (:func:`check`, :class:`WrongResult`); the tolerance grows with the number
  of terms summed, so only a wrong result fails, never a different
  summation order.
- A timing is the median of runs of enough calls to last ``min_ms``: the
  median resists a noisy neighbour, a run long enough to average over many
  calls resists the clock's resolution. On a GPU the clock is a pair of
  CUDA events around the run (the GPU's own time, not the host's launch
  loop); on a CPU it is the host's.
- :func:`alternate` times several contenders in turn, round after round,
  and takes each one's median, so a machine that slows down for a while
  slows all of them alike and their ratio holds.
- On a CPU, TVM's thread pool is made as wide as torch's before each call
  (:func:`~.threads.match_torch`), as in training.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Mapping, Protocol

import torch
import torch.nn.functional as F

from . import threads
from .layout import aligned, arrange, empty
from .problem import DepthwiseConv

__all__ = ["Kernel", "WrongResult", "tolerance", "reference", "prepare", "check", "call", "kernel_fn", "torch_fn",
           "alternate", "measure_us", "torch_us"]


class Kernel(Protocol):
    """A compiled kernel as this process runs it: called with its inputs, then its output, all tensors."""

    def __call__(self, *tensors: torch.Tensor) -> object: ...


class WrongResult(ValueError):
    """A kernel whose output differs from torch's: a failed candidate, never a time."""

    status = "wrong"  # how the records name this failure


def _dtype(conv: DepthwiseConv) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[conv.dtype]


def _operands(conv: DepthwiseConv, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Random x, w and dy of ``conv`` (NCHW), drawn on the CPU so a seed gives the same values everywhere."""
    g = torch.Generator().manual_seed(seed)
    dt = _dtype(conv)
    return tuple(torch.randn(shape, generator=g).to(device, dt) for shape in (conv.shapes()[k] for k in "xwy"))


def reference(conv: DepthwiseConv, op: str, device: torch.device,
              seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random inputs of ``op`` (in call order) and torch's result for them."""
    x, w, dy = _operands(conv, device, seed)
    kw = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.c)
    if op == "fwd":
        return [x, w], F.conv2d(x, w, **kw)
    xr, wr = x.clone().requires_grad_(op == "dgrad"), w.clone().requires_grad_(op == "wgrad")
    F.conv2d(xr, wr, **kw).backward(dy)
    if op == "dgrad":
        return [dy, w], xr.grad
    return [x, dy], wr.grad


def tolerance(conv: DepthwiseConv, op: str) -> float:
    """The largest error, relative to the result's scale (at least 1), that summation order explains."""
    terms = conv.kernel[0] * conv.kernel[1] * (conv.multiplier if op == "dgrad" else 1)
    if op == "wgrad":
        terms = conv.n * conv.out_hw[0] * conv.out_hw[1]
    eps = 1e-6 if conv.dtype == "float32" else 1e-2
    return eps * max(8.0, terms ** 0.5 * 4)


# Which of (input 0, input 1, output) are activations (in the kernel's layout) rather than weights.
_ACTIVATIONS = {"fwd": (True, False, True), "dgrad": (True, False, True), "wgrad": (True, True, False)}


def _arrange(t: torch.Tensor, layout: str, activation: bool) -> torch.Tensor:
    return arrange(t, layout if activation else "NCHW")


def call(kernel: Kernel, op: str, layout: str, inputs: list[torch.Tensor], out_shape: tuple[int, ...]) -> torch.Tensor:
    """Run ``kernel`` on NCHW-shaped ``inputs`` as the runtime op does (a fresh output each call)."""
    out_act = _ACTIVATIONS[op][2]
    if inputs[0].device.type == "cpu":
        threads.match_torch()  # TVM's pool, where a kernel keeps it, as wide as torch's
    out = empty(out_shape, inputs[0], layout if out_act else "NCHW")
    kernel(aligned(inputs[0]), aligned(inputs[1]), _arrange(out, layout, out_act))
    return out


@functools.lru_cache(maxsize=2)  # a tuning run checks and times every candidate on the same data
def prepare(conv: DepthwiseConv, op: str, layout: str, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`reference`'s inputs arranged for a ``layout`` kernel, and torch's result (cached)."""
    inputs, ref = reference(conv, op, device)
    a, b, _ = _ACTIVATIONS[op]
    return [_arrange(inputs[0], layout, a), _arrange(inputs[1], layout, b)], ref


def check(kernel: Kernel, conv: DepthwiseConv, op: str, device: torch.device, layout: str = "NCHW") -> float:
    """Max abs error of ``kernel`` vs torch on random data; raises :class:`WrongResult` if over tolerance."""
    inputs, ref = prepare(conv, op, layout, device)
    out = call(kernel, op, layout, inputs, tuple(ref.shape))
    err = (out.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.float().abs().max().item())
    limit = tolerance(conv, op) * scale
    if not err <= limit:
        raise WrongResult(f"{op} kernel for {conv} differs from torch by {err:.3g} (tolerance {limit:.3g})")
    return err


def kernel_fn(kernel: Kernel, conv: DepthwiseConv, op: str, device: torch.device,
              layout: str = "NCHW") -> Callable[[], object]:
    """One call of ``kernel`` on :func:`prepare`'s data, as :func:`measure_us` times it."""
    inputs, ref = prepare(conv, op, layout, device)
    shape = tuple(ref.shape)
    return lambda: call(kernel, op, layout, inputs, shape)


def torch_fn(conv: DepthwiseConv, op: str, device: torch.device, channels_last: bool) -> Callable[[], object]:
    """One call of torch's own kernel for ``op`` with activations in one memory layout."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, w, dy = _operands(conv, device, seed=1)
    x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0, 0], conv.c)
    if op == "fwd":
        return lambda: F.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.c)
    mask = [op == "dgrad", op == "wgrad", False]  # grad input, weight, bias
    return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, mask)


def _run_us(fn: Callable[[], object], device: torch.device, number: int) -> float:
    """µs per call of ``number`` calls: CUDA events on a GPU, the host clock on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / number
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number * 1e6


def _calls_for(fn: Callable[[], object], device: torch.device, min_ms: float) -> int:
    """Calls of ``fn`` that last about ``min_ms`` (after a warm-up call)."""
    _run_us(fn, device, 1)
    once = max(_run_us(fn, device, 1), 0.1)
    return max(1, int(min_ms * 1e3 / once))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _time_us(fn: Callable[[], object], device: torch.device, repeat: int, min_ms: float) -> float:
    number = _calls_for(fn, device, min_ms)
    return _median([_run_us(fn, device, number) for _ in range(repeat)])


def alternate(fns: Mapping[str, Callable[[], object]], device: torch.device, rounds: int = 3,
              min_ms: float = 20) -> dict[str, float]:
    """Median µs per call of each of ``fns``, timed in turn for ``rounds`` rounds (see the module docstring)."""
    numbers = {name: _calls_for(fn, device, min_ms) for name, fn in fns.items()}
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            runs[name].append(_run_us(fn, device, numbers[name]))
    return {name: _median(v) for name, v in runs.items()}


def measure_us(kernel: Kernel, conv: DepthwiseConv, op: str, device: torch.device, repeat: int = 5, min_ms: float = 20,
               layout: str = "NCHW") -> float:
    """Median µs of one call of ``kernel`` on ``device``, allocating its output like torch's op does."""
    return _time_us(kernel_fn(kernel, conv, op, device, layout), device, repeat, min_ms)


def torch_us(conv: DepthwiseConv, op: str, device: torch.device, channels_last: bool, repeat: int = 5,
             min_ms: float = 20) -> float:
    """Median µs of torch's own kernel for ``op`` in one memory layout."""
    return _time_us(torch_fn(conv, op, device, channels_last), device, repeat, min_ms)
