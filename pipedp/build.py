"""The build step: a model, a sample batch, options and a communicator in; a ready pipeline out.

It cuts the model into blocks, checks the chain, profiles the blocks (or
estimates them), chooses the cut (one rank decides, every rank follows),
places the stages on devices and lanes, and makes what a step needs around
the executor: gradient sync, BatchNorm handling, the buffer snapshot that
undoes a failed step. It changes nothing but the model's placement and
memory layout (and, where statistics are deferred, its BatchNorm hooks); the
engine keeps the result.

A module used at several places of the model (a reused activation or
BatchNorm, tied weights) may end up in several stages. On one rank that is
exact: gradients of all uses accumulate in the one ``.grad``, and deferred
statistics put BatchNorm updates in plain order. Pipeline ranks hold their
own copies of every tensor, so a module whose uses fall on different ranks
is refused: its copies would drift apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from .comm import Communicator
from .decide.choose import decide, microbatch_choices
from .decide.coupling import batch_coupled, contract, kept_note, resolve_microbatches
from .decide.cut import build_plan
from .decide.config import Config
from .decide.cache import PlanCache, default_folder
from .decide.decision import Decision
from .decide.fingerprint import Fingerprint, fingerprint
from .decide.reuse import Planned, reuse_or_decide
from .decide.rules import shared_settings
from .decide.layout import Layout
from .decide.levers import settle
from .decide.search import Measure
from .device import canonical_device
from .lower import in_layout, make_executor, set_layout, whole_model
from .ops.swap import Swap
from .options import ConcurrencyOptions, PipelineOptions, TrainingOptions
from .partition.blocks import Block, CutError, blocks_of
from .partition.check import check_chain
from .partition.parts import Parts
from .partition.reads import BakedReads, baked_reads
from .partition.profile import BlockProfile
from .pipeline import microbatch
from .pipeline.batchnorm import DeferredBatchNorm, batchnorms_in_several, deferred_in
from .pipeline.executor import Executor
from .pipeline.gradsync import GradSync
from .pipeline.p2p import Transport
from .pipeline.recompute import Recompute
from .pipeline.stage import Stage
from .plan import Plan
from .snapshot import BufferSnapshot
from .trials.built import BuiltTrials

if TYPE_CHECKING:
    from .pipeline.concurrency import Concurrency

__all__ = ["Pipeline", "build_pipeline", "sample_batch"]


@dataclass
class Pipeline:
    """Everything one engine runs each step, made once from the first batch."""

    executor: Executor
    plan: Plan
    decision: Decision  # what planning chose: the cut, microbatches, layout, compile, threads, concurrency
    record: dict[str, Any]  # the decision as plain data, to save and hand back (wrap's decision=)
    sync: GradSync | None  # gradient averaging over data-parallel replicas
    transport: Transport | None  # messages between pipeline ranks
    batchnorm: DeferredBatchNorm | None  # "batch", or a BatchNorm used by several stages: deferred updates
    buffers: BufferSnapshot  # to put buffers back after a failed step
    concurrency: Concurrency | None = None  # the concurrency pieces: branches swapped in (undo() puts back)
    baked: BakedReads | None = None  # what the traced blocks it runs read as constants, checked every step

    @property
    def microbatches(self) -> int:
        return self.decision.microbatches

    @property
    def channels_last(self) -> bool:
        return self.decision.channels_last

    def detach(self) -> None:
        """Take off the user's model what this pipeline put on it (swapped blocks, BatchNorm
        and gradient hooks), so that a closed or dropped engine leaves the plain model; safe to call twice."""
        if self.concurrency is not None:
            self.concurrency.undo()
        if self.batchnorm is not None:
            self.batchnorm.remove()
        if self.sync is not None:
            self.sync.remove()


def sample_batch(model: nn.Module, sample: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``sample`` itself, or a random batch of that shape in the model's dtype.

    The stand-in comes from a generator of its own with a fixed seed: it
    leaves the user's generator where it was (a seeded script draws the same
    with ``sample=shape`` as without) and is the same batch every run.
    """
    if isinstance(sample, torch.Tensor):
        return sample
    p = next(model.parameters(), None)
    return torch.randn(tuple(int(v) for v in sample), dtype=p.dtype if p is not None else torch.float32,
                       generator=torch.Generator().manual_seed(0))


