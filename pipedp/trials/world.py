"""``pp="auto"`` for an engine: the global batch it plans on, the layouts it may build, a trial per layout.

The engine asks :func:`choose_layout` once, before it makes its
communicator; each layout the choice times for real is an engine of its own
(made by the ``make`` it is handed) on a copy of the model, so the user's
model, optimizer and options stay untouched.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from ..build import sample_batch
from ..decide.coupling import Resolved, batch_coupled, resolve_microbatches
from ..decide.cut import AUTO_MICROBATCHES
from ..decide.layout import Layout
from ..decide.schedules import layout_schedules
from ..decide.world import Trial, WorldChoice, choose_world
from ..options import DataParallelOptions, KernelOptions, PipelineOptions, TrainingOptions
from ..partition.parts import surrogate_loss

__all__ = ["AUTO_REDUCE_DTYPE", "choose_layout", "global_batch", "world_microbatches"]

# What reduce_dtype="auto" lets pp="auto" weigh: bf16 keeps fp32's range (an fp16 sum can overflow), and both
# NCCL and gloo reduce it.
AUTO_REDUCE_DTYPE = torch.bfloat16


class TrialEngine(Protocol):
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> object: ...

    def close(self) -> None: ...


MakeEngine = Callable[..., TrialEngine]  # Engine(model, optimizer=, loss_fn=, pipeline=, ...), keywords as Engine's


def world_microbatches(spec: Resolved) -> list[int]:
    """The microbatch counts ``pp="auto"`` may give its layouts: the resolved request's, or all of auto's."""
    return list(AUTO_MICROBATCHES) if spec == "auto" else [int(spec)]


def global_batch(model: nn.Module, sample: torch.Tensor | Sequence[int] | None,
                 opts: PipelineOptions) -> torch.Tensor:
    """The global batch ``pp="auto"`` plans on, checked against the options it cannot honour."""
    if sample is None:
        raise ValueError("pp='auto' chooses the world's layout when the engine is made: pass sample= (the "
                         "global batch of one step over all ranks, or its shape), or pass pp=N")
    if opts.stages != "auto" or opts.threads is not None:
        given = f"stages={opts.stages!r}" if opts.stages != "auto" else f"threads={opts.threads!r}"
        raise ValueError(f"pp='auto' chooses each layout's cut itself, so {given} cannot be honoured: leave "
                         f"stages='auto' and threads=None, or pass pp=N with your cut")
    return sample_batch(model, sample)


def choose_layout(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  sample: torch.Tensor | Sequence[int] | None, device: torch.device, pipeline: PipelineOptions,
                  data_parallel: DataParallelOptions, training: TrainingOptions, make: MakeEngine,
                  ) -> tuple[WorldChoice, torch.Tensor]:
    """The world's layout for ``model`` (collective: every rank calls it) and this replica's share of the sample."""
    batch = global_batch(model, sample, pipeline)
    coupled = batch_coupled(model, batch)
    allowed = world_microbatches(resolve_microbatches(pipeline.microbatches, pipeline.stages, coupled))
    # The default's one microbatch for exact BatchNorm math: the pipelines it rules out are shown, not run.
    withheld = [m for m in AUTO_MICROBATCHES if m not in allowed] if pipeline.microbatches is None else []
    world = choose_world(
        model, batch, device, _trial(model, optimizer, batch, pipeline, data_parallel, training, make),
        microbatches=allowed, budget_s=pipeline.plan_budget_s, bucket_bytes=data_parallel.bucket_bytes,
        schedules=layout_schedules(pipeline.schedule), depth=pipeline.depth, withheld=withheld, coupled=coupled,
        reduce_dtypes=(None, AUTO_REDUCE_DTYPE) if data_parallel.reduce_dtype == "auto" else (
            data_parallel.reduce_dtype,))
    return world, batch[: batch.shape[0] // world.layout.dp]


def _trial(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: torch.Tensor,
           pipeline: PipelineOptions, data_parallel: DataParallelOptions, training: TrainingOptions,
           make: MakeEngine) -> Trial:
    """How ``pp="auto"`` times a layout: an engine of it on a copy of the model (the user's stays untouched),
    with the user's optimizer class and defaults, the user's numerics, torch's own kernels and a surrogate loss."""

    def trial(layout: Layout) -> tuple[Callable[[], None], Callable[[], None]]:
        x = batch[: batch.shape[0] // layout.dp]
        y = torch.zeros(x.shape[0])
        opt = None if optimizer is None else (lambda params: type(optimizer)(params, **optimizer.defaults))
        engine = make(
            copy.deepcopy(model), optimizer=opt, loss_fn=surrogate_loss,
            pipeline=replace(pipeline, stages=list(layout.counts), microbatches=layout.microbatches,
                             schedule=layout.schedule, profile=False, progress=False),
            data_parallel=replace(data_parallel, pp=layout.pp, reduce_dtype=layout.reduce_dtype),
            kernels=KernelOptions(mode="torch"),
            training=training, sample=x)

        def step() -> None:
            engine.train_step(x, y)

        return step, engine.close

    return trial
