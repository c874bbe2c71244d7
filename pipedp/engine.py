"""The user-facing engine: train steps, inference, the plan, checkpoints and traces of a built pipeline.

``engine.module`` is the user's own model object: no parameter or buffer is
copied or renamed, so checkpoints load into plain code. The pipeline itself
is made by :func:`pipedp.build.build_pipeline` from the first batch (or
``sample``), and a step is run by :class:`pipedp.step.StepRunner`; whatever
differs under ``torch.distributed`` is behind the engine's communicator.
"""

from __future__ import annotations

import copy
import os
import statistics
import weakref
from typing import Any, Mapping, NoReturn, Sequence, SupportsIndex

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from .atomic import require_folder
from .build import Pipeline, build_pipeline, sample_batch
from .checks import positive_int
from .comm import communicator
from .device import resolve_devices
from .decide.decision import Decision
from .decide.record import from_record
from .decide.rules import check_rules
from .distributed import Layout
from .lower import in_layout
from .ops.swap import swap_depthwise
from .optimizer import OptimizerSpec, check_optimizer, move_optimizer_state
from .options import (
    ConcurrencyOptions, DataParallelOptions, KernelOptions, MicrobatchSpec, PipelineOptions, TrainingOptions,
)
from .partition.blocks import check_materialised, check_not_wrapped, check_one_input
from .pipeline import microbatch
from .pipeline.early_update import EarlyUpdate
from .pipeline.executor import Executor, StepTimer
from .pipeline.sync_stats import SyncStats
from .pipeline.trace import Clock
from .plan import Plan
from .precision import LossScaler
from .restore import (
    EngineEntry, apply_run_state, apply_window, check_checkpoint, check_run_state, held_window, model_identity,
    undo_on_failure, warn_run_state,
)
from .snapshot import forked_rng, rng_state
from .step import LossFn, StepRunner, loss_reduction
from .update import GradientStep
from .watch import ModelWatch
from .decide.world import WorldChoice
from .trials.world import choose_layout

__all__ = ["Engine"]

CHECKPOINT_FORMAT = 3  # 3: the model a run state was saved for, an accumulation window's gradients


# A copy would share the original's stages, streams and hooks on the one model, or half-copy them.
_NOT_COPIED = (
    "an Engine cannot be copied or pickled: it holds the built pipeline (stages, streams, worker threads and "
    "the hooks it put on the model). To keep training for later, save engine.state_dict() (or engine.save(path)) "
    "and load it into a new engine that wraps the same kind of model; to train a copy, copy.deepcopy(engine.module) "
    "(or the model before wrap) and wrap the copy")


def _check_data(call: str, *tensors: torch.Tensor) -> None:
    """Refuse a batch of meta tensors before anything plans or steps on it (torch's copy error names no fix)."""
    if any(t.is_meta for t in tensors):
        raise ValueError(
            f"{call} got meta tensors (device='meta'): they have a shape but no data to compute on. Pass the "
            f"batch as real tensors (CPU or GPU); to plan from a shape alone, pass wrap(..., sample=<the shape>)")


