"""State that ranks must share: the model they train, the planning decision, checkpoints, RNG streams.

Every helper here that communicates is collective over the groups it names,
so every rank of the layout calls it at the same point, and waits at most the
layout's timeout (a :class:`~pipedp.distributed.DistributedError` past it).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .distributed import DistributedError, Layout, broadcast_object, gather_objects, timed

__all__ = [
    "broadcast_decision", "gather_rng", "merge_pipeline_state", "share_loss", "model_signature", "mismatch_message",
    "check_same_model",
]

Entry = tuple[str, str, str]  # (kind, name, what it must be on every rank)


def share_loss(loss: torch.Tensor | None, lay: Layout, device: torch.device, step: int) -> torch.Tensor:
    """The last pipeline rank's loss on every rank of the pipeline (others pass None)."""
    buf = loss.detach().float().reshape(1) if loss is not None else torch.zeros(1, device=device)
    try:
        timed(lambda: dist.broadcast(buf, src=lay.pp_peer(lay.pp - 1), group=lay.pp_group, async_op=True),
              lay.timeout, [buf], device_side=buf.is_cuda)  # NCCL: no host sync inside a step
    except DistributedError as e:
        raise DistributedError(
            f"sharing the loss over the pipeline ranks failed at step {step} (this is rank {lay.rank}): "
            f"a peer died or hung. Cause: {e}"
        ) from e
    return buf[0]


def broadcast_decision(decision: Any, lay: Layout) -> Any:
    """The first rank's (profiles, counts, notes) on every rank: all must run the same cut.

    The first pipeline shares it along its ranks, then each pipeline rank with
    its data-parallel peers.
    """
    if lay.pp > 1 and lay.dp_rank == 0:
        decision = broadcast_object(decision, lay.pp_peer(0), lay.pp_group, lay.timeout)
    if lay.dp > 1:
        decision = broadcast_object(decision, dist.get_global_rank(lay.dp_group, 0), lay.dp_group, lay.timeout)
    return decision


def gather_rng(mine: dict[str, Any], lay: Layout) -> list[dict[str, Any]]:
    """Every rank's RNG state, indexed by global rank."""
    return gather_objects(mine, lay.everyone, lay.timeout)


