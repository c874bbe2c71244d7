"""From block costs to a cut: how many stages, where to cut, which device each gets.

Predicted step time comes from simulating the schedule with each stage's
forward and backward time. Stages on separate devices overlap freely; stages
on one device without streams (the CPU) run one after another, so cutting them
only adds overhead. Where no timed trials run (a given stage count, several
devices, pipeline ranks) these predictions choose; on one device
:mod:`pipedp.decide.search` times the choices instead, since stages that share
a device overlap only as far as their kernels leave it idle, which solo
timings cannot tell.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..options import StagesSpec
from ..partition.balance import balance, refine
from ..partition.profile import BlockProfile
from ..pipeline import microbatch
from ..pipeline.deps import action_ms
from ..pipeline.orders import PER_RANK, placement, simulate_schedule
from ..pipeline.schedule import Action
from ..pipeline.simulate import Simulation
from ..plan import Plan, StagePlan
from .decision import Decision

__all__ = [
    "stage_devices", "stage_places", "stage_times", "action_durations", "resolve_counts",
    "simulate_plan", "build_plan", "untimed_microbatches", "AUTO_MICROBATCHES", "MAX_TRIAL_STAGES",
]


ACTION_OVERHEAD_MS = 0.05  # host work per action (events, bookkeeping), a rough constant
LINK_BYTES_PER_S = 20e9  # nominal device-to-device bandwidth for transfer costs
MAX_AUTO_STAGES = 8
MAX_TRIAL_STAGES = 4
MAX_PER_RANK = 4  # the most stages per rank an interleaved pipeline is cut into by stages="auto"
AUTO_MICROBATCHES = (1, 2, 4, 8)  # the microbatch counts trials try when the caller leaves the choice to the planner
_MiB = float(1 << 20)


def stage_devices(stages: int, devices: Sequence[torch.device]) -> list[torch.device]:
    """Device of each stage: contiguous groups of stages per device, in order."""
    d = len(devices)
    return [devices[s * d // stages] if stages >= d else devices[s] for s in range(stages)]


def stage_places(stages: int, devices: Sequence[torch.device], ranks: int = 1, schedule: str = "1f1b"
                 ) -> list[tuple[int, torch.device]]:
    """(pipeline rank, device) of each stage: ``stages // ranks`` stages per rank, placed as the schedule
    places them (consecutive, or interleaved), each rank's spread over its ``devices`` in order."""
    rank_of = placement(schedule, stages, ranks)
    local = stage_devices(stages // ranks, devices)
    seen: dict[int, int] = {}
    out = []
    for r in rank_of:
        out.append((r, local[seen.get(r, 0)]))
        seen[r] = seen.get(r, 0) + 1
    return out


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
    return lambda s, a: action_ms(a.kind, fwd[s], bwd[s]) + overhead_ms


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
    return _simulate_placed(profiles, counts, stage_places(len(counts), devices, ranks, schedule), microbatches,
                            schedule, ranks)


def _simulate_placed(profiles: Sequence[BlockProfile], counts: Sequence[int],
                     devs: Sequence[tuple[int, torch.device]], microbatches: int, schedule: str,
                     ranks: int) -> Simulation:
    """:func:`simulate_plan` with each stage's (rank, device) given."""
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
    return simulate_schedule(schedule, len(counts), microbatches, ranks, duration=duration, resources=resources)


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
        if schedule in PER_RANK:
            return _auto_per_rank(profiles, devices, microbatches, schedule, ranks)
        stages = ranks
    if isinstance(stages, int) and not isinstance(stages, bool):
        _check_ranks(stages, ranks, n)
        places = stage_places(stages, devices, ranks, schedule) if stages >= 1 else []
        transfer = _transfer_ms(profiles) if len(set(places)) == stages > 1 else None
        counts = balance(costs, stages, transfer=transfer)
        if schedule not in PER_RANK:
            return counts, []
        return _refined(profiles, counts, devices, microbatches, schedule, ranks)[:2]
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


def _auto_per_rank(profiles: Sequence[BlockProfile], devices: Sequence[torch.device], microbatches: int,
                   schedule: str, ranks: int) -> tuple[list[int], list[str]]:
    """An interleaved pipeline's stages per rank: the count whose simulated step (shorter fill and drain
    against one more message and action per extra stage) is fastest, at most :data:`MAX_PER_RANK`."""
    costs = [p.cost_ms for p in profiles]
    best: tuple[float, int, list[int]] | None = None
    for v in range(1, min(MAX_PER_RANK, len(profiles) // ranks) + 1):
        counts, _, ms = _refined(profiles, balance(costs, v * ranks, transfer=_transfer_ms(profiles)), devices,
                                 microbatches, schedule, ranks)
        if best is None or ms < best[0] - 1e-9:
            best = (ms, v, counts)
    assert best is not None
    return best[2], [f"stages=auto, {schedule}: {best[1]} stage(s) per pipeline rank, the fastest simulated step "
                     f"of 1 to {MAX_PER_RANK}"]


def _refined(profiles: Sequence[BlockProfile], counts: list[int], devices: Sequence[torch.device],
             microbatches: int, schedule: str, ranks: int) -> tuple[list[int], list[str], float]:
    """A per-rank schedule's cut: the balanced ``counts`` refined on the simulated step (:func:`refine`), its
    note and its simulated ms (each cut simulated once)."""
    simulated: dict[tuple[int, ...], float] = {}

    def step_ms(c: Sequence[int]) -> float:
        key = tuple(c)
        if key not in simulated:
            simulated[key] = simulate_plan(profiles, c, devices, microbatches, schedule, ranks).makespan
        return simulated[key]

    out = refine(counts, step_ms)
    if out == counts:
        return out, [], step_ms(out)
    return out, [f"{schedule}: the balanced cut {counts} moved to {out}, {step_ms(counts):.1f} -> "
                 f"{step_ms(out):.1f} ms per simulated step (each rank runs several stages: its sum sets the step)"], \
        step_ms(out)


def untimed_microbatches(stages: int, batch: int) -> int:
    """``microbatches="auto"`` where no trials run (CPU, several devices, pipeline ranks).

    One stage has nothing to overlap, so one microbatch (the plain step);
    several stages take the most microbatches of :data:`AUTO_MICROBATCHES`
    the batch allows (the more microbatches, the smaller the pipeline bubble).
    """
    if stages == 1:
        return 1
    return max(m for m in AUTO_MICROBATCHES if microbatch.count(max(batch, 1), m) == m)


def build_plan(
    profiles: Sequence[BlockProfile],
    decision: Decision,
    *,
    microbatch_size: int,
    layout: str = "",
    contract: str = "",
) -> Plan:
    """The printable plan of a settled ``decision``: stages with their blocks, places and predicted costs."""
    counts, microbatches, places, ranks = decision.counts, decision.microbatches, decision.places, decision.pp
    schedule = decision.schedule
    sim = _simulate_placed(profiles, counts, places, microbatches, schedule, ranks)
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
        batchnorm=decision.settled.batchnorm,
        predicted_step_ms=sim.makespan,
        source=decision.source,
        notes=decision.notes,
        layout=layout,
        contract=contract,
        trials=decision.trials,
        trial_baseline_ms=decision.bar_ms,
        trial_chosen=decision.chosen,
        compiled=decision.compiled,
        channels_last=decision.channels_last,
        kernels=decision.kernels,
        bar=decision.bar,
        planning_s=decision.planning_s,
        hint=decision.hint,
    )
