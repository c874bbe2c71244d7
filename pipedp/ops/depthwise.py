"""``pipedp.ops.depthwise_conv2d``: a torch custom op backed by tuned TVM kernels.

Three ops (forward, grad-input, grad-weight) are registered with
``torch.library``, each with a fake implementation so ``torch.compile`` can
trace through them; autograd of the forward calls the two gradient ops. Each
runs the tuned kernel of its layer (whatever the batch size: a kernel tuned
at one serves all) when the caller's
:class:`~pipedp.ops.runtime.KernelChoice` names a library that has one and
torch's own convolution otherwise, so results never depend on what was
tuned, only speed does. The choice travels with every call (the ops take the
library's key and policy as arguments): nothing process-wide decides it.
Tensors go to the kernel directly (zero copy; on CUDA the kernel runs on
torch's current stream). The input's memory format
picks the kernel: a contiguous input runs the NCHW kernel, a channels_last
one the NHWC kernel (on CPU, where that layout is the fast one), and the
output and gradients keep that format.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import threads
from .layout import aligned, arrange, empty, layout_of_tensor
from .problem import DepthwiseConv
from .runtime import KernelChoice, KernelLibrary, library, library_or_none

__all__ = ["depthwise_conv2d", "problem_of"]

log = logging.getLogger(__name__)


def problem_of(x_shape: Sequence[int], w_shape: Sequence[int], stride, padding, dilation, dtype: torch.dtype) -> DepthwiseConv:
    n, c, h, w = (int(v) for v in x_shape)
    return DepthwiseConv(
        n, c, h, w, multiplier=int(w_shape[0]) // c, kernel=(int(w_shape[2]), int(w_shape[3])),
        stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation),
        dtype=str(dtype).replace("torch.", ""),
    )


def _kernel(op: str, device: torch.device, x_shape, w_shape, stride, padding, dilation, dtype: torch.dtype,
            layout: str, lib_key: str, faster_only: bool):
    """The tuned kernel for this layer and activation layout at this batch size, or None (then torch computes it).

    The answer is remembered per call signature on the library (building the
    record key costs about as much as launching a small kernel).
    """
    if not lib_key:
        return None
    lib = library_or_none(lib_key) if faster_only else library(lib_key)
    if lib is None:
        return None
    key = (op, tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding), tuple(dilation), dtype, layout,
           faster_only)
    found = lib.lookups.get(key, _MISSING)
    if found is _MISSING:
        found = lib.lookups[key] = _find(lib, op, device, x_shape, w_shape, stride, padding, dilation, dtype, layout,
                                         faster_only)
    if found is not None and device.type == "cpu" and not lib.torch_team:
        threads.match_torch()  # TVM's own pool: as wide as torch's, as when it was tuned
    return found


_MISSING = object()


def _find(lib: KernelLibrary, op: str, device: torch.device, x_shape, w_shape, stride, padding, dilation,
          dtype: torch.dtype, layout: str, faster_only: bool):
    try:
        p = problem_of(x_shape, w_shape, stride, padding, dilation, dtype)
    except ValueError:  # a dtype or kernel size the kernels do not cover
        return None
    k = lib.find(op, p, layout, faster_only)
    if k is None:
        log.debug("no tuned %s %s kernel for %s on %s: torch runs it", layout, op, p, device)
    return k


def _out_shape(x_shape, w_shape, stride, padding, dilation) -> list[int]:
    n, _, h, w = x_shape
    kh, kw = w_shape[2], w_shape[3]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return [n, w_shape[0], oh, ow]


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], lib: str, faster_only: bool) -> torch.Tensor:
    layout = layout_of_tensor(x)
    k = _kernel("fwd", x.device, x.shape, weight.shape, stride, padding, dilation, x.dtype, layout, lib, faster_only)
    if k is None:
        return F.conv2d(x, weight, None, stride, padding, dilation, x.shape[1])
    y = empty(_out_shape(x.shape, weight.shape, stride, padding, dilation), x, layout)
    k(aligned(arrange(x, layout)), aligned(weight.contiguous()), arrange(y, layout))
    return y


_fwd = torch.library.custom_op("pipedp::depthwise_fwd", _fwd_impl, mutates_args=())


@_fwd.register_fake
def _(x, weight, stride, padding, dilation, lib, faster_only):
    return empty(_out_shape(x.shape, weight.shape, stride, padding, dilation), x, layout_of_tensor(x))


# The gradient ops take the forward input's layout: gradients are stored like the tensors they belong to.

def _dgrad_impl(grad: torch.Tensor, weight: torch.Tensor, x_shape: list[int], stride: list[int], padding: list[int],
                dilation: list[int], layout: str, lib: str, faster_only: bool) -> torch.Tensor:
    k = _kernel("dgrad", grad.device, x_shape, weight.shape, stride, padding, dilation, grad.dtype, layout, lib,
                faster_only)
    if k is None:
        x = empty(x_shape, grad, layout)
        return torch.ops.aten.convolution_backward(
            grad, x, weight, None, stride, padding, dilation, False, [0, 0], x_shape[1], [True, False, False]
        )[0]
    dx = empty(x_shape, grad, layout)
    k(aligned(arrange(grad, layout)), aligned(weight.contiguous()), arrange(dx, layout))
    return dx


_dgrad = torch.library.custom_op("pipedp::depthwise_dgrad", _dgrad_impl, mutates_args=())


@_dgrad.register_fake
def _(grad, weight, x_shape, stride, padding, dilation, layout, lib, faster_only):
    return empty(x_shape, grad, layout)


def _wgrad_impl(x: torch.Tensor, grad: torch.Tensor, w_shape: list[int], stride: list[int], padding: list[int],
                dilation: list[int], layout: str, lib: str, faster_only: bool) -> torch.Tensor:
    k = _kernel("wgrad", x.device, x.shape, w_shape, stride, padding, dilation, x.dtype, layout, lib, faster_only)
    if k is None:
        w = x.new_empty(w_shape)
        return torch.ops.aten.convolution_backward(
            grad, x, w, None, stride, padding, dilation, False, [0, 0], x.shape[1], [False, True, False]
        )[1]
    dw = x.new_empty(w_shape)
    k(aligned(arrange(x, layout)), aligned(arrange(grad, layout)), dw)
    return dw


_wgrad = torch.library.custom_op("pipedp::depthwise_wgrad", _wgrad_impl, mutates_args=())


@_wgrad.register_fake
def _(x, grad, w_shape, stride, padding, dilation, layout, lib, faster_only):
    return x.new_empty(w_shape)


def _setup(ctx, inputs, output):
    x, weight, stride, padding, dilation, lib, faster_only = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (stride, padding, dilation, layout_of_tensor(x), lib, faster_only)


def _grads(ctx, grad, dgrad, wgrad):
    x, weight = ctx.saved_tensors
    stride, padding, dilation, layout, lib, faster_only = ctx.args
    conv = (stride, padding, dilation, layout, lib, faster_only)
    dx = dgrad(grad, weight, list(x.shape), *conv) if ctx.needs_input_grad[0] else None
    dw = wgrad(x, grad, list(weight.shape), *conv) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None, None, None


def _backward(ctx, grad):
    return _grads(ctx, grad, _dgrad, _wgrad)


_fwd.register_autograd(_backward, setup_context=_setup)


class _Eager(torch.autograd.Function):
    """The same op in eager mode without the dispatcher's round trips (a sizeable share of a small kernel's
    time); torch.compile, fake tensors and tensor subclasses take the registered custom op."""

    @staticmethod
    def forward(ctx, x, weight, stride, padding, dilation, lib, faster_only):
        _setup(ctx, (x, weight, stride, padding, dilation, lib, faster_only), None)
        return _fwd_impl(x, weight, stride, padding, dilation, lib, faster_only)

    @staticmethod
    def backward(ctx, grad):
        return _grads(ctx, grad, _dgrad_impl, _wgrad_impl)


def _plain(*tensors: torch.Tensor) -> bool:
    return all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


def _pair(v: int | Sequence[int], name: str) -> list[int]:
    t = [v, v] if isinstance(v, int) else list(v)
    if len(t) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return [int(a) for a in t]


def depthwise_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    kernels: KernelChoice | None = None,
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups=x.shape[1])``, with tuned kernels.

    ``weight`` has shape ``(multiplier * C, 1, kh, kw)``. ``kernels`` names the
    library and policy (None: torch computes everything).
    """
    if x.dim() != 4 or weight.dim() != 4 or weight.shape[1] != 1 or weight.shape[0] % x.shape[1]:
        raise ValueError(
            f"depthwise_conv2d takes x (N, C, H, W) and weight (M*C, 1, kh, kw); got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    args = (_pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"),
            kernels.library if kernels is not None else "", bool(kernels and kernels.faster_only))
    eager = not torch.compiler.is_compiling() and _plain(x, weight)
    y = _Eager.apply(x, weight, *args) if eager else _fwd(x, weight, *args)
    if bias is not None:
        y = y + bias.view(1, -1, 1, 1)
    return y
