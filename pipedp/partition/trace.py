"""Tracing an unmodified model with ``torch.fx`` so that it can be cut, keeping whole what fx cannot see into.

fx runs a forward on proxies and records the tensor operations; Python
control flow is resolved while it traces. That is wrong or impossible for
some modules, which are therefore kept whole (leaves, one graph node each,
their own Python running at every call):

* subclasses of torch.nn's own layers (timm's ``BatchNormAct2d`` is a
  ``BatchNorm2d``, its ``Conv2dSame`` a ``Conv2d`` that pads by input size):
  fx keeps torch.nn's layers whole, and a subclass is one layer too;
* modules whose own forward reads ``self.training`` (drop-path, norm-act
  layers): traced, their train-mode branch would be baked into the graph and
  run in eval mode as well;
* modules with buffers of their own (a frozen BatchNorm such as
  torchvision's ``FrozenBatchNorm2d``, which ``timm.layers.freeze_batch_norm_2d``
  puts in): fx reads a submodule's buffer as a plain tensor and bakes what
  forward computes from it into constants, which a checkpoint loaded later
  would not change;
* what timm registers as not traceable (``timm.layers``' no-trace modules
  and functions), when the model's code has imported timm;
* children that fx cannot trace (shape-dependent Python, asserts on
  values): found by tracing each child alone, after the whole model failed.

Two things fx does not record are recorded here. Grad mode: each node
carries ``meta["grad"]``, whether gradients were on where it was traced (a
``torch.no_grad()`` region inside forward traces as plain nodes, and blocks
cut from them must switch gradients off there again: :mod:`.modes`). The
root's own train/eval branching (timm's ``F.dropout(x, p,
training=self.training)`` in ``forward_head``), which no leaf can hold: the
forward is traced in both modes, and the eval-mode graph is kept where it
differs.

Inputs after the first that have defaults are held at their defaults
(``concrete_args``), so a ``forward(x, mask=None)`` traces with one input.
The root's own buffers are traced as attributes (``get_attr``), not as
constants; tensor constants fx still makes (a ``torch.tensor`` built in
forward) are compared by value across the two modes' traces, and taken off
the user's model again, where fx puts them.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, Iterable

from dataclasses import dataclass

import torch
from torch import nn

from .modes import differing

__all__ = ["trace", "Traced", "leaf_reason", "ModeError"]

# torch.nn classes that hold other modules: their subclasses are traced through, not kept whole.
_CONTAINERS = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _from_torch_nn(cls: type) -> bool:
    return cls.__module__.startswith(("torch.nn.", "torch.ao.nn.")) and cls not in _CONTAINERS


def _timm_notrace() -> tuple[tuple[type, ...], tuple[Callable[..., object], ...]]:
    """timm's registered no-trace modules and functions, if the model's code imported timm (never imported here)."""
    fx = sys.modules.get("timm.layers._fx")
    if fx is None:
        return (), ()
    try:
        return tuple(fx.get_notrace_modules()), tuple(f for f in fx.get_notrace_functions() if callable(f))
    except Exception:  # noqa: BLE001 - another timm version: trace without its registry
        return (), ()


def leaf_reason(module: nn.Module, timm_modules: tuple[type, ...] = ()) -> str | None:
    """Why ``module`` is kept whole when tracing (None: traced into)."""
    cls = type(module)
    if isinstance(module, nn.Sequential | nn.ModuleList | nn.ModuleDict):
        return None
    if _from_torch_nn(cls):
        return "a torch.nn layer"
    if any(_from_torch_nn(c) for c in cls.__mro__[1:]):
        return "a subclass of a torch.nn layer"
    if timm_modules and isinstance(module, timm_modules):
        return "registered with timm as not traceable"
    if "self.training" in _own_source(cls):
        return "its forward depends on train/eval mode"
    if next(module.buffers(recurse=False), None) is not None:
        return "it holds buffers (fx would bake what forward computes from them into constants)"
    return None


@functools.cache
def _own_source(cls: type) -> str:
    """The source of the methods ``cls`` and its bases above nn.Module define (a forward may call a helper)."""
    parts = []
    for base in cls.__mro__:
        if base is nn.Module or _from_torch_nn(base) or base is object:
            break
        for value in base.__dict__.values():
            if inspect.isfunction(value):
                try:
                    parts.append(inspect.getsource(value))
                except (OSError, TypeError):
                    continue
    return "\n".join(parts)


class ModeError(ValueError):
    """The root's forward runs other operations in eval mode than in train mode: no one graph serves both."""


@dataclass(frozen=True)
class Traced:
    """The traced forward (train mode), the modules kept whole beyond torch.nn's own layers (qualified name:
    why), and the eval-mode graph where it differs from the train-mode one in arguments only (node for node)."""

    module: torch.fx.GraphModule
    kept_whole: dict[str, str]
    eval_module: torch.fx.GraphModule | None
    root: nn.Module  # the model traced: its own flag says which graph a block runs


