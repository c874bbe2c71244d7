"""Walks a schedule's actions, issuing each stage's work on that stage's lane.

The host issues actions in the order the simulator gives (by simulated start
time), and every cross-lane dependency is an event: a stage's forward waits for
the previous stage's forward of the same microbatch, its backward for the next
stage's backward. Activations cross a stage boundary detached, as a fresh leaf
that requires grad; its ``.grad`` after the next stage's backward is the
gradient sent back. Nothing here synchronises the host, so a step stays
asynchronous on CUDA. On devices without streams every lane is the in-order
stand-in and the same code runs sequentially, unless the lanes have CPU
workers: then each action is queued to its stage's worker, to start once the
action it depends on (as above) is done, and the step waits for all of them
at its end (:mod:`~pipedp.pipeline.cpu_lane`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch

from ..device import canonical_device
from ..partition.boundary import Value, is_value, leaf, map_tensors, tensors
from .ahead import Ahead
from .cpu_lane import Flight
from .deps import ACCUMULATES, grad_kinds, needs
from .p2p import Transport
from .ranks import check_programs, format_program, lower_programs, rank_programs
from .schedule import Action, Schedule, forward_only
from .simulate import simulate
from .stage import Stage
from .stream import Lane, current_lane, new_lane
from .trace import Clock
from .weight_grad import Deferred, anchor, run_deferred

__all__ = ["Executor", "StepTimer", "tensors_in"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


def _loss_error(loss: object) -> str | None:
    if not isinstance(loss, torch.Tensor):
        return f"loss_fn returned {type(loss).__name__}; it must return a scalar tensor"
    if loss.dim() != 0:
        return (
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return a scalar "
            f"(use a mean reduction, e.g. nn.CrossEntropyLoss(reduction='mean'))"
        )
    if not loss.requires_grad:
        return "loss_fn returned a scalar that does not require grad: no parameter of the model takes part in it"
    return None


def tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors inside a stage's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for item in items for t in tensors_in(item)]


class Executor:
    """Runs training and inference steps of a fixed pipeline over microbatches.

    ``stages`` are this rank's stages (``Stage.index`` is the global index);
    ``schedule`` covers all of them. Without ``stage_rank`` every stage is
    local; with it, ``stage_rank[s]`` is the global rank running stage s and
    ``transport`` moves values to and from the other ranks. ``orders``: each
    rank's (stage, action) pairs in the order it runs them, where a rank
    interleaves its stages (:mod:`.orders`); by default the simulator's start
    order of ``schedule``.
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
        self.split = grad_kinds((s, a) for s, acts in enumerate(schedule) for a in acts)
        self.microbatches = len({a.microbatch for a in schedule[0]})
        compute = _by_rank(simulate(schedule, duration=duration).order if orders is None else
                           _checked(orders, schedule), self.stage_rank)
        infer = simulate(forward_only(n, self.microbatches), training=False, duration=duration).order
        # Every rank's program of a training step (compute, sends, receives), checked where stages span ranks.
        self.programs = lower_programs(compute, self.stage_rank)
        if len(set(self.stage_rank)) > 1:
            check_programs(self.programs)
            check_programs(rank_programs(infer, self.stage_rank))
        self.train_order = list(compute[rank])
        self.infer_order = [(s, a) for s, a in infer if s in mine]
        self.last_backward = {s: [a for a in schedule[s] if a.kind in ACCUMULATES][-1].microbatch for s in mine}
        self._fewer: dict[int, tuple[list[tuple[int, Action]], list[tuple[int, Action]], dict[int, int]]] = {}
        self.is_first, self.is_last = 0 in mine, n - 1 in mine
        # With their indices: _move compares them with tensors' devices and looks copy lanes up by them.
        self.devices = list(dict.fromkeys(canonical_device(s.device) for s in self.stages))
        # One copy lane per device: cross-device copies run on the source device's copy lane.
        self.copy_lanes = {d: new_lane(d, f"copy:{d}") for d in self.devices if len(self.devices) > 1}
        # Lanes the stages' layers issue work on besides the stage's own (split weight gradients): joined too.
        self.side_lanes: list[Lane] = []
        workers = [st.lane.worker is not None for st in self.stages]
        if any(workers) and (not all(workers) or transport is not None or self.devices[0].type != "cpu"):
            raise ValueError("CPU worker lanes need every stage on the CPU of this process (no pipeline ranks): "
                             "give every stage a thread count, or none")
        self.workers = all(workers) and bool(workers)
        # The leaf each device's held weight-gradient nodes hang from, where backwards are split.
        self.anchors = {d: anchor(d) for d in self.devices} if self.split else {}
        if self.split and self.workers:
            raise ValueError("a schedule with split backwards (I and W) runs one action at a time: give the stages "
                             "no thread counts of their own, or run gpipe or 1f1b")

    def program_text(self) -> str:
        """Each rank's program of a training step, a line a rank (``rank 0: 0F0 0SEND_F0 0F1 ...``)."""
        return "\n".join(f"rank {r}: {format_program(ops)}" for r, ops in sorted(self.programs.items()))

    # -- plumbing ---------------------------------------------------------------------------------
    def _fork(self) -> None:
        """Every lane starts after what the caller issued before the step.

        The copy and side lanes too, although their work waits for a stage's
        lane anyway: :meth:`_join` makes the caller wait for each of them, and
        under CUDA-graph capture a stream may only wait for a stream that joined
        the capture. A side lane a step never uses (a model without a forking
        block, a stage without a convolution) would otherwise be an uncaptured
        stream, and waiting for it invalidates the capture.
        """
        for s in self.stages:
            s.lane.wait_lane(current_lane(s.device))
        for lane in (*self.copy_lanes.values(), *self.side_lanes):
            lane.wait_lane(current_lane(lane.device))

    def _join(self) -> None:
        """The caller's streams wait for everything the step issued."""
        for d in self.devices:
            cur = current_lane(d)
            for s in self.stages:
                if s.device == d:
                    cur.wait_lane(s.lane)
            if d in self.copy_lanes:
                cur.wait_lane(self.copy_lanes[d])
            for side in self.side_lanes:
                if side.device == d:
                    cur.wait_lane(side)

    def _move(self, t: torch.Tensor, ready: "torch.cuda.Event | None", src: torch.device, dst: Lane) -> torch.Tensor:
        """``t`` (made on ``src`` when ``ready`` fires) usable on lane ``dst``."""
        src = canonical_device(src)
        if src == dst.device:
            dst.wait(ready)
            dst.keep(t)
            return t
        if src.type != "cuda" or dst.device.type != "cuda":
            dst.wait(ready)
            return t.to(dst.device)
        copy = self.copy_lanes[src]
        copy.wait(ready)
        # torch copies across devices on the source's current stream and makes the
        # destination's current stream wait for it: make those our copy lane and dst.
        with copy.use(), dst.use():
            out = t.to(dst.device, non_blocking=True)
        copy.keep(t)
        return out

    def _act(self, s: int, act: Action, step: "_Step", sync: GradSyncLike | None,
             update: StageUpdateLike | None, last_backward: dict[int, int]) -> None:
        with self.local[s].lane.use():
            if act.kind == "F":
                step.forward(s, act.microbatch)
                return
            # The stage's last accumulation: its last B, or its last W where backwards are split. A split stage
            # launches its buckets once that W is done (its I's accumulate some gradients, its W's the rest).
            last = act.kind != "I" and act.microbatch == last_backward[s]
            if last and sync is not None and act.kind == "B":
                sync.arm(self.pos[s])
            if act.kind == "W":
                step.weight_grads(s, act.microbatch, sync)
            else:
                step.backward(s, act.microbatch, act.kind)
            if last and sync is not None:
                sync.finish(self.pos[s])
            if last and update is not None:
                update.stage_done(self.pos[s])

    def _run(self, order: list[tuple[int, Action]], last: dict[int, int], step: "_Step",
             sync: GradSyncLike | None = None, update: StageUpdateLike | None = None) -> None:
        self._fork()
        if self.workers:
            flight = Flight()
            for s, act in order:
                after = [d for d in needs(s, act, self.n) if d[0] != s]  # the lane keeps its own stage's order
                flight.submit(self.local[s].lane.worker, (s, act),
                              lambda s=s, act=act: self._act(s, act, step, sync, update, last),
                              after=after, label=f"stage {s} ({self.local[s].names[-1]}), {act}")
            flight.wait()
        else:
            # One thread issues this rank's actions: the receives still to come can be posted ahead, in order.
            ahead = step.ahead = Ahead(order, step) if self.transport is not None and \
                self.transport.posts_ahead else None
            for s, act in order:
                if ahead is not None:
                    ahead.fill()
                self._act(s, act, step, sync, update, last)
        if self.transport is not None:
            self.transport.flush()
        if update is not None:
            update.join()
        self._join()

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
    ) -> torch.Tensor | None:
        """Forward and backward of every microbatch; returns the weighted loss sum (detached).

        ``xs`` must be on the first stage's device and ``ys`` on the last's
        (on other pipeline ranks only their shapes matter). Each microbatch's
        loss is multiplied by ``weights[i]`` (and by ``loss_scale``, fp16 loss
        scaling, which the returned sum leaves out) before its backward;
        gradients accumulate in the parameters' ``.grad``. ``sync.arm(k)``/``sync.finish(k)``
        bracket the last backward of local stage k, and ``update.stage_done(k)``
        follows it (an early optimizer update). ``divisor``: each loss is
        divided by it before its backward (and before ``loss_scale``), as a
        plain loop that accumulates over several batches divides its loss; the
        returned sum leaves it out. Returns None on a rank without the last
        stage.
        """
        if not len(xs) == len(ys) == len(weights):
            raise ValueError(f"got {len(xs)} inputs, {len(ys)} targets and {len(weights)} weights: one each per "
                             f"microbatch")
        order, _, last = self.orders(len(xs))
        step = _Step(self, xs, ys, weights, loss_fn, timer, loss_scale, divisor)
        self._run(order, last, step, sync, update)
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
        _, order, last = self.orders(len(xs))
        step = _Step(self, xs, None, None, None, None)
        self._run(order, last, step)
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
    got: Schedule = [[] for _ in schedule]
    for prog in orders:
        for s, a in prog:
            if not 0 <= s < len(got):
                raise ValueError(f"an order runs {a} of stage {s}, but the schedule has {len(got)} stages")
            got[s].append(a)
    for s, (mine, want) in enumerate(zip(got, schedule)):
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


