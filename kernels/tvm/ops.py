"""Depthwise convolution and its two gradients as TVM tensor expressions (NCHW).

A depthwise convolution has ``groups == in_channels`` and ``out_channels =
multiplier * in_channels``: output channel ``o`` reads input channel
``o // multiplier`` only. Stride, padding and dilation are per axis; kernels
need not be square. The three operators:

- forward:     y[n, o, i, j]  = sum_{r, s} x[n, o // M, i*sh + r*dh - ph, j*sw + s*dw - pw] * w[o, 0, r, s]
- grad-input:  dx[n, c, i, j] = sum_{m, r, s} dy[n, c*M + m, (i + ph - r*dh) / sh, ...] * w[c*M + m, 0, r, s]
               (only where the division is exact and in range: the strided
               output is "dilated" with zeros, padded, and correlated with the
               flipped kernel)
- grad-weight: dw[o, 0, r, s] = sum_{n, i, j} dy[n, o, i, j] * x[n, o // M, i*sh + r*dh - ph, ...]

Padding is its own stage (``pad`` / ``dy_pad``) so a schedule can inline it
or compute it per plane; the reductions are named ``r``, ``s`` (and ``m``,
``n``, ``i``, ``j``) so schedules can address them.

Every reduction accumulates in fp32 (:data:`ACC`): fp16/bf16 products are
exact in fp32 and summed there, and the result is rounded to the problem's
dtype once, in a ``<output>_cast`` stage (``y_cast``, ``dx_cast``,
``dw_cast``) that exists only for fp16/bf16, so fp32 kernels have the same
stages as before. Summed in bf16, a 3x3 tap sum would lose about three bits
and a grad-weight over a batch all of them.

The batch extent can be symbolic (``compute(..., batch=batch_var())``): the
kernel then takes any n, read from its tensors' shapes at each call, so one
kernel tuned for a layer serves every batch and microbatch size. Everything
else stays a constant, so the loops within a sample compile as they would
for a fixed batch.
"""

from __future__ import annotations

from typing import Any

from tvm import te, tirx

from pipedp.ops.layout import LAYOUTS
from pipedp.ops.problem import OPS, DepthwiseConv

__all__ = ["DepthwiseConv", "OPS", "LAYOUTS", "ACC", "compute", "batch_var", "Batch", "rounded"]

Batch = Any  # the batch extent: the problem's n, or a symbolic ``tirx.Var``
ACC = "float32"  # what every reduction accumulates in, whatever the problem's dtype


def rounded(conv: DepthwiseConv, acc: te.Tensor, name: str) -> te.Tensor:
    """``acc`` (fp32) rounded to the problem's dtype in a ``name`` stage; ``acc`` itself for an fp32 problem."""
    if conv.dtype == ACC:
        return acc
    return te.compute(acc.shape, lambda *i: acc(*i).astype(conv.dtype), name=name)


def _zero(dtype: str) -> Any:
    return tirx.const(0.0, dtype)


def batch_var() -> tirx.Var:
    """A symbolic batch extent (int32: the index arithmetic stays 32-bit, as for a fixed batch that fits)."""
    return te.var("n", "int32")


def _shape(batch: Batch, nchw: tuple[int, ...]) -> tuple[Any, ...]:
    return (batch, *nchw[1:])


def _padded_input(conv: DepthwiseConv, x: te.Tensor, batch: Batch) -> te.Tensor:
    (ph, pw), (h, w) = conv.padding, (conv.h, conv.w)
    if ph == 0 and pw == 0:
        return x
    return te.compute(
        (batch, conv.c, h + 2 * ph, w + 2 * pw),
        lambda n, c, i, j: tirx.if_then_else(
            tirx.all(i >= ph, i < h + ph, j >= pw, j < w + pw), x[n, c, i - ph, j - pw], _zero(conv.dtype)
        ),
        name="pad",
    )


