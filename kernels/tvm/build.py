"""From (problem, operator, config, target) to a compiled kernel, checked against torch and timed.

Only the compiler side uses this; the runtime side loads exported libraries.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
import tvm
from tvm import s_tir, te

from . import cpu, cuda
from .offline_cuda import ensure_cuda_codegen
from .ops import DepthwiseConv, compute
from .space import Config, Space

__all__ = [
    "Target", "make_target", "target_key", "template", "space", "schedule", "compile_module", "build",
    "reference", "check", "measure_us", "torch_us",
]

Target = tvm.target.Target


def template(target: Target) -> Any:
    return cuda if target.kind.name == "cuda" else cpu


def space(conv: DepthwiseConv, op: str, target: Target) -> Space:
    return template(target).space(conv, op)


def make_target(kind: str, arch: str | None = None) -> Target:
    """``cpu`` (this host's CPU, all its vector units) or ``cuda`` (``arch`` like ``sm_90``)."""
    if kind == "cpu":
        # "mcpu": "native" silently means generic x86 here: ask LLVM for the host CPU.
        return Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    if kind == "cuda":
        if not arch:
            raise ValueError("a CUDA target needs an arch, e.g. --arch sm_90 (or run where torch sees the GPU)")
        return Target({"kind": "cuda", "arch": arch})
    raise ValueError(f"target {kind!r}: use 'cpu' or 'cuda'")


def target_key(target: Target) -> str:
    """How records and exports name a target: ``cpu:znver4``, ``cuda:sm_90``."""
    if target.kind.name == "cuda":
        return f"cuda:{target.attrs['arch']}"
    return f"cpu:{target.attrs.get('mcpu', 'generic')}"


def schedule(conv: DepthwiseConv, op: str, config: Config, target: Target, symbol: str | None = None) -> s_tir.Schedule:
    """The scheduled prim func (raises InvalidConfig before any compile work)."""
    template(target).validate(conv, op, config)
    symbol = symbol or default_symbol(op)
    func = te.create_prim_func(compute(conv, op)).with_attr("global_symbol", symbol)
    sch = s_tir.Schedule(tvm.IRModule({symbol: func}))
    sch.work_on(symbol)
    return template(target).apply(sch, conv, op, config)


def default_symbol(op: str) -> str:
    return f"depthwise_{op}"


def compile_module(mod: tvm.IRModule, target: Target) -> Any:
    if target.kind.name == "cuda":
        ensure_cuda_codegen()
    with target:
        return tvm.compile(mod, target=target)


def build(conv: DepthwiseConv, op: str, config: Config, target: Target) -> Any:
    """Compile one kernel; the result is callable with torch tensors (inputs..., output)."""
    return compile_module(schedule(conv, op, config, target).mod, target)[default_symbol(op)]


def _dtype(conv: DepthwiseConv) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[conv.dtype]


def reference(conv: DepthwiseConv, op: str, device: torch.device, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random inputs of ``op`` (in call order) and torch's result for them."""
    g = torch.Generator().manual_seed(seed)
    s = conv.shapes()
    dt = _dtype(conv)
    x = torch.randn(s["x"], generator=g).to(device, dt)
    w = torch.randn(s["w"], generator=g).to(device, dt)
    dy = torch.randn(s["y"], generator=g).to(device, dt)
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


def check(kernel: Any, conv: DepthwiseConv, op: str, device: torch.device) -> float:
    """Max abs error of ``kernel`` vs torch on random data; raises if over tolerance."""
    inputs, ref = reference(conv, op, device)
    out = torch.empty_like(ref)
    kernel(*inputs, out)
    err = (out.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.float().abs().max().item())
    if not err <= _tolerance(conv, op) * scale:
        raise ValueError(f"{op} kernel for {conv} differs from torch by {err:.3g} (tolerance {_tolerance(conv, op) * scale:.3g})")
    return err


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_us(fn: Callable[[], Any], device: torch.device, repeat: int, min_ms: float) -> float:
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


def measure_us(kernel: Any, conv: DepthwiseConv, op: str, device: torch.device, repeat: int = 5, min_ms: float = 20) -> float:
    """Median µs of one call of ``kernel`` on ``device``."""
    inputs, ref = reference(conv, op, device)
    out = torch.empty_like(ref)
    return _time_us(lambda: kernel(*inputs, out), device, repeat, min_ms)


def torch_us(conv: DepthwiseConv, op: str, device: torch.device, channels_last: bool, repeat: int = 5, min_ms: float = 20) -> float:
    """Median µs of torch's own kernel for ``op`` in one memory layout."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    inputs, ref = reference(conv, op, device)
    s = conv.shapes()
    dt = _dtype(conv)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s["x"], generator=g).to(device, dt).contiguous(memory_format=fmt)
    w = torch.randn(s["w"], generator=g).to(device, dt)
    dy = torch.randn(s["y"], generator=g).to(device, dt).contiguous(memory_format=fmt)
    args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0, 0], conv.c)
    if op == "fwd":
        fn = lambda: F.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.c)  # noqa: E731
    else:
        mask = [op == "dgrad", False, op == "wgrad"]
        fn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, mask)  # noqa: E731
    return _time_us(fn, device, repeat, min_ms)
