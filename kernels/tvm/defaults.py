"""A reasonable config of a GPU template for a problem, without measuring: what runs before any tuning has.

The build-here, measure-there loop needs something to measure in its first
round, and a GPU benchmark shipped without a tuning run needs kernels that
are not absurd. :func:`default_config` picks from rules that hold for any
CUDA GPU (the reasons are beside each rule); the first of its preferences
that the template accepts (scheduled, so that what TVM allocates is
checked too) wins, and when none does, the first valid config of a seeded
random sample of the space does, so every problem gets a
config and the same one every time.

Rules:

- NCHW, small planes (at most 32x32 outputs): the flat mapping with enough
  planes per block for 128-256 threads, so a block is not a few dozen
  threads on one 7x7 plane;
- NCHW, larger planes: a block tile that divides the plane (a tile that
  does not makes TVM stage the whole padded plane per block), up to 16 rows
  (8 threads x 2) by 32 columns (2 virtual threads x 16 threads), with
  enough planes per block for 64 threads;
- NHWC: the widest vector load the channels allow (16 bytes), channel
  groups up to 32 threads along channels that divide them, and a pixel tile
  that divides the plane where it can;
- grad-weight: 256 threads per channel (block) and enough splits of the
  (n, h, w) sum that there are at least two blocks per SM of an H100.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterator

from .builder import schedule
from .cuda import small_plane
from .cuda_common import SPLITS, vector_widths
from .cuda_nhwc import SPLITS as NHWC_SPLITS
from .ops import DepthwiseConv
from .space import Config, InvalidConfig
from .target import make_target
from .template import get_template

__all__ = ["default_config", "preferences", "MIN_BLOCKS"]

MIN_BLOCKS = 2 * 132  # two blocks per SM of an H100 SXM: fewer leaves SMs idle


def _splits(blocks_per_split: int, choices: tuple[int, ...] = SPLITS) -> Iterator[int]:
    """Splits of grad-weight's sum, fewest first that reach :data:`MIN_BLOCKS` (then fewer, if it must)."""
    enough = [s for s in choices if blocks_per_split * s >= MIN_BLOCKS]
    first = enough[0] if enough else choices[-1]
    yield first
    yield from (s for s in reversed(choices) if s < first)


def _pow2(n: int, limit: int) -> int:
    """The largest power of two dividing ``n``, at most ``limit``: a tile that divides the axis."""
    return min(n & -n, limit)


def _nchw(conv: DepthwiseConv, op: str) -> Iterator[Config]:
    if op == "wgrad":
        for threads in (256, 128, 64):
            for splits in _splits(conv.out_channels):
                yield {"threads": threads, "unroll": 16, "splits": splits}
        return
    planes = conv.c if op == "dgrad" else conv.out_channels
    h, w = conv.out_hw if op == "fwd" else (conv.h, conv.w)
    tiling = {"vt_h": 1, "vt_w": 1, "th": 1, "ih": 1, "iw": 1}
    if small_plane(conv, op):
        for tile_c in (16, 8, 32, 4, 2, 1):
            if tile_c <= planes:
                for tw in (16, 32, 8, 4):
                    yield {"tile_c": tile_c, **tiling, "tw": tw, "unroll": 16, "flat": 1}
    bh, bw = _pow2(h, 16), _pow2(w, 32)  # tiles that divide the plane (else TVM stages all of it per block)
    th, ih = (bh // 2, 2) if bh >= 16 else (bh, 1)
    vt_w, tw = (2, bw // 2) if bw >= 32 else (1, max(bw, 4))
    for tile_c in (1, 2, 4, 8, 16, 32):
        if th * tw * tile_c >= 64 and tile_c <= planes:
            yield {"tile_c": tile_c, "vt_h": 1, "vt_w": vt_w, "th": th, "tw": tw, "ih": ih, "iw": 1, "unroll": 16}
    base = {"tile_c": 1, "vt_h": 1, "vt_w": 2, "th": 8, "tw": 16, "ih": 2, "iw": 1, "unroll": 16}
    yield base
    yield {**base, "vt_w": 1, "tw": 8, "th": 4}


def _nhwc(conv: DepthwiseConv, op: str) -> Iterator[Config]:
    if op == "wgrad":  # the widest channel block whose splits still give MIN_BLOCKS blocks
        widths = sorted((32, 16, 8, 64), key=lambda t: -(-conv.out_channels // t) * NHWC_SPLITS[-1] < MIN_BLOCKS)
        for tc in widths:
            blocks = -(-conv.out_channels // tc)
            for ty in (8, 4, 16):
                for splits in _splits(blocks, NHWC_SPLITS):
                    yield {"layout": "NHWC", "tc": tc, "ty": ty, "splits": splits, "unroll": 16}
        return
    h, w, channels = (*conv.out_hw, conv.out_channels) if op == "fwd" else (conv.h, conv.w, conv.c)
    bh, bw = _pow2(h, 4), _pow2(w, 8)  # pixel tiles that divide the plane, where the plane allows
    for vec in reversed(vector_widths(channels, conv.dtype)):
        bc = _pow2(channels, 32 * vec)
        tiles = [(bh, bw)] + [(th, tw * iw) for th, tw, iw in ((2, 4, 2), (4, 4, 2), (1, 4, 2), (2, 2, 1))]
        for tc in (t for t in (32, 16, 8, 4, 2, 1) if t * vec <= bc):
            for th, width in tiles:
                iw = 2 if width >= 2 else 1
                yield {"layout": "NHWC", "vec": vec, "tc": tc, "tw": max(width // iw, 1), "th": th, "vt_w": 1,
                       "ih": 1, "iw": iw, "unroll": 16}


def preferences(conv: DepthwiseConv, op: str, layout: str) -> Iterator[Config]:
    """The rules' configs for ``op`` on ``conv``, best first (not all of them valid for every problem)."""
    return _nhwc(conv, op) if layout == "NHWC" else _nchw(conv, op)


def _fits(conv: DepthwiseConv, op: str, config: Config) -> bool:
    """Whether ``config`` passes the template's checks, those after scheduling too (shared memory as TVM sizes
    it), so a default never fails to compile."""
    try:
        schedule(conv, op, config, make_target("cuda", "sm_90"))
        return True
    except InvalidConfig:
        return False


def default_config(conv: DepthwiseConv, op: str, layout: str = "NCHW", seed: int = 0, tries: int = 5000) -> Config:
    """The first of :func:`preferences` the CUDA template accepts, else the first valid config of a seeded walk."""
    template = get_template("cuda", layout)
    space = template.space(conv, op)
    candidates = itertools.chain((space.complete(c) for c in preferences(conv, op, layout)),
                                 (space.sample(random.Random(seed * 1_000_003 + i)) for i in range(tries)))
    for config in candidates:
        try:
            template.validate(conv, op, config)
        except InvalidConfig:
            continue
        if _fits(conv, op, config):
            return config
    raise InvalidConfig(f"no valid {layout} {op} config found for {conv} in {tries} samples of its space")
