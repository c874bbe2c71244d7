"""A convolution's weight gradient on a side stream, off the backward's critical path.

Backward through a convolution computes two things: the gradient of its
input, which the layer before needs next, and the gradient of its weight,
which nothing needs until the optimizer (or the gradient sync). Plain
autograd issues both on one stream, one after the other. Here the layer's
backward issues the input gradient on the stage's stream and the weight (and
bias) gradient on the stage's side lane, which waits for the stage's stream
at the start of that backward only (an event, no host sync). The weight
gradient is accumulated into ``.grad`` on the side lane by the layer itself,
because a gradient handed back to autograd would be accumulated on the
stage's stream at once, which would have to wait for it. Whoever reads
gradients joins the side lanes first: the executor at the end of a step,
the gradient sync before launching a bucket, an early optimizer update
before its stage's update (see :attr:`SplitGrads.lanes`).

Exactness: the kernels are torch's own (``aten.convolution_backward``, one
output each), and accumulation is what ``AccumulateGrad`` does: the first
gradient becomes ``.grad``, later ones are added in place. Under autocast
the layer casts input, weight and bias to the autocast dtype as autocast
would and casts the gradients back to each one's dtype, as the backward of
autocast's casts does. Hooks registered with
``register_post_accumulate_grad_hook`` on such a layer's parameters are
not called (autograd no longer accumulates them); the engine's gradient sync
is told through :attr:`SplitGrads.on_accumulate` instead.

Installed by swapping each plain ``nn.Conv2d``'s class for
:class:`SplitGradConv2d` (as :mod:`pipedp.ops.swap` does for kernels);
:meth:`SplitGrads.undo` puts every layer back. Parameters, names and
``state_dict`` keys do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..device import canonical_device
from .side import SideLanes
from .stage import Stage
from .stream import Lane, current_lane

__all__ = ["SplitGradConv2d", "SplitGrads", "split_grads", "accumulate_grad", "weight_grads"]

_ATTR = "_pipedp_split"


def accumulate_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """What ``AccumulateGrad`` does with a new gradient ``g`` of leaf ``p`` (outside create_graph)."""
    with torch.no_grad():
        if p.grad is None:
            same = g.dtype == p.dtype and g.stride() == p.stride() and g.shape == p.shape
            p.grad = g if same else torch.empty_like(p).copy_(g)
        else:
            p.grad.add_(g)


class SplitGrads:
    """Which layers compute their weight gradient on a side lane, and how to undo the swap."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.sides = SideLanes(stages, "wgrad")
        self.on_accumulate: list[Callable[[torch.Tensor], None]] = []  # called after a parameter's accumulation
        self.layers: list[nn.Module] = []
        # Empty leaves that require grad: they keep a layer's backward in the graph while its parameters stay
        # out of it (autograd would accumulate them, and call their hooks, itself). One per device, made here.
        self.anchors = {canonical_device(st.device): torch.empty(0, device=st.device, requires_grad=True)
                        for st in stages}

    @property
    def count(self) -> int:
        return len(self.layers)

    def lanes(self, stage: int | None = None) -> list[Lane]:
        """The side lanes (of stage ``stage``) that a reader of gradients must wait for."""
        return self.sides.lanes() if stage is None else [self.sides.by_stage[stage]]

    def accumulated(self, p: torch.Tensor) -> None:
        for fn in self.on_accumulate:
            fn(p)

    def undo(self) -> None:
        """Put the swapped layers back to ``nn.Conv2d`` (safe to call more than once)."""
        for m in self.layers:
            if type(m) is SplitGradConv2d:
                m.__class__ = nn.Conv2d
            m.__dict__.pop(_ATTR, None)
        self.layers = []

    def __deepcopy__(self, memo: dict) -> "SplitGrads":
        return self

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # Pickled (torch.save of the model) as no owner: the layer computes as plain nn.Conv2d, and the engine's
        # lanes and gradient sync (streams, process groups) are never pickled.
        return type(None), ()


@dataclass
class _Geometry:
    stride: Any
    padding: Any
    dilation: Any
    groups: int


