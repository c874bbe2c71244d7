"""How every stage and step of a plan runs, resolved once from the user's options into the decision.

The cut, the microbatches and the levers the trials weigh live in
:class:`~pipedp.decide.config.Config`; the rest of what the build and the
step runner need (precision, BatchNorm mode, CUDA graph, which stages
recompute, the concurrency pieces the plan kept, early updates, rollback,
gradient clipping, the steps timed for the plan table) lives here, resolved against the chosen cut. After
:func:`settle` nothing reads the options: the lowering and the runtime read
the decision alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ..options import AUTOCAST_DTYPES, ConcurrencyOptions, GradHook, PipelineOptions, TrainingOptions
from .cut import stage_places
from .decision import Decision

__all__ = ["Levers", "resolve_levers", "settle"]

@dataclass(frozen=True)
class Levers:
    """The resolved run-time settings of a plan (each a choice, none a request such as ``"auto"`` or ``True``)."""

    precision: str = "fp32"  # "fp32", "bf16" or "fp16"
    batchnorm: str = "microbatch"  # statistics per microbatch, or deferred to the whole batch ("batch")
    cuda_graph: bool = False
    recompute: tuple[int, ...] = ()  # the stages (global indices) that recompute their activations
    branches: bool = False  # shortcut branches on side lanes (kept by the plan)
    split_grads: bool = False  # weight gradients on side lanes (kept by the plan)
    early_update: bool = False
    rollback: bool = True
    clip_grad_norm: float | None = None
    measure_steps: int = 3  # the first steps timed for the plan's measured column
    grad_hook: GradHook | None = field(default=None, compare=False)  # this rank's own callback

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype stages compute in under autocast (None: fp32, no autocast)."""
        return AUTOCAST_DTYPES.get(self.precision)

    def recomputes(self, stage: int) -> bool:
        return stage in self.recompute


def resolve_levers(training: TrainingOptions, pipeline: PipelineOptions, concurrency: ConcurrencyOptions | None,
                   stages: int, concurrent: bool = True) -> Levers:
    """The levers of a plan of ``stages`` stages; ``concurrent``: whether it keeps the concurrency pieces asked
    for (timed trials may find the plan faster without). Recompute indices past the cut are left out: a trial
    cut may have fewer stages than the chosen one (:func:`settle` refuses them for the chosen cut)."""
    c = concurrency if concurrency is not None else ConcurrencyOptions()
    recompute = training.recompute
    chosen = range(stages) if recompute is True else () if recompute is False else recompute
    return Levers(
        precision=training.precision, batchnorm=pipeline.batchnorm, cuda_graph=pipeline.cuda_graph,
        recompute=tuple(i for i in chosen if i < stages),
        branches=c.branches and concurrent, split_grads=c.split_grads and concurrent,
        early_update=c.early_update, rollback=pipeline.rollback, clip_grad_norm=training.clip_grad_norm,
        measure_steps=pipeline.measure_steps, grad_hook=training.grad_hook,
    )


def settle(decision: Decision, pipeline: PipelineOptions, training: TrainingOptions,
           concurrency: ConcurrencyOptions | None, devices: Sequence[torch.device], pp: int, dp: int = 1, *,
           trial: bool = False, notes: Sequence[str] = ()) -> Decision:
    """``decision`` made whole: its levers, the world layout and each stage's place, from this rank's options.

    Every rank settles the deciding rank's decision with its own options,
    which the communicator checked are the same everywhere (but for
    ``grad_hook``, each rank's own). ``trial``: a configuration the planner
    times, whose cut may have fewer stages than ``recompute`` names.
    ``notes``: what the build found before planning (the model's cut), put
    first.
    """
    n = len(decision.counts)
    recompute = training.recompute
    bad = [i for i in recompute if i >= n] if not isinstance(recompute, bool) and not trial else []
    if bad:  # checked on the cut, not on the trial cuts of stages="auto"
        raise ValueError(
            f"recompute names stage(s) {bad} but the pipeline has {n} stage(s) (0..{n - 1}): "
            f"pass indices of existing stages, or recompute=True for all"
        )
    levers = resolve_levers(training, pipeline, concurrency, n, decision.concurrent)
    places = tuple(stage_places(n, devices, pp, decision.schedule))
    notes = [*notes, *decision.notes]
    if len(devices) > 1 and not trial:
        notes.append(f"blocks were profiled on {devices[0]}; the other devices are assumed alike")
        used = len({d for _, d in places})
        if used < len(devices):
            notes.append(f"{n // pp} stage(s) per rank use {used} of {len(devices)} devices")
    return replace(decision, levers=levers, places=places, pp=pp, dp=dp, notes=tuple(notes))
