"""Turning an unmodified model into an ordered chain of blocks.

A block takes one value and returns one (a tensor, or a tuple of tensors
where a cut crosses several: :mod:`pipedp.partition.boundary`), and running
the blocks one after another computes the model's forward. Stages are
contiguous runs of blocks, so the blocks are the finest places a pipeline can
be cut. Blocks share their modules (and so their parameters) with the user's
model; nothing is copied or re-registered.

Three kinds of model are understood, tried in this order:

* ``nn.Sequential``: its entries (nested Sequentials expanded up to ``depth``);
* torchvision-style ResNets (``conv1, bn1, relu, maxpool, layer1..4, avgpool,
  fc``): the stem modules, every residual block, ``avgpool``, a flatten, ``fc``;
* anything ``torch.fx`` can trace (:mod:`pipedp.partition.trace` keeps whole
  what it cannot see into): the graph is cut at every point where exactly one
  tensor is live; a stretch of more than :data:`SPAN` nodes without such a
  point (parallel branches, a dense block's feature list) is cut where several
  tensors are live, passed as a tuple, at points with the fewest. Each piece
  becomes a small ``GraphModule``.

A module object that a Sequential holds at several positions (one ``ReLU``,
``Dropout`` or ``BatchNorm`` reused, a tied ``Linear``) runs at each of them,
so it becomes one block per use, each named by the position it is used at,
all sharing that one object: ``named_children()`` lists an object once and
would silently drop the later uses.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from ..checks import positive_int
from .boundary import Value
from .modes import ModeBlock, copy_nodes, differing
from .trace import ModeError, Traced, trace

__all__ = ["CutError", "Point", "carried", "chosen_points", "traced_points", "fx_blocks", "is_resnet", "Block",
           "blocks_of", "check_materialised", "check_not_wrapped", "check_one_input", "Chain", "module_mode"]

_HOW = "pass an nn.Sequential of the model's parts"
SPAN = 16  # fx nodes: a longer stretch without a one-tensor cut is cut where several tensors are live
_RESNET = ("conv1", "bn1", "relu", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")


class CutError(ValueError):
    """The model cannot be cut into blocks: ``reason``, and ``fix``, what would allow a cut.

    Cutting is an optimisation: where the cut was not asked for
    (``stages="auto"``) the model trains as one stage and the plan says why.
    """

    def __init__(self, reason: str, fix: str = _HOW) -> None:
        super().__init__(f"{reason}. To proceed, {fix}, or use stages=1 (no pipeline cut)")
        self.reason, self.fix = reason, fix


@dataclass(frozen=True)
class Block:
    """A named piece of the model: one value in, one value out (a tensor, or a tuple of tensors)."""

    name: str
    module: nn.Module


class Chain(nn.Module):
    """Runs blocks one after another; the module a pipeline stage executes."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.names = [b.name for b in blocks]
        self.parts = nn.ModuleList([b.module for b in blocks])

    def forward(self, x: Value) -> Value:
        for part in self.parts:
            x = part(x)
        return x


def check_materialised(model: nn.Module) -> None:
    """Refuse a model with lazy layers whose parameters do not exist yet (``nn.LazyLinear`` before its first call).

    Planning, the cut and the optimizer all need the parameters' shapes; PyTorch makes them on the first
    forward, which the user can run before ``wrap``.
    """
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"{type(model).__name__} has lazy layers whose parameters are not made yet ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): run one forward pass first, model(example_batch), then build "
            f"the optimizer and call wrap()")


