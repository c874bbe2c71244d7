"""The rules across option groups, in one place, and the settings every rank must share.

Each option group checks its own fields when made; what depends on two
groups or the devices is checked here, once, at wrap, before
any model is touched. The settings ranks must share are derived from the
option fields: a field is shared unless its metadata marks it ``local``
(where a rank's value may differ: its devices, its progress output).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Sequence

import torch

from ..options import ConcurrencyOptions, PipelineOptions, TrainingOptions

__all__ = ["check_rules", "shared_settings"]


def check_rules(pipeline: PipelineOptions, training: TrainingOptions, concurrency: ConcurrencyOptions,
                devices: Sequence[torch.device]) -> None:
    """Refuse combinations that would not be exact or would not run: a clear error naming the fix."""
    if training.compile is True and concurrency.branches:
        raise ValueError(
            "branches=True with compile=True: the swapped blocks order streams by events, "
            "which torch.compile does not trace. Use compile=False with them, or turn them off")
    if training.compile is True and concurrency.split_grads:
        raise ValueError(
            "split_grads=True with compile=True: a compiled stage's backward computes its weight gradients "
            "inside the compiled graph, so none is left for the side lane. Use compile=False with it, or turn it off")
    if concurrency.early_update:
        check_early_update(clip=training.clip_grad_norm, precision=training.precision,
                           hook=training.grad_hook is not None)
    if pipeline.cuda_graph and training.precision == "fp16":
        raise ValueError(
            "precision='fp16' with cuda_graph=True is not supported yet: its loss scaling decides on the host "
            "whether to skip a step with inf/NaN gradients. Use precision='bf16' (no loss scaling) with "
            "cuda_graph=True, or cuda_graph=False"
        )
    if pipeline.cuda_graph and (len(devices) != 1 or devices[0].type != "cuda"):
        raise ValueError(
            f"cuda_graph=True needs all stages on one CUDA device, got devices "
            f"{[str(d) for d in devices]}: pass devices='cuda' or cuda_graph=False"
        )


def shared_settings(*groups: Any) -> dict[str, Any]:
    """Every field of the option groups that is not marked ``local``, keyed ``Group.field``."""
    out: dict[str, Any] = {}
    for g in groups:
        if not is_dataclass(g):
            raise TypeError(f"shared_settings takes option groups (dataclasses), got {type(g).__name__}")
        for f in fields(g):
            if not f.metadata.get("local", False):
                out[f"{type(g).__name__}.{f.name}"] = getattr(g, f.name)
    return out


def check_early_update(*, clip: float | None, precision: str, hook: bool = False) -> None:
    """Refuse what an early, per-stage update cannot do exactly."""
    if hook:
        raise ValueError(
            "early_update=True with grad_hook: the hook sees all of a step's gradients before any update, but an "
            "early update steps each stage as its backward ends. Pass early_update=False to use grad_hook")
    if clip is not None:
        raise ValueError(
            "early_update=True with clip_grad_norm: clipping scales every gradient by the norm over all of "
            "them, which is known only after the last stage's backward. Pass early_update=False to clip, or "
            "clip_grad_norm=None")
    if precision == "fp16":
        raise ValueError(
            "early_update=True with precision='fp16': loss scaling skips a step when any gradient holds "
            "inf/NaN, which is known only after the whole backward. Use precision='bf16' (no loss scaling) or "
            "early_update=False")