class GradSyncLike(Protocol):
    def arm(self, stage: int) -> None: ...

    def accumulated(self, p: torch.Tensor) -> None: ...

    def finish(self, stage: int) -> None: ...


class StageUpdateLike(Protocol):
    def stage_done(self, stage: int) -> None: ...

    def join(self) -> None: ...


class _Step:
    """The in-flight tensors and events of one step (training when ``loss_fn`` is given)."""

    def __init__(self, ex: Executor, xs, ys, weights, loss_fn: LossFn | None, timer: StepTimer | None,
                 loss_scale: torch.Tensor | None = None, divisor: int = 1) -> None:
        n, m = ex.n, len(xs)
        self.ex, self.xs, self.ys, self.weights, self.loss_fn, self.timer = ex, xs, ys, weights, loss_fn, timer
        self.loss_scale, self.divisor = loss_scale, divisor
        self.inputs: list[list[Value | None]] = [[None] * m for _ in range(n)]
        self.outputs: list[list[Any]] = [[None] * m for _ in range(n)]  # the last stage's: what loss_fn takes
        self.losses: list[torch.Tensor | None] = [None] * m
        self.fwd_ev: list[list] = [[None] * m for _ in range(n)]
        self.bwd_ev: list[list] = [[None] * m for _ in range(n)]
        self.total: torch.Tensor | None = None
        # Both sides of a rank boundary derive message keys from the same input signature.
        self.keys = [(tuple(x.shape), x.dtype, loss_fn is not None) for x in xs]
        self.ahead: Ahead | None = None  # the receives posted ahead, where one thread issues the actions
        self.held: dict[tuple[int, int], list] = {}  # (stage, microbatch): weight gradients its W computes

    def _peer(self, s: int) -> int:
        return self.ex.stage_rank[s]

    def peer_of(self, s: int, act: Action) -> int | None:
        """The rank ``act`` of stage ``s`` receives from: the previous stage's for a forward, the next one's for a
        backward, where that stage is on another rank."""
        if act.kind == "W":  # a stage's own weight gradients: nothing comes in
            return None
        other = s - 1 if act.kind == "F" else s + 1
        return self._peer(other) if 0 <= other < self.ex.n and other not in self.ex.local else None

    def post(self, s: int, act: Action) -> bool | None:
        """Post the receive of ``act`` of stage ``s`` now, where its sizes are known (:class:`Ahead`)."""
        transport, peer, i = self.ex.transport, self.peer_of(s, act), act.microbatch
        assert transport is not None and peer is not None
        if act.kind == "F":
            key = (s - 1, self.keys[i])
            if not transport.knows(key):
                return False
            transport.post_activation(peer, key)
            return True
        out = self.outputs[s][i]
        if out is None:  # its forward has not run: the gradients' sizes are not known
            return False
        outs = [t for t in tensors(out) if t.requires_grad]
        if not outs:
            return None
        transport.post_grads(outs, peer, (s, i))
        return True

    def _posted(self, s: int, act: Action) -> bool:
        """Whether the receive of ``act`` was posted ahead; after this the next ones may be."""
        return self.ahead is not None and self.ahead.take(s, act)

    def _refill(self) -> None:
        if self.ahead is not None:
            self.ahead.fill()  # while this action computes, the next transfers cross

    def forward(self, s: int, i: int) -> None:
        ex, timer = self.ex, self.timer
        stage = ex.local[s]
        lane = stage.lane
        if s == 0:
            inp = ex._move(self.xs[i], None, self.xs[i].device, lane)
        elif s - 1 in ex.local:
            prev = self.outputs[s - 1][i]
            assert prev is not None
            src, ready = ex.local[s - 1].device, self.fwd_ev[s - 1][i]
            inp = leaf(map_tensors(prev, lambda t: ex._move(t.detach(), ready, src, lane)),
                       [t.requires_grad for t in tensors(prev)])
            if self.loss_fn is None:  # inference keeps nothing for a backward
                self.outputs[s - 1][i] = None
        else:
            assert ex.transport is not None
            posted = self._posted(s, Action("F", i))
            inp = ex.transport.recv_activation(self._peer(s - 1), (s - 1, self.keys[i]), posted=posted)
            self._refill()
        if self.loss_fn is not None:
            self.inputs[s][i] = inp
        if timer is not None:
            timer.begin(lane)
        if self.loss_fn is not None and (s, i) in ex.split and stage.body is None:  # compiled or recomputed: whole
            with Deferred(self.held.setdefault((s, i), []), ex.anchors[canonical_device(stage.device)]):
                out = stage(inp)
        else:
            out = stage(inp)
        if s == ex.n - 1 and self.loss_fn is not None:
            with stage.precision():  # the loss under autocast too, as in plain autocast training
                loss = self.loss_fn(out, ex._move(self.ys[i], None, self.ys[i].device, lane))
            err = _loss_error(loss)
            if err:
                raise ValueError(err)
            loss = loss * self.weights[i]
            self.total = loss.detach() if self.total is None else self.total + loss.detach()
            if self.divisor != 1:
                loss = loss / self.divisor
            if self.loss_scale is not None:
                loss = loss * self.loss_scale.to(loss.device, non_blocking=True)
            self.losses[i] = loss
        else:
            if not is_value(out) and s < ex.n - 1:  # the last stage's output leaves the pipeline
                raise ValueError(f"stage {s} ({stage.names[-1]}) returned {type(out).__name__}, not a tensor or a "
                                 f"tuple of tensors")
            self.outputs[s][i] = out
            if s + 1 < ex.n and s + 1 not in ex.local:
                assert ex.transport is not None
                ex.transport.send_activation(out, self._peer(s + 1), (s, self.keys[i]))
        if timer is not None:
            timer.end(ex.pos[s], lane, f"F{i}")
        self.fwd_ev[s][i] = lane.record()

    def weight_grads(self, s: int, i: int, sync: GradSyncLike | None) -> None:
        """W: the weight gradients microbatch ``i``'s I held back on stage ``s``, accumulated now."""
        lane = self.ex.local[s].lane
        if self.timer is not None:
            self.timer.begin(lane)
        run_deferred(self.held.pop((s, i), []), sync.accumulated if sync is not None else lambda p: None)
        if self.timer is not None:
            self.timer.end(self.ex.pos[s], lane, f"W{i}")

    def backward(self, s: int, i: int, kind: str = "B") -> None:
        """B, or I where the weight gradients were held back (its forward ran under :class:`Deferred`)."""
        ex, timer = self.ex, self.timer
        stage = ex.local[s]
        lane = stage.lane
        # Backward runs outside autocast (autograd replays the forward's dtypes).
        with torch.autocast(stage.device.type, enabled=False):
            if s == ex.n - 1:
                loss, self.losses[i] = self.losses[i], None
                assert loss is not None
                if timer is not None:
                    timer.begin(lane)
                torch.autograd.backward(loss)
            else:
                out = self.outputs[s][i]
                self.outputs[s][i] = None
                assert out is not None
                outs: list[torch.Tensor] = [t for t in tensors(out) if t.requires_grad]
                grads: list[torch.Tensor] = []
                if s + 1 in ex.local:
                    nxt, self.inputs[s + 1][i] = self.inputs[s + 1][i], None
                    assert nxt is not None
                    src, ready = ex.local[s + 1].device, self.bwd_ev[s + 1][i]
                    # A tensor whose next-stage copy got no gradient adds nothing to the backward.
                    pairs = [(o, n.grad) for o, n in zip(tensors(out), tensors(nxt))
                             if o.requires_grad and n.grad is not None]
                    outs, grads = [o for o, _ in pairs], [ex._move(g, ready, src, lane) for _, g in pairs]
                else:
                    posted = self._posted(s, Action(kind, i))
                    if outs:
                        assert ex.transport is not None
                        grads = ex.transport.recv_grads(outs, self._peer(s + 1), posted=(s, i) if posted else None)
                        self._refill()
                if timer is not None:
                    timer.begin(lane)
                if grads:
                    torch.autograd.backward(outs, grads)
        if s > 0 and s - 1 not in ex.local:
            inp, self.inputs[s][i] = self.inputs[s][i], None
            assert inp is not None and ex.transport is not None
            need = [t for t in tensors(inp) if t.requires_grad]
            if need:
                ex.transport.send_grads([t.grad if t.grad is not None else torch.zeros_like(t) for t in need],
                                        self._peer(s - 1))
        if s == 0:
            self.inputs[0][i] = None
        if timer is not None:
            timer.end(ex.pos[s], lane, f"{kind}{i}")
        self.bwd_ev[s][i] = lane.record()
