"""The three depthwise operators as TVM tensor expressions on NHWC activations.

Same mathematics as :mod:`.ops` (see there), with activations stored
(n, h, w, c) so the channel axis is contiguous and a CPU vector covers
neighbouring channels: the padding conditions then depend on (h, w) only and
cost one scalar test per vector, not per element. Weights stay in torch's
(out_channels, 1, kh, kw) layout (zero copy); a small ``wT`` stage
transposes them to (kh, kw, out_channels) inside the kernel so that a vector
of weights is one load. Grad-weight reduces into ``dwT`` (kh, kw, o) and
writes torch's layout at the end.
"""

from __future__ import annotations

from typing import Any

from tvm import te, tirx

from .problem import DepthwiseConv

__all__ = ["forward", "grad_input", "grad_weight", "activation_shape"]


def activation_shape(nchw: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = nchw
    return (n, h, w, c)


def _zero(dtype: str) -> Any:
    return tirx.const(0.0, dtype)


def _weight_t(conv: DepthwiseConv, w: te.Tensor) -> te.Tensor:
    kh, kw = conv.kernel
    return te.compute((kh, kw, conv.out_channels), lambda r, q, o: w[o, 0, r, q], name="wT")


def _padded(conv: DepthwiseConv, x: te.Tensor) -> te.Tensor:
    (ph, pw), (h, w) = conv.padding, (conv.h, conv.w)
    if ph == 0 and pw == 0:
        return x
    return te.compute(
        (conv.n, h + 2 * ph, w + 2 * pw, conv.c),
        lambda n, i, j, c: tirx.if_then_else(
            tirx.all(i >= ph, i < h + ph, j >= pw, j < w + pw), x[n, i - ph, j - pw, c], _zero(conv.dtype)
        ),
        name="pad",
    )


def forward(conv: DepthwiseConv) -> list[te.Tensor]:
    s = conv.shapes()
    x = te.placeholder(activation_shape(s["x"]), conv.dtype, name="x")
    w = te.placeholder(s["w"], conv.dtype, name="w")
    pad, wt = _padded(conv, x), _weight_t(conv, w)
    (kh, kw), (sh, sw), (dh, dw), m = conv.kernel, conv.stride, conv.dilation, conv.multiplier
    r = te.reduce_axis((0, kh), name="r")
    q = te.reduce_axis((0, kw), name="s")
    y = te.compute(
        activation_shape(s["y"]),
        lambda n, i, j, o: te.sum(pad[n, i * sh + r * dh, j * sw + q * dw, o // m] * wt[r, q, o], axis=[r, q]),
        name="y",
    )
    return [x, w, y]


def grad_input(conv: DepthwiseConv) -> list[te.Tensor]:
    s = conv.shapes()
    dy = te.placeholder(activation_shape(s["y"]), conv.dtype, name="dy")
    w = te.placeholder(s["w"], conv.dtype, name="w")
    wt = _weight_t(conv, w)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), m = conv.kernel, conv.stride, conv.padding, conv.dilation, conv.multiplier
    oh, ow = conv.out_hw
    top, left = (kh - 1) * dh - ph, (kw - 1) * dw - pw

    def dy_at(n: Any, u: Any, v: Any, o: Any) -> Any:
        a, b = u - top, v - left
        inside = tirx.all(a >= 0, b >= 0, a % sh == 0, b % sw == 0, a // sh < oh, b // sw < ow)
        return tirx.if_then_else(inside, dy[n, a // sh, b // sw, o], _zero(conv.dtype))

    dy_pad = te.compute(
        (conv.n, conv.h + (kh - 1) * dh, conv.w + (kw - 1) * dw, conv.out_channels), dy_at, name="dy_pad"
    )
    mm = te.reduce_axis((0, m), name="m")
    r = te.reduce_axis((0, kh), name="r")
    q = te.reduce_axis((0, kw), name="s")
    dx = te.compute(
        activation_shape(s["x"]),
        lambda n, i, j, c: te.sum(
            dy_pad[n, i + r * dh, j + q * dw, c * m + mm] * wt[kh - 1 - r, kw - 1 - q, c * m + mm], axis=[mm, r, q]
        ),
        name="dx",
    )
    return [dy, w, dx]


def grad_weight(conv: DepthwiseConv) -> list[te.Tensor]:
    s = conv.shapes()
    x = te.placeholder(activation_shape(s["x"]), conv.dtype, name="x")
    dy = te.placeholder(activation_shape(s["y"]), conv.dtype, name="dy")
    pad = _padded(conv, x)
    (kh, kw), (sh, sw), (dh, dw), m = conv.kernel, conv.stride, conv.dilation, conv.multiplier
    oh, ow = conv.out_hw
    rn = te.reduce_axis((0, conv.n), name="n")
    ri = te.reduce_axis((0, oh), name="i")
    rj = te.reduce_axis((0, ow), name="j")
    acc = "float32"
    dwt = te.compute(
        (kh, kw, conv.out_channels),
        lambda r, q, o: te.sum(
            dy[rn, ri, rj, o].astype(acc) * pad[rn, ri * sh + r * dh, rj * sw + q * dw, o // m].astype(acc),
            axis=[rn, ri, rj],
        ),
        name="dwT",
    )
    dw_ = te.compute(s["w"], lambda o, _, r, q: dwt[r, q, o].astype(conv.dtype), name="dw")
    return [x, dy, dw_]
