"""CUDA schedule templates for NCHW activations: two-level tiling with virtual threads, shared-memory staging.

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

Small planes (an output of at most 32x32: MobileNetV2's and EfficientNet's
last stages at 224x224, all of them at 32x32). A plane-per-block tile is a
few dozen threads there, and their rows are a few words long, so most of
an H100 idles and half of each global access is wasted; and a block tile
that does not divide the plane (7x7, 14x14) makes TVM stage the whole
padded plane per block anyway (its bounds of a non-dividing split are the
whole axis), so whole planes are what such tiles cost. ``tile_c`` packs up
to 32 planes into a block, and ``flat=1`` maps the block's threads onto its
planes as one flat run of ``tile_c * tw`` threads (planes are contiguous in
NCHW, so neighbouring threads read and write neighbouring words, across
rows and planes alike):

    blockIdx.x   fuse(n, channels / tile_c)
      shared     tile_c whole padded planes and their filters
      threadIdx.x  tile_c * tw threads over fuse(planes, rows, cols); each computes every (tile_c * tw)-th output

(``flat=1`` reads tile_c, tw and unroll only: the other knobs must be 1.)

Grad-weight sums over (n, h, w) for the few taps of a channel:

    blockIdx.x   fuse(split, channel)
      threadIdx.x  threads partial sums, each over a strided share of the split's (n, h, w),
                   all kh*kw taps held in registers (rfactor)
      shared       the threads' partial sums
      threadIdx.x  one tap per thread (the threads past kh*kw idle): sum of the partials, to global memory
    (splits > 1)  a second kernel: blockIdx.x, threadIdx.x over (channel, tap): the sum of the splits' partials
    (fp16/bf16)   a last small kernel rounds the fp32 sums to the problem's dtype

With ``splits=1`` a block sums a channel's whole (n, h, w): C blocks, fewer
than an H100's SMs for a 32-channel layer. ``splits`` cuts the sum into that
many contiguous chunks, one block each, whose partial sums go to a global
buffer that a second, small kernel adds up (two stages, no atomics, so the
result does not depend on the order blocks finish in).

fp16/bf16 problems accumulate in fp32 registers and round once, at the
write-back (see :func:`.ops.rounded`); grad-weight's few sums are rounded
by a kernel of their own, since a write computed at the taps loop would
not be guarded against the threads past the last tap. Registered as the template of CUDA
targets for NCHW activations (torch's native depthwise layout there); the
NHWC one is :mod:`.cuda_nhwc`.
"""

from __future__ import annotations

import math

from tvm import s_tir

from .cuda_common import (MAX_SHARED, MAX_THREADS, SPLITS, allocated_shared, check_accumulators, check_shared,
                          check_splits, check_threads, cooperative_fetch, log2, own_kernel, sum_splits, write_back)
from .ops import DepthwiseConv
from .space import Config, InvalidConfig, Knob, Space
from .template import has_pad, register

__all__ = ["CudaTemplate", "TEMPLATE", "shared_bytes", "small_plane", "MAX_THREADS", "MAX_SHARED", "SMALL_PLANE"]

SMALL_PLANE = 32 * 32  # outputs per plane up to which the flat mapping is offered
_TILING = ("vt_h", "vt_w", "th", "ih", "iw")  # what flat=1 does not read


def _extent(conv: DepthwiseConv, op: str) -> tuple[int, int]:
    return conv.out_hw if op == "fwd" else (conv.h, conv.w)


def small_plane(conv: DepthwiseConv, op: str) -> bool:
    """Whether ``op``'s output planes are small enough for the flat mapping (see the module docstring)."""
    h, w = _extent(conv, op)
    return h * w <= SMALL_PLANE


def _block_tile(conv: DepthwiseConv, op: str, config: Config) -> tuple[int, int]:
    """Outputs of one block along (h, w): virtual threads x threads x outputs per thread (flat: whole planes)."""
    if config.get("flat"):
        return _extent(conv, op)
    return (config["vt_h"] * config["th"] * config["ih"], config["vt_w"] * config["tw"] * config["iw"])


def _threads(config: Config) -> int:
    return config["tile_c"] * config["tw"] * (1 if config.get("flat") else config["th"])