class _SplitConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor,  # type: ignore[override]
                params: tuple[torch.Tensor, torch.Tensor | None], geo: _Geometry, owner: SplitGrads,
                cast: torch.dtype | None) -> torch.Tensor:
        # The parameters come in a tuple, which autograd does not look into: they are not inputs of this node.
        ctx.params = params  # the leaves whose .grad the backward accumulates into
        weight, bias = params[0].detach(), params[1].detach() if params[1] is not None else None
        xc, wc = (x.to(cast), weight.to(cast)) if cast is not None else (x, weight)
        bc = bias.to(cast) if cast is not None and bias is not None else bias
        ctx.save_for_backward(xc, wc)
        ctx.geo, ctx.owner = geo, owner
        ctx.x_dtype = x.dtype
        return torch.ops.aten.convolution(xc, wc, bc, geo.stride, geo.padding, geo.dilation, False, [0, 0],
                                          geo.groups)

    @staticmethod
    def backward(ctx: Any, go: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        geo, owner = ctx.geo, ctx.owner
        weight, bias = ctx.params
        want_w, want_b = weight.requires_grad, bias is not None and bias.requires_grad
        conv_args = (geo.stride, geo.padding, geo.dilation, False, [0, 0], geo.groups)
        if want_w or want_b:
            side = owner.sides.current(go.device)
            if side is None:  # not on a stage's stream: everything in order here
                weight_grads(go, x, w, conv_args, weight if want_w else None, bias if want_b else None,
                             owner.accumulated)
            else:
                cur = current_lane(go.device)
                side.wait(cur.record())  # grad_output and the saved input are ready here
                for t in (go, x, w):
                    side.keep(t)  # read on the side lane after autograd drops them
                with side.use():
                    weight_grads(go, x, w, conv_args, weight if want_w else None, bias if want_b else None,
                                 owner.accumulated)
        gi = None
        if ctx.needs_input_grad[0]:
            gi = torch.ops.aten.convolution_backward(go, x, w, None, *conv_args, [True, False, False])[0]
            gi = gi.to(ctx.x_dtype)
        return gi, None, None, None, None, None


def weight_grads(go: torch.Tensor, x: torch.Tensor, w: torch.Tensor, conv_args: tuple, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, notify: Callable[[torch.Tensor], None]) -> None:
    """A convolution's weight and bias gradients accumulated into ``.grad`` on the current stream, each then
    announced to ``notify``."""
    sizes = list(bias.shape) if bias is not None else None
    _, gw, gb = torch.ops.aten.convolution_backward(go, x, w, sizes, *conv_args,
                                                    [False, weight is not None, bias is not None])
    for p, g in ((weight, gw), (bias, gb)):
        if p is not None:
            accumulate_grad(p, g.to(p.dtype))
            notify(p)


class SplitGradConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` whose backward issues its weight gradient on its stage's side lane."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner: SplitGrads | None = self.__dict__.get(_ATTR)
        trained = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if owner is None or not torch.is_grad_enabled() or not trained or x.device not in owner.anchors:
            return super().forward(x)
        kind = x.device.type
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if cast is not None and not (x.is_floating_point() and self.weight.is_floating_point()):
            cast = None
        geo = _Geometry(self.stride, self.padding, self.dilation, self.groups)
        with torch.autocast(kind, enabled=False):
            out = _SplitConv.apply(x, owner.anchors[x.device], (self.weight, self.bias), geo, owner, cast)
        return out


def _splittable(m: nn.Module) -> bool:
    return type(m) is nn.Conv2d and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def split_grads(stages: Sequence[Stage]) -> SplitGrads:
    """Swap every plain ``nn.Conv2d`` of ``stages`` (zero padding, numeric) onto :class:`SplitGradConv2d`.

    Subclasses of ``nn.Conv2d`` (their forward may differ; tuned depthwise
    kernels) and string padding stay as they are.
    """
    owner = SplitGrads(stages)
    seen: set[int] = set()
    for st in stages:
        for m in st.chain.modules():
            if id(m) in seen or not _splittable(m):
                continue
            seen.add(id(m))
            m.__class__ = SplitGradConv2d
            m.__dict__[_ATTR] = owner
            owner.layers.append(m)
    return owner
