"""Which microbatch counts keep the user's math, and what the plan promises about it.

Microbatching changes a step's math only through what couples the samples
of a batch: a batch norm in training normalises each microbatch with that
microbatch's statistics, not the batch's; so does a forward that subtracts
``x.mean(0)`` or multiplies ``x.T @ x``. Everything else (convolutions,
per-sample norms, a mean loss weighted by each microbatch's share) gives
plain PyTorch's step within fp32 rounding. So with the default
``microbatches=None`` the planner may microbatch a model without such an
operation, and keeps one microbatch, the user's own step, for a model with
one; a count or ``"auto"`` given by the user allows accumulation, and the
plan's first line says which of the two contracts holds.

Coupling is read from what the forward computes, not from class names: the
model runs twice in train mode, on 2 and on 3 samples of the planning batch,
under a dispatch observer that records every aten operation, the module it
ran in and the shapes it saw. A dimension whose size differs between the
two runs carries the batch; an operation that normalises, reduces,
contracts or reorders along such a dimension (batch norm in training,
``mean``, ``mm``, ``softmax``, ``sort``, ...) or that returns nothing
carrying it couples the samples. So InstanceNorm, which torch computes as a
batch norm over a per-sample view, does not, and a user's own normalisation
calling ``F.batch_norm`` does. Where the runs cannot tell, the answer is
"coupled", with why: a custom autograd function (its backward is code; a
reentrant ``torch.utils.checkpoint`` is not one of them, its ops are the
forward's), a forward that runs other operations at the two sizes, or one
that fails on them. Both runs start from the user's random state and buffers, and leave
generators, buffers, ``.grad``, modes and hooks as they were.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointFunction

from ..options import DEFAULT_MICROBATCHES, MicrobatchSpec
from ..partition.blocks import module_mode
from ..snapshot import BufferSnapshot, rng_state, set_rng_state

__all__ = ["batch_coupled", "resolve_microbatches", "contract", "kept_note"]

Resolved = Union[int, Literal["auto"]]

SIZES = (2, 3)  # samples of the two observed forwards: dimensions whose size differs carry the batch

# Batch norms (aten's forms of F.batch_norm, SyncBatchNorm's statistics) that normalise over every dimension but 1.
_BATCH_NORMS = frozenset({
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "cudnn_batch_norm",
    "miopen_batch_norm", "_batch_norm_with_update", "_batch_norm_with_update_functional", "batch_norm_stats",
    "batch_norm_update_stats"})
# Operations that reduce, scan, sort or reorder along their ``dim``/``dims`` argument.
_ALONG = frozenset({
    "sum", "mean", "var", "std", "var_mean", "std_mean", "amax", "amin", "max", "min", "aminmax", "argmax",
    "argmin", "logsumexp", "norm", "linalg_vector_norm", "prod", "median", "nanmedian", "mode", "nansum",
    "nanmean", "any", "all", "count_nonzero", "kthvalue", "topk", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax", "sort", "argsort",
    "flip", "roll", "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add",
    "index_copy", "index_reduce", "index_fill", "diff", "glu"})
# Matrix products: the dimensions each contracts, by argument.
_CONTRACTED = {
    "mm": {"self": (1,), "mat2": (0,)}, "addmm": {"mat1": (1,), "mat2": (0,)},
    "bmm": {"self": (2,), "mat2": (1,)}, "baddbmm": {"batch1": (2,), "batch2": (1,)},
    "addbmm": {"batch1": (0, 2), "batch2": (0, 1)}, "mv": {"self": (1,), "vec": (0,)},
    "addmv": {"mat": (1,), "vec": (0,)}, "dot": {"self": (0,), "tensor": (0,)}, "vdot": {"self": (0,), "other": (0,)}}
# Operations that read only their input's metadata (a new tensor of a given size).
_METADATA = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"})


class _Shape(tuple):  # type: ignore[type-arg]
    """A tensor argument as the observer keeps it: its shape."""


@dataclass(frozen=True)
class _Op:
    where: str  # the module whose forward ran it
    name: str  # aten's operator name, without namespace and overload
    args: dict[str, Any]  # by the schema's names; tensors as their _Shape
    outs: tuple[_Shape, ...]


@dataclass
class _Run:
    ops: list[_Op] = field(default_factory=list)
    functions: list[tuple[str, str]] = field(default_factory=list)  # (module, custom autograd function)
    failed: str | None = None  # what the forward raised


def batch_coupled(model: nn.Module, batch: torch.Tensor) -> str | None:
    """What first couples the samples of a batch as ``model`` trains, in words (None: nothing does).

    For example ``"'norm' calls batch_norm over the batch"``. A model that
    trains with some modules frozen in eval mode runs as the user left it (a
    frozen BatchNorm normalises with its running statistics, per sample); a
    model left in eval mode as a whole (an engine whose first call is
    inference) says nothing about how it will train, and runs in train mode.
    """
    name = type(model).__name__
    runs: list[_Run] = []
    for n in SIZES:
        runs.append(_observe(model, batch, n))
        if runs[-1].failed is not None:
            return (f"{name}.forward fails on a batch of {n} samples ({runs[-1].failed}), so pipedp cannot read "
                    f"whether it couples them")
    a, b = runs
    for x, y in zip(a.ops, b.ops):
        if x.name != y.name:
            break
        label = _couples(x, y)
        if label is not None:
            return f"{_where(x.where, name)} calls {label} over the batch"
    if len(a.ops) != len(b.ops) or any(x.name != y.name for x, y in zip(a.ops, b.ops)):
        return (f"{name}.forward runs other operations on {SIZES[0]} samples than on {SIZES[1]}, so pipedp cannot "
                f"read whether it couples them")
    if a.functions:
        where, fn = a.functions[0]
        return f"{_where(where, name)} applies the custom autograd function {fn}, whose backward pipedp cannot read"
    return None


def _where(module: str, model: str) -> str:
    return f"'{module or model + '.forward'}'"


def _observe(model: nn.Module, batch: torch.Tensor, n: int) -> _Run:
    """The operations of one train-mode forward on ``n`` samples of ``batch``; the user's state put back after."""
    device = next((t.device for t in (*model.parameters(), *model.buffers())), batch.device)
    x = batch[torch.arange(n, device=batch.device) % batch.shape[0]].to(device)
    run = _Run()
    buffers = BufferSnapshot(model)
    buffers.save()
    grads = [(p, p.grad) for p in model.parameters()]
    start = rng_state()
    mode = contextlib.nullcontext() if model.training else module_mode(model, training=True)
    try:
        with mode, torch.enable_grad(), _tracked(model, run) as where, _Observer(run, where):
            try:
                model(x)
            except Exception as e:  # noqa: BLE001 - whatever the user's forward raises on a small batch
                run.failed = f"{type(e).__name__}: {e}"
    finally:
        set_rng_state(start)
        buffers.restore()
        for p, g in grads:
            p.grad = g
    return run