def shared_bytes(conv: DepthwiseConv, op: str, config: Config) -> int:
    """Shared memory of one block: the padded input tile plus its filters."""
    (kh, kw), (dh, dw) = conv.kernel, conv.dilation
    (sh, sw) = conv.stride if op == "fwd" else (1, 1)
    bh, bw = _block_tile(conv, op, config)
    chans = config["tile_c"] * (conv.multiplier if op == "dgrad" else 1)
    tile = ((bh - 1) * sh + (kh - 1) * dh + 1) * ((bw - 1) * sw + (kw - 1) * dw + 1)
    return conv.itemsize * chans * (tile + kh * kw)


class CudaTemplate:
    """NCHW activations on a CUDA GPU (see the module docstring for the loop nests)."""

    name = "cuda"

    def space(self, conv: DepthwiseConv, op: str) -> Space:
        if op == "wgrad":
            return Space("cuda-wgrad", (
                Knob("threads", (64, 128, 256, 512), "threads summing partials per channel"),
                Knob("unroll", (0, 16, 64), "auto-unroll limit of the partial-sum loop"),
                Knob("splits", SPLITS, "blocks per channel, each summing a chunk of (n, h, w); a second kernel "
                     "adds their partial sums", since=1),
            ))
        knobs = (
            Knob("tile_c", (1, 2, 4, 8, 16, 32), "planes per block (threadIdx.z)"),
            Knob("vt_h", (1, 2), "virtual threads along h"),
            Knob("vt_w", (1, 2, 4), "virtual threads along w"),
            Knob("th", (1, 2, 4, 8, 16), "threads along h"),
            Knob("tw", (4, 8, 16, 32), "threads along w"),
            Knob("ih", (1, 2, 4), "rows per thread and virtual thread"),
            Knob("iw", (1, 2), "columns per thread and virtual thread"),
            Knob("unroll", (0, 16, 64, 512), "auto-unroll limit"),
        )
        if small_plane(conv, op):
            knobs += (Knob("flat", (0, 1), "whole planes per block, its threads one flat run over them", since=0),)
        return Space(f"cuda-{op}", knobs)

    def validate(self, conv: DepthwiseConv, op: str, config: Config) -> None:
        """At least a warp per block and at most the block limit; no block tile that mostly idles; shared
        memory and registers within the per-block limits."""
        self.space(conv, op).check(config)
        if op == "wgrad":
            smem = 4 * config["threads"] * conv.kernel[0] * conv.kernel[1]  # every thread's fp32 partial sums
            if smem > MAX_SHARED:
                raise InvalidConfig(f"{config['threads']} threads' partial sums of {conv.kernel} taps are {smem} bytes "
                                    f"of shared memory per block: at most {MAX_SHARED}")
            check_splits(conv, config["splits"], config["threads"])
            return
        planes = conv.c if op == "dgrad" else conv.out_channels
        if config["tile_c"] > planes:
            raise InvalidConfig(f"tile_c={config['tile_c']} exceeds the {planes} channels of a sample")
        h, w = _extent(conv, op)
        threads = _threads(config)
        if config.get("flat"):
            unused = [k for k in _TILING if config[k] != 1]
            if unused:
                raise InvalidConfig(f"flat=1 reads tile_c, tw and unroll only: set {', '.join(unused)} to 1")
            check_threads(threads)
            if threads > 2 * config["tile_c"] * h * w:
                raise InvalidConfig(f"{threads} threads for {config['tile_c']} planes of {h}x{w}: most would idle")
        else:
            check_threads(threads, config["tile_c"])
            bh, bw = _block_tile(conv, op, config)
            if bh > 2 * h or bw > 2 * w:
                raise InvalidConfig(f"block tile {bh}x{bw} is more than twice the {h}x{w} output: threads would idle")
            check_accumulators(config["vt_h"] * config["vt_w"] * config["ih"] * config["iw"], threads)
        check_shared(shared_bytes(conv, op, config))

    def apply(self, sch: s_tir.Schedule, conv: DepthwiseConv, op: str, config: Config) -> s_tir.Schedule:
        self.validate(conv, op, config)
        if op == "wgrad":
            _wgrad(sch, conv, config)
        elif config.get("flat"):
            _flat(sch, conv, op, config)
        else:
            _conv_like(sch, conv, op, config)
        check_shared(allocated_shared(sch.mod))  # as TVM sizes it (validate's estimate can be short)
        return sch

    def features(self, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
        """Threads, outputs per thread, block tile, wasted edge work, shared bytes, flat, blocks per sample
        (grad-weight: threads, terms per thread, splits, blocks)."""
        if op == "wgrad":
            work = conv.n * conv.out_hw[0] * conv.out_hw[1]
            splits = config.get("splits", 1)
            return [math.log2(config["threads"]), log2(work / (config["threads"] * splits)), math.log2(splits),
                    log2(conv.out_channels * splits)]
        h, w = _extent(conv, op)
        threads = _threads(config)
        bh, bw = _block_tile(conv, op, config)
        planes = conv.c if op == "dgrad" else conv.out_channels
        if config.get("flat"):
            per_thread = math.ceil(config["tile_c"] * h * w / threads)
            waste = per_thread * threads / (config["tile_c"] * h * w)
        else:
            per_thread = config["vt_h"] * config["vt_w"] * config["ih"] * config["iw"]
            waste = (math.ceil(h / bh) * bh * math.ceil(w / bw) * bw) / (h * w)
        blocks = math.ceil(planes / config["tile_c"]) * math.ceil(h / bh) * math.ceil(w / bw)
        return [math.log2(threads), log2(per_thread), log2(bh * bw), waste, math.log2(shared_bytes(conv, op, config)),
                float(config.get("flat", 0)), log2(blocks)]


TEMPLATE = register("cuda", "NCHW", CudaTemplate())


def _output(sch: s_tir.Schedule, op: str) -> tuple[s_tir.SBlockRV, s_tir.SBlockRV | None]:
    """The fp32 reduction block of ``op`` and its rounding stage (None for fp32 problems)."""
    name = {"fwd": "y", "dgrad": "dx", "wgrad": "dw"}[op]
    cast = [b for b in sch.get_consumers(sch.get_sblock(name)) if sch.get(b).name_hint == f"{name}_cast"]
    return sch.get_sblock(name), (cast[0] if cast else None)


def _stage_inputs(sch: s_tir.Schedule, conv: DepthwiseConv, op: str, out: s_tir.SBlockRV, block: s_tir.LoopRV,
                  threads: list[tuple[int, str]]) -> None:
    """The block's (padded) input tile and its filters in shared memory, fetched by all its threads."""
    if has_pad(conv, op):
        pad = sch.get_sblock("pad" if op == "fwd" else "dy_pad")
        sch.set_scope(pad, 0, "shared")
        cooperative_fetch(sch, pad, block, threads)
    else:
        cooperative_fetch(sch, sch.cache_read(out, 0, "shared"), block, threads)
    cooperative_fetch(sch, sch.cache_read(out, 1, "shared"), block, threads)


def _conv_like(sch: s_tir.Schedule, conv: DepthwiseConv, op: str, cfg: Config) -> None:
    out, cast = _output(sch, op)
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
    write_back(sch, out, cast, tx)
    _stage_inputs(sch, conv, op, out, block,
                  [(cfg["tile_c"], "threadIdx.z"), (cfg["th"], "threadIdx.y"), (cfg["tw"], "threadIdx.x")])
    if cfg["unroll"]:
        sch.annotate(block, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(block, "pragma_unroll_explicit", 1)
    sch.decompose_reduction(out, taps[0])


def _flat(sch: s_tir.Schedule, conv: DepthwiseConv, op: str, cfg: Config) -> None:
    """Small planes: ``tile_c`` whole planes per block, its threads one flat run over them (module docstring)."""
    out, cast = _output(sch, op)
    n, c, i, j, *taps = sch.get_loops(out)
    co, ci = sch.split(c, [None, cfg["tile_c"]])
    block = sch.fuse(n, co)
    sch.bind(block, "blockIdx.x")
    threads = _threads(cfg)
    flat = sch.fuse(ci, i, j)
    # The write-back goes below the flat loop *before* it is split over the threads, so the split's predicate
    # (flat index < tile_c * h * w) guards the write as it guards the sum. Computed at the split's inner loop
    # instead, the write would be guarded by the buffer's bounds only: past the tile's last output the flat
    # index runs into the next block's planes, and the threads there would store their unset accumulators
    # over that block's outputs (a race: wrong results wherever h * w is not a multiple of tw, e.g. 14x14, 7x7).
    write_back(sch, out, cast, flat)
    each, lane = sch.split(flat, [None, threads])
    sch.reorder(lane, each)
    sch.bind(lane, "threadIdx.x")
    _stage_inputs(sch, conv, op, out, block, [(threads, "threadIdx.x")])
    if cfg["unroll"]:
        sch.annotate(block, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(block, "pragma_unroll_explicit", 1)
    sch.decompose_reduction(out, taps[0])


def _wgrad(sch: s_tir.Schedule, conv: DepthwiseConv, cfg: Config) -> None:
    out, cast = _output(sch, "wgrad")
    o, z, r, s, n, i, j = sch.get_loops(out)
    red = sch.fuse(n, i, j)
    splits = cfg.get("splits", 1)
    main = out
    if splits > 1:  # stage 1: dw_rf[split, o, 0, r, s] in global memory, one block per (split, channel)
        part, red = sch.split(red, [splits, None])
        main = sch.rfactor(part, factor_axis=0)
        o, z, r, s, part, red = sch.get_loops(main)
        sch.reorder(part, o, z, r, s, red)
    ro, ri = sch.split(red, [None, cfg["threads"]])
    rf = sch.rfactor(ri, factor_axis=0)  # one partial sum per thread: [lane, (split,) o, 0, r, s]
    if conv.padding != (0, 0):
        sch.compute_inline(sch.get_sblock("pad"))
    # The partial sums are scheduled where rfactor put them (their own loops, at the root), never moved with
    # compute_at: the (n, h, w) sum rarely divides into splits x threads x steps (n is any batch size), and
    # only the splits' predicate keeps a thread's last steps inside its split's chunk and inside the tensors.
    # compute_at rebuilds a block's loops from its iteration domain and drops that predicate: the threads
    # then summed terms of the next chunk twice and, in the last chunk, read past the end of x and dy
    # (wrong grad-weights at most batch sizes, and illegal memory accesses). The sum over the lanes is moved
    # below the partial sums' block instead (reverse_compute_at: no reduction loop of its own is rebuilt).
    *head, lane = sch.get_loops(rf)  # (split,) o, 0, r, s, ro, lane
    *chan_loops, rr, rs, rro = head
    sch.reorder(*chan_loops, lane, rro, rr, rs)
    chan = sch.fuse(*chan_loops)  # (split,) o, 0
    sch.bind(chan, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    sch.set_scope(rf, 0, "shared")
    acc = sch.cache_write(rf, 0, "local")
    sch.reverse_compute_at(acc, lane)
    if cfg["unroll"]:
        sch.annotate(rro, "pragma_auto_unroll_max_step", cfg["unroll"])
    sch.unroll(rr)
    sch.unroll(rs)
    sch.decompose_reduction(rf, rro)
    sch.reverse_compute_at(main, chan)
    # One tap per thread, split by the block's width: a kernel has one threadIdx.x extent (the lanes'), and the
    # split's predicate keeps the threads past the kh*kw taps idle (a plain bind of the 9 taps would not). The
    # sum goes straight to its buffer under that predicate: a write stage computed at this loop would not get
    # it, and TVM sizes such a stage by the loop (64 taps), not by the taps there are.
    lanes, tr, ts = sch.get_loops(main)[1:]  # below chan, as main's iteration variables: the lanes' sum, r, s
    sch.reorder(tr, ts, lanes)
    _, taps = sch.split(sch.fuse(tr, ts), [None, cfg["threads"]])
    sch.bind(taps, "threadIdx.x")
    if splits > 1:  # stage 2: the splits' partial sums, one (channel, tap) per thread
        sum_splits(sch, out)
    if cast is not None:  # rounding the fp32 sums: a small kernel of its own (see above for why not at the taps)
        own_kernel(sch, cast)
