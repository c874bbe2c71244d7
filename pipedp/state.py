"""State that ranks must share: the planning decision, checkpoints of a pipeline, RNG streams.

Every helper here is collective over the groups it names, so every rank of
the layout calls it at the same point.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .distributed import DistributedError, Layout

__all__ = ["broadcast_decision", "gather_rng", "merge_pipeline_state", "share_loss"]


def share_loss(loss: torch.Tensor | None, lay: Layout, device: torch.device, step: int) -> torch.Tensor:
    """The last pipeline rank's loss on every rank of the pipeline (others pass None)."""
    buf = loss.detach().float().reshape(1) if loss is not None else torch.zeros(1, device=device)
    try:
        dist.broadcast(buf, src=lay.pp_peer(lay.pp - 1), group=lay.pp_group)
    except RuntimeError as e:
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
    box = [decision]
    if lay.pp > 1 and lay.dp_rank == 0:
        dist.broadcast_object_list(box, src=lay.pp_peer(0), group=lay.pp_group)
    if lay.dp > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(lay.dp_group, 0), group=lay.dp_group)
    return box[0]


def gather_rng(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state, indexed by global rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


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
    parts: list[Any] = [None] * lay.pp
    dist.all_gather_object(parts, (mine_model, mine_optim), group=lay.pp_group)
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
