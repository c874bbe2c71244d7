"""From (problem, operator, config, target) to a compiled kernel, checked against torch and timed.

Only the compiler side uses this; the runtime side loads exported libraries.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
import tvm
from tvm import s_tir, te

from . import cpu, cpu_nhwc, cuda, parallel, streaming, threads
from .offline_cuda import ensure_cuda_codegen
from .layout import LAYOUTS, arrange, empty
from .ops import DepthwiseConv, compute
from .space import Config, Space

__all__ = [
    "Target", "make_target", "target_key", "template", "space", "schedule", "compile_module", "build",
    "reference", "check", "measure_us", "torch_us", "layout_of", "layouts_for", "call", "runnable", "streamed",
]

Target = tvm.target.Target


def layouts_for(target: Target) -> tuple[str, ...]:
    """Activation layouts a target has templates for (CUDA: NCHW, torch's native depthwise layout there)."""
    return ("NCHW",) if target.kind.name == "cuda" else LAYOUTS


def template(target: Target, layout: str = "NCHW") -> Any:
    if layout not in layouts_for(target):
        raise ValueError(f"layout {layout!r} has no {target.kind.name} template: use one of {layouts_for(target)}")
    if target.kind.name == "cuda":
        return cuda
    return cpu_nhwc if layout == "NHWC" else cpu


def layout_of(config: Config) -> str:
    """A config names its layout (configs without one are NCHW)."""
    return str(config.get("layout", "NCHW"))


def space(conv: DepthwiseConv, op: str, target: Target, layout: str = "NCHW") -> Space:
    return template(target, layout).space(conv, op)


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
    layout = layout_of(config)
    tmpl = template(target, layout)
    config = tmpl.space(conv, op).complete(config)
    tmpl.validate(conv, op, config)
    symbol = symbol or default_symbol(op)
    func = te.create_prim_func(compute(conv, op, layout)).with_attr("global_symbol", symbol)
    sch = s_tir.Schedule(tvm.IRModule({symbol: func}))
    sch.work_on(symbol)
    return tmpl.apply(sch, conv, op, config)


def default_symbol(op: str) -> str:
    return f"depthwise_{op}"


def streamed(op: str, config: Config) -> str | None:
    """The output buffer a config writes with streaming stores (see :mod:`.streaming`), if it does."""
    return {"fwd": "y", "dgrad": "dx"}.get(op) if config.get("stream") else None


def compile_module(mod: tvm.IRModule, target: Target, streams: dict[str, str] | None = None) -> Any:
    """Compile ``mod``; ``streams`` (symbol -> output buffer) get streaming output stores (CPU only)."""
    if target.kind.name == "cuda":
        ensure_cuda_codegen()
    with target:
        lib = tvm.compile(mod, target=target)
    if streams:
        return streaming.compile_streaming(lib.mod, streams)
    return lib


def build(conv: DepthwiseConv, op: str, config: Config, target: Target) -> Any:
    """Compile one kernel; the result is callable with torch tensors (inputs..., output)."""
    symbol = default_symbol(op)
    out = streamed(op, config)
    lib = compile_module(schedule(conv, op, config, target).mod, target, {symbol: out} if out else None)
    return runnable(lib, symbol, target)


def runnable(executable: Any, symbol: str, target: Target) -> Any:
    """``symbol`` of a compiled module, run as training will run it.

    A CPU kernel is written out as a shared library and loaded like an
    export, so its parallel loops go to torch's OpenMP team (see
    :mod:`.parallel`) when tuning measures it, as they will in training.
    """
    if target.kind.name == "cuda":
        return executable[symbol]
    import tvm_ffi

    fd, path = tempfile.mkstemp(prefix="pipedp-kernel-", suffix=".so")
    os.close(fd)
    try:
        executable.export_library(path)
        module = tvm_ffi.load_module(path)
        parallel.route(path)
    finally:
        os.unlink(path)  # the loaded copy stays mapped
    return module[symbol]


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


_ACTIVATIONS = {"fwd": (True, False, True), "dgrad": (True, False, True), "wgrad": (True, True, False)}


def _arrange(t: torch.Tensor, layout: str, activation: bool) -> torch.Tensor:
    return arrange(t, layout if activation else "NCHW")


def call(kernel: Any, op: str, layout: str, inputs: list[torch.Tensor], out_shape: tuple[int, ...]) -> torch.Tensor:
    """Run ``kernel`` on NCHW-shaped ``inputs`` as the runtime op does (a fresh output each call)."""
    out_act = _ACTIVATIONS[op][2]
    if inputs[0].device.type == "cpu":
        threads.match_torch()  # TVM's pool, where a kernel keeps it, as wide as torch's
    out = empty(out_shape, inputs[0], layout if out_act else "NCHW")
    kernel(inputs[0], inputs[1], _arrange(out, layout, out_act))
    return out


@functools.lru_cache(maxsize=2)  # a tuning run checks and times every candidate on the same data
def _prepare(conv: DepthwiseConv, op: str, layout: str, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    inputs, ref = reference(conv, op, device)
    a, b, _ = _ACTIVATIONS[op]
    return [_arrange(inputs[0], layout, a), _arrange(inputs[1], layout, b)], ref


def check(kernel: Any, conv: DepthwiseConv, op: str, device: torch.device, layout: str = "NCHW") -> float:
    """Max abs error of ``kernel`` vs torch on random data; raises if over tolerance."""
    inputs, ref = _prepare(conv, op, layout, device)
    out = call(kernel, op, layout, inputs, tuple(ref.shape))
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


def measure_us(kernel: Any, conv: DepthwiseConv, op: str, device: torch.device, repeat: int = 5, min_ms: float = 20,
               layout: str = "NCHW") -> float:
    """Median µs of one call of ``kernel`` on ``device``, allocating its output like torch's op does."""
    inputs, ref = _prepare(conv, op, layout, device)
    shape = tuple(ref.shape)
    return _time_us(lambda: call(kernel, op, layout, inputs, shape), device, repeat, min_ms)


def torch_us(conv: DepthwiseConv, op: str, device: torch.device, channels_last: bool, repeat: int = 5, min_ms: float = 20) -> float:
    """Median µs of torch's own kernel for ``op`` in one memory layout."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
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
        mask = [op == "dgrad", op == "wgrad", False]  # grad input, weight, bias
        fn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, mask)  # noqa: E731
    return _time_us(fn, device, repeat, min_ms)
