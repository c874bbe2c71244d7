"""``pp="auto"``: the world's layout (data parallel x pipeline) chosen by prediction, then by timing the best few.

Which layout of a world is fastest depends on the model, the batch and the
links, and a prediction alone misses where the machine does what the model
does not say (contention of ranks sharing a host, a collective slower than
its probe). So, collectively over the world, when the engine is made:

1. every rank profiles the blocks on its share of the global batch, all at
   once, as they will train (rank 0's profile is the one used);
2. the links are probed: ring all-reduce over the world, point-to-point
   between neighbours (:mod:`pipedp.decide.probe`);
3. rank 0 predicts every layout (:func:`pipedp.decide.layout.rank`) and all
   ranks take its list;
4. the best few predictions (:func:`finalists`) are built and timed for real
   (a trial: one engine on a copy of the model; the slowest rank's median
   window), while the planning budget lasts. A timing decides only beside
   another, so none is taken where there is one finalist or where two
   trials (at their predicted steps) would not fit the budget after the
   profile: then the prediction decides (on a 2-core CPU one ResNet-50
   trial is 3% of a 10-minute run); where two trials of their windows would
   not fit but two of fewer windows would, each is timed in fewer;
5. the fastest measured is the layout (:func:`pick`), the same on every rank
   since every figure it rests on is broadcast or all-reduced.

The trial itself is the caller's (:class:`Trial`): the engine builds it, so this
module knows layouts and clocks, not engines.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..device import sync_devices
from .layout import BlockCosts, Layout, Prediction, predict, rank
from .links import Link
from .probe import probe_allreduce, probe_p2p

__all__ = ["WorldRow", "WorldChoice", "Trial", "finalists", "pick", "choose_world", "window_ms", "FINALISTS",
           "WITHIN"]

FINALISTS = 3  # layouts timed for real at most
WITHHELD = "needs microbatches='auto'"
GAIN_NOTED = 1.05  # a withheld layout predicted this much faster than the choice is pointed out
WITHIN = 1.25  # a layout predicted more than 25% slower than the best is not timed
# The profile only ranks the layouts (the finalists are timed): one run per block, not 5, and no warm-up of its
# own after the whole step's (on a 2-core CPU the profile was two thirds of ResNet-50's planning, 59 of 87 s).
PROFILE_REPEATS = 1
PROFILE_WARMUP = 0


class Trial(Protocol):
    """Builds ``layout`` for real (collectively): one training step to call, and what ends the trial."""

    def __call__(self, layout: Layout) -> tuple[Callable[[], None], Callable[[], None]]: ...


@dataclass(frozen=True)
class WorldRow:
    """One layout: its prediction, and its measured step where it was timed (ms)."""

    prediction: Prediction
    measured_ms: float | None = None

    @property
    def layout(self) -> Layout:
        return self.prediction.layout


@dataclass(frozen=True)
class WorldChoice:
    """The layout ``pp="auto"`` chose, every layout it considered, and what it measured them on."""

    layout: Layout
    rows: tuple[WorldRow, ...]
    allreduce: Link
    p2p: Link
    planning_s: float
    notes: tuple[str, ...] = ()
    withheld: tuple[Prediction, ...] = ()  # layouts the user's options do not allow, predicted only
    # What the rows were predicted from (rank 0's profile), so any other layout can be predicted alike.
    costs: BlockCosts | None = None
    global_batch: int = 0
    update_ms: float = 0.0
    bucket_bytes: float = 25 * 2**20

    def predict(self, layout: Layout) -> Prediction:
        """``layout`` predicted as the rows were (the same profile and probed links): a layout the user runs
        instead, or another cut, put beside its measured step."""
        if self.costs is None:
            raise ValueError("this layout choice kept no profile to predict from")
        return predict(self.costs, layout, self.global_batch, self.allreduce, p2p=self.p2p, update_ms=self.update_ms,
                       bucket_bytes=self.bucket_bytes)

    def table(self) -> str:
        """Every layout with predicted and measured step and what it moves over the links, the chosen one marked."""
        lines = [f"pp=auto: {self.layout.label} (links: all-reduce {self.allreduce.bytes_per_s / 1e9:.2f} GB/s + "
                 f"{self.allreduce.alpha_s * 1e6:.0f} us, point-to-point {self.p2p.bytes_per_s / 1e9:.2f} GB/s + "
                 f"{self.p2p.alpha_s * 1e6:.0f} us; planning {self.planning_s:.1f} s)"]
        labels = [_cut_label(r.layout) for r in self.rows] + [_cut_label(p.layout) for p in self.withheld]
        w = max([32, *map(len, labels)])  # the widest label sets the column
        lines.append(f"  {'layout [blocks per stage]':<{w}} {'predicted ms':>12} {'measured ms':>12}  moves a step")
        for r in self.rows:
            measured = f"{r.measured_ms:12.2f}" if r.measured_ms is not None else f"{'-':>12}"
            mark = "  chosen" if r.layout == self.layout else ""
            lines.append(f"  {_cut_label(r.layout):<{w}} {r.prediction.step_ms:12.2f} {measured}  "
                         f"{r.prediction.moves()}{mark}")
        for p in self.withheld:
            lines.append(f"  {_cut_label(p.layout):<{w}} {p.step_ms:12.2f} {'not run':>12}  {p.moves()}  ({WITHHELD})")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _cut_label(layout: Layout) -> str:
    """The layout's label with its cut (blocks per stage) where it has one: two cuts of one layout may be ranked."""
    return layout.label + (f" [{'+'.join(map(str, layout.counts))}]" if layout.pp > 1 else "")


