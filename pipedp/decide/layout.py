"""The layout of a world of ranks: data parallel x pipeline, each predicted from block costs and links.

A world of ``R`` ranks trains as ``dp`` replicas of a ``pp``-stage pipeline
(``dp * pp = R``). Which layout is fastest depends on the model (how its
parameters and activations compare with its compute), the batch and the
links: data parallelism moves every parameter's gradient each step, a
pipeline moves activations and idles in its bubble. The prediction:

* compute: each stage's forward and backward, the sums of its profiled
  blocks at the microbatch's samples (:class:`BlockCosts`: through two
  profiled sizes where there are two, a fixed part per call plus a part per
  sample, each profiled size predicted as measured unless more samples ran
  faster, which is noise; else in proportion to the samples), run through
  the schedule
  simulator (:mod:`pipedp.pipeline.simulate`) as the executor would
  issue them, every stage on its own rank;
* point-to-point: each cut's activation (and its gradient, back) crosses in
  :func:`~pipedp.decide.links.p2p_s`, one message at a time per direction,
  while both stages go on computing (receives are posted ahead:
  :mod:`pipedp.pipeline.ahead`); the receiver starts when it has arrived;
* gradient sync: each stage's gradients are ring-all-reduced over its ``dp``
  replicas in buckets (in the layout's ``reduce_dtype``: a 16-bit reduce
  moves half the bytes; the casts to and from it are not predicted, the
  trials time them), overlapped with the stage's last backward as the
  engine's gradient sync does (buckets become ready through that backward;
  the last one starts when it ends);
* update: each stage's optimizer update (its share, by parameter bytes, of
  the profiled update of the whole model) after its sync.

The step is the latest stage's end. Not modelled (stated with every
forecast): contention between ranks that share a host beyond what the
profile saw, compute that is not linear in the samples (small microbatches
on a GPU), host overhead beyond a constant per action.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..partition.balance import balance, refine, stage_costs
from ..partition.profile import BlockProfile
from ..pipeline.microbatch import MIN_SAMPLES
from ..pipeline.deps import ACCUMULATES
from ..pipeline.orders import PER_RANK, placement, simulate_schedule
from .cut import ACTION_OVERHEAD_MS, action_durations, stage_times
from .links import Link, allreduce_s, p2p_s

__all__ = ["BlockCosts", "Layout", "Prediction", "predict", "layouts", "hop_aware_cut", "rank", "ASSUMPTIONS",
           "INTERLEAVED_PER_RANK"]

# Stages per rank of an interleaved layout: two halve 1F1B's fill and drain for twice the messages over the hop
# (more would cut a ResNet's few blocks thinner than the layouts' hop costs repay).
INTERLEAVED_PER_RANK = 2

ASSUMPTIONS = (
    "a block's time at any microbatch size is a fixed part plus a part per sample, fitted to its two profiled sizes "
    "(where the fit's fixed part is negative, sizes outside the two in proportion to the samples from the nearer "
    "one; in proportion to the samples where one size was profiled)",
    "every rank computes as fast as the device the blocks were profiled on (blocks scaled to the whole model's step)",
    "gradients are ring-all-reduced per stage in buckets, overlapped with the stage's last backward (a rank's "
    "stages one after another over its link)",
    "the optimizer's update takes the profiled time (SGD with momentum), split over the stages by their parameters",
)


@dataclass(frozen=True)
class BlockCosts:
    """The model's blocks profiled on ``batch`` samples, and optionally again on ``small_batch`` samples.

    Two sizes give each block's fixed cost per call (kernel launches, small
    tensors' poorer efficiency), which is what makes many small microbatches
    slower than their samples alone say.
    """

    blocks: tuple[BlockProfile, ...]
    batch: int
    small: tuple[BlockProfile, ...] = ()
    small_batch: int = 0

    def __post_init__(self) -> None:
        if self.small and (len(self.small) != len(self.blocks) or not 0 < self.small_batch < self.batch):
            raise ValueError(f"a second profile needs the same {len(self.blocks)} blocks on fewer samples than "
                             f"{self.batch}; got {len(self.small)} blocks on {self.small_batch}")

    def at(self, samples: float) -> list[BlockProfile]:
        """Every block's costs on a microbatch of ``samples``."""
        r = samples / self.batch
        if not self.small:
            return [replace(b, forward_ms=b.forward_ms * r, backward_ms=b.backward_ms * r,
                            output_bytes=round(b.output_bytes * r), saved_bytes=round(b.saved_bytes * r))
                    for b in self.blocks]
        out = []
        for big, lit in zip(self.blocks, self.small):
            out.append(replace(big, forward_ms=self._affine(big.forward_ms, lit.forward_ms, samples),
                               backward_ms=self._affine(big.backward_ms, lit.backward_ms, samples),
                               output_bytes=round(big.output_bytes * r), saved_bytes=round(big.saved_bytes * r)))
        return out

    def _affine(self, big: float, small: float, samples: float) -> float:
        # t(n) = fixed + n * per_sample through both sizes, so each profiled size is predicted as measured.
        per = (big - small) / (self.batch - self.small_batch)
        if per <= 0:  # more samples ran no slower: noise, the faster figure holds
            return min(big, small)
        fixed = big - per * self.batch
        if fixed >= 0 or self.small_batch <= samples <= self.batch:
            return fixed + per * samples
        # Time growing faster than the samples (a working set falling out of cache: ResNet-50's blocks on a
        # 2-core EPYC took 6.1x the time on 4x the samples) is real between the sizes; outside them the line
        # would reach negative times below the smaller and overstate the growth above the larger, so there
        # the nearer size scales in proportion.
        n, t = (self.small_batch, small) if samples < self.small_batch else (self.batch, big)
        return t * samples / n