@contextlib.contextmanager
def _tracked(model: nn.Module, run: _Run) -> Iterator[list[str]]:
    """The stack of modules whose forward runs (innermost last), kept by hooks removed on exit.

    Each module's exit also claims the custom autograd functions its forward
    applied: the autograd nodes behind its outputs, down to its inputs', that
    no module inside it claimed first.
    """
    stack: list[str] = []
    inputs: list[set[Any]] = []
    seen: set[Any] = set()
    handles = []

    def enter(name: str) -> Any:
        def hook(_m: nn.Module, args: Any) -> None:
            stack.append(name)
            inputs.append({t.grad_fn for t in _tensors(args) if t.grad_fn is not None})
        return hook

    def leave(name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            stack.pop()
            boundary = inputs.pop()
            todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
            while todo:
                node = todo.pop()
                if node is None or node in seen or node in boundary:
                    continue
                seen.add(node)
                fn = getattr(node, "_forward_cls", None)
                if fn is not None and fn is not CheckpointFunction:  # a reentrant checkpoint's ops are observed
                    run.functions.append((name, fn.__name__))
                todo.extend(nxt for nxt, _ in node.next_functions)
        return hook

    try:
        for name, m in model.named_modules():
            with contextlib.suppress(RuntimeError):  # a scripted module takes no Python hooks: its parent counts
                handles.append(m.register_forward_pre_hook(enter(name)))
                handles.append(m.register_forward_hook(leave(name)))
        yield stack
    finally:
        for h in handles:
            h.remove()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class _Observer(TorchDispatchMode):
    """Records each aten operation with the module it runs in and the shapes of its tensors."""

    def __init__(self, run: _Run, where: list[str]) -> None:
        super().__init__()
        self.run, self.where = run, where

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.run.ops.append(_Op(self.where[-1] if self.where else "", func._schema.name.split("::")[-1],
                                _named(func, args, kwargs), tuple(_Shape(t.shape) for t in _tensors(out))))
        return out


def _named(func: Any, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The operation's arguments by their schema names, tensors replaced by their shapes."""
    def keep(v: Any) -> Any:
        return pytree.tree_map(lambda t: _Shape(t.shape) if isinstance(t, torch.Tensor) else t, v)

    named: dict[str, Any] = {}
    positional = iter(args)
    for a in func._schema.arguments:
        if not a.kwarg_only:
            v = next(positional, _MISSING)
            if v is not _MISSING:
                named[a.name] = keep(v)
                continue
        if a.name in kwargs:
            named[a.name] = keep(kwargs[a.name])
        elif a.has_default_value():
            named[a.name] = a.default_value
    return named


_MISSING = object()


def _carries(a: Any, b: Any) -> frozenset[int]:
    """The dimensions of a tensor argument that carry the batch: those whose size differs between the two runs."""
    if not isinstance(a, _Shape) or not isinstance(b, _Shape):
        return frozenset()
    if len(a) != len(b):
        return frozenset(range(len(a)))
    return frozenset(d for d, (x, y) in enumerate(zip(a, b)) if x != y)


def _dims(value: Any, ndim: int, empty_is_all: bool) -> frozenset[int]:
    if value is None or value == []:
        return frozenset(range(ndim)) if empty_is_all else frozenset()
    dims = value if isinstance(value, (list, tuple)) else [value]
    return frozenset(int(d) % ndim for d in dims) if ndim else frozenset()


Carries = dict[str, frozenset[int]]  # an operation's arguments: the dimensions of each that carry the batch
_NONE: frozenset[int] = frozenset()


def _couples(a: _Op, b: _Op) -> str | None:
    """The name of the operation ``a`` (on 2 samples; ``b``: on 3) where it mixes samples, else None."""
    carries = {k: _carries(v, b.args.get(k)) for k, v in a.args.items()}
    return next((label for rule in _RULES if (label := rule(a, b, carries)) is not None), None)


def _batch_norm(a: _Op, b: _Op, carries: Carries) -> str | None:
    """Batch norm in training normalises over every dimension but the channels'."""
    if a.name in _BATCH_NORMS and a.args.get("training", True) and carries.get("input", _NONE) - {1}:
        return "batch_norm"
    return None


def _along(a: _Op, b: _Op, carries: Carries) -> str | None:
    """A reduction, scan, sort or reorder along ``dim``: None or [] is every dimension (flip's [] is none)."""
    first = next((k for k, v in a.args.items() if isinstance(v, _Shape)), None)
    along = "dim" if "dim" in a.args else "dims" if "dims" in a.args else None  # sum.default: see _reduced
    if a.name not in _ALONG or first is None or along is None:
        return None
    dims = _dims(a.args[along], len(a.args[first]), empty_is_all=a.name != "flip")
    return a.name.lstrip("_") if dims & carries[first] else None


def _layer_norm(a: _Op, b: _Op, carries: Carries) -> str | None:
    if a.name != "native_layer_norm":
        return None
    ndim = len(a.args["input"])
    return "layer_norm" if set(range(ndim - len(a.args["normalized_shape"]), ndim)) & carries["input"] else None


def _indexed(a: _Op, b: _Op, carries: Carries) -> str | None:
    """``x[perm]``, ``x[mask]`` on a dimension that carries the batch: other samples, or in another order."""
    if a.name.lstrip("_") not in ("index", "unsafe_index", "index_put", "index_put_impl", "unsafe_index_put"):
        return None
    indexed = {d for d, i in enumerate(a.args.get("indices") or ()) if i is not None}
    return "index" if indexed & carries.get("self", _NONE) else None


def _contracted(a: _Op, b: _Op, carries: Carries) -> str | None:
    """A matrix product summing over a dimension that carries the batch (``x.T @ x``)."""
    hit = any(set(dims) & carries.get(arg, _NONE) for arg, dims in _CONTRACTED.get(a.name, {}).items())
    return a.name if hit else None


def _convolution(a: _Op, b: _Op, carries: Carries) -> str | None:
    """A convolution over channels (or positions) that carry the batch, unless its groups keep samples apart."""
    if a.name != "convolution" or a.args.get("groups") != b.args.get("groups"):
        return None
    return a.name if carries.get("input", _NONE) - {0} or carries.get("weight", _NONE) else None


def _attention(a: _Op, b: _Op, carries: Carries) -> str | None:
    """Fused attention whose keys (or features) carry the batch."""
    if not a.name.startswith("_scaled_dot_product") or not isinstance(a.args.get("key"), _Shape):
        return None
    k, q = len(a.args["key"]), len(a.args["query"])
    mixed = carries["key"] & {k - 2, k - 1} or carries.get("query", _NONE) & {q - 1}
    return "scaled_dot_product_attention" if mixed else None


def _reduced(a: _Op, b: _Op, carries: Carries) -> str | None:
    """Any other operation whose inputs carry the batch and whose outputs do not: a reduction over it."""
    if a.name in _METADATA or not a.outs or not any(carries.values()):
        return None
    return None if any(_carries(x, y) for x, y in zip(a.outs, b.outs)) else a.name.lstrip("_")


_RULES = (_batch_norm, _along, _layer_norm, _indexed, _contracted, _convolution, _attention, _reduced)


def resolve_microbatches(requested: MicrobatchSpec, stages: object, coupled: str | None) -> Resolved:
    """The microbatch spec the planner works with: the user's count or ``"auto"``, or what ``None`` allows.

    ``None``: one microbatch where something couples the batch; else
    ``"auto"`` with ``stages="auto"`` (the trials choose) and
    :data:`~pipedp.options.DEFAULT_MICROBATCHES` with a given stage count.
    """
    if requested is not None:
        return requested
    if coupled is not None:
        return 1
    return "auto" if stages == "auto" else DEFAULT_MICROBATCHES


def contract(microbatches: int, coupled: str | None) -> str:
    """The plan's promise about its math, in the words the README uses."""
    if microbatches == 1:
        return "the same math as your step"
    if coupled is None:
        return (f"the same math as your step (accumulation over {microbatches} microbatches; no layer couples the "
                f"samples of a batch)")
    return f"accumulation over {microbatches} microbatches, which can change the math of your step: {coupled}"


def kept_note(requested: MicrobatchSpec, stages: object, coupled: str | None, ranks: int = 1) -> list[str]:
    """Where ``None`` kept one microbatch for a pipeline the user asked for (stages, or ``ranks`` pipeline
    ranks): how to let it overlap."""
    single = stages == 1 or (isinstance(stages, (list, tuple)) and len(stages) == 1)
    asked = ranks > 1 or (stages != "auto" and not single)
    if requested is not None or coupled is None or not asked:
        return []
    return [f"microbatches: 1, the same math as your step ({coupled}), so the stages run one after another; pass "
            f"microbatches=N or 'auto' to overlap them (accumulation: each microbatch then over its own samples)"]
