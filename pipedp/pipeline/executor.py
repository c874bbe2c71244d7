"""Runs this rank's program of a step, issuing each action on its stage's lane.

The program (:mod:`.ranks`) is this rank's actions in the order the simulator
gives (by simulated start time) or the schedule's per-rank order, with the
messages between ranks and each stage's REDUCE_GRAD and UPDATE; the
interpreter (:mod:`.interpreter`) runs each action. Every cross-lane
dependency is an event: a stage's forward waits for the previous stage's
forward of the same microbatch, its backward for the next stage's backward.
Nothing here synchronises the host, so a step stays asynchronous on CUDA. On
devices without streams every lane is the in-order stand-in and the same code
runs sequentially, unless the lanes have CPU workers: then each action is
queued to its stage's worker, to start once the action it depends on (as
above) is done, and the step waits for all of them at its end
(:mod:`~pipedp.pipeline.cpu_lane`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Sequence

import torch

from ..partition.parts import tensors_in
from .ahead import Ahead
from .cpu_lane import Flight
from .deps import ACCUMULATES, grad_kinds, needs
from .interpreter import BatchNormCommitLike, GradSyncLike, LossFn, StageUpdateLike, StepRun
from .orders import per_stage
from .p2p import Transport
from .ranks import COMPUTE, Op, check_programs, close_stages, format_program, lower_programs, rank_programs
from .schedule import Action, Schedule, forward_only
from .simulate import simulate
from .stage import Stage
from .lanes import RankLanes
from .stream import Lane, current_lane
from .trace import Clock

__all__ = ["Executor", "StepTimer", "GradSyncLike", "StageUpdateLike", "LossFn"]


class StepTimer:
    """Per-stage busy time of one step: CUDA timing events, or the host clock.

    With a :class:`Clock` it also keeps every action's span, for a trace.
    """

    def __init__(self, stages: int, clock: Clock | None = None) -> None:
        self.host_ms = [0.0] * stages
        self.clock = clock
        self.events: list[tuple[int, str, torch.device, "torch.cuda.Event", "torch.cuda.Event"]] = []
        self.host_spans: list[tuple[int, str, float, float]] = []
        self._t0: dict[int, float] = {}  # per lane: CPU workers time their stages concurrently
        self._start: "torch.cuda.Event | None" = None

    def begin(self, lane: Lane) -> None:
        if lane.is_cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(lane.stream)
        else:
            self._t0[id(lane)] = time.perf_counter()

    def end(self, stage: int, lane: Lane, label: str = "") -> None:
        if lane.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(lane.stream)
            assert self._start is not None
            self.events.append((stage, label, lane.device, self._start, end))
        else:
            t, t0 = time.perf_counter(), self._t0[id(lane)]
            self.host_ms[stage] += (t - t0) * 1e3
            if self.clock is not None:
                self.host_spans.append((stage, label, t0, t))

    def ready(self) -> bool:
        return all(e[-1].query() for e in self.events)

    def stage_ms(self) -> list[float]:
        """Busy milliseconds per stage (waits for the events: call outside a step)."""
        out = list(self.host_ms)
        for s, _, _, start, end in self.events:
            end.synchronize()
            out[s] += start.elapsed_time(end)
        return out

    def spans(self) -> list[tuple[int, str, float, float]]:
        """(stage position, label, start ms, end ms) of every action, from the clock's origin."""
        if self.clock is None:
            raise RuntimeError("this timer has no clock: pass one to keep spans")
        ms = self.clock.ms
        out = [(s, label, ms(a), ms(b)) for s, label, a, b in self.host_spans]
        out += [(s, label, ms(a, d), ms(b, d)) for s, label, d, a, b in self.events]
        return out


