"""One step of a rank's program, interpreted: a handler per action.

The lowering (:mod:`.ranks`) gives each rank its program: compute (F, B, or
I and W), the messages between ranks (SEND/RECV of an activation or of its
gradient), after a stage's last forward BN_COMMIT (where BatchNorm statistics
are deferred) and after its last accumulation REDUCE_GRAD and UPDATE.
:class:`StepRun` holds one step's tensors in flight and runs each action by
its kind; the executor walks the program (one thread, or the CPU workers)
and calls :meth:`StepRun.run` on each. Within a rank, activations cross a
stage boundary detached, as a fresh leaf that requires grad; its ``.grad``
after the next stage's backward is the gradient sent back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from ..partition.boundary import Value, is_value, leaf, map_tensors, tensors
from .ahead import Ahead
from .ranks import Op
from .schedule import Action
from .weight_grad import Deferred, run_deferred

if TYPE_CHECKING:
    from .executor import Executor, StepTimer

__all__ = ["StepRun", "GradSyncLike", "StageUpdateLike", "BatchNormCommitLike", "LossFn"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GradSyncLike(Protocol):
    def arm(self, stage: int) -> None: ...

    def accumulated(self, p: torch.Tensor) -> None: ...

    def finish(self, stage: int) -> None: ...


class BatchNormCommitLike(Protocol):
    def commit_stage(self, pos: int) -> None: ...


class StageUpdateLike(Protocol):
    def stage_done(self, stage: int) -> None: ...

    def join(self) -> None: ...


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


class StepRun:
    """The in-flight tensors and events of one step (training when ``loss_fn`` is given), and its handlers.

    ``last``: per local stage, the microbatch of its last accumulation (its
    last B arms the gradient sync, so buckets launch as they fill).
    """

    def __init__(self, ex: "Executor", xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor] | None,
                 weights: Sequence[float] | None, loss_fn: LossFn | None, timer: "StepTimer | None",
                 loss_scale: torch.Tensor | None = None, divisor: int = 1, *, last: dict[int, int] | None = None,
                 sync: GradSyncLike | None = None, update: StageUpdateLike | None = None,
                 batchnorm: BatchNormCommitLike | None = None) -> None:
        n, m = ex.n, len(xs)
        self.ex, self.xs, self.ys, self.weights, self.loss_fn, self.timer = ex, xs, ys, weights, loss_fn, timer
        self.loss_scale, self.divisor = loss_scale, divisor
        self.last, self.sync, self.update, self.batchnorm = last or {}, sync, update, batchnorm
        self.inputs: list[list[Value | None]] = [[None] * m for _ in range(n)]
        self.outputs: list[list[Any]] = [[None] * m for _ in range(n)]  # the last stage's: what loss_fn takes
        self.arrived: dict[tuple[int, int], Any] = {}  # what a RECV took, until its action takes it
        self.losses: list[torch.Tensor | None] = [None] * m
        self.fwd_ev: list[list] = [[None] * m for _ in range(n)]
        self.bwd_ev: list[list] = [[None] * m for _ in range(n)]
        self.total: torch.Tensor | None = None
        # Both sides of a rank boundary derive message keys from the same input signature.
        self.keys = [(tuple(x.shape), x.dtype, loss_fn is not None) for x in xs]
        self.ahead: Ahead | None = None  # the receives posted ahead, where one thread issues the actions
        self.held: dict[tuple[int, int], list] = {}  # (stage, microbatch): weight gradients its W computes
        self.handlers: dict[str, Callable[[Op], None]] = {
            "F": self.forward, "B": self.backward, "I": self.backward, "W": self.weight_grads,
            "recv": self.receive, "send": self.send, "commit": self.commit, "reduce": self.reduce,
            "update": self.step_stage,
        }

    def run(self, op: Op) -> None:
        """Run one action of this rank's program on its stage's lane (W: on the lane the executor gives it)."""
        with self.ex.lanes.of(op).use():
            self.handlers[op.kind](op)

    # -- receives posted ahead (:class:`Ahead`) ------------------------------------------------------
    def peer_of(self, s: int, act: Action) -> int | None:
        """The rank ``act`` of stage ``s`` receives from: the previous stage's for a forward, the next one's for a
        backward, where that stage is on another rank."""
        if act.kind == "W":  # a stage's own weight gradients: nothing comes in
            return None
        other = s - 1 if act.kind == "F" else s + 1
        return self.ex.stage_rank[other] if 0 <= other < self.ex.n and other not in self.ex.local else None

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

    def _backward_kind(self, s: int, i: int) -> str:
        return "I" if (s, i) in self.ex.split else "B"

    # -- messages -------------------------------------------------------------------------------------
    def receive(self, op: Op) -> None:
        """RECV: the activation stage ``op.stage`` takes in, or the gradient of its output, from ``op.peer``."""
        transport, s, i = self.ex.transport, op.stage, op.microbatch
        assert transport is not None
        if op.payload == "act":
            posted = self._posted(s, Action("F", i))
            self.arrived[(s, i)] = transport.recv_activation(op.peer, (s - 1, self.keys[i]), posted=posted)
        else:
            posted = self._posted(s, Action(self._backward_kind(s, i), i))
            outs = [t for t in tensors(self.outputs[s][i]) if t.requires_grad]
            if outs:
                self.arrived[(s, i)] = transport.recv_grads(outs, op.peer, posted=(s, i) if posted else None)
        if self.ahead is not None:
            self.ahead.fill()  # while the action computes, the next transfers cross

    def send(self, op: Op) -> None:
        """SEND: stage ``op.stage``'s output to the next stage's rank, or its input's gradient to the previous."""
        transport, s, i = self.ex.transport, op.stage, op.microbatch
        assert transport is not None
        if op.payload == "act":
            transport.send_activation(self.outputs[s][i], op.peer, (s, self.keys[i]))
            if self.loss_fn is None:  # inference keeps nothing for a backward
                self.outputs[s][i] = None
            return
        inp, self.inputs[s][i] = self.inputs[s][i], None
        assert inp is not None
        need = [t for t in tensors(inp) if t.requires_grad]
        if need:
            transport.send_grads([t.grad if t.grad is not None else torch.zeros_like(t) for t in need], op.peer)

    # -- compute --------------------------------------------------------------------------------------
    def _input(self, s: int, i: int) -> Value:
        ex = self.ex
        lane = ex.local[s].lane
        if s == 0:
            return ex.lanes.move(self.xs[i], None, self.xs[i].device, lane)
        if s - 1 in ex.local:
            prev = self.outputs[s - 1][i]
            assert prev is not None
            src, ready = ex.local[s - 1].device, self.fwd_ev[s - 1][i]
            inp = leaf(map_tensors(prev, lambda t: ex.lanes.move(t.detach(), ready, src, lane)),
                       [t.requires_grad for t in tensors(prev)])
            if self.loss_fn is None:  # inference keeps nothing for a backward
                self.outputs[s - 1][i] = None
            return inp
        return self.arrived.pop((s, i))

    def forward(self, op: Op) -> None:
        """F: stage ``op.stage``'s forward of a microbatch (and the loss, on the last stage)."""
        ex, timer, s, i = self.ex, self.timer, op.stage, op.microbatch
        stage = ex.local[s]
        lane = stage.lane
        inp = self._input(s, i)
        if self.loss_fn is not None:
            self.inputs[s][i] = inp
        if timer is not None:
            timer.begin(lane)
        if self.loss_fn is not None and (s, i) in ex.split and stage.body is None:  # compiled or recomputed: whole
            with Deferred(self.held.setdefault((s, i), []), ex.lanes.anchor(stage.device)):
                out = stage(inp)
        else:
            out = stage(inp)
        if s == ex.n - 1 and self.loss_fn is not None:
            self.losses[i] = self._loss(s, i, out)
        else:
            if not is_value(out) and s < ex.n - 1:  # the last stage's output leaves the pipeline
                raise ValueError(f"stage {s} ({stage.names[-1]}) returned {type(out).__name__}, not a tensor or a "
                                 f"tuple of tensors")
            self.outputs[s][i] = out
        if timer is not None:
            timer.end(ex.pos[s], lane, f"F{i}")
        self.fwd_ev[s][i] = lane.record()

    def _loss(self, s: int, i: int, out: Any) -> torch.Tensor:
        ex = self.ex
        stage = ex.local[s]
        assert self.loss_fn is not None and self.ys is not None and self.weights is not None
        with stage.precision():  # the loss under autocast too, as in plain autocast training
            loss = self.loss_fn(out, ex.lanes.move(self.ys[i], None, self.ys[i].device, stage.lane))
        err = _loss_error(loss)
        if err:
            raise ValueError(err)
        loss = loss * self.weights[i]
        self.total = loss.detach() if self.total is None else self.total + loss.detach()
        if self.divisor != 1:
            loss = loss / self.divisor
        if self.loss_scale is not None:
            loss = loss * self.loss_scale.to(loss.device, non_blocking=True)
        return loss

    def weight_grads(self, op: Op) -> None:
        """W: the weight gradients microbatch ``i``'s I held back on stage ``s``, accumulated now.

        On a side lane (``split_grads``) W starts once the stage's lane (and
        its other side lanes: a shortcut's) has issued its I, and the tensors
        it reads stay alive until the side lane has read them; the stage's
        lane goes on with its next action. A stage's last W arms the gradient
        sync: the buckets of the weights it accumulates launch as they fill.
        """
        s, i = op.stage, op.microbatch
        lane, own = self.ex.lanes.of(op), self.ex.local[s].lane
        held = self.held.pop((s, i), [])
        if lane is not own:
            lane.wait(own.record())
            for other in self.ex.lanes.of_stage(s):
                if other is not lane:
                    lane.wait(other.record())
            for h in held:
                for t in h.reads:
                    lane.keep(t)
        if self.sync is not None and self.last.get(s) == i:
            self.sync.arm(self.ex.pos[s])
        if self.timer is not None:
            self.timer.begin(lane)
        sync = self.sync
        run_deferred(held, sync.accumulated if sync is not None else lambda p: None)
        if self.timer is not None:
            self.timer.end(self.ex.pos[s], lane, f"W{i}")

    def backward(self, op: Op) -> None:
        """B, or I where the weight gradients were held back (its forward ran under :class:`Deferred`).

        A stage's last B arms the gradient sync: its buckets launch as they fill during this backward.
        """
        ex, timer, s, i = self.ex, self.timer, op.stage, op.microbatch
        stage = ex.local[s]
        lane = stage.lane
        if op.kind == "B" and self.sync is not None and self.last.get(s) == i:
            self.sync.arm(ex.pos[s])
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
                    outs, grads = [o for o, _ in pairs], [ex.lanes.move(g, ready, src, lane) for _, g in pairs]
                elif outs:
                    grads = self.arrived.pop((s, i))
                if timer is not None:
                    timer.begin(lane)
                if grads:
                    torch.autograd.backward(outs, grads)
        if s == 0:
            self.inputs[0][i] = None
        if timer is not None:
            timer.end(ex.pos[s], lane, f"{op.kind}{i}")
        self.bwd_ev[s][i] = lane.record()

    # -- a stage's close ------------------------------------------------------------------------------
    def commit(self, op: Op) -> None:
        """BN_COMMIT: the deferred BatchNorm statistics the stage's last forward completed, applied now."""
        if self.batchnorm is not None:
            self.batchnorm.commit_stage(self.ex.pos[op.stage])

    def reduce(self, op: Op) -> None:
        """REDUCE_GRAD: the stage's gradients are whole; its buckets still to go are launched."""
        if self.sync is not None:
            self.sync.finish(self.ex.pos[op.stage])

    def step_stage(self, op: Op) -> None:
        """UPDATE: the stage's parameters stepped now, where updates run early."""
        if self.update is not None:
            self.update.stage_done(self.ex.pos[op.stage])
