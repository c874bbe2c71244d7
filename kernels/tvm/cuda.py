"""CUDA schedule templates: two-level tiling with virtual threads, shared-memory staging.

Forward and grad-input (same loop nest; grad-input also reduces over the
multiplier):

    blockIdx.x   fuse(n, channels / tile_c, rows / block_h, cols / block_w)  -- level 1: block tile
      shared     the block's padded input tile and its filters            -- loaded cooperatively
      threadIdx.z  tile_c planes
      vthread.y, vthread.x  (vt_h, vt_w)                                   -- level 2: virtual threads
        threadIdx.y, threadIdx.x  (th, tw)
          taps (m, r, s)  unrolled up to ``unroll`` steps
            (ih, iw) outputs per thread, accumulated in registers

    block_h = vt_h * th * ih,  block_w = vt_w * tw * iw

A block's tile lies within one sample: the batch is only ever the outermost
block index, so a kernel compiled for any batch size (a symbolic n) stages
the same shared-memory tile, and TVM's bounds for it never involve n.

A virtual thread interleaves its outputs with the other threads' instead of
taking a contiguous run, so neighbouring threads of a warp read neighbouring
shared-memory words at every tap (no bank conflicts, coalesced global
stores), while each thread still computes ``vt_h * vt_w * ih * iw`` outputs.

Grad-weight sums over (n, h, w) for the few taps of a channel:

    blockIdx.x   channel
      threadIdx.x  threads partial sums, each over a strided share of (n, h, w),
                   all kh*kw taps held in registers (rfactor)
      shared       the threads' partial sums
      threadIdx.x  one tap per thread: sum of the partials

Registered as the template of CUDA targets for NCHW activations (torch's
native depthwise layout there; there is no NHWC one).
"""

from __future__ import annotations

import math

from tvm import s_tir

from .ops import DepthwiseConv
from .space import Config, InvalidConfig, Knob, Space
from .template import has_pad, register

__all__ = ["CudaTemplate", "TEMPLATE", "shared_bytes", "MAX_THREADS", "MAX_SHARED"]

MAX_THREADS = 1024  # threads per block on every CUDA GPU
MAX_SHARED = 48 * 1024  # shared memory per block without opting in to more


def _extent(conv: DepthwiseConv, op: str) -> tuple[int, int]:
    return conv.out_hw if op == "fwd" else (conv.h, conv.w)


def _block_tile(config: Config) -> tuple[int, int]:
    """Outputs of one block along (h, w): virtual threads x threads x outputs per thread."""
    return (config["vt_h"] * config["th"] * config["ih"], config["vt_w"] * config["tw"] * config["iw"])


def shared_bytes(conv: DepthwiseConv, op: str, config: Config) -> int:
    """Shared memory of one block: the padded input tile plus its filters."""
    (kh, kw), (dh, dw) = conv.kernel, conv.dilation
    (sh, sw) = conv.stride if op == "fwd" else (1, 1)
    bh, bw = _block_tile(config)
    chans = config["tile_c"] * (conv.multiplier if op == "dgrad" else 1)
    tile = ((bh - 1) * sh + (kh - 1) * dh + 1) * ((bw - 1) * sw + (kw - 1) * dw + 1)
    size = 4 if conv.dtype == "float32" else 2
    return size * chans * (tile + kh * kw)