class Executor:
    """Runs training and inference steps of a fixed pipeline over microbatches.

    ``stages`` are this rank's stages (``Stage.index`` is the global index);
    ``schedule`` covers all of them. Without ``stage_rank`` every stage is
    local; with it, ``stage_rank[s]`` is the global rank running stage s and
    ``transport`` moves values to and from the other ranks. ``orders``: each
    rank's (stage, action) pairs in the order it runs them, where a rank
    interleaves its stages (:mod:`.orders`); by default the simulator's start
    order of ``schedule``. ``side_weights``: each stage's W runs on a side
    lane of its own, beside the stage's next action (``split_grads``).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: Schedule,
        *,
        duration: Callable[[int, Action], float] | None = None,
        stage_rank: Sequence[int] | None = None,
        rank: int = 0,
        transport: Transport | None = None,
        orders: Sequence[Sequence[tuple[int, Action]]] | None = None,
        commits: Collection[int] = (),
        side_weights: bool = False,
    ) -> None:
        self.stages = sorted(stages, key=lambda st: st.index)
        self.n = n = len(schedule)
        self.local = {st.index: st for st in self.stages}
        self.pos = {st.index: k for k, st in enumerate(self.stages)}
        self.stage_rank = list(stage_rank) if stage_rank is not None else [rank] * n
        self.rank = rank
        mine = {s for s in range(n) if self.stage_rank[s] == rank}
        if len(self.stage_rank) != n or set(self.local) != mine:
            raise ValueError(
                f"schedule has {n} stages; this rank ({rank}) should hold stages {sorted(mine)} "
                f"but was given {sorted(self.local)}"
            )
        self.transport = transport
        if transport is None and len(mine) != n:
            raise ValueError("stages on other ranks need a transport")
        # Backwards split into I and W (zero-bubble schedules): their forwards hold the weight gradients back.
        self.split = grad_kinds([(s, a) for s, acts in enumerate(schedule) for a in acts])
        self.microbatches = len({a.microbatch for a in schedule[0]})
        compute = _by_rank(simulate(schedule, duration=duration).order if orders is None else
                           _checked(orders, schedule), self.stage_rank)
        # Inference runs the forwards; where the ranks' orders are given, each rank's in its own order (a rank that
        # interleaves its stages sends its activations in the order its peers take them).
        infer = simulate(forward_only(n, self.microbatches), training=False, duration=duration).order \
            if orders is None else [(s, a) for prog in orders for s, a in prog if a.kind == "F"]
        # Every rank's program of a training step (compute, messages, each stage's close), checked where stages
        # span ranks; this rank runs its own.
        self.commits = frozenset(commits)  # stages closing with BN_COMMIT (deferred BatchNorm statistics)
        self.programs = {r: close_stages(ops, self.commits)
                         for r, ops in lower_programs(compute, self.stage_rank).items()}
        if len(set(self.stage_rank)) > 1:
            check_programs(self.programs)
            check_programs(rank_programs(infer, self.stage_rank))
        self.train_order = list(compute[rank])
        self.infer_order = [(s, a) for s, a in infer if s in mine]
        self.last_backward = {s: [a for a in schedule[s] if a.kind in ACCUMULATES][-1].microbatch for s in mine}
        self._fewer: dict[int, tuple[list[tuple[int, Action]], list[tuple[int, Action]], dict[int, int]]] = {}
        self._lowered: dict[tuple[int, bool], list[Op]] = {}
        self.is_first, self.is_last = 0 in mine, n - 1 in mine
        # Each stage's lane, its side lanes, the copy lanes between devices, the held nodes' anchors.
        self.lanes = RankLanes(self.local, side_weights=side_weights, held=bool(self.split))
        workers = [st.lane.worker is not None for st in self.stages]
        if any(workers) and (not all(workers) or transport is not None or self.lanes.devices[0].type != "cpu"):
            raise ValueError("CPU worker lanes need every stage on the CPU of this process (no pipeline ranks): "
                             "give every stage a thread count, or none")
        self.workers = all(workers) and bool(workers)
        if self.split and self.workers:
            raise ValueError("a schedule with split backwards (I and W) runs one action at a time: give the stages "
                             "no thread counts of their own, or run gpipe or 1f1b")

    def program_text(self) -> str:
        """Each rank's program of a training step, a line a rank (``rank 0: 0F0 0SEND_F0 0F1 ...``)."""
        return "\n".join(f"rank {r}: {format_program(ops)}" for r, ops in sorted(self.programs.items()))

    def program(self, k: int, training: bool = True) -> list[Op]:
        """This rank's program of a step of ``k`` microbatches: its actions in order with the messages between
        ranks and, training, each stage's REDUCE_GRAD and UPDATE (:mod:`.ranks`)."""
        key = (k, training)
        if key == (self.microbatches, True):
            return self.programs[self.rank]  # lowered and checked with every rank's at construction
        if key not in self._lowered:
            train, infer, _ = self.orders(k)
            ops = lower_programs({self.rank: train if training else infer}, self.stage_rank)[self.rank]
            self._lowered[key] = close_stages(ops, self.commits) if training else ops
        return self._lowered[key]

    def _run(self, program: list[Op], order: list[tuple[int, Action]], step: StepRun) -> None:
        """Run this rank's ``program``: one thread, its actions in order, posting the receives still to come
        ahead; or each action queued to its stage's CPU worker, to start once what it needs from the other
        stages is done."""
        self.lanes.fork()
        if self.workers:
            flight = Flight()
            for op in program:
                after = [Op(a.kind, d, a.microbatch) for d, a in needs(op.stage, Action(op.kind, op.microbatch),
                                                                        self.n)
                         if d != op.stage] if op.kind in COMPUTE else []  # a worker keeps its own stage's order
                flight.submit(self.local[op.stage].lane.worker, op, lambda op=op: step.run(op), after=after,
                              label=f"stage {op.stage} ({self.local[op.stage].names[-1]}), {op}")
            flight.wait()
        else:
            ahead = step.ahead = Ahead(order, step) if self.transport is not None and \
                self.transport.posts_ahead else None
            for op in program:
                if ahead is not None:
                    ahead.fill()
                step.run(op)
        if self.transport is not None:
            self.transport.flush()
        if step.update is not None:
            step.update.join()
        self.lanes.join()

    def orders(self, k: int) -> tuple[list[tuple[int, Action]], list[tuple[int, Action]], dict[int, int]]:
        """Training order, inference order and last backward per local stage of a step of ``k`` microbatches.

        ``k`` is at most the schedule's count (a batch too small for it, see
        :func:`~pipedp.pipeline.microbatch.count`): the actions of the first
        ``k`` microbatches in the schedule's order. A subsequence of a valid
        order is valid, as every dependency links actions of one microbatch;
        pipeline ranks, each deriving ``k`` from the same batch size, keep
        matching sends and receives.
        """
        if k == self.microbatches:
            return self.train_order, self.infer_order, self.last_backward
        if not 1 <= k < self.microbatches:
            raise ValueError(f"a step of this pipeline runs 1 to {self.microbatches} microbatches, got {k}")
        if k not in self._fewer:
            train = [(s, a) for s, a in self.train_order if a.microbatch < k]
            infer = [(s, a) for s, a in self.infer_order if a.microbatch < k]
            self._fewer[k] = train, infer, {s: a.microbatch for s, a in train if a.kind in ACCUMULATES}
        return self._fewer[k]

    # -- training -------------------------------------------------------------------------------
    def train(
        self,
        xs: Sequence[torch.Tensor],
        ys: Sequence[torch.Tensor],
        weights: Sequence[float],
        loss_fn: LossFn,
        timer: StepTimer | None = None,
        sync: GradSyncLike | None = None,
        loss_scale: torch.Tensor | None = None,
        update: StageUpdateLike | None = None,
        divisor: int = 1,
        batchnorm: BatchNormCommitLike | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of every microbatch; returns the weighted loss sum (detached).

        ``xs`` must be on the first stage's device and ``ys`` on the last's
        (on other pipeline ranks only their shapes matter). Each microbatch's
        loss is multiplied by ``weights[i]`` (and by ``loss_scale``, fp16 loss
        scaling, which the returned sum leaves out) before its backward;
        gradients accumulate in the parameters' ``.grad``. ``sync.arm(k)``/``sync.finish(k)``
        bracket the last backward of local stage k, and ``update.stage_done(k)``
        follows it (an early optimizer update). ``batchnorm.commit_stage(k)`` is BN_COMMIT of local
        stage k (deferred statistics, after its last forward). ``divisor``: each loss is
        divided by it before its backward (and before ``loss_scale``), as a
        plain loop that accumulates over several batches divides its loss; the
        returned sum leaves it out. Returns None on a rank without the last
        stage.
        """
        if not len(xs) == len(ys) == len(weights):
            raise ValueError(f"got {len(xs)} inputs, {len(ys)} targets and {len(weights)} weights: one each per "
                             f"microbatch")
        order, _, last = self.orders(len(xs))
        step = StepRun(self, xs, ys, weights, loss_fn, timer, loss_scale, divisor, last=last, sync=sync,
                       update=update, batchnorm=batchnorm)
        self._run(self.program(len(xs)), order, step)
        if step.total is not None:
            current_lane(self.stages[-1].device).keep(step.total)
        return step.total

    # -- inference ------------------------------------------------------------------------------
    def forward(self, xs: Sequence[torch.Tensor]) -> list[Any]:
        """Forward of every microbatch (under the caller's grad mode); outputs of the last stage.

        On a rank without the last stage the list is empty. The last stage may
        return what ``loss_fn`` takes (a tuple, a dict; see
        :func:`~pipedp.pipeline.microbatch.gather`).
        """
        _, order, _ = self.orders(len(xs))
        step = StepRun(self, xs, None, None, None, None)
        self._run(self.program(len(xs), training=False), order, step)
        if not self.is_last:
            return []
        cur = current_lane(self.stages[-1].device)
        result = [o for o in step.outputs[self.n - 1] if o is not None]
        for o in result:
            for t in tensors_in(o):
                cur.keep(t)
        return result


def _checked(orders: Sequence[Sequence[tuple[int, Action]]], schedule: Schedule) -> list[tuple[int, Action]]:
    """The ranks' orders one after another, once they are checked to run each stage's actions as ``schedule``."""
    for prog in orders:
        for s, a in prog:
            if not 0 <= s < len(schedule):
                raise ValueError(f"an order runs {a} of stage {s}, but the schedule has {len(schedule)} stages")
    for s, (mine, want) in enumerate(zip(per_stage(orders, len(schedule)), schedule)):
        if mine != want:
            raise ValueError(f"the orders run stage {s}'s actions as {' '.join(map(str, mine))}, the schedule as "
                             f"{' '.join(map(str, want))}")
    return [x for prog in orders for x in prog]


def _by_rank(order: Sequence[tuple[int, Action]], stage_rank: Sequence[int]) -> dict[int, list[tuple[int, Action]]]:
    """Each rank's (stage, action) pairs, in ``order``."""
    out: dict[int, list[tuple[int, Action]]] = {r: [] for r in dict.fromkeys(stage_rank)}
    for s, a in order:
        out[stage_rank[s]].append((s, a))
    return out
