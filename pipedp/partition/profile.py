"""Per-block cost: measured forward+backward time and memory, or a FLOP/byte estimate.

Balancing needs each block's cost on the device it will run on, at the
microbatch size it will see. Profiling runs the chain block by block on a sample
microbatch (warm-up, then the median of several runs; CUDA events on CUDA, the
host clock elsewhere). It leaves the model as it found it: buffers (BatchNorm
statistics), gradients and RNG state are restored, and the backward runs as
a stage's does (``torch.autograd.backward``, which a reentrant
``torch.utils.checkpoint`` needs) into gradients set aside and put back.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .blocks import Block
from .boundary import Value, is_value, leaf, map_tensors, nbytes, tensors

__all__ = ["BlockProfile", "profile_blocks", "estimate_blocks"]


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs at the microbatch size (times in milliseconds)."""

    name: str
    forward_ms: float
    backward_ms: float
    output_bytes: int  # the activation that crosses a cut after this block (all tensors of a tuple)
    saved_bytes: int  # tensors autograd keeps for backward (excluding parameters)
    param_bytes: int

    @property
    def cost_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timer:
    """Elapsed milliseconds of a callable: CUDA events on CUDA, host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out


def _saved_bytes(run: Callable[[], Value], params: Sequence[torch.Tensor]) -> tuple[int, Value]:
    """Bytes autograd saves for backward during ``run()`` (parameters excluded), and its output.

    The returned output's graph is only for counting and must never be
    backwarded: the pack hook keeps a size, not the tensor. (Keeping the tensor
    itself would tie saved outputs to their own graph in a cycle that Python's
    collector cannot see, leaking the graph.)
    """
    param_ptrs = {p.data_ptr() for p in params}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> int:
        nonlocal total
        ptr = t.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen.add(ptr)
            total += _nbytes(t)
        return _nbytes(t)

    def unpack(_: int) -> torch.Tensor:
        raise RuntimeError("internal: the graph pipedp profiles saved-tensor sizes on cannot be backwarded")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = run()
    return total, map_tensors(y, torch.Tensor.detach) if is_value(y) else y


def profile_blocks(
    blocks: Sequence[Block],
    sample: torch.Tensor,
    *,
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
    copy_input: Sequence[bool] | None = None,
) -> list[BlockProfile]:
    """Measure every block's forward and backward time on ``sample``'s device.

    ``sample`` is one microbatch of input. Blocks run in train mode, as in
    training; call inside :func:`pipedp.snapshot.preserved_state` to leave the model untouched.
    ``copy_input[i]`` says block i modifies its input in place, so (as a stage
    would) it gets a copy of its leaf input.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    timer = _Timer(sample.device)
    out: list[BlockProfile] = []
    # No bar object at all unless asked: a disabled tqdm still starts its monitor thread, which outlives the wrap.
    bar = tqdm(blocks, desc="pipedp: profiling blocks", unit="block", delay=1.0, leave=False) if progress else blocks
    x: Value = sample.detach()
    for i, block in enumerate(bar):
        inp = leaf(x, i > 0)
        copy = bool(copy_input[i]) if copy_input is not None else False
        prof, x = _profile_block(block, inp, copy, timer, warmup, repeats)  # x: detached output
        out.append(prof)
    return out


def _profile_block(
    block: Block, inp: Value, copy: bool, timer: _Timer, warmup: int, repeats: int
) -> tuple[BlockProfile, Value]:
    """Median forward and backward time of one block on ``inp``, and its (detached) output."""
    mod = block.module
    wrt = [t for t in tensors(inp) if t.requires_grad] + _params(mod)

    def run() -> Value:
        return mod(map_tensors(inp, torch.clone) if copy else inp)

    saved, y = _saved_bytes(run, list(mod.parameters()))
    if not is_value(y):
        raise ValueError(f"block '{block.name}' returns {type(y).__name__}, not a tensor or a tuple of tensors")
    grad_out = [torch.ones_like(t) for t in tensors(y)]
    fwd_ms: list[float] = []
    bwd_ms: list[float] = []
    for r in range(warmup + repeats):
        f_ms, out = timer(run)
        b_ms = 0.0
        outs = [(t, g) for t, g in zip(tensors(out), grad_out) if t.requires_grad]  # type: ignore[arg-type]
        if outs and wrt:
            b_ms, _ = timer(lambda: _backward(outs, wrt))  # noqa: B023
        if r >= warmup:
            fwd_ms.append(f_ms)
            bwd_ms.append(b_ms)
    prof = BlockProfile(
        block.name, statistics.median(fwd_ms), statistics.median(bwd_ms), nbytes(y), saved,
        sum(_nbytes(p) for p in mod.parameters()),
    )
    return prof, y


def _backward(outs: list[tuple[torch.Tensor, torch.Tensor]], wrt: list[torch.Tensor]) -> None:
    """Backward of ``outs`` (with their output gradients) into ``wrt``, whose ``.grad`` is left as it was."""
    kept = [t.grad for t in wrt]
    for t in wrt:
        t.grad = None
    try:
        torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
    finally:
        for t, g in zip(wrt, kept):
            t.grad = g


# Nominal device throughput for the cost model. Only ratios between blocks on
# the same device matter for balancing, so rough figures are enough.
_NOMINAL = {"cuda": (30e12, 2e12), "cpu": (50e9, 10e9)}


def estimate_blocks(blocks: Sequence[Block], sample: torch.Tensor) -> list[BlockProfile]:
    """Cost-model fallback (``profile=False``): FLOPs and bytes of one forward.

    Time = max(FLOPs / peak, bytes moved / bandwidth) with nominal device
    figures; backward is counted as twice the forward. Good for relative
    balance, not for absolute step times.
    """
    from torch.utils.flop_counter import FlopCounterMode

    peak, bw = _NOMINAL.get(sample.device.type, _NOMINAL["cpu"])
    out: list[BlockProfile] = []
    x: Value = sample.detach()
    with torch.no_grad():
        for block in blocks:
            counter = FlopCounterMode(display=False)
            with counter:
                y = block.module(x)
            if not is_value(y):
                raise ValueError(f"block '{block.name}' returns {type(y).__name__}, not a tensor or a tuple of "
                                 f"tensors")
            flops = counter.get_total_flops()
            param_bytes = sum(_nbytes(p) for p in block.module.parameters())
            moved = nbytes(x) + nbytes(y) + param_bytes
            fwd = max(flops / peak, moved / bw) * 1e3
            out.append(BlockProfile(block.name, fwd, 2 * fwd, nbytes(y), nbytes(x), param_bytes))
            x = y
    return out