class CudaTemplate:
    """NCHW activations on a CUDA GPU (see the module docstring for the loop nests)."""

    name = "cuda"

    def space(self, conv: DepthwiseConv, op: str) -> Space:
        if op == "wgrad":
            return Space("cuda-wgrad", (
                Knob("threads", (64, 128, 256, 512), "threads summing partials per channel"),
                Knob("unroll", (0, 16, 64), "auto-unroll limit of the partial-sum loop"),
            ))
        return Space(f"cuda-{op}", (
            Knob("tile_c", (1, 2, 4), "planes per block (threadIdx.z)"),
            Knob("vt_h", (1, 2), "virtual threads along h"),
            Knob("vt_w", (1, 2, 4), "virtual threads along w"),
            Knob("th", (1, 2, 4, 8, 16), "threads along h"),
            Knob("tw", (4, 8, 16, 32), "threads along w"),
            Knob("ih", (1, 2, 4), "rows per thread and virtual thread"),
            Knob("iw", (1, 2), "columns per thread and virtual thread"),
            Knob("unroll", (0, 16, 64, 512), "auto-unroll limit"),
        ))

    def validate(self, conv: DepthwiseConv, op: str, config: Config) -> None:
        """At least a warp per block and at most the block limit; no block tile that mostly idles; shared
        memory within the per-block limit."""
        self.space(conv, op).check(config)
        if op == "wgrad":
            smem = 4 * config["threads"] * conv.kernel[0] * conv.kernel[1]  # every thread's fp32 partial sums
            if smem > MAX_SHARED:
                raise InvalidConfig(f"{config['threads']} threads' partial sums of {conv.kernel} taps are {smem} bytes "
                                    f"of shared memory per block: at most {MAX_SHARED}")
            return
        threads = config["tile_c"] * config["th"] * config["tw"]
        if threads > MAX_THREADS or threads < 32:
            raise InvalidConfig(f"{threads} threads per block: use 32..{MAX_THREADS}")
        h, w = _extent(conv, op)
        bh, bw = _block_tile(config)
        if bh > 2 * h or bw > 2 * w:
            raise InvalidConfig(f"block tile {bh}x{bw} is more than twice the {h}x{w} output: threads would idle")
        planes = conv.c if op == "dgrad" else conv.out_channels
        if config["tile_c"] > planes:
            raise InvalidConfig(f"tile_c={config['tile_c']} exceeds the {planes} channels of a sample")
        smem = shared_bytes(conv, op, config)
        if smem > MAX_SHARED:
            raise InvalidConfig(f"{smem} bytes of shared memory per block: at most {MAX_SHARED}")

    def apply(self, sch: s_tir.Schedule, conv: DepthwiseConv, op: str, config: Config) -> s_tir.Schedule:
        self.validate(conv, op, config)
        if op == "wgrad":
            _wgrad(sch, conv, config)
        else:
            _conv_like(sch, conv, op, config)
        return sch

    def features(self, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
        """Threads, outputs per thread, block tile, wasted edge work, shared bytes."""
        if op == "wgrad":
            work = conv.n * conv.out_hw[0] * conv.out_hw[1]
            return [math.log2(config["threads"]), math.log2(max(1.0, work / config["threads"]))]
        threads = config["tile_c"] * config["th"] * config["tw"]
        per_thread = config["vt_h"] * config["vt_w"] * config["ih"] * config["iw"]
        bh, bw = _block_tile(config)
        h, w = _extent(conv, op)
        waste = (math.ceil(h / bh) * bh * math.ceil(w / bw) * bw) / (h * w)
        return [math.log2(threads), math.log2(per_thread), math.log2(bh * bw), waste,
                math.log2(shared_bytes(conv, op, config))]


TEMPLATE = register("cuda", "NCHW", CudaTemplate())


def _cooperative_fetch(sch: s_tir.Schedule, block: s_tir.SBlockRV, at: s_tir.LoopRV, threads: list[int]) -> None:
    """Compute ``block`` per thread block at ``at``, its elements spread over all the block's threads."""
    sch.compute_at(block, at)
    loops = sch.get_loops(block)
    inner = loops[len(loops) - _own_loops(sch, block, at):]
    fused = sch.fuse(*inner)
    tz, ty, tx = threads
    _, z, y, x = sch.split(fused, [None, tz, ty, tx])
    sch.bind(z, "threadIdx.z")
    sch.bind(y, "threadIdx.y")
    sch.bind(x, "threadIdx.x")


def _own_loops(sch: s_tir.Schedule, block: s_tir.SBlockRV, at: s_tir.LoopRV) -> int:
    loops = sch.get_loops(block)
    for k, lp in enumerate(loops):
        if sch.get(lp).same_as(sch.get(at)):
            return len(loops) - k - 1
    raise ValueError("loop not found")


def _conv_like(sch: s_tir.Schedule, conv: DepthwiseConv, op: str, cfg: Config) -> None:
    out = sch.get_sblock("y" if op == "fwd" else "dx")
    n, c, i, j, *taps = sch.get_loops(out)
    co, tz = sch.split(c, [None, cfg["tile_c"]])
    io, vy, ty, iy = sch.split(i, [None, cfg["vt_h"], cfg["th"], cfg["ih"]])
    jo, vx, tx, ix = sch.split(j, [None, cfg["vt_w"], cfg["tw"], cfg["iw"]])
    sch.reorder(n, co, io, jo, tz, vy, vx, ty, tx, *taps, iy, ix)
    block = sch.fuse(n, co, io, jo)
    sch.bind(block, "blockIdx.x")
    sch.bind(tz, "threadIdx.z")
    sch.bind(vy, "vthread.y")
    sch.bind(vx, "vthread.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    local = sch.cache_write(out, 0, "local")
    sch.reverse_compute_at(local, tx)
    threads = [cfg["tile_c"], cfg["th"], cfg["tw"]]
    if has_pad(conv, op):
        pad = sch.get_sblock("pad" if op == "fwd" else "dy_pad")
        sch.set_scope(pad, 0, "shared")
        _cooperative_fetch(sch, pad, block, threads)
    else:
        staged = sch.cache_read(out, 0, "shared")
        _cooperative_fetch(sch, staged, block, threads)
    filt = sch.cache_read(out, 1, "shared")
    _cooperative_fetch(sch, filt, block, threads)
    if cfg["unroll"]:
        sch.annotate(block, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(block, "pragma_unroll_explicit", 1)
    sch.decompose_reduction(out, taps[0])


def _wgrad(sch: s_tir.Schedule, conv: DepthwiseConv, cfg: Config) -> None:
    out = sch.get_sblock("dw")
    o, z, r, s, n, i, j = sch.get_loops(out)
    red = sch.fuse(n, i, j)
    ro, ri = sch.split(red, [None, cfg["threads"]])
    rf = sch.rfactor(ri, factor_axis=0)  # dw_rf[lane, o, 0, r, s]: one partial sum per thread
    if conv.padding != (0, 0):
        sch.compute_inline(sch.get_sblock("pad"))
    fo, fz, fr, fs, fl = sch.get_loops(out)
    chan = sch.fuse(fo, fz)
    sch.bind(chan, "blockIdx.x")
    taps = sch.fuse(fr, fs)
    sch.bind(taps, "threadIdx.x")
    sch.set_scope(rf, 0, "shared")
    sch.compute_at(rf, chan)
    rri, rr, rs, rro = sch.get_loops(rf)[1:]  # compute_at orders them as dw_rf's vars: lane, r, s, then ro
    sch.reorder(rri, rro, rr, rs)
    sch.bind(rri, "threadIdx.x")
    acc = sch.cache_write(rf, 0, "local")
    sch.reverse_compute_at(acc, rri)
    if cfg["unroll"]:
        sch.annotate(rro, "pragma_auto_unroll_max_step", cfg["unroll"])
    sch.unroll(rr)
    sch.unroll(rs)
    sch.decompose_reduction(rf, rro)

