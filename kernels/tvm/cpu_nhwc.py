"""CPU schedule templates for NHWC activations: vectors along channels.

With channels innermost, one vector holds ``vec`` neighbouring channels of
one pixel, every tap is a contiguous load, and a vector of transposed
weights is one load too. Forward and grad-input share one template:

    parallel  fuse(n, h, [c_outer])                -- "task": a row, or a row x channel block
      [c_outer]
        w_outer
          taps (m), r, s                            -- unrolled when unroll=1
            w_inner (tile_w)                        -- register tile of tile_w pixels
              c_inner (vec, vectorised)

Padding is inlined: its test depends on (h, w) only, so it is one scalar
branch per vector. Outputs too large to stay in cache can be written with
streaming stores (``stream``, with the tile accumulated locally so each
output vector is stored once; see :mod:`.streaming`); the knob is offered by
the output's size at the tuned batch, and a kernel that streams does so at
every batch size it runs at.

Grad-weight splits n into ``nsplit`` partial sums (rfactor) for parallelism
(``nsplit`` divides the tuned batch; at any other batch size the kernel
takes, each split gets ceil(n / nsplit) samples and the last ones fewer or
none, a predicate TVM adds) and sweeps (n, h, w) in one of two orders:

    order=channel                                order=pixel
    parallel  fuse(n_outer, c_outer)             parallel  n_outer
      n_inner, h, w_outer                          n_inner, h, w_outer
        r, s (unrolled)                              c_outer, r, s (unrolled)
          w_inner (tile_w, unrolled)                   w_inner (tile_w, unrolled)
            c_inner (vec, vectorised)                    c_inner (vec, vectorised)

    dwT[r, s, c] += dy * x; neighbouring taps of the w tile load an input vector once.

With ``order=channel`` a channel block's kh*kw accumulators stay in
registers, but a task reads one vector per pixel, ``c`` floats apart, and
the prefetchers fetch its neighbours for nothing; with ``order=pixel`` a task
reads every channel of ``tile_w`` pixels (contiguous) and keeps its
kh*kw*c partial sums in L1.

Registered as the template of CPU (``llvm``) targets for NHWC activations.
"""

from __future__ import annotations

import math

from tvm import s_tir

from . import streaming
from .ops import DepthwiseConv
from .space import Config, InvalidConfig, Knob, Space, divisors
from .template import has_pad, register

__all__ = ["CpuNhwcTemplate", "TEMPLATE"]


def _vectors(channels: int) -> tuple[int, ...]:
    return tuple(v for v in (32, 16, 8, 4) if channels % v == 0) or (1,)


def _can_stream(conv: DepthwiseConv, op: str) -> bool:
    """Streaming pays only for outputs that do not stay in cache anyway (see :mod:`.streaming`)."""
    return streaming.available() and conv.output_bytes(op) >= streaming.MIN_BYTES


