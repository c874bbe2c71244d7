"""The three depthwise operators as TVM tensor expressions on NHWC activations.

Same mathematics as :mod:`.ops` (see there), with activations stored
(n, h, w, c) so the channel axis is contiguous and a CPU vector covers
neighbouring channels: the padding conditions then depend on (h, w) only and
cost one scalar test per vector, not per element. Weights stay in torch's
(out_channels, 1, kh, kw) layout (zero copy); a small ``wT`` stage
transposes them to (kh, kw, out_channels) inside the kernel so that a vector
of weights is one load. Grad-input visits only the taps that reach each
input pixel (polyphase for strides > 1, see :func:`_phases`). Grad-weight
reduces into ``dwT`` (kh, kw, o) and writes torch's layout at the end.
Each operator takes the batch extent (``conv.n`` or a symbolic variable, see
:func:`.ops.compute`).
"""

from __future__ import annotations

from typing import Any

from tvm import te, tirx

from pipedp.ops.problem import DepthwiseConv

from .ops import ACC, Batch, rounded

__all__ = ["forward", "grad_input", "grad_weight", "activation_shape"]


def activation_shape(nchw: tuple[Any, ...]) -> tuple[Any, ...]:
    n, c, h, w = nchw
    return (n, h, w, c)


def _act(batch: Batch, nchw: tuple[int, ...]) -> tuple[Any, ...]:
    """An activation's NHWC shape with ``batch`` samples."""
    return activation_shape((batch, *nchw[1:]))


def _zero(dtype: str) -> Any:
    return tirx.const(0.0, dtype)


def _weight_t(conv: DepthwiseConv, w: te.Tensor) -> te.Tensor:
    kh, kw = conv.kernel
    return te.compute((kh, kw, conv.out_channels), lambda r, q, o: w[o, 0, r, q], name="wT")


def _padded(conv: DepthwiseConv, x: te.Tensor, batch: Batch) -> te.Tensor:
    (ph, pw), (h, w) = conv.padding, (conv.h, conv.w)
    if ph == 0 and pw == 0:
        return x
    return te.compute(
        (batch, h + 2 * ph, w + 2 * pw, conv.c),
        lambda n, i, j, c: tirx.if_then_else(
            tirx.all(i >= ph, i < h + ph, j >= pw, j < w + pw), x[n, i - ph, j - pw, c], _zero(conv.dtype)
        ),
        name="pad",
    )


