"""The build step: a model, a sample batch, options and a communicator in; a ready pipeline out.

It cuts the model into blocks, checks the chain, profiles the blocks (or
estimates them), chooses the cut (one rank decides, every rank follows),
places the stages on devices and lanes, and makes what a step needs around
the executor: gradient sync, BatchNorm handling, the buffer snapshot that
undoes a failed step. It changes nothing but the model's placement (and,
where statistics are deferred, its BatchNorm hooks); the engine keeps the result.

A module used at several places of the model (a reused activation or
BatchNorm, tied weights) may end up in several stages. On one rank that is
exact: gradients of all uses accumulate in the one ``.grad``, and deferred
statistics put BatchNorm updates in plain order. Pipeline ranks hold their
own copies of every tensor, so a module whose uses fall on different ranks
is refused: its copies would drift apart.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .comm import Communicator
from .device import canonical_device
from .options import ConcurrencyOptions, PipelineOptions, TrainingOptions
from .partition.blocks import Block, Chain, blocks_of, check_chain, module_mode
from .partition.profile import BlockProfile, estimate_blocks, profile_blocks
from .partition.threads import CpuPlan, at_threads, concurrent_cpu, concurrent_times, plan_cpu, step_ms
from .pipeline import microbatch
from .pipeline.batchnorm import DeferredBatchNorm, batchnorms_in_several
from .pipeline.concurrency import Concurrency, install
from .pipeline.executor import Executor, tensors_in
from .pipeline.gradsync import GradSync
from .pipeline.graphed import captured_call
from .pipeline.p2p import Transport
from .pipeline.recompute import Recompute
from .pipeline.schedule import get_schedule
from .pipeline.stage import Stage
from .pipeline.cpu_lane import core_sets
from .pipeline.stream import new_lane
from .plan import Plan
from .planner import (
    AUTO_MICROBATCHES, Candidate, Decision, action_durations, build_plan, choose_by_trials, resolve_counts,
    stage_devices, stage_places, stage_times, trial_candidates, trials_apply, untimed_microbatches,
)
from .snapshot import BufferSnapshot, preserved_state

__all__ = ["Pipeline", "Trials", "build_pipeline", "sync_devices", "in_layout", "sample_batch"]


@dataclass
class Pipeline:
    """Everything one engine runs each step, made once from the first batch."""

    executor: Executor
    plan: Plan
    sync: GradSync | None  # gradient averaging over data-parallel replicas
    transport: Transport | None  # messages between pipeline ranks
    batchnorm: DeferredBatchNorm | None  # "batch", or a BatchNorm used by several stages: deferred updates
    buffers: BufferSnapshot  # to put buffers back after a failed step
    concurrency: Concurrency | None = None  # branches / split weight gradients swapped in (undo() puts back)

    def detach(self) -> None:
        """Take off the user's model what this pipeline put on it (swapped blocks and convolutions, BatchNorm
        and gradient hooks), so that a closed or dropped engine leaves the plain model; safe to call twice."""
        if self.concurrency is not None:
            self.concurrency.undo()
        if self.batchnorm is not None:
            self.batchnorm.remove()
        if self.sync is not None:
            self.sync.remove()


@dataclass(frozen=True)
class Trials:
    """How ``stages="auto"`` times its trials: ms per step of a candidate plan, and of the plain step.

    The build makes the real ones (short captured steps on the GPU); tests pass
    their own to check the plumbing on a CPU.
    """

    plan: Callable[[Candidate], float]
    plain: Callable[[], float]


@dataclass(frozen=True)
class _Parts:
    blocks: list[Block]
    copy_input: list[bool]  # per block: its forward changes its input in place


def sync_devices(devices: Sequence[torch.device]) -> None:
    """Wait for every CUDA device in ``devices`` (a no-op on CPUs)."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _surrogate_loss(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


