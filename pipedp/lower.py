"""Lowering a settled decision: the model's blocks into this rank's stages, lanes and executor.

What the build step runs and what the planner's trials time are the same
stages, made here: a trial times exactly what the chosen plan will run.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .comm import Communicator
from .decide.cut import action_durations, stage_times
from .decide.decision import Decision
from .decide.levers import Levers
from .partition.blocks import Block, Chain
from .partition.parts import Parts, surrogate_loss
from .partition.profile import BlockProfile
from .pipeline.batchnorm import commit_stages
from .pipeline.cpu_lane import core_sets
from .pipeline.executor import Executor
from .pipeline.p2p import Transport
from .pipeline.recompute import Recompute
from .pipeline.orders import join_backwards, per_stage, rank_orders, split_backwards
from .pipeline.stage import Stage
from .pipeline.stream import new_lane

__all__ = ["make_executor", "whole_model", "in_layout", "set_layout", "trial"]


def trial(ex: Executor, parts: Parts, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
          weights: Sequence[float]) -> Callable[[], object]:
    """One step of a plan as the trials time it: forward and backward with :func:`surrogate_loss`, or the forward
    alone where nothing of the model trains (:attr:`Parts.trains`)."""
    if parts.trains:
        return lambda: ex.train(xs, ys, weights, surrogate_loss)
    return lambda: ex.forward(xs)


# Channels-last for each tensor rank that has one: 4-d (NCHW, Conv2d) and 5-d (NCDHW, Conv3d).
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def in_layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``x`` in the memory format the model runs in (itself when it already is): a 4-d batch channels-last,
    a 5-d one channels-last-3d, any other rank as it is."""
    fmt = _CHANNELS_LAST.get(x.dim()) if channels_last else None
    return x.contiguous(memory_format=fmt) if fmt is not None else x


def set_layout(model: nn.Module, channels_last: bool) -> None:
    """Put the model's 4-d and 5-d parameters and buffers in channels-last (-3d) or plain contiguous format
    (in place: the parameters stay the same objects, as ``model.to`` keeps them)."""
    if not channels_last:
        model.to(memory_format=torch.contiguous_format)
        return
    # model.to(memory_format=channels_last) refuses 5-d tensors (Conv3d) and channels_last_3d 4-d ones:
    # each tensor gets its own rank's format, by the conversion Module.to applies (Tensor.to, whose strides for
    # size-1 dims differ from Tensor.contiguous's: other strides pick other kernels, and so other rounding
    # than the user's model.to(memory_format=torch.channels_last)).
    model._apply(lambda t: t.to(memory_format=_CHANNELS_LAST[t.dim()]) if t.dim() in _CHANNELS_LAST else t)


def _dress(stage: Stage, levers: Levers, compile: bool) -> Stage:
    """``stage`` as the decision runs it: under autocast, compiled, recomputed."""
    stage.autocast = levers.autocast
    stage.autocast_cache = not levers.cuda_graph
    # Static shapes: trials compile the same Chain.forward for several microbatch sizes, and dynamo's automatic
    # dynamic shapes would then serve every size, the chosen one too, with slower symbolic-shape kernels
    # (ResNet-18 on the H100: the chosen compiled step 3.17 ms against 2.76 ms in its own trial).
    body: Any = torch.compile(stage.chain, dynamic=False) if compile else None
    if levers.recomputes(stage.index):
        body = Recompute(body if body is not None else stage.chain, stage.chain)
    stage.body = body
    return stage


def whole_model(parts: Parts, decision: Decision) -> nn.Module | None:
    """The user's model where the decision runs it in one stage on one rank, else None (the blocks run).

    Such a plan is the user's step: their own forward runs, reading what it
    reads at every call, rather than the traced blocks. The concurrency pieces
    work on the blocks, so a plan with them keeps the blocks.
    """
    levers = decision.settled
    if parts.whole is None or len(decision.counts) != 1 or decision.pp != 1 or levers.branches or levers.split_grads:
        return None
    return parts.whole


def make_executor(parts: Parts, decision: Decision, comm: Communicator, *,
                  profiles: Sequence[BlockProfile] | None = None, step: int = 0,
                  reuse: Sequence[Stage] | None = None) -> tuple[Executor, Transport | None]:
    """This rank's stages of a settled ``decision`` (:func:`~pipedp.decide.levers.settle`) on their devices and
    lanes, run in each rank's order of its schedule. It reads the decision alone, never the options.

    ``profiles``: the block times, which order a zero-bubble rank's weight
    gradients. ``reuse``: the stages a trial made for the same cut
    (compiled ones keep their compiled code).
    """
    levers, counts, places, threads = decision.settled, decision.counts, decision.places, decision.threads
    if len(places) != len(counts) or decision.pp != comm.pp:
        raise ValueError(f"the decision places {len(places)} stage(s) over {decision.pp} pipeline rank(s), but cuts "
                         f"{len(counts)} and runs in a world of {comm.pp}: settle it for this world first")
    stages, start = list(reuse or []), 0
    pins = core_sets(threads) if threads is not None else [None] * len(counts)
    whole = whole_model(parts, decision)
    for s, k in enumerate(counts if reuse is None else []):
        r, dev = places[s]
        if r == comm.pp_rank:
            chain = Chain([Block("model", whole)] if whole is not None else list(parts.blocks[start : start + k]))
            lane = new_lane(dev, f"stage{s}", threads[s] if threads is not None else None, pins[s])
            # The user's forward on the user's batch changes it in place as their step does; microbatches are
            # views sharing one version counter, so they get copies.
            copy = parts.copy_input[start] and (whole is None or decision.microbatches > 1)
            stage = Stage(s, chain.to(dev), dev, lane, copy_input=copy)
            stages.append(_dress(stage, levers, decision.compiled))
        start += k
    # Every stage's blocks, on every rank: each rank prints all programs, BN_COMMIT included.
    groups = [nn.ModuleList([b.module for b in parts.blocks[a : a + k]])
              for a, k in zip(itertools.accumulate([0, *counts]), counts)]
    commits = commit_stages(groups, levers.batchnorm)
    duration = action_durations(*stage_times(profiles, counts)) if profiles is not None else None
    orders = rank_orders(decision.schedule, len(counts), decision.microbatches, comm.pp, duration=duration)
    # split_grads: every backward as I then W (W on the stage's side lane); else an I and W that nothing comes
    # between run as the backward they make (not where the stage before runs at once on a stream of its own).
    orders = split_backwards(orders) if levers.split_grads else \
        join_backwards(orders, lambda a, b: places[a][1].type == "cuda")
    per = per_stage(orders, len(counts))
    mine = [d for r, d in places if r == comm.pp_rank]
    transport = comm.transport(mine[0], step)
    stage_rank = comm.stage_ranks([r for r, _ in places])
    # split_grads: each stage's W on its side lane.
    common: dict[str, Any] = dict(duration=duration, orders=orders, commits=commits, side_weights=levers.split_grads)
    if stage_rank is None:
        return Executor(stages, per, **common), None
    return Executor(stages, per, stage_rank=stage_rank, rank=comm.rank, transport=transport, **common), transport