def finalists(predictions: Sequence[Prediction], k: int = FINALISTS, within: float = WITHIN) -> list[Prediction]:
    """The layouts worth timing: the ``k`` fastest predicted, none predicted slower than ``within`` x the best.

    Pure data parallelism (``pp == 1``) is always among them where it exists: it is the layout a user
    runs without pipedp, so a choice is never made without timing it.
    """
    ordered = sorted(predictions, key=lambda p: p.step_ms)
    if not ordered:
        return []
    best = ordered[0].step_ms
    out = [p for p in ordered if p.step_ms <= within * best][:k]
    dp = next((p for p in ordered if p.layout.pp == 1), None)
    if dp is not None and dp not in out:
        out = [*out[: k - 1], dp] if k > 1 else [dp]
    return out


def pick(rows: Sequence[WorldRow]) -> Layout:
    """The fastest measured layout; the fastest predicted where none was measured."""
    measured = [r for r in rows if r.measured_ms is not None]
    if measured:
        return min(measured, key=lambda r: r.measured_ms).layout  # type: ignore[arg-type,return-value]
    return min(rows, key=lambda r: r.prediction.step_ms).layout


def _slowest(value: float) -> float:
    """The largest ``value`` over the world's ranks (the step of a world ends with its last rank)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def window_ms(step: Callable[[], None], device: torch.device, steps: int) -> float:
    """One timing window: the slowest rank's ms per step over ``steps`` steps, all ranks starting together."""
    dist.barrier()
    sync_devices([device])
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync_devices([device])
    return _slowest((time.perf_counter() - t0) / steps * 1e3)


def _time(step: Callable[[], None], device: torch.device, rounds: int, steps: int) -> float:
    """Median over ``rounds`` windows of the slowest rank's ms per step, after one warm-up step."""
    step()
    return statistics.median(window_ms(step, device, steps) for _ in range(rounds))


def _trial_s(p: Prediction, rounds: int, steps: int) -> float:
    """The least a trial of ``p`` costs: its warm-up step and timed windows at the predicted step time."""
    return (1 + rounds * steps) * p.step_ms / 1e3


