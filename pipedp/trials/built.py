"""The trials of one build: the device clock of timed trials and the step clock of concurrent CPU stages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn

from ..comm import Communicator
from ..decide.config import Config
from ..decide.decision import Decision
from ..decide.levers import settle
from ..decide.measuring import KernelSwitch
from ..decide.schedules import fixed
from ..lower import make_executor, trial
from ..options import ConcurrencyOptions, PipelineOptions, TrainingOptions
from ..partition.parts import Parts
from ..pipeline import microbatch
from .clock import DeviceClock

if TYPE_CHECKING:
    from ..partition.threads import CpuPlan

__all__ = ["BuiltTrials"]


class BuiltTrials:
    """:class:`~pipedp.decide.measuring.Trials` for ``model`` cut into ``parts``, on ``batch`` and ``devices``."""

    def __init__(self, model: nn.Module, parts: Parts, batch: torch.Tensor, devices: Sequence[torch.device],
                 options: PipelineOptions, comm: Communicator, training: TrainingOptions,
                 concurrency: ConcurrencyOptions | None = None) -> None:
        self.model, self.parts, self.batch, self.devices = model, parts, batch, list(devices)
        self.options, self.comm, self.training, self.concurrency = options, comm, training, concurrency
        self.runs: dict[CpuPlan, Callable[[], object]] = {}  # kept warm: a plan timed again runs warm

    def clock(self, kernels: KernelSwitch | None) -> DeviceClock:
        return DeviceClock(self.model, self.parts, self.batch, self.devices, self.options, self.comm, self.training,
                           self.concurrency, kernels=kernels)

    def thread_plan_ms(self, plan: CpuPlan) -> float:
        """A first step also allocates; every plan's first step pays that alike, so none is left out."""
        if plan not in self.runs:
            config = Config(plan.counts, plan.microbatches, threads=plan.threads)
            planned = settle(Decision(config, schedule=fixed(self.options.schedule)), self.options, self.training,
                             None, [self.batch.device], self.comm.pp, trial=True)
            ex, _ = make_executor(self.parts, planned, self.comm)
            xs = microbatch.split(self.batch, plan.microbatches)
            w = microbatch.shares([t.shape[0] for t in xs])
            self.runs[plan] = trial(ex, self.parts, xs, xs, w)
        from ..partition.threads import step_ms  # CPU thread teams: an add-on, loaded where asked for

        return step_ms(self.runs[plan], warmup=False)
