"""Thread counts for concurrent CPU stages: profile, model, joint cut, hill climbing on measured steps.

One intra-op team over all cores scales sub-linearly (serial parts, memory
bandwidth, small layers), so on a many-core CPU stages that run at the same
time on disjoint cores, each with the count it uses best, can beat one stage
on all cores. Per block the forward and backward times are measured at a few
thread counts (1, 2, 4, ... up to the cores) and fitted by least squares to
Amdahl's form ``t(p) = a + b / p``. The cut and the per-stage counts are then
chosen jointly by a dynamic program over blocks and the core budget that
minimises the slowest stage, for each stage count; the schedule's simulated
step ranks those plans. Models are only a start: measured steps decide, by
hill climbing (move one core between two stages, or one block across a
boundary; keep a move only if measured faster by more than ``MIN_GAIN``)
and, for ``stages="auto"``, against the one-stage plan on all cores (plain
microbatching), which a concurrent plan must beat by ``MIN_GAIN`` as well.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np
import torch

from ..device import available_cores
from ..options import ThreadsSpec
from ..pipeline.cpu_lane import CpuWorker
from ..pipeline.deps import action_ms
from ..pipeline.schedule import get_schedule
from ..pipeline.simulate import simulate
from .blocks import Block
from .profile import BlockProfile, profile_blocks

__all__ = [
    "ThreadCurve", "CpuPlan", "CpuChoice", "profile_counts", "fit_amdahl",
    "profile_threads", "split_threads", "predict", "neighbours", "choose_cpu_plan", "concurrent_cpu", "plan_cpu",
    "step_ms", "at_threads", "concurrent_times", "MIN_GAIN",
]

MIN_GAIN = 0.03  # a move or a concurrent plan must be measured this much faster (more than step-to-step noise)
MAX_STAGES = 4
CLIMB_TRIALS = 6  # measured neighbours per plan, at most
TRIAL_STEPS = 1  # timed steps per trial, after one warm-up step (a CPU step of a real model takes seconds)


def concurrent_cpu(threads: ThreadsSpec, devices: Sequence[torch.device], world: int) -> bool:
    """Do the stages run concurrently on CPU workers? ``threads`` set, on a CPU, in one process (else an error)."""
    if threads is None:
        return False
    if any(torch.device(d).type != "cpu" for d in devices):
        raise ValueError(f"threads={threads!r} runs CPU stages concurrently, but the stages go to {list(devices)}: "
                         f"pass threads=None on other devices")
    if world > 1:
        raise ValueError(f"threads={threads!r} runs CPU stages concurrently in one process, but this is one of "
                         f"{world} processes (torch.distributed): pass threads=None, or distributed=False")
    return True


def step_ms(run: Callable[[], object], steps: int = TRIAL_STEPS, warmup: bool = True) -> float:
    """ms of one call of ``run``: the fastest of ``steps`` timed calls (after a warm-up call).

    The fastest, because other load on the machine only ever slows a call down.
    """
    if warmup:
        run()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def profile_counts(cores: int) -> list[int]:
    """Thread counts to profile at: powers of two below ``cores``, and ``cores`` itself."""
    out = [1 << i for i in range(max(cores, 1).bit_length()) if 1 << i < cores]
    return out + [cores]


def fit_amdahl(threads: Sequence[int], ms: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``t(p) = a + b / p`` with ``a, b >= 0``."""
    p, t = np.asarray(threads, dtype=float), np.asarray(ms, dtype=float)
    if len(set(threads)) < 2:
        return 0.0, float(np.mean(t * p))
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(p), 1 / p], axis=1), t, rcond=None)
    if b < 0:
        return float(np.mean(t)), 0.0
    if a < 0:
        return 0.0, float(np.sum(t / p) / np.sum(1 / p**2))
    return float(a), float(b)


@dataclass(frozen=True)
class ThreadCurve:
    """One block's forward and backward ms against its thread count p: ``a + b / p`` each."""

    name: str
    forward: tuple[float, float]
    backward: tuple[float, float]

    def forward_ms(self, p: int) -> float:
        return self.forward[0] + self.forward[1] / p

    def backward_ms(self, p: int) -> float:
        return self.backward[0] + self.backward[1] / p

    def cost_ms(self, p: int) -> float:
        return self.forward_ms(p) + self.backward_ms(p)


