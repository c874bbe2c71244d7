"""``pipedp.wrap``: an unmodified model, cut into balanced stages, trained as a microbatch pipeline.

The engine owns one training step end to end: split the batch into
microbatches, run the schedule over the stages, step the optimizer. A step
equals plain PyTorch running the same microbatches with gradient accumulation
(each microbatch's mean loss weighted by its share of the batch) followed by the
same optimizer step. ``engine.module`` is the user's own model object: no
parameter or buffer is copied or renamed, so checkpoints load into plain code.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Any, Callable, Iterable, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from .atomic import require_folder
from .device import parse_device
from .distributed import DEFAULT_TIMEOUT_S, DistributedError, Layout, check_backend, missing_note, resolve_layout
from .ops.swap import swap_depthwise
from .partition.blocks import Block, Chain, blocks_of, check_chain, module_mode
from .partition.profile import BlockProfile, estimate_blocks, preserved_state, profile_blocks
from .pipeline import microbatch
from .pipeline.batchnorm import DeferredBatchNorm
from .pipeline.executor import Executor, StepTimer
from .pipeline.gradsync import DEFAULT_BUCKET_BYTES, GradSync, SyncStats
from .pipeline.graphed import StepGraph, captured_call, hyper_signature
from .pipeline.p2p import Transport
from .pipeline.schedule import get_schedule
from .pipeline.stage import Stage
from .pipeline.stream import current_lane, new_lane
from .pipeline.trace import Clock, step_spans, write_trace
from .plan import Plan
from .planner import StagesSpec, build_plan, resolve_counts, stage_devices, stage_places
from .state import broadcast_decision, gather_rng, merge_pipeline_state, share_loss

__all__ = ["Engine", "wrap"]

DeviceSpec = Union[None, str, int, torch.device, Sequence[Union[str, int, torch.device]]]
OptimizerSpec = Union[None, torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]
BATCHNORM_MODES = ("microbatch", "batch")


def _check_positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def resolve_devices(model: nn.Module, devices: DeviceSpec) -> list[torch.device]:
    """The devices to run on, checked: they must exist on this machine."""
    if devices is None:
        p = next(model.parameters(), None)
        items: list[Any] = [p.device if p is not None else torch.device("cpu")]
    elif isinstance(devices, (str, int, torch.device)):
        items = [devices]
    else:
        items = list(devices)
    if not items:
        raise ValueError("devices is empty: pass None (the model's device), a device, or a list of devices")
    out: list[torch.device] = []
    for d in items:
        dev = parse_device(d)
        out.append(dev)
    if len(set(out)) != len(out):
        raise ValueError(
            f"devices {[str(d) for d in out]} lists a device twice; list each device once "
            f"(several stages share a device on their own when stages > len(devices))"
        )
    return out


class _BufferSnapshot:
    """Copies of all buffers, so a failed step can put BatchNorm statistics back."""

    def __init__(self, model: nn.Module) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in model.buffers():
            groups.setdefault((b.device, b.dtype), []).append(b)
        self.groups = list(groups.values())
        self.saved: list[list[torch.Tensor]] | None = None

    def save(self) -> None:
        with torch.no_grad():
            if self.saved is None:
                self.saved = [[b.clone() for b in g] for g in self.groups]
            else:
                for dst, src in zip(self.saved, self.groups):
                    torch._foreach_copy_(dst, src)

    def restore(self) -> None:
        if self.saved is None:
            return
        with torch.no_grad():
            for dst, src in zip(self.groups, self.saved):
                torch._foreach_copy_(dst, src)


def _move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    for p, state in optimizer.state.items():
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and v.device != p.device and v.dim() > 0:
                state[k] = v.to(p.device)


def _surrogate_loss(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


class Engine:
    """A model trained as a microbatch pipeline (:func:`wrap` builds one).

    Args:
        model: the unmodified model (``nn.Sequential``, torchvision-style ResNet,
            or an fx-traceable chain); it stays the same object (``engine.module``).
        optimizer: an optimizer built on ``model.parameters()``, or a factory.
        loss_fn: ``loss_fn(output, target) -> scalar`` with a mean reduction.
        microbatches: microbatches per batch.
        stages: ``"auto"``, a number of stages, or block counts per stage.
        schedule: ``"1f1b"`` (less activation memory) or ``"gpipe"``.
        devices: device(s) for the stages; default the model's device. Several
            stages may share one CUDA device, each on its own stream.
        batchnorm: ``"microbatch"`` (running stats per microbatch, like GPipe) or
            ``"batch"`` (one update per step from the whole batch).
        profile: measure block times (True) or use the FLOP/byte cost model.
        depth: how many levels of nested ``nn.Sequential`` to cut into.
        sample: a batch (or its shape) to plan with now; else the first batch.
        measure_steps: training steps (after the first) timed per stage for ``engine.plan``.
        progress: show a progress bar while profiling takes long.
        cuda_graph: on one CUDA device, capture the whole step (all stages'
            streams, loss, optimizer) as a CUDA graph after two eager steps and
            replay it; removes per-kernel launch cost. Optimizers with step
            counters need ``capturable=True``.

    Under ``torch.distributed`` (launched with torchrun, process group initialised):
        pp: pipeline ranks; the world is laid out as dp = world // pp replicas of
            a pipeline spread over pp ranks (default 1: every rank holds the
            whole pipeline on its own device and is one data-parallel replica).
        mesh: a ``DeviceMesh`` with dims ``("dp", "pp")`` or ``("dp",)`` instead of ``pp``.
        dp_group, pp_group: explicit process groups instead of ``pp``/``mesh``.
        bucket_mb: gradient all-reduce bucket size (MiB), like DDP's ``bucket_cap_mb``.
        reduce_dtype: ``torch.bfloat16``/``torch.float16`` to all-reduce gradients in
            half the bytes (each rank's gradient is rounded before the sum).
        timeout: seconds a collective or transfer may take before the step fails
            with :class:`pipedp.DistributedError` (a peer died or hung).
        distributed: False trains this process on its own even when a process
            group exists (default: data parallel whenever one is initialised).
        kernels: ``"auto"`` runs depthwise convolutions with the tuned TVM
            kernels exported by ``tune-kernels`` where one exists for the
            layer's shape and measured faster than torch (torch elsewhere, and
            on a CPU where the kernels cannot share torch's OpenMP team: see
            ``pipedp.ops.swap``), ``"tvm"`` uses every tuned kernel and makes a
            missing one an error, ``"torch"`` never uses them.
        kernel_db: the ``tune-kernels --db`` folder (default: the per-user cache).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerSpec = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        microbatches: int = 4,
        stages: StagesSpec = "auto",
        schedule: str = "1f1b",
        devices: DeviceSpec = None,
        batchnorm: str = "microbatch",
        profile: bool = True,
        depth: int = 1,
        sample: torch.Tensor | Sequence[int] | None = None,
        measure_steps: int = 3,
        progress: bool = True,
        cuda_graph: bool = False,
        pp: int = 1,
        mesh: Any = None,
        dp_group: Any = None,
        pp_group: Any = None,
        bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        reduce_dtype: torch.dtype | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        distributed: bool = True,
        kernels: str = "auto",
        kernel_db: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.module = model
        self.microbatches = _check_positive_int("microbatches", microbatches)
        get_schedule(schedule)
        self.schedule = schedule
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm must be one of {BATCHNORM_MODES}, got {batchnorm!r}")
        self.batchnorm = batchnorm
        self.depth = _check_positive_int("depth", depth)
        if not (stages == "auto" or isinstance(stages, (int, list, tuple))) or isinstance(stages, bool):
            raise ValueError(f"stages must be an int, 'auto' or a list of block counts, got {stages!r}")
        self._stages_spec = stages
        self.devices = resolve_devices(model, devices)
        self.kernel_layers = swap_depthwise(model, kernels, kernel_db, self.devices[0])
        self.profile = bool(profile)
        self.progress = progress
        self.measure_steps = max(int(measure_steps), 0)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> scalar, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.optimizer = self._make_optimizer(optimizer)
        self.steps = 0
        self.executor: Executor | None = None
        self._plan: Plan | None = None
        self._timers: list[StepTimer] = []
        self._bn: DeferredBatchNorm | None = None
        self._snapshot: _BufferSnapshot | None = None
        self._graph: StepGraph | None = None
        self._trace_path: str | None = None
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        if reduce_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"reduce_dtype must be None, torch.bfloat16 or torch.float16, got {reduce_dtype!r}")
        self.reduce_dtype = reduce_dtype
        self.layout: Layout | None = None
        if distributed:
            self.layout = resolve_layout(pp=pp, mesh=mesh, dp_group=dp_group, pp_group=pp_group, timeout=timeout)
        self._sync: GradSync | None = None
        self._transport: Transport | None = None
        if self.layout is not None:
            check_backend(self.devices, self.layout.pp)
            if cuda_graph:
                raise ValueError(
                    "cuda_graph=True is not supported under torch.distributed yet: pass cuda_graph=False "
                    "(collectives and transfers are issued eagerly)"
                )
        if cuda_graph:
            if len(self.devices) != 1 or self.devices[0].type != "cuda":
                raise ValueError(
                    f"cuda_graph=True needs all stages on one CUDA device, got devices "
                    f"{[str(d) for d in self.devices]}: pass devices='cuda' or cuda_graph=False"
                )
            self._graph = StepGraph(self._graph_body)
        if sample is not None:
            if not isinstance(sample, torch.Tensor):
                shape = tuple(int(v) for v in sample)
                p = next(model.parameters(), None)
                sample = torch.randn(shape, dtype=p.dtype if p is not None else torch.float32)
            self._build(sample)

    # -- construction ---------------------------------------------------------------------------
    def _make_optimizer(self, optimizer: OptimizerSpec) -> torch.optim.Optimizer | None:
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, "
                    f"got {type(optimizer).__name__}"
                )
            optimizer = optimizer(self.module.parameters())
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        mine = {id(p) for p in self.module.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) that are not the model's: "
                f"build it on model.parameters() of the model you wrap (or pass a factory)"
            )
        return optimizer

    def _build(self, batch: torch.Tensor) -> None:
        m = self.microbatches
        sizes = microbatch.sizes(batch.shape[0], m)
        first = self.devices[0]
        model = self.module
        model.to(first)
        sample = batch[: sizes[0]].to(first)
        lay = self.layout
        ranks = lay.pp if lay is not None else 1
        if self._stages_spec == 1 and ranks == 1:
            blocks, copy_input = [Block("model", model)], [False]
        else:
            blocks = blocks_of(model, depth=self.depth)
            copy_input = check_chain(model, blocks, sample)
        self._copy_input = copy_input
        decision: Any = None
        if lay is None or (lay.dp_rank == 0 and lay.pp_rank == 0):
            try:
                decision = self._decide(blocks, sample, batch, ranks)
            except Exception as e:
                if lay is None:
                    raise
                decision = e  # the other ranks must not wait for a decision forever
        if lay is not None:
            # Every rank must run the same cut: the first rank decides, the others follow.
            decision = broadcast_decision(decision, lay)
        if isinstance(decision, Exception):
            raise decision
        profiles, counts, notes = decision
        local_devs = stage_devices(len(counts) // ranks, self.devices)
        if len(self.devices) > 1:
            notes = notes + [f"blocks were profiled on {first}; the other devices are assumed alike"]
        if len(set(local_devs)) < len(self.devices):
            notes = notes + [f"{len(counts) // ranks} stage(s) per rank use {len(set(local_devs))} of {len(self.devices)} devices"]
        self.executor = self._make_executor(blocks, counts, profiles)
        if lay is not None:
            self._sync = GradSync(
                [list(st.chain.parameters()) for st in self.executor.stages], lay.dp_group,
                bucket_bytes=self.bucket_bytes, reduce_dtype=self.reduce_dtype, timeout=lay.timeout,
            )
        if self.optimizer is not None:
            _move_optimizer_state(self.optimizer)
        self._plan = build_plan(
            profiles, counts, self.devices, microbatches=m, microbatch_size=sizes[0],
            schedule=self.schedule, batchnorm=self.batchnorm,
            source="profile" if self.profile else "cost model", notes=notes,
            ranks=ranks, layout=lay.describe() if lay is not None else "",
        )
        if self.batchnorm == "batch":
            self._bn = DeferredBatchNorm(model)
        self._snapshot = _BufferSnapshot(model)

    def _decide(
        self, blocks: Sequence[Block], sample: torch.Tensor, batch: torch.Tensor, ranks: int
    ) -> tuple[list[BlockProfile], list[int], list[str]]:
        """Profile the blocks and choose the cut."""
        model = self.module
        with preserved_state(model, self.devices), module_mode(model, training=True):
            if self.profile:
                profiles = profile_blocks(blocks, sample, progress=self.progress, copy_input=self._copy_input)
            else:
                profiles = estimate_blocks(blocks, sample)
            measure = lambda counts: self._trial_ms(blocks, counts, batch)  # noqa: E731
            counts, notes = resolve_counts(
                profiles, self._stages_spec, self.devices, self.microbatches, self.schedule,
                measure=measure, ranks=ranks,
            )
        return list(profiles), counts, notes

    def _make_executor(
        self, blocks: Sequence[Block], counts: Sequence[int], profiles: Sequence[BlockProfile] | None = None
    ) -> Executor:
        lay = self.layout
        ranks = lay.pp if lay is not None else 1
        me = lay.pp_rank if lay is not None else 0
        places = stage_places(len(counts), self.devices, ranks)
        stages, start = [], 0
        for s, k in enumerate(counts):
            r, dev = places[s]
            if r == me:
                chain = Chain(list(blocks[start : start + k])).to(dev)
                lane = new_lane(dev, f"stage{s}")
                stages.append(Stage(s, chain, dev, lane, copy_input=self._copy_input[start]))
            start += k
        duration = None
        if profiles is not None:
            fwd, bwd, start = [], [], 0
            for k in counts:
                fwd.append(sum(p.forward_ms for p in profiles[start : start + k]))
                bwd.append(sum(p.backward_ms for p in profiles[start : start + k]))
                start += k
            duration = lambda s, a: fwd[s] if a.kind == "F" else bwd[s]  # noqa: E731
        schedule = get_schedule(self.schedule)(len(counts), self.microbatches)
        if ranks == 1:
            return Executor(stages, schedule, duration=duration)
        assert lay is not None
        self._transport = Transport(lay.pp_group, self.devices[0], lay.timeout, step=self.steps)
        stage_rank = [lay.pp_peer(r) for r, _ in places]
        return Executor(
            stages, schedule, duration=duration, stage_rank=stage_rank, rank=lay.rank, transport=self._transport
        )

    def _trial_ms(self, blocks: Sequence[Block], counts: list[int], batch: torch.Tensor) -> float:
        """Median time of a few forward+backward passes of one candidate cut (no optimizer step).

        With ``cuda_graph`` the candidate is timed captured, as it will run.
        """
        ex = self._make_executor(blocks, counts)
        x = batch.to(self.devices[0])
        xs = microbatch.split(x, self.microbatches)
        ys = [t.to(ex.stages[-1].device) for t in xs]
        w = microbatch.shares([t.shape[0] for t in xs])

        def run() -> object:
            return ex.train(xs, ys, w, _surrogate_loss)

        if self._graph is not None:
            run = captured_call(run, self.devices[0], before=lambda: self.module.zero_grad(set_to_none=True))
        times = []
        for r in range(4):
            _sync(self.devices)
            t0 = time.perf_counter()
            run()
            _sync(self.devices)
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
        self.module.zero_grad(set_to_none=True)
        return statistics.median(times)

    # -- public API -----------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """Stages, devices, predicted and (after the first steps) measured ms per stage."""
        if self._plan is None:
            raise RuntimeError(
                "the plan is made from the first batch: pass sample=<a batch or its shape> to wrap(), "
                "or run train_step()/engine(x) first"
            )
        if self._timers and self.executor is not None:
            per_step = [t.stage_ms() for t in self._timers]
            m = self.microbatches
            mine = {st.index: k for k, st in enumerate(self.executor.stages)}
            measured = [
                statistics.median(step[mine[s]] for step in per_step) / m if s in mine else None
                for s in range(self.executor.n)
            ]
            self._plan = self._plan.with_measured(measured)
            self._timers = []
        if self._sync is not None and self._sync.step:
            st = self._sync.stats()
            assert self.layout is not None
            self._plan = self._plan.with_sync(
                f"{st.buckets} bucket(s) of <= {self.bucket_bytes / 2**20:g} MiB over {self.layout.dp} replica(s); "
                f"last step {st.sync_ms:.2f} ms in flight, {100 * st.hidden_fraction:.0f}% hidden behind backward, "
                f"optimizer waited {st.exposed_ms:.2f} ms"
            )
        return self._plan

    def sync_stats(self) -> SyncStats | None:
        """The last step's gradient sync: ms in flight, hidden behind compute, and waited for.

        None when not distributed. On CUDA this waits for the last step's events.
        """
        return self._sync.stats() if self._sync is not None and self._sync.step else None

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the batch ``(x, y)``; returns the detached batch-mean loss.

        The loss stays on the device (no host sync); call ``.item()`` when needed.
        If the step fails, parameters, optimizer state and buffers are as before.
        """
        if self.optimizer is None or self.loss_fn is None:
            raise RuntimeError("train_step needs wrap(..., optimizer=..., loss_fn=...)")
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(f"train_step takes tensors (x, y), got {type(x).__name__}, {type(y).__name__}")
        if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"x and y must share the batch dimension 0, got shapes {tuple(x.shape)} and {tuple(y.shape)}"
            )
        microbatch.sizes(x.shape[0], self.microbatches)  # clear error for a batch too small
        if self.executor is None:
            self._build(x)
        ex = self.executor
        assert ex is not None
        if ex.is_first:
            x = x.to(ex.stages[0].device, non_blocking=True)
        if ex.is_last:
            y = y.to(ex.stages[-1].device, non_blocking=True)
        trace_path, self._trace_path = self._trace_path, None
        graph = self._graph if trace_path is None else None  # a traced step runs eagerly
        if graph is not None:
            hyper = hyper_signature(self.optimizer)
            if not graph.replayable(x, y, hyper) and graph.due(x, y, hyper):
                graph.capture(x, y, hyper, before=lambda: self.module.zero_grad(set_to_none=True))
            if graph.replayable(x, y, hyper):
                loss = graph.replay(x, y)
                self.steps += 1
                return loss
            graph.note_eager(x, y, hyper)
        measuring = 1 <= self.steps <= self.measure_steps
        clock = Clock(ex.devices) if trace_path is not None else None
        timer = StepTimer(len(ex.stages), clock) if measuring or clock is not None else None
        self._zero_grads()
        assert self._snapshot is not None
        self._snapshot.save()
        for part in (self._sync, self._transport):
            if part is not None:
                part.step = self.steps
        try:
            loss = self._forward_backward(x, y, timer)
            if self._sync is not None:
                self._sync.wait()
            if self.layout is not None and self.layout.pp > 1:
                loss = share_loss(loss, self.layout, self.executor.stages[-1].device, self.steps)
        except DistributedError as e:
            self._recover()
            note = missing_note(self.steps, self.layout.world) if self.layout is not None else ""
            raise DistributedError(f"{e}{note}") from e.__cause__
        except BaseException:
            self._recover()
            raise
        marks = [(d, clock.mark(current_lane(d))) for d in ex.devices] if clock is not None else []
        self._update()
        if clock is not None:
            assert timer is not None and trace_path is not None
            updates = [(d, m, clock.mark(current_lane(d))) for d, m in marks]
            self._write_trace(trace_path, clock, timer, updates)
        self.steps += 1
        if timer is not None and measuring:
            self._timers.append(timer)
        return loss

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
        if self.layout is not None and self.layout.world > 1:
            stem, suffix = os.path.splitext(path)
            path = f"{stem}.rank{self.layout.rank}{suffix}"
        self._trace_path = path

    def _write_trace(self, path: str, clock: Clock, timer: StepTimer, updates: list[tuple[torch.device, Any, Any]]) -> None:
        assert self.executor is not None
        where = self.layout.describe() if self.layout is not None else "single process"
        meta = {"step": self.steps, "microbatches": self.microbatches, "schedule": self.schedule, "where": where,
                "plan": str(self._plan)}
        spans = step_spans(self.executor.stages, clock, timer, self._sync, updates)
        write_trace(path, spans, process=f"pipedp ({where})", metadata=meta)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, timer: StepTimer | None = None) -> Any:
        assert self.executor is not None and self.loss_fn is not None
        xs, ys = microbatch.split(x, self.microbatches), microbatch.split(y, self.microbatches)
        weights = microbatch.shares([t.shape[0] for t in xs])
        if self._bn is not None:
            self._bn.begin()
        return self.executor.train(xs, ys, weights, self.loss_fn, timer, sync=self._sync)

    def _update(self) -> None:
        assert self.optimizer is not None
        if self._bn is not None:
            self._bn.commit()
        self.optimizer.step()

    def _graph_body(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self._forward_backward(x, y)
        self._update()
        return loss

    def _zero_grads(self) -> None:
        if self._sync is not None:
            # Gradients are views into the all-reduce buckets.
            self.module.zero_grad(set_to_none=True)
            self._sync.attach()
            return
        # Once a CUDA graph holds the gradient buffers they are zeroed in place.
        self.module.zero_grad(set_to_none=self._graph is None or not self._graph.captured)

    def _recover(self) -> None:
        assert self.executor is not None and self._snapshot is not None
        self.executor._join()
        if self._transport is not None:
            self._transport.reset()
        if self._bn is not None:
            self._bn.abort()
        self._snapshot.restore()
        self._zero_grads()

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Forward-only pipelined inference in the module's current mode (see :meth:`eval`)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError("engine(x) takes a batched tensor")
        if self.executor is None:
            self._build(x)
        ex = self.executor
        assert ex is not None
        if ex.is_first:
            x = x.to(ex.stages[0].device, non_blocking=True)
        if x.shape[0] < self.microbatches and len(ex.stages) == ex.n:  # too small to pipeline: stages in turn
            for st in ex.stages:
                x = st(x.to(st.device))
            return x
        outs = ex.forward(microbatch.split(x, self.microbatches))
        return microbatch.gather(outs) if ex.is_last else None  # type: ignore[return-value]

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: model (keys unchanged), optimizer, step, RNG states.

        Under torch.distributed this is collective (call it on every rank): the
        pipeline ranks' stages are merged into one full model, and every rank's
        RNG state is gathered so that each can resume its own stream.
        """
        lay = self.layout
        if lay is not None and lay.pp > 1 and self.executor is not None:
            model, optim = merge_pipeline_state(self.module, self.executor.stages, self.optimizer, lay)
        else:
            model = self.module.state_dict()
            optim = self.optimizer.state_dict() if self.optimizer is not None else None
        rng = [checkpoint.rng_state()]
        if lay is not None:
            rng = gather_rng(rng[0])
        return {
            "model": model,
            "optimizer": optim,
            "engine": {"steps": self.steps, "format": 2, "rng": rng},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: model, optimizer, step and this rank's RNG states."""
        if not isinstance(state, dict) or not {"model", "optimizer", "engine"} <= set(state):
            raise ValueError(
                "not an engine checkpoint (needs keys 'model', 'optimizer', 'engine'); "
                "to load plain model weights use engine.module.load_state_dict(...)"
            )
        self.module.load_state_dict(state["model"])
        if self._graph is not None:
            # The optimizer gets new state tensors; a captured step would update the old ones.
            self._graph.reset()
            self.module.zero_grad(set_to_none=True)
        if state["optimizer"] is not None:
            if self.optimizer is None:
                raise ValueError("the checkpoint has optimizer state but this engine has no optimizer")
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["engine"].get("steps", 0))
        rng = state["engine"].get("rng")
        if rng:
            rank, world = (dist.get_rank(), dist.get_world_size()) if self.layout is not None else (0, 1)
            if len(rng) == world:
                checkpoint.set_rng_state(rng[rank])
            else:
                warnings.warn(
                    f"the checkpoint holds RNG states of {len(rng)} rank(s), this run has {world}: RNG states "
                    f"are not restored, so random augmentation/dropout will not continue the saved streams",
                    stacklevel=2,
                )

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` atomically (global rank 0 writes; collective when distributed).

        The file appears complete or not at all: a crash mid-save leaves the previous checkpoint.
        """
        state = self.state_dict()
        if self.layout is None or dist.get_rank() == 0:
            checkpoint.save(state, path)
        if self.layout is not None:
            dist.barrier()  # nobody reads the file before it exists

    def load(self, path: str | os.PathLike) -> None:
        """Resume from a file written by :meth:`save` (read as data only: ``weights_only=True``)."""
        self.load_state_dict(checkpoint.load(path, map_location="cpu"))

    def __repr__(self) -> str:
        built = f"{len(self.executor.stages)} stages" if self.executor else "not built"
        return f"Engine({type(self.module).__name__}, {built}, microbatches={self.microbatches}, schedule={self.schedule})"


def _sync(devices: Sequence[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def wrap(model: nn.Module, **options: Any) -> Engine:
    """Cut ``model`` into balanced stages and train it as a microbatch pipeline.

    Takes the keyword options of :class:`Engine` (optimizer, loss_fn,
    microbatches, stages, schedule, devices, batchnorm, cuda_graph, ...).
    """
    return Engine(model, **options)