def build_pipeline(model: nn.Module, batch: torch.Tensor, options: PipelineOptions,
                   devices: Sequence[torch.device], comm: Communicator, *, step: int = 0,
                   training: TrainingOptions | None = None, measure: Measure | None = None,
                   concurrency: ConcurrencyOptions | None = None, given: Layout | None = None,
                   kernels: Swap | None = None, saved: Mapping[str, Any] | None = None) -> Pipeline:
    """The pipeline for ``model`` planned on ``batch`` (its first microbatch is what blocks are timed on).

    Planning (:func:`pipedp.decide.choose.decide`) makes every choice; this
    executes the decision: the model in the chosen layout, this rank's stages
    compiled or not, the chosen microbatches (``pipe.microbatches``).
    ``measure`` replaces the clock of ``stages="auto"``'s trials (tests);
    ``given``: the world layout ``pp="auto"`` chose (:mod:`pipedp.decide.world`);
    ``kernels``: the depthwise layers wrap swapped onto tuned kernels, left
    on them or put back on torch's as the decision says. ``saved``: a
    decision record to replay instead of planning (:mod:`pipedp.decide.reuse`).
    """
    training = training if training is not None else TrainingOptions()
    # With their indices (``cuda`` is ``cuda:<current>``), as tensors report theirs: stages, lanes and the
    # executor's copy lanes compare and key devices, and ``cuda`` != ``cuda:0``.
    devices = [canonical_device(d) for d in devices]
    first = devices[0]
    model.to(first)
    if training.channels_last is True:
        set_layout(model, True)
    batch = in_layout(batch, training.channels_last is True)
    # In the modes the user left (before planning sets its own), in the layout it trains in; one microbatch
    # asked for needs no answer.
    coupled = batch_coupled(model, batch) if options.microbatches != 1 else None
    spec = resolve_microbatches(options.microbatches, options.stages, coupled)
    sizes = microbatch.sizes(batch.shape[0], max(microbatch_choices(spec, batch.shape[0]), default=1))
    sample = batch[: sizes[0]].to(first)
    parts, uncut = _parts(model, sample, options, comm)
    # Every rank must run the same plan: the first rank decides, the others follow.
    warm: dict[Config, Sequence[object]] = {}  # compiled stages of the deciding rank's trials, to reuse
    # The cache holds decisions timed on the machine's own clock: not those of an injected one or of pp="auto".
    cache = _plan_cache(options) if measure is None and given is None else None

    def plan() -> Planned:  # on the deciding rank only: the others receive its profiles, decision and record
        return reuse_or_decide(
            lambda: decide(parts, model, sample, batch, devices, options, comm, training, concurrency, measure,
                           warm=warm, given=given, kernels=kernels, coupled=coupled,
                           trials=BuiltTrials(model, parts, batch, devices, options, comm, training, concurrency)),
            _fingerprint(model, batch, devices, options, comm, training, concurrency, kernels),
            [b.name for b in parts.blocks], saved, cache)

    profiles, decision, record = comm.decide(plan)  # the trials put the kernels back as they found them
    if training.channels_last == "auto":  # trials may have left the model in either layout
        set_layout(model, decision.channels_last)
    notes = [*uncut, *kept_note(options.microbatches, options.stages, coupled, comm.pp)]
    decision = settle(decision, options, training, concurrency, devices, comm.pp, comm.world // comm.pp, notes=notes)
    return lower_pipeline(model, parts, profiles, decision, record, batch, comm, step=step, kernels=kernels,
                          coupled=coupled, reuse=warm.get(decision.config))


def lower_pipeline(model: nn.Module, parts: Parts, profiles: Sequence[BlockProfile], decision: Decision,
                   record: dict[str, Any], batch: torch.Tensor, comm: Communicator, *, step: int = 0,
                   kernels: Swap | None = None, coupled: str | None = None,
                   reuse: Sequence[Stage] | None = None) -> Pipeline:
    """The pipeline a settled ``decision`` describes (:func:`~pipedp.decide.levers.settle`), built from it alone.

    Nothing here reads the options: the cut, the places, the schedule and
    every lever come from the decision, which every rank holds the same.
    """
    levers = decision.settled
    if kernels is not None:  # every rank runs the kernels the decision names (trials may have switched them)
        kernels.use(decision.kernels)
    counts = list(decision.counts)
    # The deciding rank's microbatches, as this rank's batch runs them (a small one with fewer, as every step).
    sizes = microbatch.sizes(batch.shape[0], microbatch.count(batch.shape[0], decision.microbatches))
    if decision.pp > 1:
        _check_shared_within_ranks(model, parts.blocks, counts, [r for r, _ in decision.places])
    executor, transport = make_executor(parts, decision, comm, profiles=profiles, step=step, reuse=reuse)
    plan = build_plan(profiles, decision, microbatch_size=sizes[0], layout=comm.describe(),
                      contract=contract(decision.microbatches, coupled))
    if decision.threads is not None:
        shared = batchnorms_in_several([st.chain for st in executor.stages])
        if shared:
            raise ValueError(f"{len(shared)} BatchNorm module(s) are used by several stages, which would update them "
                             f"from concurrent CPU stages at once: pass threads=None (stages in order), or a cut "
                             f"(stages=[block counts]) that keeps each BatchNorm's uses in one stage")
        from .partition.threads import concurrent_times  # CPU thread teams: an add-on, loaded where used

        plan = plan.with_threads(list(decision.threads), *concurrent_times(profiles, counts, decision.schedule,
                                                                           decision.microbatches))
    deferred = _batchnorm(model, executor, levers.batchnorm)
    for st in executor.stages:
        if isinstance(st.body, Recompute) and deferred is not None:
            st.body.paused.append(deferred)  # a recomputed forward must not record statistics again
    sync = comm.grad_sync(executor.stages)
    # Last (nothing after it can fail), after profiling and trials, which time the model as it is.
    concurrent = None
    if levers.branches or levers.split_grads:  # an add-on: loaded only where a plan uses it
        from .pipeline.concurrency import install

        concurrent = install(executor, levers)
    if sync is not None:
        sync.follow_lanes(executor)
    if concurrent is not None:
        plan = replace(plan, notes=(*plan.notes, *concurrent.notes()))
    return Pipeline(
        executor=executor,
        plan=plan,
        decision=decision,
        record=record,
        sync=sync,
        transport=transport,
        batchnorm=deferred,
        buffers=BufferSnapshot(model),
        concurrency=concurrent,
        baked=parts.baked if parts.baked and whole_model(parts, decision) is None else None,
    )


def _fingerprint(model: nn.Module, batch: torch.Tensor, devices: Sequence[torch.device], options: PipelineOptions,
                 comm: Communicator, training: TrainingOptions, concurrency: ConcurrencyOptions | None,
                 kernels: Swap | None) -> Fingerprint:
    """What this build's plan is made for: the model, the batch, every shared option, the world and the kernels."""
    request = shared_settings(options, training, concurrency if concurrency is not None else ConcurrencyOptions())
    request.update(world=comm.world, pp=comm.pp, kernels=list(kernels.levers) if kernels is not None else [False])
    return fingerprint(model, batch, devices, request)


def _plan_cache(options: PipelineOptions) -> PlanCache | None:
    """The cache ``plan_cache`` names; ``~`` is the user's home, as a shell reads it (not a folder named ``~``)."""
    if options.plan_cache is False:
        return None
    folder = default_folder() if options.plan_cache is True else os.fspath(options.plan_cache)
    return PlanCache(os.path.expanduser(folder))


def _parts(model: nn.Module, sample: torch.Tensor, options: PipelineOptions,
           comm: Communicator) -> tuple[Parts, list[str]]:
    """The model's blocks, checked against its forward; and a note when ``stages="auto"`` keeps it whole.

    Cutting is an optimisation: a model plain PyTorch trains is never refused
    for it. With ``stages="auto"`` on one pipeline rank a model that cannot be
    cut (or whose blocks do not compute its forward) trains as one stage, and
    the plan says why; a cut the user asked for (``stages=N``, block counts,
    ``pp>1``) that cannot be made is an error naming the cause and the fix.
    """
    whole = Parts([Block("model", model)], [False])
    if options.stages == 1 and comm.pp == 1:
        return whole, []
    try:
        blocks = blocks_of(model, depth=options.depth)
        return Parts(blocks, check_chain(model, blocks, sample), whole=model, baked=baked_reads(model, blocks)), []
    except CutError as e:
        if options.stages != "auto" or comm.pp > 1:
            raise
        return whole, [f"stages=auto: one stage ({e.reason}); to cut it, {e.fix}"]


def _batchnorm(model: nn.Module, executor: Executor, mode: str) -> DeferredBatchNorm | None:
    """Deferred statistics: all of them for ``batchnorm="batch"``, else those of BatchNorms used by several stages.

    A BatchNorm whose uses lie in one stage is updated in plain order by the
    stage itself; uses in several stages would be updated stage by stage.
    """
    chains = [st.chain for st in executor.stages]
    if mode == "batch":
        return DeferredBatchNorm(model, chains)
    split = deferred_in(chains, mode)
    return DeferredBatchNorm(model, chains, per_microbatch=True, only=split) if split else None


def _check_shared_within_ranks(model: nn.Module, blocks: Sequence[Block], counts: Sequence[int],
                               rank_of: Sequence[int]) -> None:
    """Refuse a cut that puts uses of one parameter or buffer on different pipeline ranks.

    Each pipeline rank trains its own copy of the model's tensors; a tensor
    used on two ranks would get two partial gradients and drift apart.
    """
    users: dict[int, list[tuple[str, int, int]]] = {}  # tensor id -> (block, stage, rank) of each use
    start = 0
    for s, k in enumerate(counts):
        for b in blocks[start : start + k]:
            for tid in dict.fromkeys(id(t) for t in (*b.module.parameters(), *b.module.buffers())):
                users.setdefault(tid, []).append((b.name, s, rank_of[s]))
        start += k
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    for tid, uses in users.items():
        if len({r for _, _, r in uses}) > 1:
            where = ", ".join(f"'{b}' (stage {s}, pipeline rank {r})" for b, s, r in uses)
            raise ValueError(
                f"'{names.get(tid, '?')}' is used by blocks {where}: pipeline ranks keep their own copies of "
                f"the model's tensors, so those copies would get partial gradients or statistics and drift "
                f"apart. To proceed, pass stages=[block counts] that keep all its uses on one pipeline rank, "
                f"or use pp=1 (data parallel only)"
            )
