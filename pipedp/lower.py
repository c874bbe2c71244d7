"""Lowering a decision: the model's blocks into this rank's stages, lanes and executor.

What the build step runs and what the planner's trials time are the same
stages, made here: a trial times exactly what the chosen plan will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .comm import Communicator
from .decide.cut import action_durations, stage_places, stage_times
from .options import PipelineOptions, TrainingOptions
from .partition.blocks import Block, Chain
from .partition.profile import BlockProfile
from .pipeline.cpu_lane import core_sets
from .pipeline.executor import Executor, tensors_in
from .pipeline.p2p import Transport
from .pipeline.recompute import Recompute
from .pipeline.orders import per_stage, rank_orders
from .pipeline.stage import Stage
from .pipeline.stream import new_lane

__all__ = ["Parts", "OneTensor", "measurable", "make_executor", "surrogate_loss", "sync_devices", "in_layout",
           "set_layout", "trial"]


@dataclass(frozen=True)
class Parts:
    """The model cut into blocks, in order."""

    blocks: list[Block]
    copy_input: list[bool]  # per block: its forward changes its input in place

    @property
    def trains(self) -> bool:
        """Has a step anything to train: a parameter that requires grad?

        A frozen model (a distillation teacher) or one without parameters can
        only run forward: an engine of one serves inference, and its trials
        time the forward (a backward would have nothing to reach).
        """
        return any(p.requires_grad for b in self.blocks for p in b.module.parameters())


def trial(ex: Executor, parts: Parts, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
          weights: Sequence[float]) -> Callable[[], object]:
    """One step of a plan as the trials time it: forward and backward with :func:`surrogate_loss`, or the forward
    alone where nothing of the model trains (:attr:`Parts.trains`)."""
    if parts.trains:
        return lambda: ex.train(xs, ys, weights, surrogate_loss)
    return lambda: ex.forward(xs)


def sync_devices(devices: Sequence[torch.device]) -> None:
    """Wait for every CUDA device in ``devices`` (a no-op on CPUs)."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def surrogate_loss(out: object, _: torch.Tensor) -> torch.Tensor:
    """The loss of profiling and trials: reaches every output element, costs next to nothing.

    A one-stage plan's output is the model's own, which may be a tuple or a dict of tensors.
    """
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    return torch.stack([t.float().mean() for t in tensors_in(out) if t.is_floating_point()]).sum()


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


class OneTensor(nn.Module):
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


def measurable(blocks: Sequence[Block]) -> list[Block]:
    """The blocks to profile: a lone block is the whole model, whose output only ``loss_fn`` sees."""
    if len(blocks) == 1:
        return [Block(blocks[0].name, OneTensor(blocks[0].module))]
    return list(blocks)


def _dress(stage: Stage, training: TrainingOptions, cuda_graph: bool, compile: bool) -> Stage:
    """``stage`` as the training options run it: under autocast, compiled, recomputed."""
    stage.autocast = training.autocast_dtype
    stage.autocast_cache = not cuda_graph
    # Static shapes: trials compile the same Chain.forward for several microbatch sizes, and dynamo's automatic
    # dynamic shapes would then serve every size, the chosen one too, with slower symbolic-shape kernels
    # (ResNet-18 on the H100: the chosen compiled step 3.17 ms against 2.76 ms in its own trial).
    body: Any = torch.compile(stage.chain, dynamic=False) if compile else None
    if training.recomputes(stage.index):
        body = Recompute(body if body is not None else stage.chain, stage.chain)
    stage.body = body
    return stage


def make_executor(
    parts: Parts, counts: Sequence[int], microbatches: int, devices: Sequence[torch.device],
    options: PipelineOptions, comm: Communicator, *, profiles: Sequence[BlockProfile] | None = None,
    step: int = 0, training: TrainingOptions | None = None, compile: bool = False,
    threads: Sequence[int] | None = None, reuse: Sequence[Stage] | None = None, schedule: str,
) -> tuple[Executor, Transport | None]:
    """This rank's stages of the cut ``counts`` on their devices and lanes, run by ``schedule`` (a name, resolved).

    ``compile``: each stage's blocks through ``torch.compile``; ``threads``: CPU
    stages run concurrently, each on a worker with that many threads on its own cores.
    ``reuse``: the stages a trial made for the same cut (compiled ones keep their compiled code).
    """
    training = training if training is not None else TrainingOptions()
    places = stage_places(len(counts), devices, comm.pp, schedule)
    stages, start = list(reuse or []), 0
    pins = core_sets(threads) if threads is not None else [None] * len(counts)
    for s, k in enumerate(counts if reuse is None else []):
        r, dev = places[s]
        if r == comm.pp_rank:
            chain = Chain(list(parts.blocks[start : start + k])).to(dev)
            lane = new_lane(dev, f"stage{s}", threads[s] if threads is not None else None, pins[s])
            stage = Stage(s, chain, dev, lane, copy_input=parts.copy_input[start])
            stages.append(_dress(stage, training, options.cuda_graph, compile))
        start += k
    duration = action_durations(*stage_times(profiles, counts)) if profiles is not None else None
    orders = rank_orders(schedule, len(counts), microbatches, comm.pp, duration=duration)
    per = per_stage(orders, len(counts))
    transport = comm.transport(devices[0], step)
    stage_rank = comm.stage_ranks([r for r, _ in places])
    if stage_rank is None:
        return Executor(stages, per, duration=duration, orders=orders), None
    return Executor(stages, per, duration=duration, stage_rank=stage_rank, rank=comm.rank,
                    transport=transport, orders=orders), transport