def choose_world(model: nn.Module, global_batch: torch.Tensor, device: torch.device, trial: Trial, *,
                 microbatches: Sequence[int], budget_s: float, bucket_bytes: float,
                 schedules: Sequence[str] = ("1f1b",),
                 depth: int = 1, rounds: int = 2, steps: int = 1, k: int = FINALISTS, within: float = WITHIN,
                 withheld: Sequence[int] = (), coupled: str | None = None,
                 reduce_dtypes: Sequence[torch.dtype | None] = (None,),
                 now: Callable[[], float] = time.perf_counter) -> WorldChoice:
    """The layout of this world for training ``model`` on ``global_batch`` (collective: every rank calls it).

    ``global_batch``: one step's samples over all ranks, the same on every rank; ``microbatches``: the
    counts a pipeline layout may have; ``budget_s``: seconds of planning after which no further finalist
    is timed (none where two would not fit); ``trial``: builds a layout for real; ``k``, ``within``: which
    predictions are timed (:func:`finalists`). ``withheld``: microbatch counts the user's options do not
    allow (one microbatch kept for the exact math of ``coupled``, a BatchNorm): pipelines with them are
    predicted and shown, never built, and a note says what they would have gained and which option
    allows them. ``reduce_dtypes``: the dtypes the gradient all-reduce may travel in (None: the gradients'
    own), each weighed for every layout with replicas. ``schedules``: the schedules each pipeline layout is
    weighed with.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("pp='auto' lays out a torch.distributed world: launch with torchrun and call "
                         "torch.distributed.init_process_group() before wrap(), or pass pp=1")
    start = now()
    world, me = dist.get_world_size(), dist.get_rank()
    n = global_batch.shape[0]
    if n < 2 * world:
        raise ValueError(f"pp='auto' plans on the global batch of one step (sample=), which has {n} samples for "
                         f"{world} ranks: pass a global batch of at least {2 * world} (2 per rank)")
    # 1-2: every rank profiles and probes at once, as the world will train; rank 0's figures decide.
    from ..forecast import profile_model  # here: `python -m pipedp.forecast` must not find it imported by pipedp
    profile = profile_model(copy.deepcopy(model).to(device), global_batch[: n // world].to(device), depth=depth,
                            repeats=PROFILE_REPEATS, warmup=PROFILE_WARMUP)
    profiled = now()
    allreduce = probe_allreduce(device=device)
    peer = me ^ 1 if (me ^ 1) < world else me - 1
    p2p = probe_p2p(peer, device=device) if world % 2 == 0 else allreduce
    shared: list[object] = [None]
    if me == 0:
        costs = profile.costs()
        every = rank(costs, world, n, allreduce, p2p=p2p, update_ms=profile.update_ms,
                     microbatches=sorted({*microbatches, *withheld}), schedules=tuple(schedules),
                     bucket_bytes=bucket_bytes, reduce_dtypes=reduce_dtypes)
        allowed = [p for p in every if p.layout.pp == 1 or p.layout.microbatches in microbatches]
        shared = [(allowed, [p for p in every if p not in allowed], allreduce, p2p, costs, profile.update_ms)]
    dist.broadcast_object_list(shared, src=0)
    preds, held, allreduce, p2p, costs, update_ms = shared[0]  # type: ignore[misc]
    probed = now()
    if not preds:
        raise ValueError(f"pp='auto': no layout of {world} ranks fits a global batch of {n} (each replica and "
                         f"microbatch needs at least 2 samples): pass a larger sample= batch, or pp=1")
    # 3-4: time the finalists while the budget lasts; every rank takes the same decision to go on.
    measured: dict[Layout, float] = {}
    notes = []
    last_s = 0.0  # the last trial's seconds: they scale the next one's predicted length
    chosen = finalists(preds, k, within)
    choice = None  # a layout chosen by prediction alone
    if len(chosen) == 1:
        choice = chosen.pop().layout
        notes.append(f"{choice.label} chosen by prediction, not timed: no other layout was a finalist (predicted "
                     f"within {within:g}x of the best)")
    else:
        # Fewer timed windows rather than none: where two trials of long steps do not fit, one window each may.
        # (Every rank takes the same branch: each test is the world's slowest figure.)
        fit = next((r for r in range(rounds, 0, -1)
                    if _slowest(now() - start + sum(_trial_s(p, r, steps) for p in chosen[:2])) <= budget_s), 0)
        if not fit:
            two_s = sum(_trial_s(p, 1, steps) for p in chosen[:2])
            notes.append(f"plan_budget_s={budget_s:g}: two trials (about {two_s:.0f} s) would not fit after the "
                         f"profile: chosen by prediction, none timed")
            chosen = []
        elif fit < rounds:
            notes.append(f"plan_budget_s={budget_s:g}: each trial timed in {fit} window(s) of {steps} step(s), not "
                         f"{rounds}: two trials with more would not fit after the profile")
            rounds = fit
    for i, p in enumerate(chosen):
        # The next trial's length: its predicted steps, scaled as the last trial's ran against its own (building
        # the engine is part of it); finalists may differ several-fold in step.
        expect = _trial_s(p, rounds, steps) * max(1.0, last_s / _trial_s(chosen[i - 1], rounds, steps)) if i else 0.0
        if i and _slowest(now() - start + expect) > budget_s:
            notes.append(f"plan_budget_s={budget_s:g}: {p.layout.label} and later finalists not timed (its trial "
                         f"of about {expect:.0f} s would not fit)")
            break
        t0 = now()
        step, close = trial(p.layout)
        try:
            measured[p.layout] = _time(step, device, rounds, steps)
        finally:
            close()
        last_s = now() - t0
    rows = tuple(WorldRow(p, measured.get(p.layout)) for p in preds)
    end = now()
    notes.append(f"planning {end - start:.1f} s on rank {me}: profile {profiled - start:.1f} s, link probes and "
                 f"prediction {probed - profiled:.1f} s, {len(measured)} trial(s) {end - probed:.1f} s")
    layout = choice or pick(rows)
    notes += _withheld_note(next(r for r in rows if r.layout == layout), held, coupled)
    return WorldChoice(layout, rows, allreduce, p2p, end - start, tuple(notes), tuple(held), costs, n, update_ms,
                       bucket_bytes)


def _withheld_note(chosen: WorldRow, held: Sequence[Prediction], coupled: str | None) -> list[str]:
    """What the best withheld pipeline was predicted to gain over the choice, and the option that allows it."""
    if not held:
        return []
    best = min(held, key=lambda p: p.step_ms)
    # Against the choice's prediction: the withheld layout has only a prediction, and the two share its errors.
    gain = chosen.prediction.step_ms / best.step_ms
    if gain < GAIN_NOTED:
        return []
    why = f" ({coupled})" if coupled else ""
    return [f"{best.layout.label} was predicted {gain:.2f}x as fast as {chosen.layout.label} but not tried: the "
            f"default keeps one microbatch for the math of your step{why}; microbatches='auto' allows it"]
