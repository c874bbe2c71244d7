"""CPU schedule templates: parallel outer tiles, a vectorised inner tile along w, a register tile.

Forward and grad-input have the same shape of loop nest (an output plane
per (n, channel), a small reduction over the kernel taps, and the multiplier
for grad-input), so one template serves both:

    parallel  fuse(n, channel, h_outer)          -- one task per band of tile_h output rows
      [pad]   the band's padded input rows        -- "tile": per task, so it stays in L1; or "inline"
      w_outer
        taps  (m), r, s                           -- unrolled when unroll=1
          h_inner  (tile_h)
            w_inner (tile_w, vectorised)          -- accumulators in registers when cache=1

Grad-weight reduces over (n, h, w) for each of the few weights of a channel:
the w loop is split and its inner part (``lanes``) made a vector of partial
sums (rfactor), which are added up once at the end:

    parallel  channel
      n, h [pad: one padded input row per (n, h) when pad="row"]
        w_outer
          r, s (unrolled)
            lanes (vectorised partial sums)

Registered as the template of CPU (``llvm``) targets for NCHW activations.
"""

from __future__ import annotations

import math

from tvm import s_tir

from .ops import DepthwiseConv
from .space import Config, InvalidConfig, Knob, Space, divisors
from .template import has_pad, register

__all__ = ["CpuTemplate", "TEMPLATE"]

_TILE_H = (1, 2, 4, 7, 8, 14, 16, 28, 32)


class CpuTemplate:
    """NCHW activations on a CPU (see the module docstring for the loop nests)."""

    name = "cpu"

    def space(self, conv: DepthwiseConv, op: str) -> Space:
        oh, ow = conv.out_hw
        pad = ("tile", "inline") if has_pad(conv, op) else ("none",)
        if op == "wgrad":
            return Space("cpu-wgrad", (
                Knob("lanes", divisors(ow, 16), "w positions summed as one vector of partial sums"),
                Knob("pad", ("row", "inline") if has_pad(conv, op) else ("none",),
                     "pad input rows in a buffer or on the fly"),
                Knob("unroll", (1, 0), "unroll the kernel taps"),
            ))
        h, w = (oh, ow) if op == "fwd" else (conv.h, conv.w)
        return Space(f"cpu-{op}", (
            Knob("tile_h", tuple(t for t in _TILE_H if h % t == 0) or (1,), "output rows per task"),
            Knob("tile_w", divisors(w, 32), "vectorised output columns"),
            Knob("pad", pad, "padded input per task (tile) or computed on the fly (inline)"),
            Knob("cache", (1, 0), "accumulate the tile in registers"),
            Knob("unroll", (1, 0), "unroll the kernel taps"),
        ))

    def validate(self, conv: DepthwiseConv, op: str, config: Config) -> None:
        """Over 512 accumulators in a tile spill registers."""
        self.space(conv, op).check(config)
        if op != "wgrad" and config["tile_h"] * config["tile_w"] > 512:
            raise InvalidConfig(f"tile {config['tile_h']}x{config['tile_w']} is over 512 accumulators: registers spill")

    def apply(self, sch: s_tir.Schedule, conv: DepthwiseConv, op: str, config: Config) -> s_tir.Schedule:
        self.validate(conv, op, config)
        if op == "wgrad":
            _wgrad(sch, conv, config)
        else:
            _conv_like(sch, op, config, pad_name="pad" if op == "fwd" else "dy_pad", has_pad=has_pad(conv, op))
        return sch

    def features(self, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
        """Tile area, vector width, tasks, padded work."""
        oh, ow = conv.out_hw
        if op == "wgrad":
            return [math.log2(config["lanes"]), float(conv.out_channels), float(conv.kernel[0] * conv.kernel[1])]
        h = oh if op == "fwd" else conv.h
        tasks = conv.n * (conv.out_channels if op == "fwd" else conv.c) * (h // config["tile_h"])
        area = config["tile_h"] * config["tile_w"]
        halo = (config["tile_h"] + conv.kernel[0] - 1) / config["tile_h"]
        return [math.log2(area), math.log2(tasks), float(config["tile_w"] % 8 == 0), halo]


TEMPLATE = register("llvm", "NCHW", CpuTemplate())


def _conv_like(sch: s_tir.Schedule, op: str, cfg: Config, pad_name: str, has_pad: bool) -> None:
    out = sch.get_sblock("y" if op == "fwd" else "dx")
    n, c, i, j, *taps = sch.get_loops(out)
    io, ii = sch.split(i, [None, cfg["tile_h"]])
    jo, ji = sch.split(j, [None, cfg["tile_w"]])
    sch.reorder(n, c, io, jo, *taps, ii, ji)
    if cfg["cache"]:
        local = sch.cache_write(out, 0, "local")
        sch.reverse_compute_at(local, jo)
    task = sch.fuse(n, c, io)
    sch.parallel(task)
    if has_pad:
        pad = sch.get_sblock(pad_name)
        if cfg["pad"] == "inline":
            sch.compute_inline(pad)
        else:
            sch.compute_at(pad, task)
    if cfg["unroll"]:
        for t in taps:
            sch.unroll(t)
    sch.vectorize(ji)
    if cfg["cache"]:
        loops = sch.get_loops(local)
        if len(loops) > 2:  # below (task, w_outer); a 1x1 tile has no loop of its own
            sch.vectorize(loops[-1])
    sch.decompose_reduction(out, taps[0])


def _wgrad(sch: s_tir.Schedule, conv: DepthwiseConv, cfg: Config) -> None:
    out = sch.get_sblock("dw")
    o, _z, r, s, n, i, j = sch.get_loops(out)
    jo, ji = sch.split(j, [None, cfg["lanes"]])
    rf = sch.rfactor(ji, factor_axis=4)  # partial sums dw_rf[o, 0, r, s, lane]
    o2, _z2, r2, s2, n2, i2, jo2, lane = sch.get_loops(rf)
    sch.reorder(o2, n2, i2, jo2, r2, s2, lane)
    sch.parallel(o2)
    if conv.padding != (0, 0):
        pad = sch.get_sblock("pad")
        if cfg["pad"] == "inline":
            sch.compute_inline(pad)
        else:
            sch.compute_at(pad, i2)
    if cfg["unroll"]:
        sch.unroll(r2)
        sch.unroll(s2)
    sch.vectorize(lane)
    sch.decompose_reduction(rf, n2)
    # the final sum of the lanes: one small loop per channel
    fo = sch.get_loops(out)[0]
    sch.parallel(fo)

