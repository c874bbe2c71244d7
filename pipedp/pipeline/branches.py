"""A residual block's shortcut path on a side stream, beside its main path.

A block whose traced graph (``torch.fx``) is one input forking into two
independent paths that meet at an addition (a ResNet block with a
downsample shortcut: conv+BN beside conv-BN-ReLU-conv-BN) can run the
shorter path on the stage's side lane while the longer one runs on the
stage's stream. Both paths are full-batch kernels, so a GPU that one path
leaves partly idle (late stages at 4x4 or 8x8, small microbatches) takes
the other at no cost in kernel size. The model is not edited: the block's
own ``forward`` is traced with every submodule it calls kept as one call,
the graph is cut into three graph modules that call those same submodules
(so their hooks, BatchNorm statistics and parameters are the block's), and
the block's ``forward`` is replaced on the instance until
:meth:`Branches.undo`.

Ordering, by events only (the step stays capturable): the side lane waits
for the stage's stream where the block starts (the input is ready), runs the
short path, and the stage's stream waits for the side lane before the
addition. Backward needs nothing more: autograd runs each op's backward on
the stream its forward ran on and orders streams where gradients cross.
The caching allocator is told that the input is read on the side lane and
that the short path's output is read on the stage's stream
(``record_stream``), so neither is reused while the other lane may still
read it.

Exactness: the paths are independent, so their order changes no value;
modules keep their own state. Refused (the block stays as it is): graphs
that do not trace, more than one input, an identity shortcut (nothing to run
beside), a path that writes the input in place (the other path reads it),
random ops on both paths (their order would change the random streams), and
anything reaching past the addition to the paths' insides.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx, nn

from .side import SideLanes
from .stage import Stage
from .stream import Lane, current_lane

__all__ = ["Branches", "BranchPlan", "plan_block", "concurrent_branches"]

_ADDS = {operator.add, operator.iadd, torch.add}
_RANDOM_FUNCTIONS = {torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
                     torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.dropout, torch.rand,
                     torch.randn, torch.rand_like, torch.randn_like, torch.bernoulli}


def _is_add(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in _ADDS:
        return len(n.args) == 2 and not n.kwargs
    return n.op == "call_method" and n.target in ("add", "add_") and len(n.args) == 2 and not n.kwargs


def _work(n: fx.Node) -> bool:
    return n.op in ("call_module", "call_function", "call_method")


def _inplace(n: fx.Node, root: nn.Module) -> bool:
    if n.op == "call_module":  # conservatively: any layer inside that works in place
        return any(getattr(m, "inplace", False) for m in root.get_submodule(str(n.target)).modules())
    if n.op == "call_method":
        return str(n.target).endswith("_")
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return bool(n.kwargs.get("inplace")) or name.startswith("i") and n.target in vars(operator).values() \
            or name.endswith("_")
    return False


def _random(n: fx.Node, root: nn.Module) -> bool:
    if n.op == "call_module":
        return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in root.get_submodule(str(n.target)).modules())
    if n.op == "call_method":
        return str(n.target) in ("bernoulli_", "random_", "uniform_", "normal_", "exponential_")
    return n.op == "call_function" and n.target in _RANDOM_FUNCTIONS


def _has_params(n: fx.Node, root: nn.Module) -> bool:
    return n.op == "call_module" and next(root.get_submodule(str(n.target)).parameters(), None) is not None


def _ancestors(n: fx.Node, x: fx.Node) -> set[fx.Node]:
    """The nodes ``n`` is computed from, ``n`` included, up to (not including) the input ``x``."""
    out: set[fx.Node] = set()
    todo = [n]
    while todo:
        m = todo.pop()
        if m is x or m in out:
            continue
        out.add(m)
        todo.extend(m.all_input_nodes)
    return out


@dataclass
class BranchPlan:
    """How one block's graph splits: the input, the two paths (in graph order), the addition and what follows."""

    graph: fx.Graph
    x: fx.Node
    side: list[fx.Node]
    main: list[fx.Node]
    join: fx.Node
    tail: list[fx.Node]
    side_first: bool  # the side path's output is the addition's first operand
    why: str = field(default="")


class _ChildrenAsLeaves(fx.Tracer):
    """Traces only the block's own ``forward``: every submodule it calls stays one call, hooks and all."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def plan_block(module: nn.Module) -> BranchPlan | str:
    """The split of ``module``'s graph into a short and a long path, or the reason it has none."""
    try:
        graph = _ChildrenAsLeaves().trace(module)
    except Exception as e:  # any tracing failure means: leave the block alone
        return f"does not trace ({type(e).__name__})"
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return f"takes {len(inputs)} inputs"
    x = inputs[0]
    order = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    free = {n for n in order if n.op == "get_attr"}  # attributes: copied into each path that reads them
    for k, j in enumerate(order):
        if not _is_add(j) or not all(isinstance(a, fx.Node) for a in j.args):
            continue
        a, b = j.args
        pa, pb = _ancestors(a, x) - free, _ancestors(b, x) - free  # type: ignore[arg-type]
        if pa & pb or not any(_work(n) for n in pa) or not any(_work(n) for n in pb):
            continue  # shared work, or an identity path
        before = {n for n in order[:k] if n not in free}
        if before != pa | pb:
            continue  # more than the two paths before the addition
        inner = pa | pb
        if any(u is not j and u not in (pa if n in pa else pb) for n in inner for u in n.users):
            continue  # a path's value is used past the addition or by the other path
        tail = order[k + 1 :]
        if any(m in inner or m is x for n in tail for m in n.all_input_nodes):
            continue
        if any(_is_add(n) or _has_params(n, module) for n in tail):
            continue  # more model after the block (a whole chain traced): its inner blocks are the candidates
        if any(x in n.all_input_nodes and _inplace(n, module) for n in inner):
            return "a path writes the block's input in place"
        if any(_random(n, module) for n in pa) and any(_random(n, module) for n in pb):
            return "both paths draw random numbers"
        short_a = sum(map(_work, pa)) <= sum(map(_work, pb))
        side, main = (pa, pb) if short_a else (pb, pa)
        in_order = [n for n in order if n not in free]
        return BranchPlan(graph, x, [n for n in in_order if n in side], [n for n in in_order if n in main], j,
                          tail, short_a)
    return "has no fork joined by an addition"


