"""CUDA schedule templates for NHWC activations: channels innermost, vector loads along them.

torch's channels_last layout, where cuDNN serves depthwise convolutions. With
channels contiguous, neighbouring threads of a warp take neighbouring
channels of one pixel: every global access is coalesced, whatever the
plane's size, and a block tile can span many channels of a small plane, so
the 7x7 and 4x4 planes of the last stages (where an NCHW plane per block
leaves an H100 mostly idle) fill a block with no special case.

Forward and grad-input (grad-input over the polyphase taps of
:func:`.ops_nhwc.grad_input`, the multiplier summed too):

    blockIdx.x   fuse(n, rows / block_h, cols / block_w, channels / (tc * vec))   -- level 1: block tile
      shared     the block's padded input tile (loaded with ``vec``-wide vector loads along channels)
                 and its transposed filters (kh, kw, channels)
      threadIdx.z  th rows,  vthread.x  vt_w,  threadIdx.y  tw columns            -- level 2
        threadIdx.x  tc channel groups of ``vec`` channels each
          taps  unrolled up to ``unroll`` steps
            (ih, iw, vec) outputs per thread, accumulated in registers

    block_h = th * ih,  block_w = vt_w * tw * iw,  block_c = tc * vec

A thread's ``vec`` channels are contiguous, so the fetch moves ``vec``
channels per instruction (up to 16 bytes: ``float4`` or eight halves) and
the write-back stores them side by side; a virtual thread along w
interleaves its columns with the other threads' so the ``tw`` threads of a
row read neighbouring pixels of the shared tile at every tap. A block's tile
lies within one sample (the batch is its outermost index), so a kernel takes
any batch size, as the NCHW one does.

Grad-weight sums over (n, h, w) for the kh*kw taps of each channel:

    blockIdx.x   fuse(split, channels / tc)
      threadIdx.x  tc channels (neighbouring threads read neighbouring channels of a pixel: coalesced)
      threadIdx.y  ty partial sums, each over a strided share of the split's (n, h, w), all taps in registers
      shared       the partial sums;  then one thread per (tap, channel) adds them up
    (splits > 1)  a second kernel adds the splits' partial sums from a global buffer (no atomics)
    then          a small kernel writes torch's (o, 1, kh, kw) weight layout (rounded for fp16/bf16)

fp16/bf16 problems accumulate in fp32 and round once at the write-back, as
in :mod:`.cuda` (see :func:`.ops.rounded`).
"""

from __future__ import annotations

import math

from tvm import s_tir

from .cuda_common import (SPLITS as BASE_SPLITS, allocated_shared, bind_flat, check_accumulators, check_shared,
                          check_splits, check_threads, cooperative_fetch, log2, own_kernel, sum_splits, vector_widths,
                          write_back)
from .ops import DepthwiseConv
from .space import Config, InvalidConfig, Knob, Space
from .template import has_pad, register

__all__ = ["CudaNhwcTemplate", "TEMPLATE", "shared_bytes", "SPLITS"]

# A block sums tc channels, so a layer of few channels has few blocks per split: more splits than NCHW's
SPLITS = BASE_SPLITS + (64, 128)

_LAYOUT = Knob("layout", ("NHWC",), "activations stored (n, h, w, c)")


def _extent(conv: DepthwiseConv, op: str) -> tuple[int, int, int]:
    """The output's (h, w, channels) of ``op``."""
    return (*conv.out_hw, conv.out_channels) if op == "fwd" else (conv.h, conv.w, conv.c)


def _block_tile(config: Config) -> tuple[int, int, int]:
    return (config["th"] * config["ih"], config["vt_w"] * config["tw"] * config["iw"], config["tc"] * config["vec"])


def _threads(config: Config) -> int:
    return config["th"] * config["tw"] * config["tc"]


