"""Building kernels: (problem, operator, config, target) to a scheduled prim func, compiled, loadable.

Rules, and why:

- A config is completed (knobs it predates get what they did then) and
  validated by its template before any compile work, so an invalid config
  costs microseconds, not a compile.
- The layout a config names picks the template (:func:`~.template.layout_of`),
  so a record alone says how to rebuild its kernel; the exporter rebuilds
  records this way.
- Streaming output stores (:mod:`.streaming`) are a pass over the compiled
  module, so :func:`compile_module` takes which symbols stream, and the
  exporter compiles many kernels, some streaming, as one library.
- A CPU kernel built for measuring is written out as a shared library and
  loaded like an export (:func:`runnable`), so its parallel loops go to
  torch's OpenMP team (:mod:`pipedp.ops.parallel`) when tuning measures it,
  as they will in training.
- CUDA code is compiled to a binary here, GPU or not
  (:mod:`.offline_cuda`), so what is built can be exported and shipped.
- Kernels take any batch size (a symbolic n, :func:`.ops.compute`), in
  tuning as in the export: a kernel tuned for a layer serves every batch and
  microbatch size, and what tuning measured (at the tuned n) is the very code
  exported. Measured against the same config compiled for a fixed n, at the
  tuned batch and at a quarter of it, the symbolic kernels ran at the same
  speed (``experiments/bench_batch.py``, README); ``batch=`` (a fixed size)
  is kept for that comparison.

:class:`Builder` is what the tuner asks of this part: one config to one
runnable kernel. :class:`LocalBuilder` builds in this process; a builder in
worker processes, or one whose output a remote runner loads, implements the
same protocol.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Mapping, Protocol, TypeVar

import tvm
from tvm import s_tir, te

from pipedp.ops import parallel

from . import streaming
from .offline_cuda import ensure_cuda_codegen
from .ops import DepthwiseConv, batch_var, compute
from .runner import Kernel
from .space import Config
from .target import Target
from .template import get_template, layout_of

__all__ = ["Builder", "LocalBuilder", "Compiled", "schedule", "default_symbol", "streamed", "compile_module", "build",
           "runnable"]

K_co = TypeVar("K_co", covariant=True)


class Builder(Protocol[K_co]):
    """Builds one config of one operator for ``target``; raises for a config that does not compile."""

    def build(self, conv: DepthwiseConv, op: str, config: Config, target: Target) -> K_co: ...


class Compiled(Protocol):
    """A compiled module: its functions by symbol, and a way to write it out as a shared library."""

    def __getitem__(self, symbol: str) -> Kernel: ...

    def export_library(self, file_name: str) -> object: ...


@dataclass(frozen=True)
class LocalBuilder:
    """Compiles in this process and loads the kernel here (see :func:`build`)."""

    def build(self, conv: DepthwiseConv, op: str, config: Config, target: Target) -> Kernel:
        return build(conv, op, config, target)


def default_symbol(op: str) -> str:
    """The symbol of a single kernel built for measuring."""
    return f"depthwise_{op}"


def schedule(conv: DepthwiseConv, op: str, config: Config, target: Target, symbol: str | None = None,
             batch: int | None = None) -> s_tir.Schedule:
    """The scheduled prim func (raises InvalidConfig before any compile work).

    The config is validated for ``conv`` (the tuned problem); the kernel takes
    any batch size, or exactly ``batch`` samples when given.
    """
    layout = layout_of(config)
    tmpl = get_template(target, layout)
    config = tmpl.space(conv, op).complete(config)
    tmpl.validate(conv, op, config)
    symbol = symbol or default_symbol(op)
    extent = batch_var() if batch is None else batch
    func = te.create_prim_func(compute(conv, op, layout, extent)).with_attr("global_symbol", symbol)
    sch = s_tir.Schedule(tvm.IRModule({symbol: func}))
    sch.work_on(symbol)
    return tmpl.apply(sch, conv, op, config)


def streamed(op: str, config: Config) -> str | None:
    """The output buffer a config writes with streaming stores (see :mod:`.streaming`), if it does."""
    return {"fwd": "y", "dgrad": "dx"}.get(op) if config.get("stream") else None


def compile_module(mod: tvm.IRModule, target: Target, streams: Mapping[str, str] | None = None) -> Compiled:
    """Compile ``mod``; ``streams`` (symbol -> output buffer) get streaming output stores (CPU only)."""
    if target.kind.name == "cuda":
        ensure_cuda_codegen()
    with target:
        lib = tvm.compile(mod, target=target)
    if streams:
        return streaming.compile_streaming(lib.mod, streams)
    return lib


def build(conv: DepthwiseConv, op: str, config: Config, target: Target, batch: int | None = None) -> Kernel:
    """Compile one kernel; the result is callable with torch tensors (inputs..., output) of any batch size
    (exactly ``batch`` when given)."""
    symbol = default_symbol(op)
    out = streamed(op, config)
    sch = schedule(conv, op, config, target, batch=batch)
    lib = compile_module(sch.mod, target, {symbol: out} if out else None)
    return runnable(lib, symbol, target)


def runnable(executable: Compiled, symbol: str, target: Target) -> Kernel:
    """``symbol`` of a compiled module, run as training will run it.

    A CPU kernel is written out as a shared library and loaded like an
    export, so its parallel loops go to torch's OpenMP team (see
    :mod:`pipedp.ops.parallel`) when tuning measures it, as they will in
    training.
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