def _module(root: nn.Module, graph: fx.Graph, inputs: Sequence[fx.Node], nodes: Sequence[fx.Node],
            outputs: Sequence[Any], free: Sequence[fx.Node]) -> fx.GraphModule:
    """A graph module of ``nodes`` (copied from ``graph``) taking ``inputs`` and returning ``outputs``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
    used = {m for n in nodes for m in n.all_input_nodes}
    for n in free:
        if n in used:
            env[n] = g.node_copy(n, lambda m: env[m])
    for n in nodes:
        env[n] = g.node_copy(n, lambda m: env[m])
    g.output(fx.node.map_arg(outputs[0] if len(outputs) == 1 else tuple(outputs), lambda m: env[m]))
    return fx.GraphModule(root, g)


class _Concurrent:
    """The replaced ``forward`` of one block: short path on the side lane, long path here, then the rest."""

    def __init__(self, side: fx.GraphModule, main: fx.GraphModule, tail: fx.GraphModule, lanes: SideLanes) -> None:
        self.side, self.main, self.tail, self.lanes = side, main, tail, lanes

    def __call__(self, x: torch.Tensor) -> Any:
        lane = self.lanes.current(x.device)
        if lane is None:  # not on a stage's stream: both paths here, in the same order
            return self.tail(self.main(x), self.side(x))
        cur = current_lane(x.device)
        lane.wait(cur.record())  # the input is ready
        lane.keep(x)
        with lane.use():
            s = self.side(x)
        done = lane.record()
        m = self.main(x)
        cur.wait(done)
        _keep(cur, s)
        return self.tail(m, s)


def _keep(lane: Lane, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        lane.keep(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _keep(lane, v)


def _concurrent(module: nn.Module, plan: BranchPlan, lanes: SideLanes) -> _Concurrent:
    free = [n for n in plan.graph.nodes if n.op == "get_attr"]
    side = _module(module, plan.graph, [plan.x], plan.side, [plan.join.args[0 if plan.side_first else 1]], free)
    main = _module(module, plan.graph, [plan.x], plan.main, [plan.join.args[1 if plan.side_first else 0]], free)
    out = next(n for n in plan.graph.nodes if n.op == "output")
    a, b = plan.join.args
    # The tail takes (main output, side output) and runs the addition with the operands in their order.
    tail_inputs = [b, a] if plan.side_first else [a, b]
    tail = _module(module, plan.graph, tail_inputs, [plan.join, *plan.tail], [out.args[0]], free)  # type: ignore[list-item]
    return _Concurrent(side, main, tail, lanes)


@dataclass
class Branches:
    """The blocks made concurrent (``count``) and why others were not; :meth:`undo` puts them back."""

    blocks: list[nn.Module] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    lanes: SideLanes | None = None

    @property
    def count(self) -> int:
        return len(self.blocks)

    def note(self) -> str:
        return f"{self.count} residual block(s) run their shortcut on a side stream (branches=True)"

    def undo(self) -> None:
        """Give every block its own forward back (safe to call more than once)."""
        for m in self.blocks:
            m.__dict__.pop("forward", None)
        self.blocks, self.names = [], []


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _candidates(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """Modules worth tracing, outermost first: not torch's own layers or containers (they do not fork)."""
    out = []
    if not isinstance(module, _CONTAINERS) and not type(module).__module__.startswith("torch.nn"):
        out.append((prefix, module))
    for name, child in module.named_children():
        out.extend(_candidates(child, f"{prefix}.{name}" if prefix else name))
    return out


def concurrent_branches(stages: Sequence[Stage]) -> Branches:
    """Run the short path of every forking block in ``stages`` on its stage's side lane."""
    lanes = SideLanes(stages, "branch")
    done = Branches(lanes=lanes)
    taken: set[int] = set()
    for st in stages:
        roots = [c for name, part in zip(st.chain.names, st.chain.parts) for c in _candidates(part, name)]
        for name, m in roots:
            if id(m) in taken or "forward" in m.__dict__:
                continue
            if any(name.startswith(f"{p}.") for p in done.names):
                continue  # inside a block already made concurrent
            plan = plan_block(m)
            if isinstance(plan, str):
                continue
            m.__dict__["forward"] = _concurrent(m, plan, lanes)
            taken.add(id(m))
            done.blocks.append(m)
            done.names.append(name)
    return done
