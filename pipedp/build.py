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
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .comm import Communicator
from .options import PipelineOptions, TrainingOptions
from .partition.blocks import Block, Chain, blocks_of, check_chain, module_mode
from .partition.profile import BlockProfile, estimate_blocks, profile_blocks
from .pipeline import microbatch
from .pipeline.batchnorm import DeferredBatchNorm, batchnorms_in_several
from .pipeline.executor import Executor, tensors_in
from .pipeline.gradsync import GradSync
from .pipeline.graphed import captured_call
from .pipeline.p2p import Transport
from .pipeline.recompute import Recompute
from .pipeline.schedule import get_schedule
from .pipeline.stage import Stage
from .pipeline.stream import new_lane
from .plan import Plan
from .planner import action_durations, build_plan, resolve_counts, stage_devices, stage_places, stage_times
from .snapshot import BufferSnapshot, preserved_state

__all__ = ["Pipeline", "build_pipeline", "sync_devices", "in_layout", "sample_batch"]


@dataclass
class Pipeline:
    """Everything one engine runs each step, made once from the first batch."""

    executor: Executor
    plan: Plan
    sync: GradSync | None  # gradient averaging over data-parallel replicas
    transport: Transport | None  # messages between pipeline ranks
    batchnorm: DeferredBatchNorm | None  # "batch", or a BatchNorm used by several stages: deferred updates
    buffers: BufferSnapshot  # to put buffers back after a failed step


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
    training: TrainingOptions | None = None, compile: bool = True,
) -> tuple[Executor, Transport | None]:
    """This rank's stages of the cut ``counts`` on their devices and lanes, with the schedule to run them.

    ``compile=False`` leaves the stages uncompiled even under ``training.compile``
    (trial steps of candidate cuts: compiling each would take longer than the trial).
    """
    training = training if training is not None else TrainingOptions()
    places = stage_places(len(counts), devices, comm.pp)
    stages, start = [], 0
    for s, k in enumerate(counts):
        r, dev = places[s]
        if r == comm.pp_rank:
            chain = Chain(list(parts.blocks[start : start + k])).to(dev)
            stage = Stage(s, chain, dev, new_lane(dev, f"stage{s}"), copy_input=parts.copy_input[start])
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


def _trial_ms(parts: _Parts, counts: list[int], batch: torch.Tensor, model: nn.Module,
              devices: Sequence[torch.device], options: PipelineOptions, comm: Communicator,
              training: TrainingOptions) -> float:
    """Median time of a few forward+backward passes of one candidate cut (no optimizer step).

    With ``cuda_graph`` the candidate is timed captured, as it will run (in
    its precision and with its recompute, but not compiled).
    """
    ex, _ = _executor(parts, counts, devices, options, comm, training=training, compile=False)
    xs = microbatch.split(batch.to(devices[0]), options.microbatches)
    ys = [t.to(ex.stages[-1].device) for t in xs]
    w = microbatch.shares([t.shape[0] for t in xs])

    def run() -> object:
        return ex.train(xs, ys, w, _surrogate_loss)

    if options.cuda_graph:
        run = captured_call(run, devices[0], before=lambda: model.zero_grad(set_to_none=True))
    times = []
    for r in range(4):
        sync_devices(devices)
        t0 = time.perf_counter()
        run()
        sync_devices(devices)
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _decide(parts: _Parts, model: nn.Module, sample: torch.Tensor, batch: torch.Tensor,
            devices: Sequence[torch.device], options: PipelineOptions, comm: Communicator,
            training: TrainingOptions) -> tuple[list[BlockProfile], list[int], list[str]]:
    """Profile the blocks and choose the cut (on the deciding rank)."""
    with preserved_state(model, devices), module_mode(model, training=True):
        blocks = _measurable(parts.blocks)
        if options.profile:
            profiles = profile_blocks(blocks, sample, progress=options.progress, copy_input=parts.copy_input)
        else:
            profiles = estimate_blocks(blocks, sample)
        counts, notes = resolve_counts(
            profiles, options.stages, devices, options.microbatches, options.schedule,
            measure=lambda c: _trial_ms(parts, c, batch, model, devices, options, comm, training), ranks=comm.pp,
        )
    return list(profiles), counts, notes


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
                   training: TrainingOptions | None = None) -> Pipeline:
    """The pipeline for ``model`` planned on ``batch`` (its first microbatch is what blocks are timed on)."""
    training = training if training is not None else TrainingOptions()
    sizes = microbatch.sizes(batch.shape[0], options.microbatches)
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
    profiles, counts, notes = comm.decide(
        lambda: _decide(parts, model, sample, batch, devices, options, comm, training))
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
    executor, transport = _executor(parts, counts, devices, options, comm, profiles, step, training)
    plan = build_plan(
        profiles, counts, devices, microbatches=options.microbatches, microbatch_size=sizes[0],
        schedule=options.schedule, batchnorm=options.batchnorm,
        source="profile" if options.profile else "cost model", notes=notes,
        ranks=comm.pp, layout=comm.describe(),
    )
    deferred = _batchnorm(model, executor, options)
    for st in executor.stages:
        if isinstance(st.body, Recompute) and deferred is not None:
            st.body.paused.append(deferred)  # a recomputed forward must not record statistics again
    return Pipeline(
        executor=executor,
        plan=plan,
        sync=comm.grad_sync(executor.stages),
        transport=transport,
        batchnorm=deferred,
        buffers=BufferSnapshot(model),
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
