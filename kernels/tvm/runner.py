"""Running compiled kernels: torch's reference, the correctness check, timing (torch only, no TVM).

Rules, and why:

- A kernel is called as the runtime op calls it: NCHW-shaped torch tensors
  arranged for its layout (:func:`~pipedp.ops.layout.arrange`, no copy for
  channels_last) and a fresh output on every call, so a timing includes
  what training pays for the output, as torch's op does.
- A kernel must match torch on random data before it is timed
  (:func:`check`); the tolerance grows with the number of terms summed, so
  only a wrong result fails, never a different summation order.
- A timing is the median of ``repeat`` runs of enough calls to last
  ``min_ms``: the median resists a noisy neighbour, and a run long enough
  to average over many calls resists the clock's resolution.
- On a CPU, TVM's thread pool is made as wide as torch's before each call
  (:func:`pipedp.ops.threads.match_torch`), as in training.

:class:`Runner` is what the tuner asks of this part: check and time one
built kernel. :class:`LocalRunner` does it in this process; a runner in a
worker process or on another machine implements the same protocol.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

import torch
import torch.nn.functional as F

from pipedp.ops import threads
from pipedp.ops.layout import arrange, empty
from pipedp.ops.problem import DepthwiseConv

__all__ = ["Kernel", "Runner", "LocalRunner", "reference", "prepare", "check", "call", "measure_us", "torch_us"]

K_contra = TypeVar("K_contra", contravariant=True)


class Kernel(Protocol):
    """A compiled kernel as this process runs it: called with its inputs, then its output, all tensors."""

    def __call__(self, *tensors: torch.Tensor) -> object: ...


class Runner(Protocol[K_contra]):
    """Checks one built kernel against torch and returns its µs per call; raises if it is wrong."""

    def run(self, kernel: K_contra, conv: DepthwiseConv, op: str, layout: str, device: torch.device,
            min_ms: float) -> float: ...


@dataclass(frozen=True)
class LocalRunner:
    """Check, then time, in this process on ``device`` (the median of ``repeat`` runs)."""

    repeat: int = 3

    def run(self, kernel: Kernel, conv: DepthwiseConv, op: str, layout: str, device: torch.device,
            min_ms: float) -> float:
        check(kernel, conv, op, device, layout)
        return measure_us(kernel, conv, op, device, repeat=self.repeat, min_ms=min_ms, layout=layout)


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


def _tolerance(conv: DepthwiseConv, op: str) -> float:
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
    kernel(inputs[0], inputs[1], _arrange(out, layout, out_act))
    return out


@functools.lru_cache(maxsize=2)  # a tuning run checks and times every candidate on the same data
def prepare(conv: DepthwiseConv, op: str, layout: str, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`reference`'s inputs arranged for a ``layout`` kernel, and torch's result (cached)."""
    inputs, ref = reference(conv, op, device)
    a, b, _ = _ACTIVATIONS[op]
    return [_arrange(inputs[0], layout, a), _arrange(inputs[1], layout, b)], ref


def check(kernel: Kernel, conv: DepthwiseConv, op: str, device: torch.device, layout: str = "NCHW") -> float:
    """Max abs error of ``kernel`` vs torch on random data; raises if over tolerance."""
    inputs, ref = prepare(conv, op, layout, device)
    out = call(kernel, op, layout, inputs, tuple(ref.shape))
    err = (out.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.float().abs().max().item())
    tolerance = _tolerance(conv, op) * scale
    if not err <= tolerance:
        raise ValueError(f"{op} kernel for {conv} differs from torch by {err:.3g} (tolerance {tolerance:.3g})")
    return err


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_us(fn: Callable[[], object], device: torch.device, repeat: int, min_ms: float) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    number = max(1, int(min_ms * 1e-3 / once))
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        _sync(device)
        runs.append((time.perf_counter() - t0) / number * 1e6)
    runs.sort()
    return runs[len(runs) // 2]


def measure_us(kernel: Kernel, conv: DepthwiseConv, op: str, device: torch.device, repeat: int = 5, min_ms: float = 20,
               layout: str = "NCHW") -> float:
    """Median µs of one call of ``kernel`` on ``device``, allocating its output like torch's op does."""
    inputs, ref = prepare(conv, op, layout, device)
    shape = tuple(ref.shape)
    return _time_us(lambda: call(kernel, op, layout, inputs, shape), device, repeat, min_ms)


def torch_us(conv: DepthwiseConv, op: str, device: torch.device, channels_last: bool, repeat: int = 5,
             min_ms: float = 20) -> float:
    """Median µs of torch's own kernel for ``op`` in one memory layout."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, w, dy = _operands(conv, device, seed=1)
    x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0, 0], conv.c)
    if op == "fwd":
        fn = lambda: F.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.c)  # noqa: E731
    else:
        mask = [op == "dgrad", op == "wgrad", False]  # grad input, weight, bias
        fn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, mask)  # noqa: E731
    return _time_us(fn, device, repeat, min_ms)
