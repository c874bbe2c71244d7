"""Concurrent CPU stages (``threads`` set): cut, threads per stage and microbatches by measured steps.

The model of each block's time against its thread count and the refinement
on measured steps live in :mod:`pipedp.partition.threads`; here a candidate
plan becomes a real executor, kept warm so a plan timed again runs warm (a
first step also allocates; every plan's first step pays that alike).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..comm import Communicator
from ..lower import Parts, make_executor, trial
from ..options import PipelineOptions, TrainingOptions
from ..partition.blocks import Block
from ..partition.profile import BlockProfile
from ..partition.threads import CpuPlan, at_threads, plan_cpu, step_ms
from ..pipeline import microbatch
from .config import Config
from .decision import Decision
from .schedules import fixed

__all__ = ["decide_cpu"]


def decide_cpu(parts: Parts, blocks: list[Block], profiles: Sequence[BlockProfile], sample: torch.Tensor,
               batch: torch.Tensor, options: PipelineOptions, comm: Communicator, training: TrainingOptions,
               choices: Sequence[int], channels_last: bool, *, compiled: bool = False,
               ) -> tuple[list[BlockProfile], Decision]:
    """The plan of concurrent CPU stages; the profiles returned are the blocks' times at their planned threads."""
    runs: dict[CpuPlan, Callable[[], object]] = {}

    def measure(plan: CpuPlan) -> float:
        if plan not in runs:
            ex, _ = make_executor(parts, list(plan.counts), plan.microbatches, [batch.device], options, comm,
                                  training=training, threads=plan.threads, schedule=fixed(options.schedule))
            xs = microbatch.split(batch, plan.microbatches)
            w = microbatch.shares([t.shape[0] for t in xs])
            runs[plan] = trial(ex, parts, xs, xs, w)
        return step_ms(runs[plan], warmup=False)

    size = microbatch.sizes(batch.shape[0], max(choices))[0]

    def relative(m: int) -> float:  # a microbatch of M's size, over the profiled (smallest) one
        return microbatch.sizes(batch.shape[0], m)[0] / size

    choice, curves = plan_cpu(
        blocks, sample, threads=options.threads, stages=options.stages, microbatches=choices,
        sizes=relative, schedule=fixed(options.schedule),
        measure=measure if options.profile else None, copy_input=parts.copy_input, host_profiles=profiles,
        profiled=options.profile)
    plan, scale = choice.plan, relative(choice.plan.microbatches)
    config = Config(plan.counts, plan.microbatches, channels_last, compiled, threads=plan.threads)
    return at_threads(profiles, curves, plan, scale), Decision(config, choice.notes)
