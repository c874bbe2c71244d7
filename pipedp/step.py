"""One training step of a built pipeline: microbatches through the schedule, then the optimizer.

A step equals plain PyTorch running the same microbatches with gradient
accumulation (each microbatch's mean loss weighted by its share of the
batch; a summed loss, ``reduction="sum"``, added as it is) followed by the
same optimizer step. If anything fails, buffers are put back, so
parameters, optimizer state and BatchNorm statistics are as before the step.
Gradients: a call inside an accumulation window (after ``update=False``
calls) puts back copies of what the window held (None where there was
none), whether its backward or its update failed; a step that opens no
window cleared the last step's gradients first, as ``optimizer.zero_grad()``
does, and a failure leaves them None (giving them back would copy every
gradient on every step). A failure inside ``optimizer.step()``
itself (which may have updated some parameters, or created state, before
it raised) is undone from a copy taken just before it where it can still
fail (:mod:`~pipedp.rollback`).
Between the last backward and the update, gradients are unscaled (fp16),
checked for overflow (a step with inf/NaN gradients skips the update, as
``GradScaler`` does) and clipped (:class:`~pipedp.update.GradientStep`). With a
CUDA graph the whole step is captured after two eager steps of the same
signature and replayed; a traced step always runs eagerly (a graph would
hide its inside). With an early update (:mod:`~pipedp.pipeline.early_update`)
each stage's update starts inside the backward, so the rollback copy is taken
before the step's first forward instead, and any failure of the step puts
it back.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from .build import Pipeline
from .comm import Communicator
from .distributed import DistributedError, StepMismatch
from .pipeline import microbatch
from .pipeline.early_update import EarlyUpdate
from .pipeline.executor import StepTimer
from .pipeline.graphed import StepGraph, hyper_signature
from .pipeline.stream import current_lane
from .pipeline.trace import step_spans, write_trace
from .rollback import Rollback
from .snapshot import UpdateSnapshot
from .update import GradientStep

__all__ = ["StepRunner", "LossFn", "loss_reduction"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# How a batch's loss reduces its samples, as torch's losses name it: "batchmean" (KLDivLoss) is a mean too.
_REDUCTIONS = {"mean": "mean", "batchmean": "mean", "sum": "sum"}


def loss_reduction(loss_fn: LossFn | None) -> str:
    """``"mean"`` or ``"sum"``: how ``loss_fn`` reduces a batch, so that microbatch losses combine to the batch's.

    Read from its ``reduction`` attribute (torch's loss modules; a closure may
    carry one) or a ``functools.partial``'s ``reduction=`` keyword; a loss that
    names none is taken as a mean. Any other reduction (``"none"``) is refused
    with the fix: a step needs one scalar per batch.
    """
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is None and isinstance(loss_fn, functools.partial):
        reduction = loss_fn.keywords.get("reduction")
    if reduction is None:
        return "mean"
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"loss_fn has reduction={reduction!r}: pipedp needs one scalar loss per batch, a mean over its samples "
            f"(reduction='mean', weighted by each microbatch's share) or a sum (reduction='sum', added up). "
            f"Use reduction='mean' or 'sum', or reduce inside a loss_fn of your own "
            f"(give it a reduction='sum' attribute when it sums)")
    return _REDUCTIONS[reduction]


class StepRunner:
    """Runs training steps of ``pipe`` for ``model`` with ``optimizer`` and ``loss_fn``."""

    def __init__(self, model: nn.Module, pipe: Pipeline, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 comm: Communicator, grads: GradientStep | None = None, early: EarlyUpdate | None = None) -> None:
        self.model, self.pipe, self.optimizer, self.loss_fn = model, pipe, optimizer, loss_fn
        self.reduction = loss_reduction(loss_fn)
        self.comm, self.microbatches = comm, pipe.microbatches  # the plan's choice ("auto" resolved)
        self.grads = grads if grads is not None else GradientStep((), comm)
        levers = pipe.decision.settled  # the plan's CUDA graph and rollback, never the options
        self.graph = StepGraph(self.graph_body) if levers.cuda_graph else None
        self.early = early  # per-stage updates issued during the backward
        # An early update may fail anywhere in the step: it copies before every step's first forward.
        self.before_update = UpdateSnapshot(optimizer) if levers.rollback and early is not None else None
        self.rollback = Rollback(optimizer) if levers.rollback and early is None else None
        self.updates: list[tuple] = []  # the last traced step's optimizer marks
        self.replayed = False  # whether the last step was a graph replay (no per-stage timings)
        self.pending = 0  # calls with update=False since the last update: their gradients are held

    def step(self, x: torch.Tensor, y: torch.Tensor, index: int, timer: StepTimer | None = None,
             outputs: list[Any] | None = None, *, update: bool = True, divisor: int = 1) -> torch.Tensor:
        """Step number ``index`` on ``(x, y)`` (already on the first and last stage's devices).

        ``outputs``: where this rank's last stage appends each microbatch's
        output, detached, in microbatch order (None: none kept). ``update``:
        False accumulates this batch's gradients for a later call that
        updates; ``divisor``: the loss of this batch is divided by it before
        its backward (:meth:`pipedp.Engine.train_step`).
        """
        accumulating = not update or divisor != 1 or self.pending > 0
        if outputs is not None and self.graph is not None:
            raise ValueError("return_outputs=True with cuda_graph=True: the captured step keeps no outputs. Use "
                             "cuda_graph=False to get them, or compute what you need inside loss_fn")
        if accumulating and (self.graph is not None or self.early is not None):
            which = "cuda_graph=True: the captured step" if self.graph is not None else \
                "early_update=True: an early update"
            raise ValueError(f"update=False / loss_divisor with {which} updates on every call. Use cuda_graph=False "
                             f"and early_update=False to accumulate over batches, or one larger batch")
        graph = self.graph if timer is None or timer.clock is None else None
        self.replayed = False
        if graph is not None:
            hyper = hyper_signature(self.optimizer)
            if not graph.replayable(x, y, hyper) and graph.due(x, y, hyper):
                graph.capture(x, y, hyper, before=lambda: self.model.zero_grad(set_to_none=True))
            if graph.replayable(x, y, hyper):
                self.replayed = True
                return graph.replay(x, y)
            graph.note_eager(x, y, hyper)
        held = self._held_grads() if self.pending else None  # a failed call gives the window's gradients back
        if not self.pending:
            self._zero_grads()
        elif self.pipe.sync is not None:
            self.pipe.sync.resume()
        self.pipe.buffers.save()
        early_rollback = self.before_update is not None
        if self.before_update is not None:
            self.before_update.save()
        for part in (self.pipe.sync, self.pipe.transport):
            if part is not None:
                part.step = index
        overflow = update and self.grads.scaler is not None  # the step's overflow agreement is still to come
        try:
            # A mean weighs this replica by its share of the global batch; sums are averaged over the replicas
            # plainly, as DDP does.
            if self.pipe.sync is not None and self.reduction == "mean":
                self.pipe.sync.begin(x.shape[0])
            if self.pipe.transport is not None:  # the ranks of a pipeline: one batch, one step
                self.pipe.transport.compare_batch(x, y)
            loss = self._forward_backward(x, y, timer, outputs, divisor)
            if self.pipe.sync is not None:
                self.pipe.sync.wait()
            loss = self.comm.share_loss(loss, self.pipe.executor.stages[-1].device, index)
            overflow = False
            apply = self.grads.prepare(index) if update else False
        except DistributedError as e:
            if early_rollback:
                self._undo_early_updates()
            self.recover(held)
            if isinstance(e, StepMismatch):  # every rank raised it from the same numbers: none is gone
                raise
            raise DistributedError(f"{e}{self.comm.failure_note(index)}") from e.__cause__
        except BaseException as e:
            if early_rollback:
                self._undo_early_updates()
            self._drain(e, overflow, index)
            self.recover(held)
            raise
        if not update:  # this batch's statistics count now, as a plain forward's; its gradients wait
            if self.pipe.batchnorm is not None:
                self.pipe.batchnorm.commit()
            self.pending += 1
            return loss  # type: ignore[return-value]
        window, self.pending = self.pending, 0
        clock = timer.clock if timer is not None else None
        devices = self.pipe.executor.lanes.devices
        marks = [(d, clock.mark(current_lane(d))) for d in devices] if clock is not None else []
        rollback = self.rollback if apply else None
        if rollback is not None:
            rollback.before()
        try:
            self._update(apply)
        except BaseException as e:
            if self.before_update is not None and apply:
                self.before_update.restore()
            if rollback is not None and not rollback.failed():
                e.add_note("pipedp: this update was not copied beforehand (an update of the same structure had "
                           "gone through), so what optimizer.step() changed before it raised stays; the next "
                           "update is copied again (see pipedp.rollback)")
            self.recover(held)
            self.pending = window  # the window's gradients are back: a retried call closes it
            raise
        if rollback is not None:
            rollback.succeeded()
        self.grads.finish()
        if clock is not None:
            assert timer is not None
            self.updates = [(d, m, clock.mark(current_lane(d))) for d, m in marks]
        return loss  # type: ignore[return-value]

    def write_trace(self, path: str, timer: StepTimer, index: int, schedule: str) -> None:
        """The step just run with ``timer`` (made with a clock) as a Chrome/Perfetto trace at ``path``."""
        assert timer.clock is not None
        where = self.comm.describe() or "single process"
        meta = {"step": index, "microbatches": self.microbatches, "schedule": schedule, "where": where,
                "plan": str(self.pipe.plan)}
        spans = step_spans(self.pipe.executor.stages, timer.clock, timer, self.pipe.sync, self.updates)
        write_trace(path, spans, process=f"pipedp ({where})", metadata=meta)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, timer: StepTimer | None = None,
                          outputs: list[Any] | None = None, divisor: int = 1) -> torch.Tensor | None:
        loss_fn = self.loss_fn if outputs is None else _keeping(self.loss_fn, outputs)
        k = microbatch.count(x.shape[0], self.microbatches)
        xs, ys = microbatch.split(x, k), microbatch.split(y, k)
        weights = microbatch.shares([t.shape[0] for t in xs], self.reduction)
        if self.pipe.batchnorm is not None:
            self.pipe.batchnorm.begin()
        if self.early is not None:
            self.early.begin(self.pipe.sync)
        return self.pipe.executor.train(xs, ys, weights, loss_fn, timer, sync=self.pipe.sync,
                                        loss_scale=self.grads.loss_scale, update=self.early, divisor=divisor,
                                        batchnorm=self.pipe.batchnorm)

    def _drain(self, error: BaseException, overflow: bool, index: int) -> None:
        """Issue what this failed step had still to issue to the data-parallel peers, which go on with it.

        A failure of this rank alone (a bad batch, an error in ``loss_fn``)
        would leave them waiting in the step's all-reduces, and this rank's
        next collective would meet theirs (gloo aborts the process on the
        mismatch). Drained (zeroed buckets, an overflow flag that makes every
        rank skip the update), they finish the step and the next one finds this
        rank behind, on every rank (:class:`~pipedp.distributed.StepMismatch`).
        """
        if not isinstance(error, Exception) or self.comm.layout is None or self.comm.layout.dp == 1:
            return  # an interrupt: no waiting for the peers
        failed = self.pipe.sync.drain() if self.pipe.sync is not None else None
        if isinstance(failed, (ValueError, StepMismatch)):
            return  # every rank refused the step at the count: nothing more goes
        if overflow and failed is None and self.comm.pp == 1 and self.grads.scaler is not None:
            found = torch.ones((), dtype=torch.float32, device=self.grads.scaler.scale.device)
            try:
                self.comm.all_reduce(found, "max", "world", f"agreeing whether step {index}'s gradients overflowed")
            except DistributedError as e:
                failed = e
        if failed is not None:
            error.add_note(f"pipedp: finishing this step's collectives with the other ranks failed too: {failed}")

    def _undo_early_updates(self) -> None:
        """Put back what the stages updated early, once every lane that may still be updating is joined."""
        assert self.early is not None and self.before_update is not None
        self.pipe.executor.lanes.join()
        self.early.join()
        self.before_update.restore()

    def _update(self, apply: bool = True) -> None:
        """End the step's BatchNorm recording (the stages' BN_COMMITs applied their statistics; what no stage
        applied is applied here) and, unless skipped, step the optimizer."""
        if self.pipe.batchnorm is not None:
            self.pipe.batchnorm.commit()
        if apply and self.early is not None:
            self.early.finish()  # the stages' parameters were updated during the backward
        elif apply:
            self.optimizer.step()

    def graph_body(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The captured step: forward, backward, clipping and update, no host sync (no fp16 loss scaling)."""
        assert self.grads.scaler is None, "fp16 loss scaling reads the host: it is not captured"
        loss = self._forward_backward(x, y)
        self.grads.prepare(0)
        self._update()
        assert loss is not None
        return loss

    def _zero_grads(self) -> None:
        if self.pipe.sync is not None:
            # Gradients are views into the all-reduce buckets.
            self.model.zero_grad(set_to_none=True)
            self.pipe.sync.attach()
            return
        # Once a CUDA graph holds the gradient buffers they are zeroed in place.
        self.model.zero_grad(set_to_none=self.graph is None or not self.graph.captured)

    def recover(self, held: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> None:
        """Undo what a failed step did besides the optimizer's update: buffers, gradients, pending transfers.

        ``held``: the gradients accumulated by earlier calls of the window
        (``update=False``), put back; else gradients are zeroed.
        """
        self.pipe.executor.lanes.join()
        if self.pipe.transport is not None:
            self.pipe.transport.reset()
        if self.pipe.batchnorm is not None:
            self.pipe.batchnorm.abort()
        self.pipe.buffers.restore()
        if held is None:
            self._zero_grads()
            return
        with torch.no_grad():
            for p, g in held:
                if g is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)

    def _held_grads(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Copies of the gradients an accumulation window holds so far (what a failed call puts back)."""
        return [(p, None if p.grad is None else p.grad.detach().clone()) for p in self.model.parameters()]


def _keeping(loss_fn: LossFn, outputs: list[Any]) -> LossFn:
    """``loss_fn`` that first keeps a detached copy of the output it is given (the last stage's, per microbatch)."""

    def keep(out: Any, y: torch.Tensor) -> torch.Tensor:
        outputs.append(_detached(out))
        return loss_fn(out, y)

    return keep


def _detached(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, dict):
        return type(v)((k, _detached(x)) for k, x in v.items())
    if isinstance(v, (tuple, list)):
        parts = [_detached(x) for x in v]
        return type(v)(*parts) if hasattr(v, "_fields") else type(v)(parts)
    return v