def profile_threads(blocks: Sequence[Block], sample: torch.Tensor, cores: Sequence[int] | None = None,
                    counts: Sequence[int] | None = None, copy_input: Sequence[bool] | None = None,
                    repeats: int = 3, known: dict[int, Sequence[BlockProfile]] | None = None) -> list[ThreadCurve]:
    """Each block's time at a few thread counts (on a worker pinned to that many cores), fitted per block.

    ``known``: profiles already measured at some thread counts (the host's), not measured again.
    """
    cores = list(cores) if cores is not None else available_cores()
    counts = list(counts) if counts is not None else profile_counts(len(cores))
    runs = []
    for p in counts:
        if known is not None and p in known:
            runs.append(list(known[p]))
            continue
        worker = CpuWorker(p, cores[:p] if p <= len(cores) else None, name=f"profile{p}")
        try:
            runs.append(worker.call(lambda: profile_blocks(blocks, sample, warmup=1, repeats=repeats,  # noqa: B023
                                                           progress=False, copy_input=copy_input)))
        finally:
            worker.close()
    curves = []
    for i, block in enumerate(blocks):
        fwd = fit_amdahl(counts, [r[i].forward_ms for r in runs])
        bwd = fit_amdahl(counts, [r[i].backward_ms for r in runs])
        curves.append(ThreadCurve(block.name, fwd, bwd))
    return curves


