"""Weight gradients held back from a backward, for a W action to compute later.

A zero-bubble schedule splits a stage's backward into I (the input gradient,
which the previous stage waits for) and W (the weight gradients, which only
the optimizer waits for). The forward of a microbatch whose backward is split
runs under :class:`Deferred`: each 2-D convolution and linear layer whose
weight trains goes through a node whose backward makes only the input
gradient and leaves a closure, with the output gradient and the saved input,
in the microbatch's list; W runs those closures. Everything else (BatchNorm,
other layers, parameters used outside these two ops) keeps its weight
gradient in I, as a whole backward would.

No module changes: the interception is a ``TorchFunctionMode`` around the
forward, so the model is the user's, and a forward outside it (inference, a
whole B) is plain. The kernels are torch's own (``aten.convolution_backward``
with one output each, ``mm``), and accumulation is what ``AccumulateGrad``
does, so a split step equals a whole one up to the order of additions.
Hooks registered with ``register_post_accumulate_grad_hook`` are not called
for the held-back parameters; the gradient sync is told through
``notify``. Under autocast the held node casts input, weight and bias to
the autocast dtype as autocast would, and casts the gradients back to each
one's dtype, as the backward of autocast's casts does.

Where W runs is the interpreter's choice: in the rank's order (zero-bubble
schedules fill the bubble with it), or on the stage's side lane right after
its I (``split_grads``), off the next action's critical path; each held
gradient names the tensors it reads (:attr:`Held.reads`) so a side lane can
keep them alive.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Deferred", "Held", "anchor", "run_deferred", "accumulate_grad", "weight_grads"]

Notify = Callable[[torch.Tensor], None]  # told of each parameter once its gradient is accumulated


class Held(NamedTuple):
    """One layer's weight gradients, held back: ``run(notify)`` accumulates them; ``reads``: the tensors it reads."""

    run: Callable[[Notify], None]
    reads: tuple[torch.Tensor, ...]


def accumulate_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """What ``AccumulateGrad`` does with a new gradient ``g`` of leaf ``p`` (outside create_graph)."""
    with torch.no_grad():
        if p.grad is None:
            same = g.dtype == p.dtype and g.stride() == p.stride() and g.shape == p.shape
            p.grad = g if same else torch.empty_like(p).copy_(g)
        else:
            p.grad.add_(g)


def weight_grads(go: torch.Tensor, x: torch.Tensor, w: torch.Tensor, conv_args: tuple, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, notify: Notify) -> None:
    """A convolution's weight and bias gradients accumulated into ``.grad`` on the current stream, each then
    announced to ``notify``."""
    sizes = list(bias.shape) if bias is not None else None
    _, gw, gb = torch.ops.aten.convolution_backward(go, x, w, sizes, *conv_args,
                                                    [False, weight is not None, bias is not None])
    for p, g in ((weight, gw), (bias, gb)):
        if p is not None:
            accumulate_grad(p, g.to(p.dtype))
            notify(p)


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


