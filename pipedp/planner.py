"""From block costs to a plan: how many stages, where to cut, which device each gets.

Predicted step time comes from simulating the schedule with each stage's
forward and backward time. Stages on separate devices overlap freely; stages
on one device without streams (the CPU) run one after another, so cutting them
only adds overhead. Stages that share one CUDA device overlap only as far as
their kernels leave the GPU idle, which solo timings cannot tell, so for them
``stages="auto"`` measures short trial steps instead of trusting a prediction:
candidate plans (one stage; S stages x M microbatches; compiled or with the
side-stream concurrency pieces, where the user asked for them) and,
beside them, the plain step of the unmodified model. A plan is chosen only if
it beats that plain step by a margin larger than trial noise; otherwise the
one-stage, one-microbatch plan (the plain step itself) is, where the caller
lets the planner choose the microbatches. The decision (:func:`choose_by_trials`)
takes the timings as callbacks, so it is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence, Union

import torch

from .partition.balance import balance
from .partition.profile import BlockProfile
from .pipeline.schedule import Action, get_schedule
from .pipeline.simulate import Simulation, simulate
from .plan import Plan, StagePlan

__all__ = [
    "StagesSpec", "stage_devices", "stage_places", "stage_times", "action_durations", "resolve_counts",
    "simulate_plan", "build_plan", "Candidate", "Decision", "trial_candidates", "choose_by_trials", "trials_apply",
    "untimed_microbatches", "plan_label", "AUTO_MICROBATCHES", "MIN_TRIAL_GAIN",
]

StagesSpec = Union[int, str, Sequence[int]]

ACTION_OVERHEAD_MS = 0.05  # host work per action (events, bookkeeping), a rough constant
LINK_BYTES_PER_S = 20e9  # nominal device-to-device bandwidth for transfer costs
MAX_AUTO_STAGES = 8
MAX_TRIAL_STAGES = 4
AUTO_MICROBATCHES = (1, 2, 4, 8)  # the microbatch counts trials try when the caller leaves the choice to the planner
MIN_TRIAL_GAIN = 0.02  # a plan must beat the plain step by this share in trials (more than their noise)
COMPILE_FINALISTS = 2  # the fastest uncompiled candidates that are also timed compiled (compiling takes long)
_MiB = float(1 << 20)


def stage_devices(stages: int, devices: Sequence[torch.device]) -> list[torch.device]:
    """Device of each stage: contiguous groups of stages per device, in order."""
    d = len(devices)
    return [devices[s * d // stages] if stages >= d else devices[s] for s in range(stages)]


def stage_places(stages: int, devices: Sequence[torch.device], ranks: int = 1) -> list[tuple[int, torch.device]]:
    """(pipeline rank, device) of each stage: ``stages // ranks`` contiguous stages per rank."""
    k = stages // ranks
    local = stage_devices(k, devices)
    return [(s // k, local[s % k]) for s in range(stages)]


def _transfer_ms(profiles: Sequence[BlockProfile]) -> list[float]:
    # An activation goes forward and its gradient (same size) comes back.
    return [2 * p.output_bytes / LINK_BYTES_PER_S * 1e3 for p in profiles[:-1]]


def _per_stage(profiles: Sequence[BlockProfile], counts: Sequence[int]) -> list[list[BlockProfile]]:
    out, start = [], 0
    for k in counts:
        out.append(list(profiles[start : start + k]))
        start += k
    return out


def stage_times(profiles: Sequence[BlockProfile], counts: Sequence[int]) -> tuple[list[float], list[float]]:
    """Forward and backward ms of each stage of the cut ``counts`` (the sums of its blocks)."""
    groups = _per_stage(profiles, counts)
    return [sum(p.forward_ms for p in g) for g in groups], [sum(p.backward_ms for p in g) for g in groups]


def action_durations(fwd: Sequence[float], bwd: Sequence[float], overhead_ms: float = 0.0) \
        -> Callable[[int, Action], float]:
    """Duration of each schedule action from per-stage forward and backward times (for the simulator)."""
    return lambda s, a: (fwd[s] if a.kind == "F" else bwd[s]) + overhead_ms


def _serial(device: torch.device) -> bool:
    """Does this device run all stages' work one after another (no streams)?"""
    return device.type != "cuda"


def simulate_plan(
    profiles: Sequence[BlockProfile],
    counts: Sequence[int],
    devices: Sequence[torch.device],
    microbatches: int,
    schedule: str,
    ranks: int = 1,
) -> Simulation:
    """Simulated step of the cut ``counts`` with per-stage times from the profiles."""
    devs = stage_places(len(counts), devices, ranks)
    fwd, bwd = stage_times(profiles, counts)
    ends = [sum(counts[: s + 1]) - 1 for s in range(len(counts))]
    for s in range(len(counts) - 1):
        if devs[s] != devs[s + 1]:
            t = profiles[ends[s]].output_bytes / LINK_BYTES_PER_S * 1e3
            fwd[s] += t
            bwd[s + 1] += t
    duration = action_durations(fwd, bwd, ACTION_OVERHEAD_MS)
    keys = [f"{r}/{d}" if _serial(d) else f"{r}/{d}/stream{s}" for s, (r, d) in enumerate(devs)]
    resources = [keys.index(k) for k in keys]
    return simulate(get_schedule(schedule)(len(counts), microbatches), duration=duration, resources=resources)


def resolve_counts(
    profiles: Sequence[BlockProfile],
    stages: StagesSpec,
    devices: Sequence[torch.device],
    microbatches: int,
    schedule: str,
    ranks: int = 1,
) -> tuple[list[int], list[str]]:
    """Block counts per stage for a stages spec (int, "auto", or given counts), with notes.

    With ``ranks`` pipeline ranks the stage count is a multiple of ``ranks``
    (``"auto"`` gives one stage per rank).
    """
    n = len(profiles)
    costs = [p.cost_ms for p in profiles]
    if isinstance(stages, str):
        if stages != "auto":
            raise ValueError(f"stages must be an int, 'auto' or a list of block counts, got {stages!r}")
        if ranks == 1:
            return _auto(profiles, devices, microbatches, schedule)
        stages = ranks
    if isinstance(stages, int) and not isinstance(stages, bool):
        _check_ranks(stages, ranks, n)
        places = stage_places(stages, devices, ranks) if stages >= 1 else []
        transfer = _transfer_ms(profiles) if len(set(places)) == stages > 1 else None
        return balance(costs, stages, transfer=transfer), []
    try:
        counts = [int(k) for k in stages]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"stages must be an int, 'auto' or a list of block counts, got {stages!r}") from None
    if any(k < 1 for k in counts) or sum(counts) != n:
        raise ValueError(f"stages={counts} must be positive block counts summing to the model's {n} blocks")
    _check_ranks(len(counts), ranks, n)
    return counts, ["cut given by the user"]


def _check_ranks(stages: int, ranks: int, blocks: int) -> None:
    if ranks > 1 and (stages < ranks or stages % ranks):
        raise ValueError(
            f"{stages} stage(s) cannot be spread over pp={ranks} pipeline ranks: use a multiple of {ranks} "
            f"(at most the model's {blocks} blocks), or stages='auto' for one stage per rank"
        )


def _auto(
    profiles: Sequence[BlockProfile],
    devices: Sequence[torch.device],
    microbatches: int,
    schedule: str,
) -> tuple[list[int], list[str]]:
    n = len(profiles)
    costs = [p.cost_ms for p in profiles]
    best: tuple[float, list[int]] | None = None
    for k in range(1, min(n, MAX_AUTO_STAGES) + 1):
        devs = stage_devices(k, devices)
        transfer = _transfer_ms(profiles) if len(set(devs)) == k > 1 else None
        counts = balance(costs, k, transfer=transfer)
        ms = simulate_plan(profiles, counts, devices, microbatches, schedule).makespan
        if best is None or ms < best[0] - 1e-9:
            best = (ms, counts)
    assert best is not None
    notes = []
    if all(_serial(d) for d in devices) and len(set(devices)) == 1:
        notes.append(
            f"stages=auto: {devices[0]} runs stages one after another, so one stage is fastest; "
            f"pass stages=N to force a pipeline, or threads='auto' to run CPU stages concurrently"
        )
    return best[1], notes


def trials_apply(stages: StagesSpec, devices: Sequence[torch.device], ranks: int = 1) -> bool:
    """Does ``stages`` get decided by timed trials? ``"auto"`` with all stages on one CUDA device, one rank."""
    return stages == "auto" and ranks == 1 and len(devices) == 1 and devices[0].type == "cuda"


@dataclass(frozen=True)
class Candidate:
    """A plan a trial can time: the cut (blocks per stage), the microbatches, compiled stages or not."""

    counts: tuple[int, ...]
    microbatches: int
    compiled: bool = False
    concurrent: bool = False  # with the user's concurrency pieces (shortcut branches, split weight gradients)

    @property
    def label(self) -> str:
        return plan_label(len(self.counts), self.microbatches, self.compiled, self.concurrent)

    @property
    def plain(self) -> bool:
        """One stage, one microbatch: the user's own step, run by the engine."""
        return len(self.counts) == 1 and self.microbatches == 1


def plan_label(stages: int, microbatches: int, compiled: bool = False, concurrent: bool = False) -> str:
    """``"SxM"`` (``" compiled"``, ``" concurrent"`` added): how trials and the plan table name a plan."""
    return f"{stages}x{microbatches}{' compiled' if compiled else ''}{' concurrent' if concurrent else ''}"


@dataclass(frozen=True)
class Decision:
    """The plan the planner chose, every trial's ms per step, and the plain step's ms measured beside them."""

    counts: tuple[int, ...]
    microbatches: int
    compiled: bool
    notes: tuple[str, ...] = ()
    trials: tuple[tuple[str, float], ...] = ()
    baseline_ms: float | None = None
    concurrent: bool = True  # the user's concurrency pieces apply (False: trials found the plan faster without)
    chosen: str = ""  # the chosen plan's trial label ("" without trials)
    threads: tuple[int, ...] | None = None  # CPU stages run concurrently with these intra-op counts (None: in order)


def trial_candidates(costs: Sequence[float], microbatch_choices: Sequence[int], batch: int,
                     max_stages: int = MAX_TRIAL_STAGES) -> list[Candidate]:
    """The uncompiled plans worth a trial: for each microbatch count the batch allows, 1..S balanced stages.

    More stages than microbatches never fill the pipeline (only adds hand-offs),
    so S stops at M. Ordered by M, then S: on equal times the simpler plan wins.
    """
    ms = sorted({int(m) for m in microbatch_choices if 1 <= int(m) <= batch})
    if not ms:
        raise ValueError(f"no microbatch count in {list(microbatch_choices)} fits a batch of {batch}")
    return [Candidate(tuple(balance(costs, k)), m) for m in ms for k in range(1, min(len(costs), max_stages, m) + 1)]


def untimed_microbatches(stages: int, batch: int) -> int:
    """``microbatches="auto"`` where no trials run (CPU, several devices, pipeline ranks).

    One stage has nothing to overlap, so one microbatch (the plain step);
    several stages take the most microbatches of :data:`AUTO_MICROBATCHES`
    the batch allows (the more microbatches, the smaller the pipeline bubble).
    """
    if stages == 1:
        return 1
    return max(m for m in AUTO_MICROBATCHES if m <= max(batch, 1))


def choose_by_trials(
    candidates: Sequence[Candidate],
    measure: Callable[[Candidate], float],
    *,
    baseline: Callable[[], float] | None = None,
    compile: bool = False,
    concurrent: bool = False,
    where: str = "",
) -> Decision:
    """Time every candidate (and the fastest few compiled, or concurrent, where asked) and choose one.

    ``compile``: the :data:`COMPILE_FINALISTS` fastest candidates are timed
    compiled too; ``concurrent``: they are timed with the user's concurrency
    pieces installed too (one stage with concurrency is such a finalist).

    ``measure(candidate)`` and ``baseline()`` return ms per forward+backward
    step of a short trial. ``baseline`` is the plain step: the unmodified model
    on the whole batch in the user's numerics (precision, channels_last),
    captured when the user asked for a CUDA graph and compiled when they asked
    for ``compile``, i.e. what they would run without pipedp. It is timed before
    and after the candidates and the faster time is the bar, so drift during the
    trials cannot favour a plan. The fastest plan is chosen only if it beats the
    bar by ``MIN_TRIAL_GAIN``; otherwise one stage x one microbatch (compiled as
    the user asked), which is that plain step, is chosen whenever one microbatch
    is among the ``candidates``: the choice is then never slower than the plain
    step as measured. Without ``baseline`` the fastest plan is chosen.
    """
    if not candidates:
        raise ValueError("stages=auto has no candidate plan to time")
    first = baseline() if baseline is not None else None
    timed = [(c, float(measure(c))) for c in candidates]
    finalists = [c for c, _ in sorted(timed, key=lambda t: t[1])[:COMPILE_FINALISTS]]
    for flag, asked in (("concurrent", concurrent), ("compiled", compile)):
        if asked:
            timed += [(c, float(measure(c))) for c in (replace(f, **{flag: True}) for f in finalists)]
    bar = min(first, float(baseline())) if baseline is not None and first is not None else None
    best, best_ms = min(timed, key=lambda t: t[1])
    on = f"timed trials on {where or 'the device'}"
    chosen = best
    if bar is None:
        notes = [f"stages=auto chose {best.label} by {on} ({best_ms:.2f} ms per step)"]
    elif best_ms <= bar * (1 - MIN_TRIAL_GAIN):
        notes = [f"stages=auto chose {best.label} by {on}: {best_ms:.2f} ms per step, {bar / best_ms:.2f}x the plain "
                 f"step ({bar:.2f} ms)"]
    else:
        plain = next((c for c in candidates if c.plain), None)
        if plain is not None:
            chosen = replace(plain, compiled=compile)
            notes = [f"stages=auto: no plan beat the plain step ({bar:.2f} ms) by {MIN_TRIAL_GAIN:.0%} in {on}: "
                     f"chose 1 stage x 1 microbatch, the plain step itself"]
        else:
            notes = [f"stages=auto: no plan beat the plain step ({bar:.2f} ms) by {MIN_TRIAL_GAIN:.0%} in {on}; kept "
                     f"the fastest, {best.label} ({best_ms:.2f} ms), because the microbatches were given: "
                     f"microbatches='auto' lets the planner fall back to the plain step"]
    return Decision(chosen.counts, chosen.microbatches, chosen.compiled, tuple(notes),
                    tuple((c.label, ms) for c, ms in timed), bar, concurrent=chosen.concurrent, chosen=chosen.label)


def build_plan(
    profiles: Sequence[BlockProfile],
    counts: Sequence[int],
    devices: Sequence[torch.device],
    *,
    microbatches: int,
    microbatch_size: int,
    schedule: str,
    batchnorm: str,
    source: str,
    notes: Sequence[str] = (),
    ranks: int = 1,
    layout: str = "",
    trials: Sequence[tuple[str, float]] = (),
    baseline_ms: float | None = None,
    compiled: bool = False,
    chosen: str = "",
) -> Plan:
    sim = simulate_plan(profiles, counts, devices, microbatches, schedule, ranks)
    places = stage_places(len(counts), devices, ranks)
    stages = []
    for s, group in enumerate(_per_stage(profiles, counts)):
        r, dev = places[s]
        stages.append(
            StagePlan(
                index=s,
                blocks=tuple(p.name for p in group),
                device=str(dev) if ranks == 1 else f"pp{r}:{dev}",
                stream=f"stream{s}" if dev.type == "cuda" else "host",
                predicted_ms=sum(p.cost_ms for p in group),
                activation_mb=sum(p.saved_bytes for p in group) * sim.peak_activations[s] / _MiB,
                param_mb=sum(p.param_bytes for p in group) / _MiB,
            )
        )
    return Plan(
        stages=tuple(stages),
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        schedule=schedule,
        batchnorm=batchnorm,
        predicted_step_ms=sim.makespan,
        source=source,
        notes=tuple(notes),
        layout=layout,
        trials=tuple(trials),
        trial_baseline_ms=baseline_ms,
        trial_chosen=chosen,
        compiled=compiled,
    )