def forward(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    s = conv.shapes()
    x = te.placeholder(_act(batch, s["x"]), conv.dtype, name="x")
    w = te.placeholder(s["w"], conv.dtype, name="w")
    pad, wt = _padded(conv, x, batch), _weight_t(conv, w)
    (kh, kw), (sh, sw), (dh, dw), m = conv.kernel, conv.stride, conv.dilation, conv.multiplier
    r = te.reduce_axis((0, kh), name="r")
    q = te.reduce_axis((0, kw), name="s")
    y = te.compute(
        _act(batch, s["y"]),
        lambda n, i, j, o: te.sum(
            pad[n, i * sh + r * dh, j * sw + q * dw, o // m].astype(ACC) * wt[r, q, o].astype(ACC), axis=[r, q]
        ),
        name="y",
    )
    return [x, w, rounded(conv, y, "y_cast")]


def _phases(k: int, s: int, p: int, d: int, size: int, out: int) -> tuple[int, Any, Any, int, int]:
    """One spatial axis of grad-input: taps per output, tap(i, t), dy index(i, t), and dy's padding.

    x[i] receives dy[o] * w[r] wherever i = o*s - p + r*d. With stride 1 every
    tap r = t is live: o = i + p - t*d. With stride s > 1 (dilation 1) only
    the taps r = (i + p) mod s + t*s are (polyphase), ceil(k/s) of them per
    output instead of k mostly-zero ones: o = (i + p) // s - t.
    """
    if s == 1:
        taps, tap, row = k, (lambda i, t: t), (lambda i, t: i + p - t * d)
        low, high = p - (k - 1) * d, size - 1 + p
    else:
        taps = -(-k // s)
        tap, row = (lambda i, t: (i + p) % s + t * s), (lambda i, t: (i + p) // s - t)
        low, high = p // s - (taps - 1), (size - 1 + p) // s
    return taps, tap, row, max(0, -low), max(0, high - (out - 1))


def grad_input(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), m = conv.kernel, conv.stride, conv.padding, conv.dilation, conv.multiplier
    if (sh > 1 and dh > 1) or (sw > 1 and dw > 1):
        return _grad_input_dilated(conv, batch)
    s = conv.shapes()
    dy = te.placeholder(_act(batch, s["y"]), conv.dtype, name="dy")
    w = te.placeholder(s["w"], conv.dtype, name="w")
    wt = _weight_t(conv, w)
    oh, ow = conv.out_hw
    th, tap_h, row_h, top, bottom = _phases(kh, sh, ph, dh, conv.h, oh)
    tw, tap_w, row_w, left, right = _phases(kw, sw, pw, dw, conv.w, ow)

    def dy_at(n: Any, a: Any, b: Any, o: Any) -> Any:
        inside = tirx.all(a >= top, a < top + oh, b >= left, b < left + ow)
        return tirx.if_then_else(inside, dy[n, a - top, b - left, o], _zero(conv.dtype))

    dy_pad = te.compute((batch, oh + top + bottom, ow + left + right, conv.out_channels), dy_at, name="dy_pad")
    mm = te.reduce_axis((0, m), name="m")
    t = te.reduce_axis((0, th), name="r")
    u = te.reduce_axis((0, tw), name="s")

    def body(n: Any, i: Any, j: Any, c: Any) -> Any:
        r, q = tap_h(i, t), tap_w(j, u)
        o = c * m + mm
        term = (dy_pad[n, row_h(i, t) + top, row_w(j, u) + left, o].astype(ACC)
                * wt[tirx.min(r, kh - 1), tirx.min(q, kw - 1), o].astype(ACC))
        live = [cond for cond, stride, k in ((r < kh, sh, kh), (q < kw, sw, kw)) if stride > 1 and k % stride]
        return tirx.if_then_else(tirx.all(*live), term, _zero(ACC)) if live else term

    dx = te.compute(_act(batch, s["x"]), lambda n, i, j, c: te.sum(body(n, i, j, c), axis=[mm, t, u]), name="dx")
    return [dy, w, rounded(conv, dx, "dx_cast")]


def _grad_input_dilated(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    """Stride and dilation on one axis: every tap over the zero-dilated gradient (rare in CNNs)."""
    s = conv.shapes()
    dy = te.placeholder(_act(batch, s["y"]), conv.dtype, name="dy")
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
        (batch, conv.h + (kh - 1) * dh, conv.w + (kw - 1) * dw, conv.out_channels), dy_at, name="dy_pad"
    )
    mm = te.reduce_axis((0, m), name="m")
    r = te.reduce_axis((0, kh), name="r")
    q = te.reduce_axis((0, kw), name="s")
    dx = te.compute(
        _act(batch, s["x"]),
        lambda n, i, j, c: te.sum(
            dy_pad[n, i + r * dh, j + q * dw, c * m + mm].astype(ACC)
            * wt[kh - 1 - r, kw - 1 - q, c * m + mm].astype(ACC), axis=[mm, r, q],
        ),
        name="dx",
    )
    return [dy, w, rounded(conv, dx, "dx_cast")]


def grad_weight(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    s = conv.shapes()
    x = te.placeholder(_act(batch, s["x"]), conv.dtype, name="x")
    dy = te.placeholder(_act(batch, s["y"]), conv.dtype, name="dy")
    pad = _padded(conv, x, batch)
    (kh, kw), (sh, sw), (dh, dw), m = conv.kernel, conv.stride, conv.dilation, conv.multiplier
    oh, ow = conv.out_hw
    rn = te.reduce_axis((0, batch), name="n")
    ri = te.reduce_axis((0, oh), name="i")
    rj = te.reduce_axis((0, ow), name="j")
    dwt = te.compute(
        (kh, kw, conv.out_channels),
        lambda r, q, o: te.sum(
            dy[rn, ri, rj, o].astype(ACC) * pad[rn, ri * sh + r * dh, rj * sw + q * dw, o // m].astype(ACC),
            axis=[rn, ri, rj],
        ),
        name="dwT",
    )
    dw_ = te.compute(s["w"], lambda o, _, r, q: dwt[r, q, o].astype(conv.dtype), name="dw")
    return [x, dy, dw_]