def split_threads(curves: Sequence[ThreadCurve], stages: int, cores: int, fixed: Sequence[int] | None = None) \
        -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The cut (blocks per stage) and threads per stage minimising the slowest stage, with sum(threads) <= cores.

    A dynamic program over (blocks done, stages made, cores used); stage cost at
    p threads is the sum of its blocks' ``a`` plus the sum of their ``b`` over p.
    ``fixed``: the threads are given per stage, only the cut is chosen.
    """
    n = len(curves)
    if fixed is not None:
        cores = max(cores, sum(fixed))
    if not 1 <= stages <= min(n, cores):
        raise ValueError(f"cannot run {stages} concurrent stage(s) of {n} block(s) on {cores} core(s): each stage "
                         f"needs a block and a core; pass stages <= {min(n, cores)}, or threads=None (stages in order)")
    a = np.concatenate([[0.0], np.cumsum([c.forward[0] + c.backward[0] for c in curves])])
    b = np.concatenate([[0.0], np.cumsum([c.forward[1] + c.backward[1] for c in curves])])
    inf = math.inf
    # best[s][j][c]: slowest stage of the first j blocks in s stages on at most c cores; arg: (i, p) of the last
    best = [[[inf] * (cores + 1) for _ in range(n + 1)] for _ in range(stages + 1)]
    arg: dict[tuple[int, int, int], tuple[int, int]] = {}
    for c in range(cores + 1):
        best[0][0][c] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for c in range(s, cores + 1):
                for i in range(s - 1, j):
                    for p in [fixed[s - 1]] if fixed is not None else range(1, c - (s - 1) + 1):
                        prev = best[s - 1][i][c - p] if p <= c else inf
                        if prev == inf:
                            continue
                        v = max(prev, a[j] - a[i] + (b[j] - b[i]) / p)
                        if v < best[s][j][c] - 1e-12:
                            best[s][j][c] = v
                            arg[(s, j, c)] = (i, p)
    counts, threads, j, c = [], [], n, cores
    for s in range(stages, 0, -1):
        i, p = arg[(s, j, c)]
        counts.append(j - i)
        threads.append(p)
        j, c = i, c - p
    return tuple(reversed(counts)), tuple(reversed(threads))


@dataclass(frozen=True)
class CpuPlan:
    """A CPU plan: blocks and threads per stage (``threads=None``: one stage on the host's own threads)."""

    counts: tuple[int, ...]
    threads: tuple[int, ...] | None
    microbatches: int
    predicted_ms: float = field(default=0.0, compare=False)  # the model's step ms (not part of the plan's identity)

    @property
    def label(self) -> str:
        if self.threads is None:
            return f"{len(self.counts)}x{self.microbatches} (host threads)"
        cut, t = "+".join(map(str, self.counts)), "+".join(map(str, self.threads))
        return f"{len(self.counts)}x{self.microbatches} (blocks {cut}, threads {t})"


def _stage_ms(curves: Sequence[ThreadCurve], counts: Sequence[int], threads: Sequence[int], scale: float) \
        -> tuple[list[float], list[float]]:
    fwd, bwd, start = [], [], 0
    for k, p in zip(counts, threads):
        group = curves[start : start + k]
        fwd.append(scale * sum(c.forward_ms(p) for c in group))
        bwd.append(scale * sum(c.backward_ms(p) for c in group))
        start += k
    return fwd, bwd


def predict(curves: Sequence[ThreadCurve], plan: CpuPlan, schedule: str, host_threads: int,
            scale: float = 1.0) -> tuple[float, list[float]]:
    """Simulated step ms of ``plan`` and its per-stage forward+backward ms per microbatch.

    ``scale``: microbatch size over the profiled one (block times taken as proportional to it).
    """
    threads = plan.threads if plan.threads is not None else (host_threads,) * len(plan.counts)
    fwd, bwd = _stage_ms(curves, plan.counts, threads, scale)
    concurrent = plan.threads is not None
    sim = simulate(get_schedule(schedule)(len(plan.counts), plan.microbatches),
                   duration=lambda s, act: action_ms(act.kind, fwd[s], bwd[s]),
                   resources=None if concurrent else [0] * len(plan.counts))
    return sim.makespan, [f + b for f, b in zip(fwd, bwd)]


def neighbours(plan: CpuPlan, cores: int) -> list[CpuPlan]:
    """Plans one move away: one core from one stage to another, or one block across one boundary."""
    if plan.threads is None:
        return []
    out = []
    t, k = list(plan.threads), list(plan.counts)
    for i in range(len(t)):
        if sum(t) < cores:
            out.append(replace(plan, threads=tuple(t[:i] + [t[i] + 1] + t[i + 1 :])))
        for j in range(len(t)):
            if i != j and t[i] > 1:
                moved = list(t)
                moved[i] -= 1
                moved[j] += 1
                out.append(replace(plan, threads=tuple(moved)))
    for s in range(len(k) - 1):
        for d in (-1, 1):
            moved = list(k)
            moved[s] += d
            moved[s + 1] -= d
            if min(moved) >= 1:
                out.append(replace(plan, counts=tuple(moved)))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class CpuChoice:
    """The chosen CPU plan, every measured trial (label, ms per step) and notes for the plan table."""

    plan: CpuPlan
    trials: tuple[tuple[str, float], ...]
    notes: tuple[str, ...]
    measured_ms: float | None = None


def choose_cpu_plan(
    curves: Sequence[ThreadCurve],
    *,
    cores: int,
    host_threads: int,
    microbatches: Sequence[int],
    schedule: str,
    measure: Callable[[CpuPlan], float] | None,
    sizes: Callable[[int], float] = lambda m: 1.0,
    stages: int | Sequence[int] | None = None,
    max_stages: int = MAX_STAGES,
    climb_trials: int = CLIMB_TRIALS,
) -> CpuChoice:
    """Choose cut, threads and microbatches: modelled candidates, then measured steps decide.

    ``stages=None`` (``"auto"``) also considers one stage on the host's own
    threads for every microbatch count; an int fixes the stage count, a list
    the cut (then only threads are chosen). ``sizes(m)``: microbatch size at
    m microbatches over the profiled one. ``measure(plan)``: ms per step of a
    short trial; without it the modelled best is taken.
    """
    cands: list[CpuPlan] = []
    for m in microbatches:
        scale = sizes(m)

        def rate(p: CpuPlan) -> CpuPlan:
            return replace(p, predicted_ms=predict(curves, p, schedule, host_threads, scale)[0])  # noqa: B023

        if isinstance(stages, (list, tuple)):
            cands += [rate(_best_threads(curves, tuple(stages), m, cores, schedule, host_threads, scale))]
            continue
        ks = [stages] if isinstance(stages, int) else range(1, min(len(curves), max_stages, cores) + 1)
        if stages is None:
            cands.append(rate(CpuPlan((len(curves),), None, m)))
        for s in ks:
            if stages is None and (s == 1 or s > m):
                continue  # the host plan is the one-stage plan; more stages than microbatches never fill
            counts, threads = split_threads(curves, s, cores)
            cands.append(rate(CpuPlan(counts, threads, m)))
    if measure is None:
        best = min(cands, key=lambda p: p.predicted_ms)
        return CpuChoice(best, (), (f"threads chosen by the model only (no trial steps): {best.label}",))
    trials: dict[CpuPlan, float] = {}

    def timed(p: CpuPlan) -> float:
        if p not in trials:
            trials[p] = float(measure(p))
        return trials[p]

    hosts = [p for p in cands if p.threads is None]
    for p in hosts:
        timed(p)
    # The model's best plan of each stage count is timed (the model ranks plans of one stage count more
    # reliably than it ranks stage counts); the climb starts from the fastest of them.
    per_stages: dict[int, CpuPlan] = {}
    for p in sorted((p for p in cands if p.threads is not None), key=lambda p: p.predicted_ms):
        per_stages.setdefault(len(p.counts), p)
    best: CpuPlan | None = None
    if per_stages:
        best = min(per_stages.values(), key=timed)
        best = _climb(best, timed, curves, cores, schedule, host_threads, sizes(best.microbatches), climb_trials)
    chosen = min(trials, key=trials.__getitem__) if best is None else best
    notes = []
    if hosts:
        host = min(hosts, key=trials.__getitem__)
        if best is not None:  # time both finalists once more: the first trials of a process run slower
            for p in (host, best):
                trials[p] = min(trials[p], float(measure(p)))
        if best is None or trials[best] > trials[host] * (1 - MIN_GAIN):
            chosen = host
            if best is not None:
                notes.append(f"no concurrent plan beat one stage on the host's threads by {MIN_GAIN:.0%} in trials")
    summary = ", ".join(f"{p.label}: {ms:.1f} ms" for p, ms in trials.items())
    notes.insert(0, f"CPU plans timed in trial steps (stages x microbatches: {summary})")
    notes.append(f"chose {chosen.label} ({trials[chosen]:.1f} ms per step, predicted {chosen.predicted_ms:.1f})")
    return CpuChoice(chosen, tuple((p.label, ms) for p, ms in trials.items()), tuple(notes), trials[chosen])


def _best_threads(curves: Sequence[ThreadCurve], counts: tuple[int, ...], m: int, cores: int, schedule: str,
                  host_threads: int, scale: float) -> CpuPlan:
    """Threads for a given cut: start from an even split, then move cores while the model improves."""
    s = len(counts)
    if s > cores:
        raise ValueError(f"{s} concurrent stages need at least {s} cores; this process may use {cores}")
    plan = CpuPlan(counts, tuple(cores // s + (1 if i < cores % s else 0) for i in range(s)), m)

    def ms(p: CpuPlan) -> float:
        return predict(curves, p, schedule, host_threads, scale)[0]

    while True:
        moves = [q for q in neighbours(plan, cores) if q.counts == counts]
        nxt = min(moves, key=ms, default=None)
        if nxt is None or ms(nxt) >= ms(plan) - 1e-9:
            return plan
        plan = nxt


def _climb(plan: CpuPlan, timed: Callable[[CpuPlan], float], curves: Sequence[ThreadCurve], cores: int,
           schedule: str, host_threads: int, scale: float, budget: int) -> CpuPlan:
    """Hill climbing on measured steps: try neighbours in modelled order, keep one measured MIN_GAIN faster."""
    spent = 0
    while spent < budget:
        ranked = sorted(neighbours(plan, cores),
                        key=lambda q: predict(curves, q, schedule, host_threads, scale)[0])
        for q in ranked:
            if spent >= budget:
                return plan
            spent += 1
            if timed(q) < timed(plan) * (1 - MIN_GAIN):
                plan = replace(q, predicted_ms=predict(curves, q, schedule, host_threads, scale)[0])
                break
        else:
            return plan
    return plan


def plan_cpu(
    blocks: Sequence[Block],
    sample: torch.Tensor,
    *,
    threads: ThreadsSpec,
    stages: object,
    microbatches: Sequence[int],
    sizes: Callable[[int], float],
    schedule: str,
    measure: Callable[[CpuPlan], float] | None,
    copy_input: Sequence[bool] | None = None,
    host_profiles: Sequence[BlockProfile] | None = None,
    profiled: bool = True,
) -> tuple[CpuChoice, list[ThreadCurve]]:
    """Profile ``blocks`` at a few thread counts and choose the CPU plan for the ``threads`` option.

    ``"auto"``: :func:`choose_cpu_plan` (``stages="auto"`` includes one stage
    on the host's threads). A list: those threads per stage, the cut chosen
    by the model for them (or given by ``stages``). ``host_profiles``: the
    blocks measured on the host's threads (reused as that thread count's
    point); ``profiled=False`` (the cost model, ``profile=False``): they are
    estimates and are taken to scale perfectly with threads, nothing is timed.
    """
    cores = available_cores()
    counts = profile_counts(len(cores)) if threads == "auto" else sorted(set(threads))  # type: ignore[arg-type]
    host = torch.get_num_threads()
    if not profiled and host_profiles is not None:
        curves = [ThreadCurve(p.name, (0.0, p.forward_ms * host), (0.0, p.backward_ms * host)) for p in host_profiles]
    else:
        known = {host: host_profiles} if host_profiles is not None else None
        curves = profile_threads(blocks, sample, cores, counts, copy_input, known=known)
    given = list(stages) if isinstance(stages, (list, tuple)) else stages if isinstance(stages, int) else None
    if threads == "auto":
        choice = choose_cpu_plan(curves, cores=len(cores), host_threads=host, microbatches=microbatches,
                                 schedule=schedule, measure=measure, sizes=sizes, stages=given)
        return choice, curves
    fixed = tuple(threads)  # type: ignore[arg-type]
    cut = tuple(given) if isinstance(given, list) else split_threads(curves, len(fixed), len(cores), fixed)[0]
    cands = [CpuPlan(cut, fixed, m) for m in microbatches]
    cands = [replace(p, predicted_ms=predict(curves, p, schedule, host, sizes(p.microbatches))[0]) for p in cands]
    if measure is None or len(cands) == 1:
        best = min(cands, key=lambda p: p.predicted_ms)
        return CpuChoice(best, (), (f"threads given: {best.label}",)), curves
    timed = {p: float(measure(p)) for p in cands}
    best = min(timed, key=timed.__getitem__)
    summary = ", ".join(f"{p.label}: {ms:.1f} ms" for p, ms in timed.items())
    return CpuChoice(best, tuple((p.label, ms) for p, ms in timed.items()),
                     (f"threads given; microbatches timed in trial steps ({summary})",), timed[best]), curves


def at_threads(profiles: Sequence[BlockProfile], curves: Sequence[ThreadCurve], plan: CpuPlan,
               scale: float = 1.0) -> list[BlockProfile]:
    """``profiles`` with each block's times at its stage's planned threads (unchanged for a host plan)."""
    if plan.threads is None:
        return list(profiles)
    out, start = [], 0
    for k, p in zip(plan.counts, plan.threads):
        for prof, curve in zip(profiles[start : start + k], curves[start : start + k]):
            out.append(replace(prof, forward_ms=scale * curve.forward_ms(p), backward_ms=scale * curve.backward_ms(p)))
        start += k
    return out


def concurrent_times(profiles: Sequence[BlockProfile], counts: Sequence[int], schedule: str, microbatches: int) \
        -> tuple[list[float], float]:
    """Per-stage forward+backward ms and the simulated step ms of concurrent stages (each its own resource)."""
    fwd, bwd, start = [], [], 0
    for k in counts:
        fwd.append(sum(p.forward_ms for p in profiles[start : start + k]))
        bwd.append(sum(p.backward_ms for p in profiles[start : start + k]))
        start += k
    sim = simulate(get_schedule(schedule)(len(counts), microbatches),
                   duration=lambda s, act: action_ms(act.kind, fwd[s], bwd[s]))
    return [f + b for f, b in zip(fwd, bwd)], sim.makespan