class _Tracer(torch.fx.Tracer):
    proxy_buffer_attributes = True  # the root's buffers as get_attr nodes, read at every run

    def __init__(self, whole: Iterable[nn.Module], timm_modules: tuple[type, ...],
                 functions: tuple[Callable[..., object], ...]) -> None:
        super().__init__(autowrap_functions=functions)
        self.whole = {id(m) for m in whole}
        self.timm_modules = timm_modules
        self.kept: dict[str, str] = {}

    def create_node(self, *args: object, **kwargs: object) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)  # type: ignore[arg-type]
        node.meta["grad"] = torch.is_grad_enabled()
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        why = "fx cannot trace it" if id(m) in self.whole else leaf_reason(m, self.timm_modules)
        if why is not None and why != "a torch.nn layer" and module_qualified_name:
            self.kept[module_qualified_name] = why
        return why is not None


def _defaults(model: nn.Module) -> dict[str, object]:
    """The forward's inputs after the first that have defaults: held at them while tracing."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    P = inspect.Parameter
    named = [p for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    return {p.name: p.default for p in named[1:] if p.default is not P.empty}


def _untraceable(model: nn.Module, tracer: Callable[[Iterable[nn.Module]], _Tracer]) -> list[nn.Module]:
    """The outermost children that fx cannot trace on their own (each kept whole)."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            t = tracer(())
            if t.is_leaf_module(child, ""):
                continue
            try:
                t.trace(child, concrete_args=_defaults(child) or None)
            except Exception:  # noqa: BLE001 - whatever user code raises on proxies
                out.append(child)
                continue
            visit(child)

    visit(model)
    return out


def trace(model: nn.Module) -> Traced:
    """``model``'s forward as fx graphs (train mode, and eval mode where it differs), leaves kept whole.

    Traced with gradients on, so that ``meta["grad"]`` marks exactly the
    nodes of the forward's own no-grad regions. Every module's mode is put
    back after. Raises what fx raised when the model cannot be traced even
    with every untraceable child kept whole (the root's own forward is the
    problem), and :class:`ModeError` when the eval-mode forward runs other
    operations than the train-mode one.
    """
    timm_modules, functions = _timm_notrace()

    def tracer(whole: Iterable[nn.Module]) -> _Tracer:
        return _Tracer(whole, timm_modules, functions)

    concrete = _defaults(model) or None
    held = set(concrete or ())
    before = {m: set(vars(m)) for m in model.modules()}
    try:
        graph, other, kept = _both_modes(model, tracer, concrete)
        for g in (graph, other):
            _drop_held_inputs(g, held)
        name = type(model).__name__
        differs = differing(graph, other, lambda target: _attribute(model, target))
        if differs is None:
            raise ModeError(
                f"{name}.forward runs other operations in eval mode than in train mode (it branches on "
                f"self.training outside any submodule), so blocks traced in one mode would compute the other "
                f"wrongly")
        eval_module = torch.fx.GraphModule(model, other, class_name=name) if differs else None
        return Traced(torch.fx.GraphModule(model, graph, class_name=name), kept, eval_module, model)
    finally:  # fx stows the constants it makes on the module it traces: the graph modules hold their own now
        for m, names in before.items():
            for k in set(vars(m)) - names:
                del m.__dict__[k]


def _both_modes(model: nn.Module, tracer: Callable[[Iterable[nn.Module]], _Tracer],
                concrete: dict[str, object] | None) -> tuple[torch.fx.Graph, torch.fx.Graph, dict[str, str]]:
    """The train-mode and eval-mode graphs and the modules kept whole; every module's mode put back after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        with torch.enable_grad():
            model.train()
            t, whole = tracer(()), list[nn.Module]()
            try:
                graph = t.trace(model, concrete_args=concrete)
            except Exception:  # noqa: BLE001
                whole = _untraceable(model, tracer)
                if not whole:
                    raise
                t = tracer(whole)
                graph = t.trace(model, concrete_args=concrete)
            model.eval()
            try:
                other = tracer(whole).trace(model, concrete_args=concrete)
            except Exception as e:  # noqa: BLE001 - whatever user code raises on proxies
                raise ModeError(f"torch.fx traced {type(model).__name__}.forward in train mode but not in eval mode: "
                                f"{type(e).__name__}: {e}") from e
    finally:
        for m, mode in flags:
            m.training = mode
    return graph, other, t.kept


def _attribute(model: nn.Module, target: str) -> object:
    """What a ``get_attr`` node of ``model``'s trace reads (None where there is no such attribute)."""
    value: object = model
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _drop_held_inputs(graph: torch.fx.Graph, held: set[str]) -> None:
    """Take out the placeholders fx keeps for inputs held at their defaults, with the checks it hangs on them.

    The forward saw the default values themselves, so nothing but fx's own
    checks (``_assert_is_none``, equality asserts) uses those placeholders
    (which fx names ``<input>_<n>``).
    """
    for ph in [n for n in graph.nodes if n.op == "placeholder" and str(n.target).rsplit("_", 1)[0] in held]:
        doomed, todo = {ph}, [ph]
        while todo:
            for user in todo.pop().users:
                if user not in doomed:
                    doomed.add(user)
                    todo.append(user)
        if any(n.op == "output" for n in doomed):
            continue  # the default itself is returned: leave it, the cut will name the extra input
        for n in reversed([n for n in graph.nodes if n in doomed]):
            graph.erase_node(n)
