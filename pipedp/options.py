"""The options of an engine, in five small groups that validate themselves when made.

:func:`pipedp.wrap` takes them as flat keywords; :class:`pipedp.Engine`
takes the groups, which a user may build, keep and reuse (one
``DataParallelOptions`` for several models, say). A bad value fails when the
group is made, before any model is touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Sequence, Union

import torch

from .checks import non_negative_int, one_of, positive_int, positive_number
from .defaults import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, KERNEL_MODES
from .device import DeviceSpec, available_cores
from .pipeline.orders import PER_RANK, check_schedule
from .pipeline.schedule import SPLIT

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "PipelineOptions", "DataParallelOptions", "KernelOptions", "TrainingOptions", "ConcurrencyOptions", "DeviceSpec",
    "StagesSpec", "ThreadsSpec", "check_threads", "BATCHNORM_MODES", "DEFAULT_BUCKET_MB", "PRECISIONS", "AUTOCAST_DTYPES", "RecomputeSpec", "GradHook", "MicrobatchSpec", "DEFAULT_MICROBATCHES",
]

BATCHNORM_MODES = ("microbatch", "batch")
PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # what each mixed precision computes in
RecomputeSpec = Union[bool, Sequence[int]]
StagesSpec = Union[int, str, Sequence[int]]  # "auto", a stage count, or blocks per stage
ThreadsSpec = Union[None, str, Sequence[int]]  # None (stages in order), "auto", or a thread count per stage
GradHook = Callable[[Sequence[torch.nn.Parameter]], None]  # this rank's parameters, gradients final
MicrobatchSpec = Union[int, Literal["auto"], None]
DEFAULT_MICROBATCHES = 4  # what microbatches=None gives a given stage count where no layer couples the batch
DEFAULT_BUCKET_MB = DEFAULT_BUCKET_BYTES / 2**20  # DDP's bucket_cap_mb


def _stages(v: object) -> StagesSpec:
    if isinstance(v, bool) or not (v == "auto" or isinstance(v, (int, list, tuple))):
        raise ValueError(f"stages must be an int, 'auto' or a list of block counts, got {v!r}")
    if isinstance(v, int):
        positive_int("stages", v)
    return v  # type: ignore[return-value]


def _microbatches(v: object, stages: object) -> None:
    if v is None:
        return
    if v == "auto":
        if stages != "auto":
            raise ValueError(
                f"microbatches='auto' lets stages='auto' choose the microbatches with the cut, but stages={stages!r} "
                f"was given: pass stages='auto', or a number of microbatches"
            )
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"microbatches must be a positive int, 'auto' or None (your step's math), got {v!r}")


def _flag(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be True or False, got {v!r}")
    return v


def _lever(name: str, v: object) -> None:
    if v != "auto" and not isinstance(v, bool):
        raise ValueError(f"{name} must be True, False or 'auto' (stages='auto' times both), got {v!r}")


_LOCAL = {"local": True}  # a field each rank may set for itself (not compared across ranks)


@dataclass(frozen=True)
class PipelineOptions:
    """How the model is cut and run.

    ``stages``: ``"auto"``, a number of stages, or block counts per stage.
    ``schedule``: ``"1f1b"`` (less activation memory), ``"gpipe"``, or ``"zb-h1"`` (1F1B with each
    backward split into the input gradient and the weight gradients, which run where 1F1B would wait:
    a smaller bubble between stages that run at once, at 1F1B's peak of activations), or ``"interleaved"``
    (Interleaved 1F1B over pipeline ranks: each rank holds several stages spread along the model, stage s on
    rank s mod pp, so the fill and drain shrink by that many times at as many more messages; ``stages`` a
    multiple of pp, ``"auto"`` choosing how many per rank, and microbatches a multiple of pp), or ``"auto"``:
    over pipeline ranks the one whose simulated step is fastest on the profiled blocks (with the cut each
    gets; ``engine.schedule`` says which), elsewhere 1F1B.
    ``devices``: device(s) for the stages (default: the model's); several stages
    may share one CUDA device, each on its own stream. ``batchnorm``:
    ``"microbatch"`` (running statistics per microbatch, as GPipe) or
    ``"batch"`` (one update per step from the whole batch). ``microbatches``:
    None (the default) keeps the math of your step: one microbatch for a
    model with a layer that couples the samples of a batch (a BatchNorm in
    training), else as ``"auto"`` with ``stages="auto"`` and 4 with a given
    stage count (:mod:`pipedp.decide.coupling`). A number, or ``"auto"``
    (with ``stages="auto"``), allows accumulation over microbatches for any
    model; ``"auto"`` lets the planner choose the count with the cut: by
    timed trials on one device (a GPU, or a CPU in one process), where one
    stage x one microbatch (the plain step) is among the
    choices; elsewhere one microbatch for one stage, else the most of 1, 2, 4,
    8 the batch allows (``pp="auto"``: the microbatches of the layout it chose). The number
    chosen is ``engine.plan.microbatches``; with ``batchnorm="microbatch"``
    the BatchNorm statistics are those of the chosen microbatches. A batch
    smaller than twice that runs as ``batch // 2`` microbatches (at least two
    samples each, see :func:`pipedp.pipeline.microbatch.count`). ``profile``:
    measure block times, or use the FLOP/byte cost model. ``depth``: levels of
    nested ``nn.Sequential`` to cut into. ``measure_steps``: training steps
    timed per stage for ``engine.plan``. ``progress``: progress bars while
    blocks are profiled and plans timed (each rank may set its own).
    ``cuda_graph``: on one CUDA device,
    capture the whole step after two eager steps and replay it (optimizers
    with step counters need ``capturable=True``). ``rollback``: undo a
    step that fails inside ``optimizer.step()``, from a copy of parameters
    and optimizer state taken before it; with torch's own optimizers only
    while the update's structure is new (:mod:`pipedp.rollback`), with
    others (and with an early update) before every step. False never copies,
    and such a failure then leaves what the optimizer had done. ``threads`` (CPU, one process): None runs the
    stages one after another on the caller's thread (torch's own thread
    count); ``"auto"`` runs stages concurrently, each on its own worker
    thread and cores with a thread count chosen by a model of each block's
    time against threads and refined on measured steps (with
    ``stages="auto"`` one stage on all cores is among the measured choices);
    a list gives each stage's count (summing to at most the cores).
    ``plan_budget_s``: seconds ``stages="auto"`` may spend planning (profiling,
    timed trials, compiles): trials are sized to fit it, and finalists and
    compiles (``compile="auto"``) that would not fit are skipped, with a note.
    ``plan_cache``: reuse the decision made for the same model, input shape,
    options, machine and versions (:mod:`pipedp.decide.cache`): True (the
    per-user cache, or ``$PIPEDP_PLAN_CACHE``), a folder (``~`` is the home
    folder), or False to plan every time.
    """

    microbatches: MicrobatchSpec = None
    stages: StagesSpec = "auto"
    schedule: str = "1f1b"
    devices: DeviceSpec = field(default=None, metadata=_LOCAL)
    batchnorm: str = "microbatch"
    profile: bool = field(default=True, metadata=_LOCAL)  # only the deciding rank profiles
    depth: int = 1
    measure_steps: int = field(default=3, metadata=_LOCAL)
    progress: bool = field(default=True, metadata=_LOCAL)
    cuda_graph: bool = False
    rollback: bool = field(default=True, metadata=_LOCAL)
    threads: ThreadsSpec = None
    plan_budget_s: float = field(default=30.0, metadata=_LOCAL)  # only the deciding rank plans
    plan_cache: bool | str | os.PathLike[str] = field(default=True, metadata=_LOCAL)  # read by the deciding rank

    def __post_init__(self) -> None:
        _stages(self.stages)
        object.__setattr__(self, "threads", check_threads(self.threads, self.stages))
        _microbatches(self.microbatches, self.stages)
        if self.schedule != "auto":
            check_schedule(self.schedule)
        if self.schedule in (*SPLIT, *PER_RANK) and self.threads is not None:
            raise ValueError(f"schedule={self.schedule!r} runs one action at a time on a CPU, and threads= runs "
                             f"stages on thread teams at once: pass threads=None, or schedule='1f1b'")
        one_of("batchnorm", self.batchnorm, BATCHNORM_MODES)
        positive_int("depth", self.depth)
        non_negative_int("measure_steps", self.measure_steps)
        for name in ("profile", "progress", "cuda_graph", "rollback"):
            _flag(name, getattr(self, name))
        if not isinstance(self.plan_cache, (bool, str, os.PathLike)):
            raise ValueError(f"plan_cache must be True, False or a folder path, got {self.plan_cache!r}")
        if isinstance(self.plan_budget_s, bool) or not isinstance(self.plan_budget_s, (int, float)) \
                or not self.plan_budget_s >= 0:
            raise ValueError(f"plan_budget_s must be a number of seconds >= 0, got {self.plan_budget_s!r}")


@dataclass(frozen=True)
class DataParallelOptions:
    """How the engine trains under ``torch.distributed`` (ignored when no process group exists).

    ``pp``: pipeline ranks; the world is laid out as ``world // pp`` replicas of
    a pipeline over ``pp`` ranks; ``"auto"``: chosen when the engine is made,
    by predicting every layout and timing the best few (:mod:`pipedp.decide.world`;
    needs ``sample=``, the global batch of one step). Or a ``mesh`` with dims ``("dp", "pp")`` /
    ``("dp",)``, or explicit ``dp_group``/``pp_group``. ``bucket_mb``: gradient
    all-reduce bucket size (DDP's ``bucket_cap_mb``). ``reduce_dtype``:
    ``torch.bfloat16``/``torch.float16`` all-reduce gradients in half the bytes;
    ``"auto"`` (with ``pp="auto"``) allows a bf16 all-reduce, which ``pp="auto"``
    then weighs beside the fp32 one for every layout, as a user reaching for
    DDP's compression hook would (other math: each rank's gradient rounded to
    8 significant bits before the sum).
    ``timeout``: seconds a collective or transfer may take before the step,
    ``wrap()`` or ``save()``/``state_dict()`` fails with
    :class:`pipedp.DistributedError`. ``enabled`` (wrap's ``distributed``):
    False trains this process on its own even when a process group exists.
    """

    enabled: bool = field(default=True, metadata=_LOCAL)
    pp: int | str = 1
    mesh: DeviceMesh | None = field(default=None, metadata=_LOCAL)  # each rank holds its own handle
    dp_group: ProcessGroup | None = field(default=None, metadata=_LOCAL)
    pp_group: ProcessGroup | None = field(default=None, metadata=_LOCAL)
    bucket_mb: float = DEFAULT_BUCKET_MB
    reduce_dtype: torch.dtype | str | None = None
    timeout: float = field(default=DEFAULT_TIMEOUT_S, metadata=_LOCAL)

    def __post_init__(self) -> None:
        _flag("distributed", self.enabled)
        if self.pp != "auto" and (isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1):
            raise ValueError(f"pp must be a positive int or 'auto', got {self.pp!r}")
        positive_number("bucket_mb", self.bucket_mb, "MiB")
        positive_number("timeout", self.timeout, "seconds")
        if self.reduce_dtype not in (None, torch.bfloat16, torch.float16, "auto"):
            raise ValueError(f"reduce_dtype must be None, torch.bfloat16, torch.float16 or 'auto', got "
                             f"{self.reduce_dtype!r}")
        if self.reduce_dtype == "auto" and self.pp != "auto":
            raise ValueError(f"reduce_dtype='auto' lets pp='auto' weigh a bf16 all-reduce beside the fp32 one, but "
                             f"pp={self.pp!r} is fixed: pass pp='auto', or choose the dtype yourself "
                             f"(reduce_dtype=torch.bfloat16, or None for fp32)")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclass(frozen=True)
class KernelOptions:
    """Which depthwise-convolution kernels the model's layers run.

    ``mode`` (wrap's ``kernels``): ``"auto"`` runs the tuned TVM kernels
    exported by ``tune-kernels`` where one exists for the layer's shape and
    measured faster than torch (torch elsewhere; on a CPU only where the
    kernels share torch's OpenMP team), so a missing or damaged database never
    blocks training; ``"tvm"`` runs every tuned kernel, and a missing one is an
    error; ``"torch"`` never runs them. ``db`` (wrap's ``kernel_db``): the
    ``tune-kernels --db`` folder (default: the per-user cache).
    """

    mode: str = "auto"
    db: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        one_of("kernels", self.mode, KERNEL_MODES)
        if self.db is not None:
            if not isinstance(self.db, (str, os.PathLike)):
                raise ValueError(f"kernel_db must be a folder path, got {type(self.db).__name__}")
            object.__setattr__(self, "db", os.fspath(self.db))


def check_threads(threads: object, stages: object = None, cores: int | None = None) -> ThreadsSpec:
    """``threads`` as an option: None, ``"auto"`` or a positive count per stage (clear error otherwise)."""
    if threads is None or threads == "auto":
        return threads  # type: ignore[return-value]
    ok = isinstance(threads, (list, tuple)) and len(threads) > 0 and all(
        isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in threads)
    if not ok:
        raise ValueError(f"threads must be None, 'auto' or a list of positive thread counts per stage, got {threads!r}")
    counts = tuple(threads)  # type: ignore[arg-type]
    n = stages if isinstance(stages, int) and not isinstance(stages, bool) else (
        len(stages) if isinstance(stages, (list, tuple)) else None)
    if n is not None and n != len(counts):
        raise ValueError(f"threads={list(counts)} gives {len(counts)} stage(s) a count but stages={stages!r} makes "
                         f"{n}: pass one count per stage, or threads='auto'")
    cores = cores if cores is not None else len(available_cores())
    if sum(counts) > cores:
        raise ValueError(f"threads={list(counts)} asks for {sum(counts)} threads but this process may use {cores} "
                         f"core(s): stages running at once would share cores; lower the counts to sum to <= {cores}")
    return counts


def _recompute(v: object) -> bool | tuple[int, ...]:
    if isinstance(v, bool):
        return v
    ok = isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
    if not ok or len(set(v)) != len(v):  # type: ignore[arg-type]
        raise ValueError(
            f"recompute must be True, False or a list of distinct stage indices (ints >= 0), got {v!r}"
        )
    return tuple(sorted(v))  # type: ignore[arg-type]


@dataclass(frozen=True)
class TrainingOptions:
    """How each step computes: precision, memory format, compilation, gradient clipping, recompute.

    ``precision``: ``"fp32"`` (exact), ``"bf16"`` or ``"fp16"`` mixed precision:
    every stage's forward and the loss run under ``torch.autocast`` while
    parameters, gradients and optimizer state stay fp32; ``"fp16"`` also
    scales the loss and skips a step whose gradients hold inf/NaN, as
    ``torch.amp.GradScaler`` does (its overflow check reads the host once a step).
    ``channels_last``: model and batches in channels-last memory format (the
    layout tensor cores and oneDNN prefer for convolutions); ``"auto"`` (the
    default) lets ``stages="auto"`` time both layouts and take the faster
    (elsewhere the model keeps its layout). ``compile``: each stage's blocks
    compiled with ``torch.compile`` (streams and events stay outside; the
    first steps compile); ``"auto"`` lets ``stages="auto"`` time compiled
    finalists within ``plan_budget_s`` (off elsewhere). Layout and compile
    change results only within fp32 rounding; precision is never changed. ``clip_grad_norm``: clip the
    gradients to this total L2 norm over all parameters (pipeline ranks
    included), after unscaling, like ``torch.nn.utils.clip_grad_norm_``.
    ``recompute``: keep only each stage's input and recompute its activations
    in backward (``torch.utils.checkpoint``): ``True`` for every stage or the
    indices of the stages to recompute; less memory, one more forward.
    ``grad_hook``: called as ``grad_hook(params)`` with this rank's
    parameters once a step's gradients are final (accumulated over the
    microbatches, averaged over replicas, unscaled under fp16) and before
    ``clip_grad_norm`` and ``optimizer.step()``: the place a training script
    clips by value, clips adaptively or logs gradient norms. Each rank may
    pass its own; under ``cuda_graph`` it is captured, so it must not read
    the host.
    """

    precision: str = "fp32"
    channels_last: bool | Literal["auto"] = "auto"
    compile: bool | Literal["auto"] = False
    clip_grad_norm: float | None = None
    recompute: RecomputeSpec = False
    grad_hook: GradHook | None = field(default=None, metadata=_LOCAL)

    def __post_init__(self) -> None:
        one_of("precision", self.precision, PRECISIONS)
        for name in ("channels_last", "compile"):
            _lever(name, getattr(self, name))
        if self.clip_grad_norm is not None:
            object.__setattr__(self, "clip_grad_norm", positive_number("clip_grad_norm", self.clip_grad_norm))
        object.__setattr__(self, "recompute", _recompute(self.recompute))
        if self.grad_hook is not None and not callable(self.grad_hook):
            raise ValueError(f"grad_hook must be callable as grad_hook(params), got {type(self.grad_hook).__name__}")

    def recomputes(self, stage: int) -> bool:
        """Whether stage ``stage`` (its index in the whole pipeline) recomputes its activations."""
        return self.recompute is True or (not isinstance(self.recompute, bool) and stage in self.recompute)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype stages compute in under autocast (None: fp32, no autocast)."""
        return AUTOCAST_DTYPES.get(self.precision)


@dataclass(frozen=True)
class ConcurrencyOptions:
    """Work of one step run side by side on one device, each piece exact and off by default.

    These fill a GPU that a small microbatch or a late, small-resolution
    stage leaves partly idle, with work that is independent at full batch
    (kernels keep their size). ``branches``: a residual block's shortcut /
    downsample path runs on a side stream beside the main path
    (:mod:`pipedp.pipeline.branches`). ``split_grads``: each backward runs as its
    input gradient (I) and then its weight gradients (W, of the convolutions
    and linear layers) on the stage's side stream, beside the stage's next
    action (:mod:`pipedp.pipeline.weight_grad`). ``early_update``: a stage's
    optimizer update starts as soon as its last backward (and gradient sync)
    is done, while earlier stages are still in backward
    (:mod:`pipedp.pipeline.early_update`). On a CPU the same code runs in
    order, with the same numbers.
    """

    branches: bool = False
    split_grads: bool = False
    early_update: bool = False

    def __post_init__(self) -> None:
        for name in ("branches", "split_grads", "early_update"):
            _flag(name, getattr(self, name))

    @property
    def any(self) -> bool:
        return self.branches or self.split_grads or self.early_update
