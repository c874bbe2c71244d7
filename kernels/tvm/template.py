"""Schedule templates behind one interface, found by (target kind, activation layout).

A template turns one depthwise operator on one problem into a scheduled
prim func. It owns its knob :class:`~.space.Space`, the constraints that
span several knobs (``validate``, checked before anything compiles), the
schedule itself (``apply``, a pure function of problem, operator and
config) and the loop-structure features the cost model learns from. The
builder, the tuner and the exporter see templates only through
:class:`Template`, so a new target or layout is one new module that
registers one object, and nothing that searches or compiles changes.

Each template module registers its object when imported; the built-in ones
(``cpu``, ``cpu_nhwc``, ``cuda``, ``cuda_nhwc``) are imported on the first lookup, not
here, because they import TVM's schedule API and this module must stay
importable for type annotations alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from pipedp.ops.layout import LAYOUTS
from pipedp.ops.problem import DepthwiseConv

from .space import Config, Space

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.target import Target

__all__ = ["Template", "register", "get_template", "layouts_for", "layout_of", "target_kind", "has_pad"]


class Template(Protocol):
    """One schedule template: its knobs, their joint constraints, the schedule, and cost-model features."""

    name: str

    def space(self, conv: DepthwiseConv, op: str) -> Space:
        """The knobs this template reads for ``op`` on ``conv``."""
        ...

    def validate(self, conv: DepthwiseConv, op: str, config: Config) -> None:
        """Raise :class:`~.space.InvalidConfig` for a config that does not fit (before any compile work)."""
        ...

    def apply(self, sch: s_tir.Schedule, conv: DepthwiseConv, op: str, config: Config) -> s_tir.Schedule:
        """Schedule the operator's prim func in ``sch`` (in place) as ``config`` says; returns ``sch``."""
        ...

    def features(self, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
        """Loop-structure features of ``config`` for the cost model (a fixed length per operator)."""
        ...


_BUILTIN = ("cpu", "cpu_nhwc", "cuda", "cuda_nhwc")
_REGISTRY: dict[tuple[str, str], Template] = {}


def register(kind: str, layout: str, template: Template) -> Template:
    """Make ``template`` the one for targets of ``kind`` (``llvm``, ``cuda``) with ``layout`` activations."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    _REGISTRY[(kind, layout)] = template
    return template


def _load_builtin() -> None:
    for name in _BUILTIN:
        importlib.import_module(f"{__package__}.{name}")


def target_kind(target: Target | str) -> str:
    """A target's kind name (``llvm`` for CPUs, ``cuda``); a string is taken as the kind itself."""
    return target if isinstance(target, str) else str(target.kind.name)


def layouts_for(target: Target | str) -> tuple[str, ...]:
    """Activation layouts the target kind has templates for, in :data:`~pipedp.ops.layout.LAYOUTS` order.

    Every target kind here has both: CUDA (torch's native kernel in NCHW, cuDNN in NHWC) as the CPU.
    """
    _load_builtin()
    kind = target_kind(target)
    return tuple(v for v in LAYOUTS if (kind, v) in _REGISTRY)


def get_template(target: Target | str, layout: str = "NCHW") -> Template:
    """The template for ``target``'s kind and ``layout`` (a ValueError naming the layouts it has)."""
    _load_builtin()
    kind = target_kind(target)
    found = _REGISTRY.get((kind, layout))
    if found is None:
        have = layouts_for(kind)
        if not have:
            kinds = ", ".join(sorted({k for k, _ in _REGISTRY}))
            raise ValueError(f"no template for {kind} targets: there are for {kinds}")
        raise ValueError(f"layout {layout!r} has no {kind} template: use one of {have}")
    return found


def layout_of(config: Config) -> str:
    """The activation layout a config was made for (configs without a ``layout`` knob are NCHW)."""
    return str(config.get("layout", "NCHW"))


def has_pad(conv: DepthwiseConv, op: str) -> bool:
    """Whether ``op``'s compute has a padding stage (grad-input always pads its dilated gradient)."""
    return op == "dgrad" or conv.padding != (0, 0)
