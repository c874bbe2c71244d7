"""``pipedp.wrap``: the one call most users need, with every option as a typed keyword."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from .build import sample_batch
from .device import DeviceSpec
from .distributed import DEFAULT_TIMEOUT_S
from .engine import Engine
from .optimizer import OptimizerSpec
from .options import (
    DEFAULT_BUCKET_MB, ConcurrencyOptions, GradHook, DataParallelOptions, KernelOptions, MicrobatchSpec, PipelineOptions,
    RecomputeSpec, StagesSpec, ThreadsSpec, TrainingOptions,
)
from .partition.report import CutReport, inspect_cut
from .snapshot import forked_rng
from .step import LossFn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["wrap", "inspect"]


def wrap(
    model: nn.Module,
    *,
    optimizer: OptimizerSpec = None,
    loss_fn: LossFn | None = None,
    microbatches: MicrobatchSpec = None,
    stages: StagesSpec = "auto",
    schedule: str = "1f1b",
    devices: DeviceSpec = None,
    batchnorm: str = "microbatch",
    profile: bool = True,
    depth: int = 1,
    sample: torch.Tensor | Sequence[int] | None = None,
    measure_steps: int = 3,
    progress: bool = True,
    cuda_graph: bool = False,
    rollback: bool = True,
    threads: ThreadsSpec = None,
    plan_budget_s: float = 30.0,
    plan_cache: bool | str | os.PathLike[str] = True,
    decision: Mapping[str, Any] | None = None,
    pp: int | str = 1,
    mesh: DeviceMesh | None = None,
    dp_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    reduce_dtype: torch.dtype | str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    distributed: bool = True,
    kernels: str = "auto",
    kernel_db: str | None = None,
    precision: str = "fp32",
    channels_last: bool | str = "auto",
    compile: bool | str = False,
    clip_grad_norm: float | None = None,
    recompute: RecomputeSpec = False,
    grad_hook: GradHook | None = None,
    branches: bool = False,
    split_grads: bool = False,
    early_update: bool = False,
) -> Engine:
    """Cut ``model`` into balanced stages and train it as a microbatch pipeline.

    The keywords are those of :class:`~pipedp.PipelineOptions` (microbatches
    to plan_cache), :class:`~pipedp.DataParallelOptions` (pp to timeout;
    ``distributed`` is its ``enabled``), :class:`~pipedp.KernelOptions`
    (``kernels``, ``kernel_db``) and :class:`~pipedp.TrainingOptions`
    (precision to recompute), :class:`~pipedp.ConcurrencyOptions` (branches,
    split_grads, early_update); ``sample`` (a batch or its shape) plans now
    instead of on the first batch; ``decision`` (``engine.decision_record()``, or a checkpoint's
    ``["engine"]["decision"]``) rebuilds that plan without planning. ``optimizer`` is built on
    ``model.parameters()`` (or a factory of them); ``loss_fn`` is called as
    ``loss_fn(output, target)`` and returns a scalar: the batch's mean, or its sum when
    ``loss_fn.reduction`` is ``"sum"``. An optimizer whose ``step`` needs a closure (LBFGS) is refused.
    Both are needed for ``train_step``, not for inference.
    """
    return Engine(
        model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        pipeline=PipelineOptions(
            microbatches=microbatches, stages=stages, schedule=schedule, devices=devices, batchnorm=batchnorm,
            profile=profile, depth=depth, measure_steps=measure_steps, progress=progress, cuda_graph=cuda_graph,
            rollback=rollback, threads=threads, plan_budget_s=plan_budget_s, plan_cache=plan_cache,
        ),
        data_parallel=DataParallelOptions(
            enabled=distributed, pp=pp, mesh=mesh, dp_group=dp_group, pp_group=pp_group, bucket_mb=bucket_mb,
            reduce_dtype=reduce_dtype, timeout=timeout,
        ),
        kernels=KernelOptions(mode=kernels, db=kernel_db),
        training=TrainingOptions(
            precision=precision, channels_last=channels_last, compile=compile, clip_grad_norm=clip_grad_norm,
            recompute=recompute, grad_hook=grad_hook,
        ),
        concurrency=ConcurrencyOptions(branches=branches, split_grads=split_grads, early_update=early_update),
        sample=sample,
        decision=decision,
    )


def inspect(model: nn.Module, sample: torch.Tensor | Sequence[int], *, depth: int = 1) -> CutReport:
    """Where ``model`` can be cut, before any step: its blocks, the modules kept whole while tracing and why,
    the stretches of its forward with no cut point, or why it is not cut at all (``stages="auto"`` then trains
    it as one stage). ``sample``: a batch, or its shape. ``print()`` the result."""
    devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
    with forked_rng(devices):  # the check runs the model: its dropout draws leave the user's generators alone
        return inspect_cut(model, sample_batch(model, sample), depth=depth)