class _HeldConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor,  # type: ignore[override]
                params: tuple[torch.Tensor, torch.Tensor | None], args: tuple, queue: list[Held],
                cast: torch.dtype | None) -> torch.Tensor:
        # The parameters ride in a tuple, which autograd does not look into: they are not inputs of this node.
        weight, bias = params
        ctx.params, ctx.args, ctx.queue, ctx.x_dtype = params, args, queue, x.dtype
        xc, wc, bc = _cast(x, cast), _cast(weight.detach(), cast), _cast(None if bias is None else bias.detach(), cast)
        ctx.save_for_backward(xc, wc)
        return torch.ops.aten.convolution(xc, wc, bc, *args)

    @staticmethod
    def backward(ctx: Any, go: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        args = ctx.args

        def later(notify: Notify) -> None:
            weight_grads(go, x, w, args, weight if weight.requires_grad else None, bias if _trains(bias) else None,
                         notify)

        ctx.queue.append(Held(later, (go, x, w)))
        gi = None
        if ctx.needs_input_grad[0]:
            gi = torch.ops.aten.convolution_backward(go, x, w, None, *args, [True, False, False])[0]
            gi = gi.to(ctx.x_dtype)
        return gi, None, None, None, None, None


class _HeldLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor,  # type: ignore[override]
                params: tuple[torch.Tensor, torch.Tensor | None], queue: list[Held],
                cast: torch.dtype | None) -> torch.Tensor:
        weight, bias = params
        ctx.params, ctx.queue, ctx.x_dtype = params, queue, x.dtype
        xc, wc, bc = _cast(x, cast), _cast(weight.detach(), cast), _cast(None if bias is None else bias.detach(), cast)
        ctx.save_for_backward(xc, wc)
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx: Any, go: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        weight, bias = ctx.params

        def later(notify: Notify) -> None:
            g2, x2 = go.reshape(-1, go.shape[-1]), x.reshape(-1, x.shape[-1])
            gw = g2.t().mm(x2) if weight.requires_grad else None
            gb = g2.sum(0) if _trains(bias) else None
            for p, g in ((weight, gw), (bias, gb)):
                if p is not None and g is not None:
                    accumulate_grad(p, g.to(p.dtype))
                    notify(p)

        ctx.queue.append(Held(later, (go, x)))
        gi = go.matmul(w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return gi, None, None, None, None


def _trains(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def _param(t: object) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad


class Deferred(TorchFunctionMode):
    """Inside it, conv2d and linear ops on trained parameters hold their weight gradients in ``queue``."""

    def __init__(self, queue: list[Held], anchor: torch.Tensor) -> None:
        super().__init__()
        self.queue = queue
        # An empty leaf that requires grad (:func:`anchor`): keeps the node in the graph where the input does not.
        self.anchor = anchor

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            held = self._held(func, args, kwargs)
            if held is not None:
                return held
        return func(*args, **kwargs)

    def _autocast(self, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
        """The dtype autocast would run the op in (None: autocast is off, or leaves these tensors alone)."""
        kind = self.anchor.device.type
        if not torch.is_autocast_enabled(kind) or not (x.is_floating_point() and weight.is_floating_point()):
            return None
        if torch.float64 in (x.dtype, weight.dtype):  # autocast leaves double precision alone
            return None
        return torch.get_autocast_dtype(kind)

    def _held(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        if func is F.linear or func is torch._C._nn.linear:
            given = dict(zip(("input", "weight", "bias"), args), **kwargs)
            x, weight, bias = given.get("input"), given.get("weight"), given.get("bias")
            if _param(weight) and (bias is None or isinstance(bias, nn.Parameter)) and isinstance(x, torch.Tensor) \
                    and x.dim() >= 2:
                cast = self._autocast(x, weight)
                with torch.autocast(self.anchor.device.type, enabled=False):
                    return _HeldLinear.apply(x, self.anchor, (weight, bias), self.queue, cast)
            return None
        if func is F.conv2d or func is torch.conv2d:
            names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
            given = dict(zip(names, args), **kwargs)
            x, weight, bias = given.get("input"), given.get("weight"), given.get("bias")
            padding = given.get("padding", 0)
            if not _param(weight) or (bias is not None and not isinstance(bias, nn.Parameter)) or \
                    isinstance(padding, str) or not isinstance(x, torch.Tensor) or x.dim() != 4:
                return None
            pair = torch.nn.modules.utils._pair
            conv = (pair(given.get("stride", 1)), pair(padding), pair(given.get("dilation", 1)), False, [0, 0],
                    int(given.get("groups", 1)))
            cast = self._autocast(x, weight)
            with torch.autocast(self.anchor.device.type, enabled=False):
                return _HeldConv.apply(x, self.anchor, (weight, bias), conv, self.queue, cast)
        return None


def anchor(device: torch.device) -> torch.Tensor:
    """The leaf a device's held nodes hang from (no gradient ever reaches it): one per device serves every step."""
    return torch.empty(0, device=device, requires_grad=True)


def run_deferred(queue: list[Held], notify: Notify) -> None:
    """Compute and accumulate the weight gradients held in ``queue`` (emptied), telling ``notify`` each one."""
    for held in queue:
        held.run(notify)
    queue.clear()
