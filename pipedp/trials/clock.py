"""The real clock of the search: a configuration run on the device, timed in short windows.

The user's own step (``own``) is the unmodified model on the whole batch,
compiled as a whole when the configuration says so; a plan runs through the
same executor the build makes. Both run in the configuration's memory
layout (the model is converted in place between trials; the build puts it in
the chosen layout afterwards), in the user's precision (the hint's trial in
its own), on the configuration's depthwise kernels (the own step on torch's),
and captured as a CUDA graph when the user asked for graphs. Runs are kept
per configuration, so a configuration timed again runs warm and a compiled
one is compiled once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import nn

from ..comm import Communicator
from ..decide.config import Config
from ..decide.decision import Decision
from ..decide.levers import settle
from ..decide.measuring import KernelSwitch
from ..decide.schedules import fixed
from ..device import sync_devices
from ..lower import in_layout, make_executor, set_layout, trial
from ..options import AUTOCAST_DTYPES, ConcurrencyOptions, PipelineOptions, TrainingOptions
from ..partition.parts import OneTensor, Parts, surrogate_loss
from ..pipeline import microbatch
from ..pipeline.graphed import captured_call
from ..pipeline.stage import Stage

__all__ = ["DeviceClock", "windows_ms"]

WINDOW_STEPS = 3  # steps per timed window (fewer when a trial has fewer steps)


def windows_ms(run: Callable[[], object], steps: int, devices: Sequence[torch.device]) -> float:
    """Median ms per call of ``run`` over ``steps`` calls, in windows of up to WINDOW_STEPS calls."""
    per = min(WINDOW_STEPS, steps)
    times = []
    for _ in range(max(1, steps // per)):
        sync_devices(devices)
        t0 = time.perf_counter()
        for _ in range(per):
            run()
        sync_devices(devices)
        times.append((time.perf_counter() - t0) * 1e3 / per)
    return statistics.median(times)


class DeviceClock:
    """:class:`~pipedp.decide.measuring.Clock` on the device: each configuration lowered as the build lowers it."""

    def __init__(self, model: nn.Module, parts: Parts, batch: torch.Tensor, devices: Sequence[torch.device],
                 options: PipelineOptions, comm: Communicator, training: TrainingOptions,
                 concurrency: ConcurrencyOptions | None = None, kernels: KernelSwitch | None = None,
                 ) -> None:
        self.model, self.parts, self.batch, self.devices = model, parts, batch.to(devices[0]), list(devices)
        self.kernels = kernels  # puts the depthwise layers on the tuned kernels or on torch's (None: none swapped)
        self.kernels_were = kernels.on if kernels is not None else False  # as found: put back on close
        self.options, self.comm, self.training, self.concurrency = options, comm, training, concurrency
        self.runs: dict[Config, Callable[[], object]] = {}
        self.stages: dict[Config, list[Stage]] = {}  # a plan's stages, compiled ones reused by the build
        self.layout: bool | None = None  # the model's layout as the trials last set it (None: untouched)
        self.scale: dict[Config, float] = {}  # sampled plans: the whole batch over the microbatch timed

    def share(self, config: Config) -> float:
        """One trial step's cost as a share of a whole step: one microbatch of M where sampled."""
        return 1.0 / config.microbatches if self.sampled(config) else 1.0

    def sampled(self, config: Config) -> bool:
        """Is ``config`` timed on one microbatch, scaled to the batch?

        A one-stage plan on a CPU runs its microbatches one after another,
        each the same work, so one microbatch times the whole step (with the
        batch over its size), at a fraction of the cost: where a step takes
        seconds, that is what lets the planning budget cover several plans.
        """
        return (self.devices[0].type == "cpu" and len(config.counts) == 1 and config.microbatches > 1
                and config.threads is None and not config.concurrent and not config.own)

    def warm(self, config: Config) -> float | None:
        """Make ``config``'s run and call it once (allocation, compilation, capture).

        Returns that call's ms per step where it stands for a step: the
        user's own eager step on a CPU, where nothing is compiled, captured
        or autotuned. It is an upper bound (within the spread of later calls
        for ResNet-18 at batch 128 on a 2-core EPYC, 1.56x for ResNet-50 in
        bf16: the first touch of the activations' memory), which the search
        times again wherever a plan beats it. Else None: a plan's first call
        on microbatch shapes pays their setup (allocations, oneDNN
        primitives) at a larger share (MobileNetV2, microbatches of 32: 1.6x
        a later call).
        """
        t0 = time.perf_counter()
        _, undo = self._ready(config)
        ms = (time.perf_counter() - t0) * 1e3 * self.scale.get(config, 1.0)
        self.model.zero_grad(set_to_none=True)
        if undo is not None:
            undo()
        counts = (self.devices[0].type == "cpu" and config.own and not config.compiled
                  and not self.options.cuda_graph)
        return ms if counts else None

    def measure(self, config: Config, steps: int) -> float:
        """ms per step of ``config`` over ``steps`` steps (made ready first if it is not kept warm)."""
        run, undo = self._ready(config)
        try:
            return windows_ms(run, steps, self.devices) * self.scale.get(config, 1.0)
        finally:
            self.model.zero_grad(set_to_none=True)
            if undo is not None:
                undo()

    def _ready(self, config: Config) -> tuple[Callable[[], object], Callable[[], None] | None]:
        """``config``'s run, called once unless kept warm, and what takes its swapped modules off (or None).

        Runs are kept warm unless they swap the model's modules (concurrency
        pieces, installed per trial) or hold a captured graph's memory pool.
        """
        if self.layout != config.channels_last and (self.layout is not None or config.channels_last):
            set_layout(self.model, config.channels_last)
            self.layout = config.channels_last
        if self.kernels is not None:
            self.kernels.use(config.kernels)
        run = self.runs.get(config)
        if run is not None:
            return run, None
        run, undo = self._own(config) if config.own else self._plan(config)
        if self.options.cuda_graph:
            run = captured_call(run, self.devices[0], before=lambda: self.model.zero_grad(set_to_none=True))
        try:
            run()  # warm-up: allocation, compilation, capture
        except BaseException:
            if undo is not None:
                undo()
            raise
        if undo is None and (config.own or not self.options.cuda_graph):
            self.runs[config] = run
        return run, undo

    def close(self) -> None:
        """Drop the warm runs (their graphs and buffers) and put the kernels back as found; the stages kept for
        the build stay."""
        self.runs = {}
        if self.kernels is not None:
            self.kernels.use(self.kernels_were)

    def _own(self, config: Config) -> tuple[Callable[[], object], None]:
        """The user's own step: the unmodified model, forward and backward on the whole batch."""
        whole: nn.Module = OneTensor(self.model)
        if config.compiled:
            whole = torch.compile(whole)  # type: ignore[assignment]
        x = in_layout(self.batch, config.channels_last)
        dtype = AUTOCAST_DTYPES.get(config.precision) if config.precision is not None else self.training.autocast_dtype
        kind = self.devices[0].type

        trains = self.parts.trains  # else the forward alone: a model with nothing to train serves inference

        def run() -> None:
            with torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
                loss = surrogate_loss(whole(x), x)
            if trains:
                loss.backward()

        return run, None

    def _plan(self, config: Config) -> tuple[Callable[[], object], Callable[[], None] | None]:
        """A plan through the executor the build would make (no optimizer step: it is the same for all).

        With the concurrency pieces they are installed for this trial only (they swap the model's modules).
        """
        xs = microbatch.split(in_layout(self.batch, config.channels_last), config.microbatches)
        if self.sampled(config):  # one microbatch stands for all of them
            xs = xs[:1]
            self.scale[config] = self.batch.shape[0] / xs[0].shape[0]
        planned = settle(Decision(replace(config, microbatches=len(xs)), schedule=fixed(self.options.schedule)),
                         self.options, self.training, self.concurrency, self.devices, self.comm.pp, trial=True)
        ex, _ = make_executor(self.parts, planned, self.comm)
        ys = [t.to(ex.stages[-1].device) for t in xs]
        w = microbatch.shares([t.shape[0] for t in xs])
        undo = None
        if planned.settled.branches or planned.settled.split_grads:
            from ..pipeline.concurrency import install  # an add-on: loaded where a trial uses it

            undo = install(ex, planned.settled).undo
        elif config.compiled:
            self.stages[config] = list(ex.stages)
        return trial(ex, self.parts, xs, ys, w), undo