def _input_span(out: int, k: int, s: int, d: int, op: str) -> int:
    """Input rows (or columns) a block tile of ``out`` outputs reads (grad-input: of the padded gradient)."""
    if op == "fwd":
        return (out - 1) * s + (k - 1) * d + 1
    if s == 1:
        return out + (k - 1) * d
    return (out - 1) // s + 1 + -(-k // s)  # polyphase: ceil(k / s) taps below each output's row


def shared_bytes(conv: DepthwiseConv, op: str, config: Config) -> int:
    """Shared memory of one block: the padded input tile and the filters of its channels."""
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel, conv.stride, conv.dilation
    bh, bw, bc = _block_tile(config)
    chans = bc * (conv.multiplier if op == "dgrad" else 1)
    tile = _input_span(bh, kh, sh, dh, op) * _input_span(bw, kw, sw, dw, op)
    return conv.itemsize * chans * (tile + kh * kw)


class CudaNhwcTemplate:
    """NHWC activations on a CUDA GPU (see the module docstring for the loop nests)."""

    name = "cuda-nhwc"

    def space(self, conv: DepthwiseConv, op: str) -> Space:
        if op == "wgrad":
            return Space("cuda-nhwc-wgrad", (
                _LAYOUT,
                Knob("tc", (8, 16, 32, 64), "channels per block, one per threadIdx.x"),
                Knob("ty", (4, 8, 16, 32), "partial sums per channel (threadIdx.y)"),
                Knob("splits", SPLITS, "blocks per channel block, each summing a chunk of (n, h, w); a second "
                     "kernel adds their partial sums"),
                Knob("unroll", (0, 16, 64), "auto-unroll limit of the partial-sum loop"),
            ))
        channels = _extent(conv, op)[2]
        return Space(f"cuda-nhwc-{op}", (
            _LAYOUT,
            Knob("vec", vector_widths(channels, conv.dtype), "contiguous channels per thread: one vector load"),
            Knob("tc", (1, 2, 4, 8, 16, 32), "channel groups per block (threadIdx.x)"),
            Knob("tw", (1, 2, 4, 8, 16), "threads along w (threadIdx.y)"),
            Knob("th", (1, 2, 4, 8), "threads along h (threadIdx.z)"),
            Knob("vt_w", (1, 2), "virtual threads along w"),
            Knob("ih", (1, 2, 4), "rows per thread"),
            Knob("iw", (1, 2), "columns per thread and virtual thread"),
            Knob("unroll", (0, 16, 64, 512), "auto-unroll limit"),
        ))

    def validate(self, conv: DepthwiseConv, op: str, config: Config) -> None:
        """At least a warp per block, no block tile that mostly idles, shared memory and registers within the
        per-block limits (before anything compiles)."""
        self.space(conv, op).check(config)
        if op == "wgrad":
            threads = config["tc"] * config["ty"]
            check_threads(threads)
            if config["tc"] > 2 * conv.out_channels:
                raise InvalidConfig(f"tc={config['tc']} is more than twice the {conv.out_channels} channels")
            taps = conv.kernel[0] * conv.kernel[1]
            check_shared(4 * threads * taps)
            check_accumulators(taps, threads)
            check_splits(conv, config["splits"], config["ty"])
            return
        h, w, c = _extent(conv, op)
        bh, bw, bc = _block_tile(config)
        if bh > 2 * h or bw > 2 * w or bc > 2 * c:
            raise InvalidConfig(f"block tile {bh}x{bw}x{bc} is more than twice the {h}x{w}x{c} output: threads "
                                f"would idle")
        threads = _threads(config)
        check_threads(threads, config["th"])
        check_accumulators(config["vt_w"] * config["ih"] * config["iw"] * config["vec"], threads)
        check_shared(shared_bytes(conv, op, config))

    def apply(self, sch: s_tir.Schedule, conv: DepthwiseConv, op: str, config: Config) -> s_tir.Schedule:
        self.validate(conv, op, config)
        if op == "wgrad":
            _wgrad(sch, conv, config)
        else:
            _conv_like(sch, conv, op, config)
        check_shared(allocated_shared(sch.mod))  # as TVM sizes it (validate's estimate can be short)
        return sch

    def features(self, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
        """Threads, outputs per thread, vector width, block tile, wasted edge work, shared bytes, blocks per
        sample (grad-weight: threads, terms per thread, splits, blocks)."""
        if op == "wgrad":
            work = conv.n * conv.out_hw[0] * conv.out_hw[1]
            threads = config["tc"] * config["ty"]
            blocks = math.ceil(conv.out_channels / config["tc"]) * config["splits"]
            return [math.log2(threads), log2(work / (config["ty"] * config["splits"])),
                    math.log2(config["splits"]), log2(blocks)]
        h, w, c = _extent(conv, op)
        bh, bw, bc = _block_tile(config)
        blocks = math.ceil(h / bh) * math.ceil(w / bw) * math.ceil(c / bc)
        waste = blocks * bh * bw * bc / (h * w * c)
        per_thread = config["vt_w"] * config["ih"] * config["iw"] * config["vec"]
        return [math.log2(_threads(config)), log2(per_thread), math.log2(config["vec"]), log2(bh * bw * bc), waste,
                math.log2(shared_bytes(conv, op, config)), log2(blocks)]


TEMPLATE = register("cuda", "NHWC", CudaNhwcTemplate())


def _output(sch: s_tir.Schedule, op: str) -> tuple[s_tir.SBlockRV, s_tir.SBlockRV | None]:
    """The fp32 reduction block of ``op`` and its rounding stage (None for fp32 problems)."""
    name = {"fwd": "y", "dgrad": "dx"}[op]
    cast = [b for b in sch.get_consumers(sch.get_sblock(name)) if sch.get(b).name_hint == f"{name}_cast"]
    return sch.get_sblock(name), (cast[0] if cast else None)


def _conv_like(sch: s_tir.Schedule, conv: DepthwiseConv, op: str, cfg: Config) -> None:
    out, cast = _output(sch, op)
    n, i, j, c, *taps = sch.get_loops(out)
    io, ty, ii = sch.split(i, [None, cfg["th"], cfg["ih"]])
    jo, vx, tx, ji = sch.split(j, [None, cfg["vt_w"], cfg["tw"], cfg["iw"]])
    co, tc, ci = sch.split(c, [None, cfg["tc"], cfg["vec"]])
    sch.reorder(n, io, jo, co, ty, vx, tx, tc, *taps, ii, ji, ci)
    block = sch.fuse(n, io, jo, co)
    sch.bind(block, "blockIdx.x")
    sch.bind(ty, "threadIdx.z")
    sch.bind(vx, "vthread.x")
    sch.bind(tx, "threadIdx.y")
    sch.bind(tc, "threadIdx.x")
    write_back(sch, out, cast, tc)
    threads = [(cfg["th"], "threadIdx.z"), (cfg["tw"], "threadIdx.y"), (cfg["tc"], "threadIdx.x")]
    if has_pad(conv, op):
        pad = sch.get_sblock("pad" if op == "fwd" else "dy_pad")
        sch.set_scope(pad, 0, "shared")
        cooperative_fetch(sch, pad, block, threads, vec=cfg["vec"])
    else:
        cooperative_fetch(sch, sch.cache_read(out, 0, "shared"), block, threads, vec=cfg["vec"])
    weights = sch.get_sblock("wT")  # (kh, kw, channels): a strided gather of torch's (o, 1, kh, kw), small
    sch.set_scope(weights, 0, "shared")
    cooperative_fetch(sch, weights, block, threads)
    if cfg["unroll"]:
        sch.annotate(block, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(block, "pragma_unroll_explicit", 1)
    sch.decompose_reduction(out, taps[0])


def _wgrad(sch: s_tir.Schedule, conv: DepthwiseConv, cfg: Config) -> None:
    out = sch.get_sblock("dwT")
    r, s, o, n, i, j = sch.get_loops(out)
    red = sch.fuse(n, i, j)
    splits = cfg["splits"]
    main = out
    if splits > 1:  # stage 1: dwT_rf[split, r, s, o] in global memory, one block per (split, channel block)
        part, red = sch.split(red, [splits, None])
        main = sch.rfactor(part, factor_axis=0)
        r, s, o, part, red = sch.get_loops(main)
        sch.reorder(part, o, r, s, red)
    ro, ri = sch.split(red, [None, cfg["ty"]])
    rf = sch.rfactor(ri, factor_axis=0)  # one partial sum per (lane, tap, channel): [lane, (split,) r, s, o]
    if conv.padding != (0, 0):
        sch.compute_inline(sch.get_sblock("pad"))
    # The partial sums stay where rfactor put them (their own loops at the root) and the lanes' sum moves
    # below them (reverse_compute_at), never the other way round: compute_at rebuilds a block's loops from its
    # iteration domain and drops the splits' predicate, without which a thread's last steps run past its
    # split's chunk of (n, h, w) (terms summed twice) and, in the last chunk, past the end of x and dy (see
    # :func:`.cuda._wgrad`, same bug, same fix).
    if splits > 1:
        part, o, rr, rs, rro, lane_rf = sch.get_loops(rf)
    else:
        (rr, rs, o, rro, lane_rf), part = sch.get_loops(rf), None
    sch.reorder(*([part] if part is not None else []), o, lane_rf, rro, rr, rs)
    sch.set_scope(rf, 0, "shared")
    acc = sch.cache_write(rf, 0, "local")
    # The registers' copy to shared memory goes below the lanes before the channels are split, so the split's
    # predicate guards it too. Moved there after the split, it got tc channels and, where the split of (n, h, w)
    # has a tail (14x14 planes), no predicate: with tc > c its threads past the channels wrote over other taps'
    # sums in shared memory, and past their end
    sch.reverse_compute_at(acc, lane_rf)
    oo, oc = sch.split(o, [None, cfg["tc"]])
    chan = sch.fuse(part, oo) if part is not None else oo
    sch.bind(chan, "blockIdx.x")
    sch.bind(oc, "threadIdx.x")
    sch.bind(lane_rf, "threadIdx.y")
    if cfg["unroll"]:
        sch.annotate(rro, "pragma_auto_unroll_max_step", cfg["unroll"])
    sch.unroll(rr)
    sch.unroll(rs)
    sch.decompose_reduction(rf, rro)
    sch.reverse_compute_at(main, chan)
    # Below chan, as main's iteration variables: the lanes' sum, r, s, the block's channels. The taps go over
    # threadIdx.y, ty at a time: one threadIdx.y extent per kernel (the lanes'), the split's predicate keeps the
    # threads past the last tap idle; the sums go straight to their buffer under it (a write stage computed here
    # would be sized by the loop, not by the taps there are, and write past them). The block's channels likewise
    # go over threadIdx.x tc at a time: with tc > c the block's one channel block is c long, a loop of c bound to
    # threadIdx.x would run its tc - c threads past the channels (past dwT_rf's end and the shared partial sums:
    # "an illegal memory access" on the H200), and the split's predicate idles them
    lanes, r, s, oi = sch.get_loops(main)[1:]
    sch.reorder(r, s, oi, lanes)
    _, taps = sch.split(sch.fuse(r, s), [None, cfg["ty"]])
    sch.bind(taps, "threadIdx.y")
    bind_flat(sch, oi, [(cfg["tc"], "threadIdx.x")])
    if splits > 1:  # stage 2: the splits' partial sums, one (tap, channel) per thread
        sum_splits(sch, out)
    own_kernel(sch, sch.get_sblock("dw"))  # torch's (o, 1, kh, kw) from dwT, rounded for fp16/bf16