def forward(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    s = conv.shapes()
    x = te.placeholder(_shape(batch, s["x"]), conv.dtype, name="x")
    w = te.placeholder(s["w"], conv.dtype, name="w")
    pad = _padded_input(conv, x, batch)
    (kh, kw), (sh, sw), (dh, dw), m = conv.kernel, conv.stride, conv.dilation, conv.multiplier
    r = te.reduce_axis((0, kh), name="r")
    q = te.reduce_axis((0, kw), name="s")
    y = te.compute(
        _shape(batch, s["y"]),
        lambda n, o, i, j: te.sum(
            pad[n, o // m, i * sh + r * dh, j * sw + q * dw].astype(ACC) * w[o, 0, r, q].astype(ACC), axis=[r, q]
        ),
        name="y",
    )
    return [x, w, rounded(conv, y, "y_cast")]


def grad_input(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    s = conv.shapes()
    dy = te.placeholder(_shape(batch, s["y"]), conv.dtype, name="dy")
    w = te.placeholder(s["w"], conv.dtype, name="w")
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), m = conv.kernel, conv.stride, conv.padding, conv.dilation, conv.multiplier
    oh, ow = conv.out_hw
    top, left = (kh - 1) * dh - ph, (kw - 1) * dw - pw  # may be negative: the bounds check covers it

    def dy_at(n: Any, o: Any, u: Any, v: Any) -> Any:
        a, b = u - top, v - left
        inside = tirx.all(a >= 0, b >= 0, a % sh == 0, b % sw == 0, a // sh < oh, b // sw < ow)
        return tirx.if_then_else(inside, dy[n, o, a // sh, b // sw], _zero(conv.dtype))

    dy_pad = te.compute(
        (batch, conv.out_channels, conv.h + (kh - 1) * dh, conv.w + (kw - 1) * dw), dy_at, name="dy_pad"
    )
    mm = te.reduce_axis((0, m), name="m")
    r = te.reduce_axis((0, kh), name="r")
    q = te.reduce_axis((0, kw), name="s")
    dx = te.compute(
        _shape(batch, s["x"]),
        lambda n, c, i, j: te.sum(
            dy_pad[n, c * m + mm, i + r * dh, j + q * dw].astype(ACC)
            * w[c * m + mm, 0, kh - 1 - r, kw - 1 - q].astype(ACC), axis=[mm, r, q]
        ),
        name="dx",
    )
    return [dy, w, rounded(conv, dx, "dx_cast")]


def grad_weight(conv: DepthwiseConv, batch: Batch) -> list[te.Tensor]:
    s = conv.shapes()
    x = te.placeholder(_shape(batch, s["x"]), conv.dtype, name="x")
    dy = te.placeholder(_shape(batch, s["y"]), conv.dtype, name="dy")
    pad = _padded_input(conv, x, batch)
    (sh, sw), (dh, dw), m = conv.stride, conv.dilation, conv.multiplier
    oh, ow = conv.out_hw
    rn = te.reduce_axis((0, batch), name="n")
    ri = te.reduce_axis((0, oh), name="i")
    rj = te.reduce_axis((0, ow), name="j")
    dw_ = te.compute(
        s["w"],
        lambda o, _, r, q: te.sum(
            dy[rn, o, ri, rj].astype(ACC) * pad[rn, o // m, ri * sh + r * dh, rj * sw + q * dw].astype(ACC),
            axis=[rn, ri, rj],
        ),
        name="dw",
    )
    return [x, dy, rounded(conv, dw_, "dw_cast")]


def compute(conv: DepthwiseConv, op: str, layout: str = "NCHW", batch: Batch | None = None) -> list[te.Tensor]:
    """Placeholders and output of operator ``op`` ("fwd", "dgrad" or "wgrad"), in call order.

    ``layout`` is the activations' layout; weights are always torch's (o, 1, kh, kw).
    ``batch`` is the batch extent: ``conv.n`` when None, another int, or :func:`batch_var` for any.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    if op not in OPS:
        raise ValueError(f"unknown operator {op!r}: one of {OPS}")
    batch = conv.n if batch is None else batch
    if layout == "NHWC":
        from . import ops_nhwc

        return {"fwd": ops_nhwc.forward, "dgrad": ops_nhwc.grad_input, "wgrad": ops_nhwc.grad_weight}[op](conv, batch)
    return {"fwd": forward, "dgrad": grad_input, "wgrad": grad_weight}[op](conv, batch)