_WRAPPERS = {
    "DistributedDataParallel": "DDP's reducer would all-reduce gradients beside pipedp's own sync (under torchrun "
                               "pipedp trains data parallel itself)",
    "DataParallel": "it splits each batch over GPUs itself, beside pipedp's plan",
    "FullyShardedDataParallel": "it shards parameters itself, beside pipedp's plan",
    "OptimizedModule": "torch.compile's wrapper is compiled as a whole (checkpoint keys gain '_orig_mod.', and it "
                       "cannot be cut); pipedp compiles its stages itself with compile=True or 'auto'",
}


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model already wrapped by DDP, DataParallel, FSDP or ``torch.compile``, naming the inner module.

    Each does a job pipedp does itself, and would do it twice (or hide the
    model's structure); the model inside is what to pass.
    """
    name = type(model).__name__
    why = _WRAPPERS.get(name)
    if why is None or not type(model).__module__.startswith("torch."):
        return
    inner = "._orig_mod" if name == "OptimizedModule" else ".module"
    extra = ", with compile=True or compile='auto'" if name == "OptimizedModule" else ""
    raise ValueError(
        f"the model is wrapped in {name}: {why}. To proceed, pass the model inside (model{inner}){extra}; "
        f"nothing was changed")


def check_one_input(model: nn.Module) -> None:
    """Refuse a model whose forward needs more than one input, at any stage count.

    ``train_step(x, y)`` and ``engine(x)`` feed the model one tensor per
    batch, with one stage as with several: a second input without a default
    would be a TypeError inside the first step. Inputs with defaults are fine.
    """
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward Python cannot describe: the call itself will tell
        return
    P = inspect.Parameter
    required = [p for p in params if p.default is P.empty]
    positional = [p.name for p in required if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in required if p.kind is P.KEYWORD_ONLY]
    needed = positional + keyword
    if len(positional) <= 1 and not keyword:
        return
    raise ValueError(
        f"{type(model).__name__}.forward takes {len(needed)} inputs ({', '.join(needed)}) without defaults, but "
        f"pipedp feeds a model one tensor per batch (engine.train_step(x, y), engine(x)), with one stage as with "
        f"several. To proceed, wrap it in a module whose forward takes one tensor (the inputs concatenated, say, "
        f"and split again inside), or give the other inputs defaults"
    )


def blocks_of(model: nn.Module, *, depth: int = 1) -> list[Block]:
    """The ordered blocks of ``model``; ``ValueError`` (why, where, what to do) if it cannot be cut."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    positive_int("depth", depth)
    if isinstance(model, nn.Sequential):
        blocks = _sequential(model, "", depth)
        if not blocks:
            raise ValueError("the nn.Sequential is empty: there is nothing to run")
        return blocks
    if is_resnet(model):
        return _resnet(model)
    return _fx_chain(model)


def _uses(seq: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """Every (position, module) that ``seq.forward`` runs, a reused module once per position."""
    return [(name, m) for name, m in seq._modules.items() if m is not None]


def _sequential(seq: nn.Sequential, prefix: str, depth: int) -> list[Block]:
    out: list[Block] = []
    for name, child in _uses(seq):
        qual = f"{prefix}{name}"
        if depth > 1 and isinstance(child, nn.Sequential) and len(child) > 0:
            out.extend(_sequential(child, qual + ".", depth - 1))
        else:
            out.append(Block(qual, child))
    return out


def is_resnet(model: nn.Module) -> bool:
    mods = dict(model.named_children())
    return all(isinstance(mods.get(n), nn.Module) for n in _RESNET) and all(
        isinstance(mods[f"layer{i}"], nn.Sequential) for i in range(1, 5)
    )


def _resnet(model: nn.Module) -> list[Block]:
    stem = ["conv1", "bn1", "relu"] + (["maxpool"] if isinstance(getattr(model, "maxpool", None), nn.Module) else [])
    blocks = [Block(n, getattr(model, n)) for n in stem]
    for i in range(1, 5):
        layer = getattr(model, f"layer{i}")
        blocks.extend(Block(f"layer{i}.{n}", m) for n, m in _uses(layer))
    blocks += [Block("avgpool", model.avgpool), Block("flatten", nn.Flatten(1)), Block("fc", model.fc)]
    return blocks


@dataclass(frozen=True)
class Point:
    """The place after one fx node of the forward and the values live there, which a cut there passes."""

    after: torch.fx.Node
    live: tuple[torch.fx.Node, ...]

    @property
    def single(self) -> bool:
        """A cut here passes one tensor."""
        return len(self.live) == 1 and self.cut

    @property
    def cut(self) -> bool:
        """A cut here can pass every live value: each a tensor (a tuple of several)."""
        return all(carried(v) for v in self.live)


def traced_points(model: nn.Module) -> tuple[Traced, list[Point]]:
    """The model traced (:mod:`pipedp.partition.trace`) and every point between its nodes; CutError if untraceable."""
    name = type(model).__name__
    try:
        traced = trace(model)
    except ModeError as e:
        raise CutError(f"cannot cut {name} into blocks: {e}",
                       "move what depends on the mode into a submodule (pipedp keeps a module that reads "
                       "self.training whole)") from e
    except Exception as e:  # TraceError, or whatever user code raises on proxies
        raise CutError(
            f"cannot cut {name} into blocks: torch.fx could not trace its forward "
            f"(data-dependent control flow or non-traceable code?): {type(e).__name__}: {e}"
        ) from e
    nodes = list(traced.module.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise CutError(
            f"cannot cut {name}: its forward takes {len(inputs)} inputs "
            f"({', '.join(n.name for n in inputs)}), a pipeline stage passes exactly one tensor"
        )
    result = nodes[-1].args[0]
    if not isinstance(result, torch.fx.Node):
        raise CutError(
            f"cannot cut {name}: its forward returns {type(result).__name__} (at fx node 'output'), "
            f"not a single tensor"
        )
    body = _body(nodes)
    if not body:
        raise CutError(f"cannot cut {name}: its forward does no work")
    order = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=-1) for n in nodes}
    defined, points = [inputs[0]], []
    for n in body[:-1]:
        defined.append(n)
        points.append(Point(n, tuple(d for d in defined if last_use[d] > order[n])))
    return traced, points


def _body(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    return [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]


def _fx_chain(model: nn.Module) -> list[Block]:
    return fx_blocks(type(model).__name__, *traced_points(model))


def fx_blocks(name: str, traced: Traced, points: list[Point]) -> list[Block]:
    """The blocks of a traced forward: its pieces between the cut points; CutError where there is none."""
    gm = traced.module
    nodes = list(gm.graph.nodes)
    body, source, result = _body(nodes), nodes[0], nodes[-1].args[0]
    cuts = [(i, points[i].live) for i in chosen_points(points)]  # (index in body after which we cut, values)
    if not cuts and points:
        fewest = min(points, key=lambda p: len(p.live))
        bad = [v.name for v in fewest.live if not carried(v)]
        raise CutError(
            f"cannot cut {name} into blocks: at every point between its fx nodes a value that is not a tensor "
            f"is live (at best after node '{fewest.after.name}': {', '.join(bad)}), so no cut can pass it"
        )
    blocks: list[Block] = []
    start, values = 0, (source,)
    other = _in_eval_mode(traced)
    for i, live in cuts + [(len(body) - 1, (result,))]:
        seg = body[start : i + 1]
        module: nn.Module = _segment(gm, seg, values, live, name)
        if other is not None and any(n in other.differs for n in seg):
            ev = other.nodes
            module = ModeBlock(module, _segment(other.module, [ev[n] for n in seg], tuple(ev[v] for v in values),
                                                tuple(ev[v] for v in live), name), traced.root)
        blocks.append(Block(_label(seg), module))
        start, values = i + 1, live
    return blocks


@dataclass(frozen=True)
class _EvalGraph:
    """The eval-mode trace: its module, each train-mode node's counterpart, the nodes whose arguments differ."""

    module: torch.fx.GraphModule
    nodes: dict[torch.fx.Node, torch.fx.Node]
    differs: frozenset[torch.fx.Node]


def _in_eval_mode(traced: Traced) -> _EvalGraph | None:
    if traced.eval_module is None:
        return None
    train, ev = list(traced.module.graph.nodes), list(traced.eval_module.graph.nodes)
    positions = differing(traced.module.graph, traced.eval_module.graph) or set()
    return _EvalGraph(traced.eval_module, dict(zip(train, ev)), frozenset(train[i] for i in positions))


def chosen_points(points: list[Point]) -> list[int]:
    """Indices of the points cut at: every one-tensor point; in a longer stretch than SPAN without one, more.

    Those are tuple cuts at about every SPAN nodes, each at the point of its
    window with the fewest live values (the least to pass between stages).
    A model with one-tensor points every few nodes keeps exactly those; one
    without any gets at least one tuple cut where it can.
    """
    singles = [i for i, p in enumerate(points) if p.single]
    out: list[int] = []
    prev = -1
    for nxt in singles + [len(points)]:
        i = prev
        while nxt - i > SPAN:
            near = [j for j in range(i + SPAN // 2, i + SPAN + 1) if points[j].cut]
            later = [j for j in range(i + SPAN + 1, nxt) if points[j].cut][:1]
            if not near and not later:
                break
            i = min(near, key=lambda j: (len(points[j].live), -j)) if near else later[0]
            out.append(i)
        if nxt < len(points):
            out.append(nxt)
        prev = nxt
    if not out:  # a short forward with several tensors live everywhere: one tuple cut, where fewest are
        some = [j for j, p in enumerate(points) if p.cut]
        out = [min(some, key=lambda j: (len(points[j].live), -j))] if some else []
    return out


_SCALAR_METHODS = frozenset({"size", "dim", "numel", "nelement", "item", "tolist", "stride", "element_size",
                             "is_contiguous", "data_ptr", "__len__"})
_TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag", "data", "grad"})


def _scalar(node: torch.fx.Node) -> bool:
    """Does ``node`` compute something other than a tensor: a shape read, a number made of them?

    Such a value is per microbatch metadata, not an activation: no cut passes
    it (a stage can recompute it from the tensors it gets).
    """
    if node.op == "call_method":
        return node.target in _SCALAR_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return node.args[1] not in _TENSOR_ATTRS
    if node.target in (len, int, float, bool):
        return True
    nodes = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    if node.target is operator.getitem:
        return _scalar(nodes[0])
    return getattr(node.target, "__module__", None) in ("_operator", "math") and all(_scalar(a) for a in nodes)


def carried(node: torch.fx.Node) -> bool:
    """Can a cut pass this live value (a tensor, not a number or a tuple taken apart later)?"""
    return not _unpacked(node) and not _scalar(node)


def _unpacked(node: torch.fx.Node) -> bool:
    """Is ``node`` a tuple or list (``chunk``, ``split``) that only its items are taken from?

    Such a value is not one tensor, so no cut passes it; the cut falls where
    the items are joined again. (A tensor used only through indexing is
    passed over too: a cut point fewer, never a wrong one.)
    """
    return bool(node.users) and all(u.op == "call_function" and u.target is operator.getitem for u in node.users)


def _label(nodes: list[torch.fx.Node]) -> str:
    def one(n: torch.fx.Node) -> str:
        return str(n.target) if n.op == "call_module" else n.name

    return one(nodes[0]) if len(nodes) == 1 else f"{one(nodes[0])}..{one(nodes[-1])}"


def _segment(
    traced: torch.fx.GraphModule, seg: list[torch.fx.Node], src: tuple[torch.fx.Node, ...],
    dst: tuple[torch.fx.Node, ...], name: str
) -> torch.fx.GraphModule:
    """A GraphModule computing ``dst`` from ``src`` with the nodes of ``seg`` (several: a tuple in or out).

    It references the traced model's submodules and attributes, which are the
    user's own objects, so parameters are shared, not copied.
    """
    g = torch.fx.Graph()
    x = g.placeholder("x")
    env: dict[torch.fx.Node, torch.fx.Node] = (
        {src[0]: x} if len(src) == 1 else {v: g.call_function(operator.getitem, (x, k)) for k, v in enumerate(src)})

    def arg(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise ValueError(f"internal: node '{n.name}' is used outside its block")
            env[n] = g.node_copy(n, arg)
        return env[n]

    copy_nodes(g, seg, env, arg)
    g.output(arg(dst[0]) if len(dst) == 1 else tuple(arg(v) for v in dst))
    return torch.fx.GraphModule(traced, g, class_name=f"{name}Block")


@contextlib.contextmanager
def module_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Temporarily put every module in train or eval mode, restoring each flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t