class CpuNhwcTemplate:
    """NHWC activations on a CPU (see the module docstring for the loop nests)."""

    name = "cpu-nhwc"

    def space(self, conv: DepthwiseConv, op: str) -> Space:
        oh, ow = conv.out_hw
        layout = Knob("layout", ("NHWC",), "activations stored (n, h, w, c)")
        if op == "wgrad":
            return Space("cpu-nhwc-wgrad", (
                layout,
                Knob("vec", _vectors(conv.out_channels), "channels per vector"),
                Knob("nsplit", tuple(d for d in (1, 2, 4, 8, 16) if conv.n % d == 0), "parallel partial sums over n"),
                Knob("unroll", (1, 0), "unroll the kernel taps"),
                Knob("tile_w", divisors(ow, 8), "output pixels whose taps share the input vectors they load", since=1),
                Knob("order", ("channel", "pixel"), "a task sweeps the pixels for its channel block, or every channel "
                     "of its pixels", since="channel"),
            ))
        width, channels = (ow, conv.out_channels) if op == "fwd" else (conv.w, conv.c)
        knobs = (
            layout,
            Knob("vec", _vectors(channels), "channels per vector"),
            Knob("tile_w", divisors(width, 8), "pixels per register tile"),
            Knob("task", ("row", "block"), "a parallel task is an output row, or a row x channel block"),
            Knob("cache", (1, 0), "accumulate the tile in a local buffer"),
            Knob("unroll", (1, 0), "unroll the kernel taps"),
        )
        if _can_stream(conv, op):
            knobs += (Knob("stream", (0, 1), "write the output with streaming stores (no read of the lines it fills)",
                           since=0),)
        return Space(f"cpu-nhwc-{op}", knobs)

    def validate(self, conv: DepthwiseConv, op: str, config: Config) -> None:
        """Register tiles that fit the vector registers; streaming only from a register tile (before compiling)."""
        self.space(conv, op).check(config)
        if op != "wgrad" and config["tile_w"] * config["vec"] > 16 * 16:
            raise InvalidConfig(f"tile {config['tile_w']}x{config['vec']} is over 16 vector registers")
        if config.get("stream") and not (config["cache"] and config["vec"] >= 4):
            raise InvalidConfig("stream=1 needs cache=1 and vec >= 4: each output vector is stored once, from the tile")
        if op == "wgrad" and config["tile_w"] * config["vec"] > 8 * 16:
            raise InvalidConfig(f"tile {config['tile_w']}x{config['vec']} and the taps' accumulators are over the "
                                "registers")
        if op == "wgrad" and config["order"] == "channel" and conv.kernel[0] * conv.kernel[1] * config["vec"] > 49 * 16:
            raise InvalidConfig(f"{conv.kernel} taps x {config['vec']} channels is over the register file")
        if op == "wgrad" and config["order"] == "pixel" and config["nsplit"] < 2:
            raise InvalidConfig("order=pixel parallelises over the n splits only: it needs nsplit >= 2")

    def apply(self, sch: s_tir.Schedule, conv: DepthwiseConv, op: str, config: Config) -> s_tir.Schedule:
        self.validate(conv, op, config)
        if op == "wgrad":
            _wgrad(sch, conv, config)
        else:
            sch.parallel(sch.get_loops(sch.get_sblock("wT"))[0])  # (kh, kw, c): small next to the convolution
            _conv_like(sch, conv, op, config)
        return sch

    def features(self, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
        """Vector width, parallel tasks, register tile size, channels (and grad-weight's sweep order)."""
        oh, ow = conv.out_hw
        channels = conv.out_channels if op != "dgrad" else conv.c
        blocks = channels / config["vec"]
        if op == "wgrad":
            tasks = config["nsplit"] * (blocks if config["order"] == "channel" else 1)
            return [math.log2(config["vec"]), math.log2(tasks), math.log2(config["tile_w"]),
                    float(config["order"] == "pixel")]
        rows = conv.n * (oh if op == "fwd" else conv.h)
        tasks = rows * (blocks if config["task"] == "block" else 1)
        return [math.log2(config["vec"]), math.log2(tasks), math.log2(config["tile_w"] * config["vec"]),
                float(channels)]


TEMPLATE = register("llvm", "NHWC", CpuNhwcTemplate())


def _conv_like(sch: s_tir.Schedule, conv: DepthwiseConv, op: str, cfg: Config) -> None:
    out = sch.get_sblock("y" if op == "fwd" else "dx")
    n, i, j, c, *taps = sch.get_loops(out)
    co, ci = sch.split(c, [None, cfg["vec"]])
    jo, ji = sch.split(j, [None, cfg["tile_w"]])
    block = cfg["task"] == "block"
    sch.reorder(n, i, co, jo, *taps, ji, ci) if block else sch.reorder(n, i, jo, co, *taps, ji, ci)
    inner = jo if block else co
    if cfg["cache"]:
        local = sch.cache_write(out, 0, "local")
        sch.reverse_compute_at(local, inner)
    task = sch.fuse(n, i, co) if block else sch.fuse(n, i)
    sch.parallel(task)
    pad = "pad" if op == "fwd" else "dy_pad"
    if has_pad(conv, op):
        sch.compute_inline(sch.get_sblock(pad))
    if cfg["unroll"]:
        for t in taps:
            sch.unroll(t)
    sch.unroll(ji)
    sch.vectorize(ci)
    if cfg["cache"] and cfg["vec"] > 1:  # (with vec 1 the innermost loop left would be the channel blocks)
        sch.vectorize(sch.get_loops(local)[-1])
    sch.decompose_reduction(out, taps[0])


def _wgrad(sch: s_tir.Schedule, conv: DepthwiseConv, cfg: Config) -> None:
    blk = sch.get_sblock("dwT")
    if cfg["nsplit"] > 1:
        r, s, o, n, i, j = sch.get_loops(blk)
        n0, _ = sch.split(n, [cfg["nsplit"], None])
        blk = sch.rfactor(n0, factor_axis=0)  # dwT_rf[n0, r, s, o]
        r, s, o, n0, n1, i, j = sch.get_loops(blk)  # the rf block keeps the original loop order
    else:
        r, s, o, n1, i, j = sch.get_loops(blk)
        n0 = None
    oo, oi = sch.split(o, [None, cfg["vec"]])
    jo, ji = sch.split(j, [None, cfg["tile_w"]])
    if cfg["order"] == "pixel":  # every channel of a few pixels at a time: reads stay sequential
        sch.reorder(n0, n1, i, jo, oo, r, s, ji, oi)
        local = sch.cache_write(blk, 0, "local")  # all kh*kw*c partial sums of the task, in L1
        sch.reverse_compute_at(local, n0)
        task = n0
    else:  # one channel block's partial sums stay in registers while the task sweeps every pixel
        head = [n0, oo] if n0 is not None else [oo]
        sch.reorder(*head, n1, i, jo, r, s, ji, oi)
        local = sch.cache_write(blk, 0, "local")
        sch.reverse_compute_at(local, oo)
        task = sch.fuse(*head) if len(head) > 1 else oo
    sch.parallel(task)
    if conv.padding != (0, 0):
        sch.compute_inline(sch.get_sblock("pad"))
    if cfg["unroll"]:
        sch.unroll(r)
        sch.unroll(s)
    sch.unroll(ji)
    sch.vectorize(oi)
    sch.decompose_reduction(blk, n1)