class Engine:
    """A model trained as a microbatch pipeline (:func:`pipedp.wrap` builds one from flat keywords).

    Args:
        model: the unmodified model (``nn.Sequential``, torchvision-style ResNet,
            or an fx-traceable chain); it stays the same object (``engine.module``).
        optimizer: an optimizer built on ``model.parameters()``, or a factory; its
            ``step()`` runs once per batch, without a closure (LBFGS is refused).
        loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the batch, or
            a sum when its ``reduction`` is ``"sum"`` (``"none"`` is refused).
        pipeline, data_parallel, kernels, training, concurrency: the option groups (defaults when None).
        sample: a batch (or its shape) to plan with now; else the first batch.
        decision: a saved decision (:meth:`decision_record`, or a checkpoint's
            ``["engine"]["decision"]``) to rebuild that plan without planning.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerSpec = None,
        loss_fn: LossFn | None = None,
        pipeline: PipelineOptions | None = None,
        data_parallel: DataParallelOptions | None = None,
        kernels: KernelOptions | None = None,
        training: TrainingOptions | None = None,
        concurrency: ConcurrencyOptions | None = None,
        sample: torch.Tensor | Sequence[int] | None = None,
        decision: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        check_not_wrapped(model)
        check_one_input(model)  # one tensor per batch, whatever the stage count
        check_materialised(model)
        self.module = model
        self.options = opts = pipeline if pipeline is not None else PipelineOptions()
        kopts = kernels if kernels is not None else KernelOptions()
        self.training_options = topts = training if training is not None else TrainingOptions()
        self.devices = resolve_devices(model, opts.devices)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> scalar, got {type(loss_fn).__name__}")
        loss_reduction(loss_fn)  # refused at wrap when it does not reduce to one scalar per batch
        self.loss_fn = loss_fn
        self.optimizer = check_optimizer(model, optimizer)
        dp_options = data_parallel if data_parallel is not None else DataParallelOptions()
        if decision is not None:
            from_record(decision)  # a value that is no saved decision is refused here, before any work
            if dp_options.pp == "auto":
                raise ValueError("decision= replays one rank's saved plan, but pp='auto' chooses the world's layout "
                                 "anew: pass pp=N (the pipeline ranks it was made with) with decision=")
        self._saved = decision
        self.world: WorldChoice | None = None  # what pp="auto" chose (None: pp given, or one process)
        if dp_options.pp == "auto" and dp_options.enabled and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            self.world, sample = choose_layout(model, self.optimizer, sample, self.devices[0], opts, dp_options,
                                               topts, Engine)  # sample: this replica's batch
        resolved_pp = self.world.layout.pp if self.world is not None else 1 if dp_options.pp == "auto" else None
        self.comm = communicator(dp_options, pp=resolved_pp,
                                 reduce_dtype=self.world.layout.reduce_dtype if self.world is not None else None)
        self.comm.check(self.devices, opts.cuda_graph)
        self.comm.check_same_model(model, self.optimizer, opts, topts)
        self.comm.same_start(model)  # rank 0's values everywhere, as DDP does
        self._watch = ModelWatch(model)  # what the model holds now, checked at every step
        self.concurrency_options = concurrency if concurrency is not None else ConcurrencyOptions()
        check_rules(opts, topts, self.concurrency_options, self.devices)
        self.scaler = LossScaler() if topts.precision == "fp16" else None  # fp16 loss scaling
        self.steps = 0
        self._resumed_calls = 0  # a loaded window's calls so far, for the step runner not built yet
        self._pipe: Pipeline | None = None
        self._runner: StepRunner | None = None
        self._plan: Plan | None = None
        self._timers: list[StepTimer] = []
        self._trace_path: str | None = None
        self._detach: weakref.finalize | None = None  # takes the pipeline's hooks off the model (close, or GC)
        self._kernels = swap = swap_depthwise(model, kopts.mode, kopts.db, self.devices[0])
        if sample is not None:
            try:  # a wrap that fails leaves the user's model as it was: its depthwise layers too
                self._build(sample_batch(model, sample))
            except BaseException:
                swap.undo()
                raise

    @property
    def kernel_layers(self) -> int:
        """How many depthwise layers run tuned kernels now: those swapped, unless the plan chose torch's."""
        return self._kernels.running

    @property
    def microbatches(self) -> MicrobatchSpec:
        """The microbatches a step is split into: the plan's (``"auto"`` until the plan chose them)."""
        return self._plan.microbatches if self._plan is not None else self.options.microbatches

    @property
    def schedule(self) -> str:
        """The schedule the plan runs: the one ``schedule="auto"`` chose once the plan is made."""
        return self._pipe.decision.schedule if self._pipe is not None else self.options.schedule

    @property
    def decision(self) -> Decision | None:
        """Everything the plan resolved, frozen: the cut, schedule, places and levers (None until planned)."""
        return self._pipe.decision if self._pipe is not None else None

    @property
    def layout(self) -> Layout | None:
        """This rank's place under ``torch.distributed`` (None in a single process)."""
        return self.comm.layout

    @property
    def executor(self) -> Executor | None:
        return self._pipe.executor if self._pipe is not None else None

    @property
    def program(self) -> str:
        """Each pipeline rank's program of one step, a line a rank (``rank 0: 0F0 0F1 1F0 ...``; empty until built)."""
        return self._pipe.executor.program_text() if self._pipe is not None else ""

    def _build(self, batch: torch.Tensor) -> Pipeline:
        """Plan and build on ``batch``. Planning runs the model on a copy of it, with the RNG forked: a forward
        that changes its input in place, or draws dropout masks, leaves the user's batch and generators as plain
        PyTorch's first step will find them."""
        with forked_rng(self.devices):
            pipe = self._pipe = build_pipeline(self.module, batch.detach().clone(), self.options, self.devices,
                                               self.comm, step=self.steps, training=self.training_options,
                                               concurrency=self.concurrency_options,
                                               given=self.world.layout if self.world is not None else None,
                                               kernels=self._kernels, saved=self._saved)
        self._plan = pipe.plan
        # Not a method of self: the finalizer must not keep the engine alive. It runs at close() or when the
        # engine is collected, so a dropped engine leaves no hooks on the user's model.
        self._detach = weakref.finalize(self, pipe.detach)
        self._detach.atexit = False  # at exit the model goes too
        self._watch.accept()  # the build placed the model on its stages' devices
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer)
        return pipe

    def _follow_changes(self) -> None:
        """Re-derive what depends on the trainable set and dtypes if they changed since the last step.

        The gradient buckets are packed again, pipeline ranks send the metadata
        of their boundaries afresh, a captured step is captured again. What
        cannot be followed raises (:class:`~pipedp.watch.ModelWatch`), and so does
        a plain attribute that traced blocks baked in (:mod:`pipedp.partition.reads`).
        """
        if self._pipe is not None and self._pipe.baked is not None:
            self._pipe.baked.check()
        if not self._watch.changed() or self._pipe is None:
            return
        pipe = self._pipe
        if pipe.sync is not None:
            pipe.sync.refresh([list(st.chain.parameters()) for st in pipe.executor.stages])
        if pipe.transport is not None:
            pipe.transport.forget()
        if self._runner is not None and self._runner.graph is not None:
            self._runner.graph.reset()
        self.module.zero_grad(set_to_none=True)

    def _runner_for(self, x: torch.Tensor) -> StepRunner:
        if self.optimizer is None or self.loss_fn is None:
            raise RuntimeError("train_step needs wrap(..., optimizer=..., loss_fn=...)")
        if self._runner is None:
            pipe = self._pipe if self._pipe is not None else self._build(x)
            levers = pipe.decision.settled  # from here on the decision, never the options
            grads = GradientStep.of(pipe.executor.stages, self.comm, self.scaler, levers.clip_grad_norm,
                                    levers.grad_hook)
            early = None
            if levers.early_update:
                ex = pipe.executor
                early = EarlyUpdate(self.optimizer, ex.stages, ex.train_order,
                                    {st.index: ex.lanes.of_stage(st.index) for st in ex.stages})
            self._runner = StepRunner(self.module, pipe, self.optimizer, self.loss_fn, self.comm, grads, early)
            self._runner.pending, self._resumed_calls = self._resumed_calls, 0  # a window loaded before
        return self._runner

    # -- public API -----------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """Stages, devices, predicted and (after the first steps) measured ms per stage."""
        if self._plan is None or self._pipe is None:
            raise RuntimeError(
                "the plan is made from the first batch: pass sample=<a batch or its shape> to wrap(), "
                "or run train_step()/engine(x) first"
            )
        ex = self._pipe.executor
        if self._timers:
            per_step = [t.stage_ms() for t in self._timers]
            mine = {st.index: k for k, st in enumerate(ex.stages)}
            measured = [
                statistics.median(step[mine[s]] for step in per_step) / self.microbatches if s in mine else None
                for s in range(ex.n)
            ]
            self._plan = self._plan.with_measured(measured)
            self._timers = []
        sync = self._pipe.sync
        if sync is not None and sync.step:
            self._plan = self._plan.with_sync(sync.describe())
        return self._plan

    def decision_record(self) -> dict[str, Any]:
        """The plan's decision as plain data: hand it to ``wrap(..., decision=)`` to rebuild this plan without
        planning (:meth:`state_dict` saves it too). Available once the plan is made."""
        if self._pipe is None:
            raise RuntimeError("the decision is made from the first batch: pass sample= to wrap(), or run "
                               "train_step()/engine(x) first")
        return copy.deepcopy(self._pipe.record)

    def sync_stats(self) -> SyncStats | None:
        """The last step's gradient sync: ms in flight, hidden behind compute, and waited for.

        None when not distributed. On CUDA this waits for the last step's events.
        """
        sync = self._pipe.sync if self._pipe is not None else None
        return sync.stats() if sync is not None and sync.step else None

    def train_step(self, x: torch.Tensor, y: torch.Tensor, *, update: bool = True, loss_divisor: int = 1,
                   return_outputs: bool = False) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """One optimizer step on the batch ``(x, y)``; returns the batch's loss (mean or sum), detached.

        The loss stays on the device (no host sync); call ``.item()`` when needed.
        If the step fails, parameters, optimizer state and buffers are as before;
        its gradients are cleared (None), as the step began by clearing the
        last step's, unless it was inside an accumulation window (below).
        ``return_outputs=True`` returns ``(loss, outputs)``: the model's output
        for the whole batch as ``loss_fn`` received it, detached (for train
        accuracy, say); None on a pipeline rank without the last stage.

        Accumulating over batches, as a plain loop does (``loss = loss_fn(...)
        / N; loss.backward()`` on each batch, ``optimizer.step()`` on every
        N-th): ``update=False`` keeps this batch's gradients for a later call
        and ``loss_divisor=N`` divides each batch's loss before its backward
        (the returned loss is not divided). Random draws and BatchNorm
        statistics follow the plain loop's order. A call that fails puts back
        the gradients the window held (None where there were none), also when
        the update closing the window raised, and the window stays open.
        """
        positive_int("loss_divisor", loss_divisor)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(f"train_step takes tensors (x, y), got {type(x).__name__}, {type(y).__name__}")
        _check_data("train_step", x, y)
        if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"x and y must share the batch dimension 0, got shapes {tuple(x.shape)} and {tuple(y.shape)}"
            )
        if x.shape[0] == 0:
            raise ValueError(
                f"the batch is empty (x has shape {tuple(x.shape)}): there is nothing to train on. Skip empty "
                f"batches, or check what produced it (a sampler or filter that selected no samples)"
            )
        self._follow_changes()
        runner = self._runner_for(x)
        ex = runner.pipe.executor
        if ex.is_first:
            x = in_layout(x.to(ex.stages[0].device, non_blocking=True), runner.pipe.channels_last)
        if ex.is_last:
            y = y.to(ex.stages[-1].device, non_blocking=True)
        trace_path, self._trace_path = self._trace_path, None
        # A small batch's step (fewer microbatches) is not one the plan's per-microbatch times describe.
        full = microbatch.count(x.shape[0], runner.microbatches) == runner.microbatches
        measuring = 1 <= self.steps <= runner.pipe.decision.settled.measure_steps and full
        clock = Clock(ex.lanes.devices) if trace_path is not None else None
        timer = StepTimer(len(ex.stages), clock) if measuring or clock is not None else None
        kept: list[Any] | None = [] if return_outputs else None
        loss = runner.step(x, y, self.steps, timer, kept, update=update, divisor=loss_divisor)
        if trace_path is not None and timer is not None:
            runner.write_trace(trace_path, timer, self.steps, self.schedule)
        self.steps += 1
        if timer is not None and measuring and not runner.replayed:
            self._timers.append(timer)
        if kept is None:
            return loss
        return loss, microbatch.gather(kept) if kept else None

    def trace(self, path: str | os.PathLike) -> None:
        """Record the next :meth:`train_step` and write it to ``path`` as a Chrome/Perfetto trace.

        One lane per stage stream with a span per microbatch forward and backward,
        one per gradient-sync stream (under torch.distributed) and the optimizer:
        bubbles and overlap become visible. That step is an ordinary training step,
        run eagerly (a captured CUDA graph would hide its inside). Under
        torch.distributed each rank writes ``<stem>.rank<r><suffix>``.
        """
        path = os.fspath(path)
        require_folder(path, "write a trace to")
        self._trace_path = self.comm.own_path(path)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Forward-only pipelined inference in the module's current mode (see :meth:`eval`)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError("engine(x) takes a batched tensor")
        _check_data("engine(x)", x)
        self._follow_changes()
        pipe = self._pipe if self._pipe is not None else self._build(x)
        ex = pipe.executor
        if ex.is_first:
            x = in_layout(x.to(ex.stages[0].device, non_blocking=True), pipe.channels_last)
        outs = ex.forward(microbatch.split(x, microbatch.count(x.shape[0], ex.microbatches)))
        return microbatch.gather(outs) if ex.is_last else None  # type: ignore[return-value]

    def close(self) -> None:
        """Take what this engine put on the model off it; the next step or call plans and builds again.

        Removes the BatchNorm and gradient hooks and puts swapped blocks and
        convolutions back, as happens when the engine is garbage-collected.
        The model keeps its weights, its devices and its depthwise kernel
        layers (plain data that run without the engine). Safe to call twice.
        """
        if self._detach is not None:
            self._detach()
            self._detach = None
        self._pipe, self._runner, self._plan, self._timers = None, None, None, []

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: model (keys unchanged), optimizer, step, RNG states (and fp16's loss scale).

        Under torch.distributed this is collective (call it on every rank): the
        pipeline ranks' stages are merged into one full model, and every rank's
        RNG state is gathered so that each can resume its own stream. Inside an
        accumulation window the gradients it holds are saved too (see
        :meth:`run_state`).
        """
        self._held_window()  # refused under torch.distributed before any collective
        stages = self._pipe.executor.stages if self._pipe is not None else None
        model, optim = self.comm.model_state(self.module, stages, self.optimizer)
        entry = self.run_state()
        if self.optimizer is not None:  # checked at load: Adam and AdamW state dicts look alike
            entry["optimizer_class"] = type(self.optimizer).__name__
        return {"model": model, "optimizer": optim, "engine": entry}

    def run_state(self) -> dict[str, Any]:
        """What a script that saves the model and optimizer itself must save beside them to resume exactly.

        The step count, every rank's RNG states (dropout, augmentation), fp16's
        loss scale, the plan's decision (to hand back to ``wrap(...,
        decision=)``), the model it belongs to (class and a digest of its
        state dict's names and shapes, checked at load) and, inside an
        accumulation window (calls with ``update=False`` since the last
        update), the gradients the window holds by parameter name
        (``["window"]``), so that a resumed run finishes the window as the
        uninterrupted one would: plain data and tensors, loadable with
        ``weights_only=True``. :meth:`state_dict` holds it as ``["engine"]``.
        Collective under torch.distributed (the RNG states are gathered),
        where a save inside a window is refused: save after the call with
        ``update=True``.
        """
        window = self._held_window()
        entry: dict[str, Any] = {"steps": self.steps, "format": CHECKPOINT_FORMAT,
                                 "rng": self.comm.rng_states(rng_state()), "model": model_identity(self.module)}
        if self.scaler is not None:
            entry["scaler"] = self.scaler.state_dict()
        if self._pipe is not None:  # the plan trained with, to replay on resume (wrap's decision=)
            entry["decision"] = copy.deepcopy(self._pipe.record)
        if window is not None:
            entry["window"] = window
        return entry

    def _window_calls(self) -> int:
        """Calls with ``update=False`` since the last update (a loaded window's, before the first step)."""
        return self._runner.pending if self._runner is not None else self._resumed_calls

    def _held_window(self) -> dict[str, Any] | None:
        """The accumulation window to save (None at a boundary); refused under torch.distributed."""
        calls = self._window_calls()
        if calls and self.comm.layout is not None:
            raise ValueError(
                f"cannot save inside an accumulation window under torch.distributed: {calls} call(s) with "
                f"update=False hold gradients since the last update, and each pipeline rank holds only its own "
                f"stages' (saving them across ranks is not supported yet). Save at the window's boundary, after "
                f"the call with update=True, or in a single process, where the held gradients are saved")
        return held_window(self.module, calls)

    def _check_window_here(self, entry: EngineEntry) -> None:
        """Refuse a saved window this engine could not finish (its next call would fail, the window stuck)."""
        if entry.window is None:
            return
        inside = f"the checkpoint was saved inside an accumulation window ({entry.window.calls} call(s) with " \
                 f"update=False)"
        if self.comm.layout is not None:
            raise ValueError(
                f"{inside}, and resuming one under torch.distributed is not supported yet. Nothing was loaded; "
                f"load it in a single process, or use a checkpoint saved at a window's boundary")
        levers = self._pipe.decision.settled if self._pipe is not None else None
        if levers is not None and (levers.cuda_graph or levers.early_update):
            raise ValueError(
                f"{inside}, and this engine's plan updates on every call (cuda_graph=True or early_update=True). "
                f"Nothing was loaded; wrap with cuda_graph=False and early_update=False to finish the window")

    def load_run_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`run_state` saved beside the script's own model and optimizer state.

        The step count, this rank's RNG states, the loss scale and an
        accumulation window's gradients; checked first (a run state of another
        model is refused), and warned about before anything changes, so a bad
        value, or a warning turned into an error, changes nothing.
        """
        entry = check_run_state(state, CHECKPOINT_FORMAT, self.module)
        self._check_window_here(entry)
        self._warn_run_state(entry)
        self._apply_run_state(entry)

    def _warn_run_state(self, entry: EngineEntry) -> None:
        warn_run_state(entry, self.comm.rank, self.comm.world,
                       self._pipe.decision.config if self._pipe is not None else None, stacklevel=4)

    def _apply_run_state(self, entry: EngineEntry) -> None:
        """Apply a checked, warned-about entry: the window first (the one part that can fail: memory)."""
        calls = apply_window(self.module, entry.window) if entry.window is not None or self._window_calls() \
            else 0  # a boundary leaves gradients alone unless it ends a window the engine is in
        self.steps = apply_run_state(entry, self.comm.rank, self.comm.world, self.scaler)
        if self._runner is not None:
            self._runner.pending = calls
        else:
            self._resumed_calls = calls

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: model, optimizer, step and this rank's RNG states.

        Whole or nothing: the checkpoint is checked against this engine's model
        and optimizer first, what it warns about is warned before anything
        changes, and a failure while applying it puts all back. A checkpoint
        saved inside an accumulation window puts the window's gradients back;
        one saved at a boundary ends any window this engine was in.
        """
        entry = check_checkpoint(state, self.module, self.optimizer, CHECKPOINT_FORMAT)
        self._check_window_here(entry)
        self._warn_run_state(entry)
        if self._runner is not None and self._runner.graph is not None:
            # The optimizer gets new state tensors; a captured step would update the old ones.
            self._runner.graph.reset()
            self.module.zero_grad(set_to_none=True)
        with undo_on_failure(self.module, self.optimizer):
            self.module.load_state_dict(state["model"])
            if state["optimizer"] is not None and self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self._apply_run_state(entry)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` atomically (global rank 0 writes; collective when distributed).

        The file appears complete or not at all: a crash mid-save leaves the previous checkpoint.
        """
        state = self.state_dict()
        if self.comm.writes_files():
            checkpoint.save(state, path)
        self.comm.barrier()  # nobody reads the file before it exists

    def load(self, path: str | os.PathLike) -> None:
        """Resume from a file written by :meth:`save` (read as data only: ``weights_only=True``)."""
        self.load_state_dict(checkpoint.load(path, map_location="cpu"))

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(_NOT_COPIED)  # pickle, copy.copy and torch.save come here

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_NOT_COPIED)

    def __repr__(self) -> str:
        built = f"{len(self._pipe.executor.stages)} stages" if self._pipe is not None else "not built"
        return f"Engine({type(self.module).__name__}, {built}, microbatches={self.microbatches}, schedule={self.schedule})"

