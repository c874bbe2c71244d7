"""Concurrent CPU stages (``threads`` set): cut, threads per stage and microbatches by measured steps.

The model of each block's time against its thread count and the refinement
on measured steps live in :mod:`pipedp.partition.threads`; the steps are
timed through the trials' clock (:mod:`pipedp.trials.built`), which runs a
candidate on the executor the build would make.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..options import PipelineOptions
from ..partition.blocks import Block
from ..partition.parts import Parts
from ..partition.profile import BlockProfile
from ..partition.threads import CpuPlan, at_threads, plan_cpu
from ..pipeline import microbatch
from .config import Config
from .decision import Choice

__all__ = ["decide_cpu"]


def decide_cpu(parts: Parts, blocks: list[Block], profiles: Sequence[BlockProfile], sample: torch.Tensor,
               batch: torch.Tensor, options: PipelineOptions, measure: Callable[[CpuPlan], float],
               choices: Sequence[int], channels_last: bool, *, compiled: bool = False, schedule: str = "1f1b",
               ) -> tuple[list[BlockProfile], Choice]:
    """The plan of concurrent CPU stages; the profiles returned are the blocks' times at their planned threads.

    ``measure``: ms of a candidate's step, run as the build would run it
    (:meth:`~pipedp.decide.measuring.Trials.thread_plan_ms`).
    """
    size = microbatch.sizes(batch.shape[0], max(choices))[0]

    def relative(m: int) -> float:  # a microbatch of M's size, over the profiled (smallest) one
        return microbatch.sizes(batch.shape[0], m)[0] / size

    choice, curves = plan_cpu(
        blocks, sample, threads=options.threads, stages=options.stages, microbatches=choices,
        sizes=relative, schedule=schedule,
        measure=measure if options.profile else None, copy_input=parts.copy_input, host_profiles=profiles,
        profiled=options.profile)
    plan, scale = choice.plan, relative(choice.plan.microbatches)
    config = Config(plan.counts, plan.microbatches, channels_last, compiled, threads=plan.threads)
    return at_threads(profiles, curves, plan, scale), Choice(config, choice.notes, schedule=schedule)