def merge_pipeline_state(
    model: nn.Module,
    stages: Sequence[Any],
    optimizer: torch.optim.Optimizer | None,
    lay: Layout,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Full model and optimizer state of a pipeline whose stages live on different ranks.

    Each rank trains only its stages' parameters; the rest of its copy of the
    model is stale. Every rank contributes the entries it owns, and all get
    the merged state. Optimizer state is keyed by parameter index, the same on
    every rank (all build the optimizer on the full model).
    """
    model_state = model.state_dict()
    owned = {id(t) for st in stages for t in (*st.chain.parameters(), *st.chain.buffers())}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    keys = {name for name, t in named if id(t) in owned}
    mine_model = {k: v.detach().cpu() for k, v in model_state.items() if k in keys}
    optim_state = optimizer.state_dict() if optimizer is not None else None
    mine_optim = None
    if optimizer is not None and optim_state is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        idx = {i for i, p in enumerate(params) if id(p) in owned}
        mine_optim = {i: _cpu(v) for i, v in optim_state["state"].items() if i in idx}
    parts = gather_objects((mine_model, mine_optim), lay.pp_group, lay.timeout)
    merged_model = dict(model_state)
    merged_state: dict[Any, Any] = {}
    for part_model, part_optim in parts:
        merged_model.update(part_model)
        merged_state.update(part_optim or {})
    merged_optim = None
    if optim_state is not None:
        merged_optim = {**optim_state, "state": dict(sorted(merged_state.items()))}
    return merged_model, merged_optim


def _cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, dict):
        return {k: _cpu(x) for k, x in v.items()}
    return v


def _plain(v: Any) -> str:
    """A value as text that is equal on every rank for equal values (no addresses, no device names)."""
    if isinstance(v, torch.Tensor):
        return repr(v.detach().cpu().tolist())
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_plain(x) for x in v) + ")"
    return type(v).__qualname__


def _tensor_entries(kind: str, named: Iterable[tuple[str, torch.Tensor]]) -> list[Entry]:
    first: dict[int, str] = {}
    out: list[Entry] = []
    for name, t in named:
        if id(t) in first:  # tied: which tensors are one decides what gradient sync averages once
            out.append((kind, name, f"the same tensor as '{first[id(t)]}'"))
            continue
        first[id(t)] = name
        grad = "" if kind == "buffer" else ", trainable" if t.requires_grad else ", frozen"
        out.append((kind, name, f"shape {tuple(t.shape)}, {t.dtype}{grad}"))
    return out


def model_signature(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    settings: Mapping[str, Any]) -> list[Entry]:
    """What must be equal on every rank for the ranks to train one model together, in model order.

    Parameters (name, shape, dtype, trainable, ties: the gradient buckets are
    built from them, and a bucket of another size aborts the collective),
    buffers, modules with their settings (the same parameters in another
    architecture would train silently apart), the options that shape the
    program of messages, and the optimizer's type and hyper-parameters.
    Values are not compared: ranks may load a checkpoint after wrap().
    """
    out = _tensor_entries("parameter", model.named_parameters(remove_duplicate=False))
    out += _tensor_entries("buffer", model.named_buffers(remove_duplicate=False))
    out += [("module", name or "(the model)", f"{type(m).__qualname__}({m.extra_repr()})")
            for name, m in model.named_modules()]
    out += [("option", key, _plain(v)) for key, v in settings.items()]
    if optimizer is not None:
        out.append(("optimizer", "type", type(optimizer).__qualname__))
        for i, g in enumerate(optimizer.param_groups):
            hyper = ", ".join(f"{k}={_plain(v)}" for k, v in sorted(g.items()) if k != "params")
            out.append(("optimizer", f"param_groups[{i}]", f"{len(g['params'])} parameters, {hyper}"))
    return out


def _first_difference(ref: Sequence[Entry], other: Sequence[Entry], rank: int) -> str:
    i = next(i for i in range(max(len(ref), len(other))) if i >= len(ref) or i >= len(other) or ref[i] != other[i])
    if i >= len(ref):
        kind, name, what = other[i]
        return f"rank {rank} has {kind} '{name}' ({what}) where rank 0 has none"
    kind, name, what = ref[i]
    if i >= len(other):
        return f"rank 0 has {kind} '{name}' ({what}) where rank {rank} has none"
    kind2, name2, what2 = other[i]
    if (kind, name) == (kind2, name2):
        return f"{kind} '{name}' is {what} on rank 0 but {what2} on rank {rank}"
    return f"rank 0 has {kind} '{name}' ({what}) where rank {rank} has {kind2} '{name2}' ({what2})"


def mismatch_message(signatures: Sequence[Sequence[Entry]]) -> str | None:
    """Which ranks' signatures differ from rank 0's and their first difference (None: all equal)."""
    ref = list(signatures[0])
    odd = [r for r, sig in enumerate(signatures) if list(sig) != ref]
    if not odd:
        return None
    return (
        f"the ranks do not hold the same model: rank(s) {odd} differ from rank 0. First difference: "
        f"{_first_difference(ref, list(signatures[odd[0]]), odd[0])}. Every rank must build the same model, "
        f"optimizer and options (same code and arguments) before wrap()"
    )


def check_same_model(signature: list[Entry], lay: Layout) -> None:
    """A ValueError on every rank unless every rank's ``signature`` equals rank 0's.

    Only digests travel unless they differ; then every rank gathers all
    signatures, so every rank raises the same message.
    """
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()
    if len(set(gather_objects(digest, lay.everyone, lay.timeout))) == 1:
        return
    message = mismatch_message(gather_objects(signature, lay.everyone, lay.timeout))
    if message is not None:
        raise ValueError(message)
