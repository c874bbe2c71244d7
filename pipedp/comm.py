"""One interface for what differs between a single process and ``torch.distributed``.

The engine and the build step talk to a :class:`Communicator` and never ask
whether they are distributed: :class:`Local` is a data-parallel world of
one (every collective is the identity), :class:`Distributed` wraps this
rank's :class:`~pipedp.distributed.Layout` and does the collectives with
``torch.distributed``. Every method of a distributed communicator that
communicates is collective over the groups it names, so every rank calls it
at the same point.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .distributed import (
    DistributedError, Layout, all_reduce, barrier, broadcast_tensors, check_backend, missing_note, resolve_layout,
)
from .decide.rules import shared_settings
from .options import DataParallelOptions, PipelineOptions, TrainingOptions
from .pipeline.gradsync import GradSync
from .pipeline.p2p import Transport
from .pipeline.stage import Stage
from .state import (
    broadcast_decision, check_same_model, gather_rng, merge_pipeline_state, model_signature, share_loss,
)

__all__ = ["Communicator", "Local", "Distributed", "communicator"]

T = TypeVar("T")
StateDicts = tuple[dict[str, Any], "dict[str, Any] | None"]

# Collectives outside a step, counted alike on every rank (all call them in the same order): the
# survivors of a failed one check in under the same key. One count per process, so that engines
# made one after another never share a key.
_CALLS = itertools.count()
CHECKPOINT = "saving a checkpoint (engine.save/state_dict)"


class Communicator(Protocol):
    """What the engine needs from the processes it runs in."""

    layout: Layout | None  # None in a single process
    pp: int  # pipeline ranks of this pipeline
    pp_rank: int
    rank: int  # global rank
    world: int

    def describe(self) -> str:
        """Where this process sits among the ranks ("" for a single process)."""

    def check(self, devices: Sequence[torch.device], cuda_graph: bool) -> None:
        """Refuse devices or options this world cannot run."""

    def check_same_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         options: PipelineOptions, training: TrainingOptions | None = None) -> None:
        """Refuse (ValueError on every rank) ranks whose model, optimizer or options differ.

        Runs before any collective that sends model tensors, which would abort
        the job (or train apart silently) on a mismatch.
        """

    def same_start(self, model: nn.Module) -> None:
        """Give every rank rank 0's parameter and buffer values, as DDP does at construction.

        After :meth:`check_same_model` (the same names, shapes and dtypes): ranks
        whose models were initialised apart would otherwise train apart.
        """

    def decide(self, fn: Callable[[], T]) -> T:
        """``fn()`` computed once and the same answer on every rank (its exception re-raised on all)."""

    def stage_ranks(self, stage_pp_ranks: Sequence[int]) -> list[int] | None:
        """Global rank of each stage, given its pipeline rank (None when every stage is local)."""

    def transport(self, device: torch.device, step: int) -> Transport | None:
        """Point-to-point messages between pipeline ranks (None without pipeline ranks)."""

    def grad_sync(self, stages: Sequence[Stage]) -> GradSync | None:
        """Gradient averaging over the data-parallel replicas (None for one replica)."""

    def share_loss(self, loss: torch.Tensor | None, device: torch.device, step: int) -> torch.Tensor | None:
        """The step's loss on every pipeline rank."""

    def all_reduce(self, tensor: torch.Tensor, op: str, over: str, what: str) -> None:
        """``tensor`` summed (``op="sum"``) or maximised (``"max"``) in place over the ranks of this pipeline
        (``over="pipeline"``) or all ranks (``"world"``); every rank of that group calls it. ``what`` names
        it in an error."""

    def failure_note(self, step: int) -> str:
        """A sentence for an error of ``step``: which ranks are gone."""

    def model_state(self, model: nn.Module, stages: Sequence[Stage] | None,
                    optimizer: torch.optim.Optimizer | None) -> StateDicts:
        """Full model and optimizer state dicts (pipeline ranks' stages merged; None: not built yet)."""

    def rng_states(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's RNG state, by global rank."""

    def writes_files(self) -> bool:
        """Whether this rank writes shared files (checkpoints)."""

    def barrier(self) -> None:
        """Wait for every rank (after rank 0 wrote a checkpoint)."""

    def own_path(self, path: str) -> str:
        """A per-rank file name for files every rank writes (traces)."""


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> StateDicts:
    return model.state_dict(), optimizer.state_dict() if optimizer is not None else None


class Local:
    """A single process: one replica, one pipeline rank, collectives are the identity."""

    layout = None
    pp = 1
    pp_rank = 0
    rank = 0
    world = 1

    def describe(self) -> str:
        return ""

    def check(self, devices: Sequence[torch.device], cuda_graph: bool) -> None:
        return None

    def check_same_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         options: PipelineOptions, training: TrainingOptions | None = None) -> None:
        return None

    def same_start(self, model: nn.Module) -> None:
        return None

    def decide(self, fn: Callable[[], T]) -> T:
        return fn()

    def stage_ranks(self, stage_pp_ranks: Sequence[int]) -> list[int] | None:
        return None

    def transport(self, device: torch.device, step: int) -> Transport | None:
        return None

    def grad_sync(self, stages: Sequence[Stage]) -> GradSync | None:
        return None

    def share_loss(self, loss: torch.Tensor | None, device: torch.device, step: int) -> torch.Tensor | None:
        return loss

    def all_reduce(self, tensor: torch.Tensor, op: str, over: str, what: str) -> None:
        _check_reduce(op, over)

    def failure_note(self, step: int) -> str:
        return ""

    def model_state(self, model: nn.Module, stages: Sequence[Stage] | None,
                    optimizer: torch.optim.Optimizer | None) -> StateDicts:
        return _local_state(model, optimizer)

    def rng_states(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        return [mine]

    def writes_files(self) -> bool:
        return True

    def barrier(self) -> None:
        return None

    def own_path(self, path: str) -> str:
        return path


class Distributed:
    """This rank in a data-parallel x pipeline layout over ``torch.distributed``."""

    def __init__(self, layout: Layout, options: DataParallelOptions, reduce_dtype: torch.dtype | None) -> None:
        self.layout = layout
        self.options = options
        self.reduce_dtype = reduce_dtype  # resolved: options.reduce_dtype may be the request "auto"
        self.pp, self.pp_rank = layout.pp, layout.pp_rank
        self.rank, self.world = layout.rank, layout.world

    def describe(self) -> str:
        return self.layout.describe()

    def check(self, devices: Sequence[torch.device], cuda_graph: bool) -> None:
        check_backend(list(devices), self.pp)
        if cuda_graph:
            raise ValueError(
                "cuda_graph=True is not supported under torch.distributed yet: pass cuda_graph=False "
                "(collectives and transfers are issued eagerly)"
            )

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """A collective of every rank; its failure names this rank, ``what`` and the ranks gone."""
        event = f"call-{next(_CALLS)}"
        try:
            yield
        except DistributedError as e:
            raise DistributedError(
                f"{what} failed on rank {self.rank} of {self.world}: a peer died, hung past the "
                f"{self.layout.timeout.total_seconds():g} s timeout, or did not make the same call. Check the "
                f"other ranks' logs, then restart from the last checkpoint."
                f"{missing_note(event, self.world, what)} Cause: {e}"
            ) from e.__cause__

    def _settings(self, options: PipelineOptions, training: TrainingOptions | None) -> dict[str, Any]:
        """The options every rank must share (they shape the cut, the messages, the gradient buckets and the
        collectives of the update), derived from the option fields, with the layout of the world."""
        training = training if training is not None else TrainingOptions()
        return {"dp": self.layout.dp, "pp": self.pp, **shared_settings(self.options, options, training)}

    def check_same_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         options: PipelineOptions, training: TrainingOptions | None = None) -> None:
        signature = model_signature(model, optimizer, self._settings(options, training))
        with self._collective("comparing the model across ranks in wrap()"):
            check_same_model(signature, self.layout)

    def same_start(self, model: nn.Module) -> None:
        tensors = [t for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
                   if not is_lazy(t)]  # a lazy layer has no values yet
        with self._collective("giving every rank rank 0's parameters and buffers in wrap()"):
            broadcast_tensors(tensors, 0, self.layout.everyone, self.layout.timeout)

    def decide(self, fn: Callable[[], T]) -> T:
        lay = self.layout
        answer: Any = None
        if lay.dp_rank == 0 and lay.pp_rank == 0:
            try:
                answer = fn()
            except Exception as e:
                answer = e  # the other ranks must not wait for an answer forever
        with self._collective("sharing the first rank's plan (the cut)"):
            answer = broadcast_decision(answer, lay)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def stage_ranks(self, stage_pp_ranks: Sequence[int]) -> list[int] | None:
        return [self.layout.pp_peer(r) for r in stage_pp_ranks] if self.pp > 1 else None

    def transport(self, device: torch.device, step: int) -> Transport | None:
        if self.pp == 1:
            return None
        return Transport(self.layout.pp_group, device, self.layout.timeout, step=step)

    def grad_sync(self, stages: Sequence[Stage]) -> GradSync | None:
        return GradSync(
            [list(st.chain.parameters()) for st in stages], self.layout.dp_group,
            bucket_bytes=self.options.bucket_bytes, reduce_dtype=self.reduce_dtype,
            timeout=self.layout.timeout,
        )

    def share_loss(self, loss: torch.Tensor | None, device: torch.device, step: int) -> torch.Tensor | None:
        return share_loss(loss, self.layout, device, step) if self.pp > 1 else loss

    def all_reduce(self, tensor: torch.Tensor, op: str, over: str, what: str) -> None:
        _check_reduce(op, over)
        group = self.layout.pp_group if over == "pipeline" else self.layout.everyone
        if (self.pp if over == "pipeline" else self.world) == 1:
            return
        try:
            all_reduce(tensor, op, group, self.layout.timeout)
        except DistributedError as e:
            over_what = "the pipeline ranks" if over == "pipeline" else "all ranks"
            raise DistributedError(f"{what} over {over_what} failed (this is rank {self.rank}): a peer died or "
                                   f"hung. Cause: {e}") from e.__cause__

    def failure_note(self, step: int) -> str:
        return missing_note(step, self.world)

    def model_state(self, model: nn.Module, stages: Sequence[Stage] | None,
                    optimizer: torch.optim.Optimizer | None) -> StateDicts:
        with self._collective(f"{CHECKPOINT}: merging the pipeline ranks' model and optimizer state"):
            if self.pp == 1 or stages is None:
                return _local_state(model, optimizer)
            return merge_pipeline_state(model, stages, optimizer, self.layout)

    def rng_states(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        with self._collective(f"{CHECKPOINT}: gathering every rank's RNG state"):
            return gather_rng(mine, self.layout)

    def writes_files(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        with self._collective(f"{CHECKPOINT}: waiting for every rank after rank 0 wrote the file"):
            barrier(self.layout.everyone, self.layout.timeout)

    def own_path(self, path: str) -> str:
        if self.world == 1:
            return path
        stem, suffix = os.path.splitext(path)
        return f"{stem}.rank{self.rank}{suffix}"


def _check_reduce(op: str, over: str) -> None:
    if op not in ("sum", "max") or over not in ("pipeline", "world"):
        raise ValueError(f"all_reduce takes op 'sum' or 'max' over 'pipeline' or 'world', got {op!r} over {over!r}")


def communicator(options: DataParallelOptions, pp: int | None = None,
                 reduce_dtype: torch.dtype | None = None) -> Communicator:
    """The communicator for this process: distributed whenever a process group exists (unless disabled).

    ``pp``, ``reduce_dtype``: what ``pp="auto"`` resolved them to (the options keep the request); None:
    the options' own (``reduce_dtype="auto"`` unresolved, with no world to weigh it in, reduces in fp32).
    """
    if reduce_dtype is None and options.reduce_dtype != "auto":
        reduce_dtype = options.reduce_dtype  # type: ignore[assignment]
    layout = None
    if options.enabled:
        layout = resolve_layout(pp=pp if pp is not None else options.pp, mesh=options.mesh, dp_group=options.dp_group,
                                pp_group=options.pp_group, timeout=options.timeout)
    return Local() if layout is None else Distributed(layout, options, reduce_dtype)