@dataclass(frozen=True)
class Layout:
    """``dp`` replicas of a pipeline of ``len(counts)`` stages (blocks per stage), ``microbatches`` each;
    ``reduce_dtype``: the dtype the gradients are all-reduced in (None: their own); ``per_rank``: stages per
    pipeline rank (several only where the schedule interleaves them)."""

    dp: int
    counts: tuple[int, ...]
    microbatches: int
    schedule: str = "1f1b"
    reduce_dtype: torch.dtype | None = None
    per_rank: int = 1

    @property
    def pp(self) -> int:
        return len(self.counts) // self.per_rank

    @property
    def label(self) -> str:
        sched = self.schedule + (f" v{self.per_rank}" if self.per_rank > 1 else "")
        tail = f" x {self.microbatches} mb" + (f" {sched}" if self.pp > 1 else "")
        wire = f", {str(self.reduce_dtype).removeprefix('torch.')} reduce" if self.reduce_dtype is not None else ""
        return f"dp {self.dp} x pp {self.pp}" + (tail if self.pp > 1 or self.microbatches > 1 else "") + wire

    @property
    def wire_share(self) -> float:
        """The share of fp32 gradient bytes its all-reduce moves (parameters are taken to be fp32)."""
        return 1.0 if self.reduce_dtype is None else min(1.0, self.reduce_dtype.itemsize / 4)


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step and where its time goes (milliseconds)."""

    layout: Layout
    step_ms: float
    compute_ms: float  # the simulated pipeline, point-to-point included, without the gradient sync
    allreduce_ms: float  # the slowest stage's gradient all-reduce, whole
    exposed_ms: float  # the most of any stage's sync not hidden behind its backward
    p2p_ms: float  # one microbatch's activation and gradient over the slowest cut
    bubble: float  # idle share of the stages within the compute
    allreduce_bytes: float = 0.0  # what one rank's all-reduce link carries a step (the stage with most parameters)
    p2p_bytes: float = 0.0  # what the busiest cut carries a step: activations forward, their gradients back

    def moves(self) -> str:
        """What this layout moves over its links each step, in MB (for the layout table)."""
        parts = [f"all-reduce {self.allreduce_bytes / 1e6:.0f} MB"] if self.allreduce_bytes else []
        parts += [f"stage hop {self.p2p_bytes / 1e6:.0f} MB"] if self.p2p_bytes else []
        return ", ".join(parts) or "nothing"


def predict(costs: BlockCosts, layout: Layout, global_batch: int, link: Link, *, p2p: Link | None = None,
            update_ms: float = 0.0, bucket_bytes: float = 25 * 2**20,
            overhead_ms: float = ACTION_OVERHEAD_MS) -> Prediction:
    """The step of ``layout`` training ``global_batch`` samples over ``link``.

    ``p2p``: the link between pipeline ranks where it differs from the collectives' (a measured world);
    ``update_ms``: the optimizer update of the whole model on one device.
    """
    if any(k < 1 for k in layout.counts) or layout.dp < 1 or layout.microbatches < 1:
        raise ValueError(f"layout {layout.label}: every stage needs a block, dp and microbatches >= 1 "
                         f"(counts {list(layout.counts)})")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if sum(layout.counts) != len(costs.blocks):
        raise ValueError(f"layout {layout.label} cuts {sum(layout.counts)} blocks; the profile has "
                         f"{len(costs.blocks)}")
    if global_batch % layout.dp:
        raise ValueError(f"a global batch of {global_batch} does not split over dp={layout.dp} replicas: "
                         f"use a multiple of {layout.dp}")
    blocks = costs.at(global_batch / layout.dp / layout.microbatches)
    fwd, bwd = stage_times(blocks, layout.counts)
    n = len(layout.counts)
    ends = [sum(layout.counts[: s + 1]) - 1 for s in range(n)]
    worst_p2p = hop_bytes = 0.0
    cross = []  # per cut, one microbatch's activation (and its gradient back) over the hop
    for s in range(n - 1):  # every cut crosses ranks (an interleaved rank's stages are never neighbours)
        t = p2p_s(p2p or link, blocks[ends[s]].output_bytes) * 1e3
        cross.append(t)
        worst_p2p = max(worst_p2p, 2 * t)
        hop_bytes = max(hop_bytes, 2.0 * blocks[ends[s]].output_bytes * layout.microbatches)
    sim = simulate_schedule(layout.schedule, n, layout.microbatches, layout.pp,
                            duration=action_durations(fwd, bwd, overhead_ms),
                            transfer=lambda s, a: cross[s] if a.kind == "F" else cross[s - 1])
    last = {}
    for slot in sim.slots:
        if slot.action.kind in ACCUMULATES:
            last[slot.stage] = slot  # slots are in start order: the last one seen is the stage's last accumulation
    total = sum(b.param_bytes for b in blocks) or 1
    end, sync, exposed, carried = sim.makespan, 0.0, 0.0, 0.0
    per_stage = [sum(b.param_bytes for b in blocks[e - k + 1 : e + 1]) for e, k in zip(ends, layout.counts)]
    rank_of = placement(layout.schedule, n, layout.pp)
    for r in range(layout.pp):  # a rank's stages share its link: their gradients go over it one after another
        mine = [s for s, q in enumerate(rank_of) if q == r]
        params = sum(per_stage[s] for s in mine)
        wire = params * layout.wire_share  # the buckets are packed at the gradients' size, cast to travel
        carried = max(carried, 2.0 * (layout.dp - 1) / layout.dp * wire)
        buckets = max(1, math.ceil(params / bucket_bytes))
        ms = allreduce_s(link, wire, layout.dp, buckets) * 1e3
        sync = max(sync, ms)
        b_start, b_end = min(last[s].start for s in mine), max(last[s].end for s in mine)
        synced = max(b_end, b_end + ms / buckets, b_start + ms) if ms > 0 else b_end
        exposed = max(exposed, synced - b_end)
        end = max(end, synced + update_ms * params / total)
    return Prediction(layout, end, sim.makespan, sync, exposed, worst_p2p, sim.bubble, carried, hop_bytes)


def layouts(blocks: Sequence[BlockProfile] | BlockCosts, ranks: int, global_batch: int,
            microbatches: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = ("1f1b",), *,
            hop: Link | None = None, profile_batch: int | None = None,
            reduce_dtypes: Sequence[torch.dtype | None] = (None,)) -> list[Layout]:
    """Every layout of ``ranks`` ranks the engine can run on ``global_batch``: each ``pp`` dividing ``ranks``.

    Each pipeline is cut where the profiled costs balance; with ``hop`` (the
    link between stages, its blocks profiled on ``profile_batch`` samples)
    also where they balance counting what each cut sends over it, when that
    is another cut: over a slow hop a cut at a smaller activation can beat
    the balanced one. Each microbatch count is cut on the blocks' costs at
    its own microbatch (given :class:`BlockCosts` of two sizes, a block's
    fixed cost per call weighs more on fewer samples, which moves the
    balanced cut; blocks of one size scale in proportion). Replicas and
    microbatches hold at least two samples (a BatchNorm needs them); one
    stage is never microbatched (with compute linear in the samples it only
    adds overhead). An interleaved schedule cuts each pipeline into
    :data:`INTERLEAVED_PER_RANK` stages per rank, where the microbatches go
    round the ranks. Every layout with replicas comes once per
    ``reduce_dtypes`` (the all-reduce's dtypes the user allows); one without
    replicas reduces nothing.
    """
    if not isinstance(blocks, BlockCosts):  # one profiled size: every microbatch's costs in proportion
        blocks = BlockCosts(tuple(blocks), profile_batch or global_batch // ranks)
    profiled = blocks.blocks
    out = []
    for pp in range(1, min(ranks, len(profiled)) + 1):
        if ranks % pp or global_batch % (ranks // pp):
            continue
        dp = ranks // pp
        per_replica = global_batch // dp
        for m in (microbatches if pp > 1 else (1,)):
            if m > per_replica // MIN_SAMPLES:
                continue
            for sched in (schedules if pp > 1 else ("1f1b",)):
                # Interleaved: INTERLEAVED_PER_RANK stages a rank (one is 1F1B), its forwards going round the
                # ranks in groups of pp.
                v = INTERLEAVED_PER_RANK if sched in PER_RANK else 1
                if v > 1 and (m % pp or pp * v > len(profiled)):
                    continue
                if pp == 1:
                    cuts = [(len(profiled),)]
                else:  # the costs of this count's microbatch, each cut as it runs
                    at = blocks.at(per_replica / m)
                    cuts = [tuple(balance([b.cost_ms for b in at], pp * v))]
                    cuts += [hop_aware_cut(at, pp * v, hop, 1.0)] if hop is not None else []
                    cuts += [rank_balanced_cut(at, cuts[0], placement(sched, pp * v, pp))] if v > 1 else []
                for counts in dict.fromkeys(cuts):
                    for wire in (reduce_dtypes if dp > 1 else (None,)):
                        out.append(Layout(dp, counts, m, sched, wire, per_rank=v))
    return out


def rank_balanced_cut(blocks: Sequence[BlockProfile], counts: Sequence[int], ranks: Sequence[int]
                      ) -> tuple[int, ...]:
    """``counts`` refined until the busiest rank's stages (``ranks[s]``: stage s's rank) cost the least a move of
    one cut point can give: where a rank runs several stages, their sum sets its share of the step."""
    costs = [b.cost_ms for b in blocks]

    def loads(c: Sequence[int]) -> list[float]:
        load: dict[int, float] = {}
        for r, ms in zip(ranks, stage_costs(costs, c)):
            load[r] = load.get(r, 0.0) + ms
        return sorted(load.values(), reverse=True)

    # The busiest rank's load, ties broken by the next busiest (a move that relieves one of two tied ranks counts).
    return tuple(refine(counts, loads))


def hop_aware_cut(blocks: Sequence[BlockProfile], pp: int, hop: Link, scale: float) -> tuple[int, ...]:
    """The cut balancing each stage's work plus what its cut sends over ``hop`` (an activation forward, its
    gradient back), the profiled blocks' times and outputs scaled by ``scale`` to a replica's samples."""
    costs = [b.cost_ms * scale for b in blocks]
    transfer = [2 * b.output_bytes * scale / hop.bytes_per_s * 1e3 for b in blocks[:-1]]
    return tuple(balance(costs, pp, transfer=transfer))


def rank(costs: BlockCosts, ranks: int, global_batch: int, link: Link, *, p2p: Link | None = None,
         update_ms: float = 0.0, microbatches: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = ("1f1b",),
         bucket_bytes: float = 25 * 2**20, overhead_ms: float = ACTION_OVERHEAD_MS,
         reduce_dtypes: Sequence[torch.dtype | None] = (None,)) -> list[Prediction]:
    """Every layout of :func:`layouts`, predicted, fastest first."""
    preds = [predict(costs, lay, global_batch, link, p2p=p2p, update_ms=update_ms, bucket_bytes=bucket_bytes,
                     overhead_ms=overhead_ms)
             for lay in layouts(costs, ranks, global_batch, microbatches, schedules, hop=p2p or link,
                                reduce_dtypes=reduce_dtypes)]
    return sorted(preds, key=lambda p: p.step_ms)