class _OneTensor(nn.Module):
    """A whole model as one block that returns one tensor, so that profiling can time its backward.

    On a single stage the model's output goes straight to ``loss_fn``, so it
    may be a tuple or a dict; only profiling needs one tensor, and the flat
    concatenation of the floating-point tensors in it reaches all of them.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            return out
        flat = [t.reshape(-1) for t in tensors_in(out) if t.is_floating_point()]
        if not flat:
            raise ValueError(
                f"{type(self.model).__name__}.forward returns {type(out).__name__} without a floating-point "
                f"tensor in it: there is nothing for loss_fn to train. Return the model's output tensor(s)"
            )
        return torch.cat(flat)


def _measurable(blocks: Sequence[Block]) -> list[Block]:
    """The blocks to profile: a lone block is the whole model, whose output only ``loss_fn`` sees."""
    if len(blocks) == 1:
        return [Block(blocks[0].name, _OneTensor(blocks[0].module))]
    return list(blocks)


def _dress(stage: Stage, training: TrainingOptions, cuda_graph: bool, compile: bool) -> Stage:
    """``stage`` as the training options run it: under autocast, compiled, recomputed."""
    stage.autocast = training.autocast_dtype
    stage.autocast_cache = not cuda_graph
    body: Any = torch.compile(stage.chain) if compile else None
    if training.recomputes(stage.index):
        body = Recompute(body if body is not None else stage.chain, stage.chain)
    stage.body = body
    return stage


def _executor(
    parts: _Parts, counts: Sequence[int], devices: Sequence[torch.device], options: PipelineOptions,
    comm: Communicator, profiles: Sequence[BlockProfile] | None = None, step: int = 0,
    training: TrainingOptions | None = None, compile: bool = True, threads: Sequence[int] | None = None,
) -> tuple[Executor, Transport | None]:
    """This rank's stages of the cut ``counts`` on their devices and lanes, with the schedule to run them.

    ``threads``: CPU stages run concurrently, each on a worker with that many threads on its own cores.

    ``compile=False`` leaves the stages uncompiled even under ``training.compile``
    (trial steps of candidate cuts: compiling each would take longer than the trial).
    """
    training = training if training is not None else TrainingOptions()
    places = stage_places(len(counts), devices, comm.pp)
    stages, start = [], 0
    pins = core_sets(threads) if threads is not None else [None] * len(counts)
    for s, k in enumerate(counts):
        r, dev = places[s]
        if r == comm.pp_rank:
            chain = Chain(list(parts.blocks[start : start + k])).to(dev)
            lane = new_lane(dev, f"stage{s}", threads[s] if threads is not None else None, pins[s])
            stage = Stage(s, chain, dev, lane, copy_input=parts.copy_input[start])
            stages.append(_dress(stage, training, options.cuda_graph, compile and training.compile))
        start += k
    duration = action_durations(*stage_times(profiles, counts)) if profiles is not None else None
    schedule = get_schedule(options.schedule)(len(counts), options.microbatches)
    transport = comm.transport(devices[0], step)
    stage_rank = comm.stage_ranks([r for r, _ in places])
    if stage_rank is None:
        return Executor(stages, schedule, duration=duration), None
    return Executor(stages, schedule, duration=duration, stage_rank=stage_rank, rank=comm.rank,
                    transport=transport), transport


TRIAL_WINDOWS, TRIAL_STEPS = 3, 3  # timed windows of steps per trial, after the warm-up


def _timer(run: Callable[[], object], model: nn.Module, devices: Sequence[torch.device],
           graph: bool) -> Callable[[], float]:
    """A clock for ``run``: each call gives the median ms per call over a few short windows.

    The first call warms ``run`` up (compiles what is compiled) and, with
    ``graph``, captures it as a CUDA graph, so later calls time the same replay.
    """
    ready: list[Callable[[], object]] = []

    def timed() -> float:
        if not ready:
            ready.append(captured_call(run, devices[0], before=lambda: model.zero_grad(set_to_none=True))
                         if graph else run)
            ready[0]()
        times = []
        for _ in range(TRIAL_WINDOWS):
            sync_devices(devices)
            t0 = time.perf_counter()
            for _ in range(TRIAL_STEPS):
                ready[0]()
            sync_devices(devices)
            times.append((time.perf_counter() - t0) * 1e3 / TRIAL_STEPS)
        model.zero_grad(set_to_none=True)
        return statistics.median(times)

    return timed


def _trial_ms(parts: _Parts, cand: Candidate, batch: torch.Tensor, model: nn.Module,
              devices: Sequence[torch.device], options: PipelineOptions, comm: Communicator,
              training: TrainingOptions, concurrency: ConcurrencyOptions | None = None) -> float:
    """ms per forward+backward step of one candidate plan (no optimizer step: it is the same for every plan).

    With ``cuda_graph`` the candidate is timed captured, as it will run, in its
    precision and with its recompute; compiled only when the candidate says so,
    and with ``concurrency``'s pieces installed (then put back) when it is concurrent.
    """
    opts = replace(options, microbatches=cand.microbatches)
    ex, _ = _executor(parts, list(cand.counts), devices, opts, comm, training=training, compile=cand.compiled)
    xs = microbatch.split(batch.to(devices[0]), cand.microbatches)
    ys = [t.to(ex.stages[-1].device) for t in xs]
    w = microbatch.shares([t.shape[0] for t in xs])
    side = install(ex, concurrency) if cand.concurrent and concurrency is not None else None
    try:
        if side is not None:
            side.connect(ex, None)
        return _timer(lambda: ex.train(xs, ys, w, _surrogate_loss), model, devices, options.cuda_graph)()
    finally:
        if side is not None:
            side.undo()


def _cpu_decide(parts: _Parts, blocks: list[Block], profiles: Sequence[BlockProfile], sample: torch.Tensor,
                batch: torch.Tensor, options: PipelineOptions, comm: Communicator, training: TrainingOptions,
                choices: Sequence[int]) -> tuple[list[BlockProfile], Decision]:
    """Cut, threads per stage and microbatches for concurrent CPU stages (:mod:`pipedp.partition.threads`).

    The profiles returned are the blocks' times at their stage's planned threads.
    Each trial plan's executor is kept for the decision, so a plan timed again
    runs warm (a first step also allocates; every plan's first step pays that alike).
    """
    runs: dict[CpuPlan, Callable[[], object]] = {}

    def measure(plan: CpuPlan) -> float:
        if plan not in runs:
            opts = replace(options, microbatches=plan.microbatches)
            ex, _ = _executor(parts, list(plan.counts), [batch.device], opts, comm, training=training, compile=False,
                              threads=plan.threads)
            xs = microbatch.split(batch, plan.microbatches)
            w = microbatch.shares([t.shape[0] for t in xs])
            runs[plan] = lambda: ex.train(xs, xs, w, _surrogate_loss)
        return step_ms(runs[plan], warmup=False)

    size = microbatch.sizes(batch.shape[0], max(choices))[0]

    def relative(m: int) -> float:  # a microbatch of M's size, over the profiled (smallest) one
        return microbatch.sizes(batch.shape[0], m)[0] / size

    choice, curves = plan_cpu(
        blocks, sample, threads=options.threads, stages=options.stages, microbatches=choices,
        sizes=relative, schedule=options.schedule,
        measure=measure if options.profile else None, copy_input=parts.copy_input, host_profiles=profiles,
        profiled=options.profile)
    plan, scale = choice.plan, relative(choice.plan.microbatches)
    decision = Decision(plan.counts, plan.microbatches, training.compile, choice.notes, threads=plan.threads)
    return at_threads(profiles, curves, plan, scale), decision


def _plain_trial(model: nn.Module, batch: torch.Tensor, devices: Sequence[torch.device],
                 options: PipelineOptions, training: TrainingOptions) -> Callable[[], float]:
    """The clock of the bar every plan must beat: the step the user would run without pipedp.

    The unmodified model, forward+backward on the whole batch, in the user's
    precision and memory format, compiled as a whole when ``training.compile``
    and captured when ``options.cuda_graph``.
    """
    whole: nn.Module = _OneTensor(model)
    if training.compile:
        whole = torch.compile(whole)  # type: ignore[assignment]
    x, dtype = batch.to(devices[0]), training.autocast_dtype

    def run() -> None:
        with torch.autocast(devices[0].type, dtype=dtype, enabled=dtype is not None):
            loss = _surrogate_loss(whole(x), x)
        loss.backward()

    return _timer(run, model, devices, options.cuda_graph)


def _choices(options: PipelineOptions, batch: int) -> list[int]:
    """The microbatch counts the planner may choose from: the user's, or all of AUTO_MICROBATCHES that fit."""
    if options.microbatches == "auto":
        return [m for m in AUTO_MICROBATCHES if m <= batch]
    return [int(options.microbatches)]


def _decide(parts: _Parts, model: nn.Module, sample: torch.Tensor, batch: torch.Tensor,
            devices: Sequence[torch.device], options: PipelineOptions, comm: Communicator,
            training: TrainingOptions, trials: Trials | None = None,
            concurrency: ConcurrencyOptions | None = None) -> tuple[list[BlockProfile], Decision]:
    """Profile the blocks and choose the plan (on the deciding rank).

    ``stages="auto"`` on one CUDA device (or with injected ``trials``) times
    candidate plans beside the plain step (:func:`pipedp.planner.choose_by_trials`);
    ``microbatches="auto"`` lets it choose the microbatches as well, and the
    fastest plans are also timed with ``concurrency``'s side-stream pieces.
    """
    choices = _choices(options, batch.shape[0])
    with preserved_state(model, devices), module_mode(model, training=True):
        blocks = _measurable(parts.blocks)
        if options.profile:
            profiles = profile_blocks(blocks, sample, progress=options.progress, copy_input=parts.copy_input)
        else:
            profiles = estimate_blocks(blocks, sample)
        if concurrent_cpu(options.threads, devices, comm.world):
            return _cpu_decide(parts, blocks, profiles, sample, batch, options, comm, training, choices)
        if options.stages == "auto" and comm.pp == 1 and (trials is not None or trials_apply("auto", devices)):
            if trials is None:
                trials = Trials(
                    lambda c: _trial_ms(parts, c, batch, model, devices, options, comm, training, concurrency),
                    _plain_trial(model, batch, devices, options, training),
                )
            candidates = trial_candidates([p.cost_ms for p in profiles], choices, batch.shape[0])
            side = concurrency is not None and (concurrency.branches or concurrency.split_grads)
            decision = choose_by_trials(candidates, trials.plan, baseline=trials.plain, compile=training.compile,
                                        concurrent=side, where=str(devices[0]))
            return list(profiles), decision
        counts, notes = resolve_counts(profiles, options.stages, devices, max(choices), options.schedule,
                                       ranks=comm.pp)
    m = choices[0]
    if options.microbatches == "auto":
        m = untimed_microbatches(len(counts), batch.shape[0])
        notes.append(f"microbatches=auto: {m} for {len(counts)} stage(s) (no timed trials on {devices[0]})")
    return list(profiles), Decision(tuple(counts), m, training.compile, tuple(notes))


def sample_batch(model: nn.Module, sample: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``sample`` itself, or a random batch of that shape in the model's dtype."""
    if isinstance(sample, torch.Tensor):
        return sample
    p = next(model.parameters(), None)
    return torch.randn(tuple(int(v) for v in sample), dtype=p.dtype if p is not None else torch.float32)


def in_layout(x: torch.Tensor, training: TrainingOptions) -> torch.Tensor:
    """``x`` in the memory format the model runs in (itself when it already is)."""
    return x.contiguous(memory_format=torch.channels_last) if training.channels_last and x.dim() == 4 else x


def build_pipeline(model: nn.Module, batch: torch.Tensor, options: PipelineOptions,
                   devices: Sequence[torch.device], comm: Communicator, *, step: int = 0,
                   training: TrainingOptions | None = None, trials: Trials | None = None,
                   concurrency: ConcurrencyOptions | None = None) -> Pipeline:
    """The pipeline for ``model`` planned on ``batch`` (its first microbatch is what blocks are timed on).

    With ``stages="auto"`` on one CUDA device the plan comes from timed trials
    (``trials`` replaces their clocks, for tests); with ``microbatches="auto"``
    the planner chooses the microbatches too: ``plan.microbatches`` is what a
    step must split the batch into.
    """
    training = training if training is not None else TrainingOptions()
    # With their indices (``cuda`` is ``cuda:<current>``), as tensors report theirs: stages, lanes and the
    # executor's copy lanes compare and key devices, and ``cuda`` != ``cuda:0``.
    devices = [canonical_device(d) for d in devices]
    sizes = microbatch.sizes(batch.shape[0], max(_choices(options, batch.shape[0])))
    first = devices[0]
    model.to(first)
    if training.channels_last:
        model.to(memory_format=torch.channels_last)
    batch = in_layout(batch, training)
    sample = batch[: sizes[0]].to(first)
    if options.stages == 1 and comm.pp == 1:
        parts = _Parts([Block("model", model)], [False])
    else:
        blocks = blocks_of(model, depth=options.depth)
        parts = _Parts(blocks, check_chain(model, blocks, sample))
    # Every rank must run the same cut: the first rank decides, the others follow.
    profiles, decision = comm.decide(
        lambda: _decide(parts, model, sample, batch, devices, options, comm, training, trials, concurrency))
    counts, notes = list(decision.counts), list(decision.notes)
    options = replace(options, microbatches=decision.microbatches)
    sizes = microbatch.sizes(batch.shape[0], options.microbatches)
    bad = [i for i in training.recompute if i >= len(counts)] if not isinstance(training.recompute, bool) else []
    if bad:  # checked on the cut, not on the trial cuts of stages="auto"
        raise ValueError(
            f"recompute names stage(s) {bad} but the pipeline has {len(counts)} stage(s) (0..{len(counts) - 1}): "
            f"pass indices of existing stages, or recompute=True for all"
        )
    if comm.pp > 1:
        _check_shared_within_ranks(model, parts.blocks, counts, comm.pp)
    per_rank = len(counts) // comm.pp
    if len(devices) > 1:
        notes = notes + [f"blocks were profiled on {first}; the other devices are assumed alike"]
    used = len(set(stage_devices(per_rank, devices)))
    if used < len(devices):
        notes = notes + [f"{per_rank} stage(s) per rank use {used} of {len(devices)} devices"]
    executor, transport = _executor(parts, counts, devices, options, comm, profiles, step, training,
                                    compile=decision.compiled, threads=decision.threads)
    plan = build_plan(
        profiles, counts, devices, microbatches=options.microbatches, microbatch_size=sizes[0],
        schedule=options.schedule, batchnorm=options.batchnorm,
        source="profile" if options.profile else "cost model", notes=notes,
        ranks=comm.pp, layout=comm.describe(), trials=decision.trials, baseline_ms=decision.baseline_ms,
        compiled=decision.compiled and training.compile, chosen=decision.chosen,
    )
    if decision.threads is not None:
        shared = batchnorms_in_several([st.chain for st in executor.stages])
        if shared:
            raise ValueError(f"{len(shared)} BatchNorm module(s) are used by several stages, which would update them "
                             f"from concurrent CPU stages at once: pass threads=None (stages in order), or a cut "
                             f"(stages=[block counts]) that keeps each BatchNorm's uses in one stage")
        plan = plan.with_threads(list(decision.threads), *concurrent_times(profiles, counts, options.schedule,
                                                                           decision.microbatches))
    deferred = _batchnorm(model, executor, options)
    for st in executor.stages:
        if isinstance(st.body, Recompute) and deferred is not None:
            st.body.paused.append(deferred)  # a recomputed forward must not record statistics again
    sync = comm.grad_sync(executor.stages)
    # Last (nothing after it can fail), after profiling and trials, which time the model as it is.
    concurrent = (install(executor, concurrency)  # unless stages="auto" trials found the plan faster without
                  if concurrency is not None and concurrency.any and decision.concurrent else None)
    if concurrent is not None:
        concurrent.connect(executor, sync)
        plan = replace(plan, notes=(*plan.notes, *concurrent.notes()))
    return Pipeline(
        executor=executor,
        plan=plan,
        sync=sync,
        transport=transport,
        batchnorm=deferred,
        buffers=BufferSnapshot(model),
        concurrency=concurrent,
    )


def _batchnorm(model: nn.Module, executor: Executor, options: PipelineOptions) -> DeferredBatchNorm | None:
    """Deferred statistics: all of them for ``batchnorm="batch"``, else those of BatchNorms used by several stages.

    A BatchNorm whose uses lie in one stage is updated in plain order by the
    stage itself; uses in several stages would be updated stage by stage.
    """
    chains = [st.chain for st in executor.stages]
    if options.batchnorm == "batch":
        return DeferredBatchNorm(model, chains)
    split = batchnorms_in_several(chains)
    return DeferredBatchNorm(model, chains, per_microbatch=True, only=split) if split else None


def _check_shared_within_ranks(model: nn.Module, blocks: Sequence[Block], counts: Sequence[int], ranks: int) -> None:
    """Refuse a cut that puts uses of one parameter or buffer on different pipeline ranks.

    Each pipeline rank trains its own copy of the model's tensors; a tensor
    used on two ranks would get two partial gradients and drift apart.
    """
    per_rank = len(counts) // ranks
    users: dict[int, list[tuple[str, int, int]]] = {}  # tensor id -> (block, stage, rank) of each use
    start = 0
    for s, k in enumerate(counts):
        for b in blocks[start : start + k]:
            for tid in dict.fromkeys(id(t) for t in (*b.module.parameters(), *b.module.buffers())):
                users.setdefault(tid, []).append((b.name, s, s // per_rank))
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
