"""The search: a cost model steering batched proposals over a template's knob space.

Each round measures a batch of configs, refits the model on everything
measured so far (see :mod:`.cost_model` for its target and features), and
proposes the next batch by simulated annealing on the model's prediction,
keeping a few random picks to explore. The model is used from the second
batch on (from the first with a :class:`~.cost_model.History`): with a
handful of points a shallow boosted tree already ranks tile shapes better
than chance, and a wrong early model costs only one batch. Every candidate
is checked against torch before it can become a record; a candidate that
fails to compile or to match is remembered as failed and never retried.
Stops at the trial budget, when the space is exhausted, or after
``patience`` batches without improvement.

The search does not build or run anything itself: a
:class:`~.builder.Builder` turns a config into a kernel and a
:class:`~.runner.Runner` checks and times it (by default both in this
process; :mod:`.isolated` does both in a worker process with a time limit),
so builders and runners elsewhere plug in without changing the search. Its
state is a :class:`Search` that proposes and is told what was measured, so
a search can also be resumed from the records (``tune(resume=...)``) or
driven a batch per run, its candidates measured on another machine
(:mod:`.remote`). The same seed, space and measurements give the same
proposals.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import torch

from .builder import Builder, LocalBuilder
from .cost_model import CostModel, History, HistoryKey, XGBoostModel, config_features
from .ops import DepthwiseConv
from .runner import LocalRunner, Runner
from .space import Config, InvalidConfig, Space
from .target import Target, target_key
from .template import get_template, layout_of

__all__ = ["TuneResult", "tune", "Measurement", "History", "Search", "history_key"]

K = TypeVar("K")


@dataclass
class Measurement:
    """One candidate's outcome: its µs, or inf and how it failed (``status``: error, wrong, crash, timeout)."""

    config: Config
    us: float  # inf when it failed
    error: str = ""
    status: str = "ok"


@dataclass
class TuneResult:
    op: str
    problem: DepthwiseConv
    target: str
    layout: str = "NCHW"
    measurements: list[Measurement] = field(default_factory=list)

    @property
    def best(self) -> Measurement | None:
        ok = [m for m in self.measurements if math.isfinite(m.us)]
        return min(ok, key=lambda m: m.us) if ok else None

    def best_so_far(self) -> list[float]:
        """Best µs after each trial (the tuning curve)."""
        out, cur = [], math.inf
        for m in self.measurements:
            cur = min(cur, m.us)
            out.append(cur)
        return out


def _key(cfg: Config) -> str:
    return json.dumps(cfg, sort_keys=True)


def _propose(
    space: Space, feats: Callable[[Config], list[float]], model: CostModel | None, seen: set[str],
    valid: Callable[[Config], bool], batch: int, rng: random.Random, start: list[Config], explore: float = 0.2,
) -> list[Config]:
    out: list[Config] = []
    picked: set[str] = set()

    def take(c: Config) -> None:
        k = _key(c)
        if k not in seen and k not in picked and valid(c):
            picked.add(k)
            out.append(c)

    guided = 0 if model is None else batch - max(1, int(batch * explore))
    if guided and model is not None:
        # Simulated annealing on the model's prediction, from the best measured configs and random ones.
        pool: dict[str, tuple[float, Config]] = {}
        walkers = [dict(c) for c in start[:4]] + [space.sample(rng) for _ in range(4)]
        scores = list(model.predict([feats(c) for c in walkers]))
        temp = 1.0
        for _ in range(60):
            nxt = [space.neighbours(c, rng, moves=rng.choice((1, 1, 2))) for c in walkers]
            pred = model.predict([feats(c) for c in nxt])
            for w, (c, p) in enumerate(zip(nxt, pred, strict=True)):
                if p < scores[w] or rng.random() < math.exp(-(p - scores[w]) / max(temp, 1e-3)):
                    walkers[w], scores[w] = c, float(p)
                k = _key(c)
                if k not in seen and valid(c):
                    pool[k] = (float(p), c)
            temp *= 0.93
        for _, c in sorted(pool.values(), key=lambda t: t[0]):
            if len(out) >= guided:
                break
            take(c)
    tries = 0
    while len(out) < batch and tries < 50 * batch:
        take(space.sample(rng))
        tries += 1
    return out


def history_key(conv: DepthwiseConv, op: str, target: Target, layout: str = "NCHW") -> HistoryKey:
    """Where a :class:`~.cost_model.History` keeps the measurements of ``op`` with the template for ``layout``."""
    return History.key(get_template(target, layout).space(conv, op), op)


class Search:
    """One kernel's search: what was measured, the cost model over it, and what to try next.

    :func:`tune` drives it in one process (propose, measure, :meth:`add`,
    :meth:`refit`); a remote round (:mod:`.remote`) rebuilds it from the
    records with :meth:`resume`, asks it for the next batch, and hears the
    times in a later run. ``prior`` is earlier problems' (features, targets)
    for the model (see :class:`~.cost_model.History`).
    """

    def __init__(self, conv: DepthwiseConv, op: str, target: Target, *, layout: str = "NCHW", seed: int = 0,
                 prior: tuple[list[list[float]], list[float]] | None = None,
                 cost_model: Callable[[int], CostModel] = XGBoostModel) -> None:
        self.conv, self.op, self.seed, self.cost_model = conv, op, seed, cost_model
        self.template = get_template(target, layout)
        self.space = self.template.space(conv, op)
        self.rng = random.Random(seed)
        self.measurements: list[Measurement] = []
        self.seen: set[str] = set()
        self.x: list[list[float]] = []  # features and log(µs / byte) of the successful measurements
        self.y: list[float] = []
        self.prior_x, self.prior_y = prior if prior is not None else ([], [])
        self.model: CostModel | None = None
        self.log_bytes = math.log(conv.min_bytes(op))  # targets are log(µs / byte): comparable between problems
        if self.prior_y:
            self.model = cost_model(seed)
            self.model.fit(self.prior_x, self.prior_y)

    def features(self, config: Config) -> list[float]:
        return config_features(self.space, self.template, self.conv, self.op, config)

    def valid(self, config: Config) -> bool:
        try:
            self.template.validate(self.conv, self.op, config)
            return True
        except InvalidConfig:
            return False

    def propose(self, n: int) -> list[Config]:
        """Up to ``n`` configs not measured yet (fewer when the space runs out), best-predicted first."""
        start = [m.config for m in sorted(self.measurements, key=lambda m: m.us) if math.isfinite(m.us)]
        return _propose(self.space, self.features, self.model, self.seen, self.valid, n, self.rng, start)

    def add(self, m: Measurement) -> None:
        """Take one measurement (the model learns it at the next :meth:`refit`)."""
        self.seen.add(_key(m.config))
        self.measurements.append(m)
        if math.isfinite(m.us):
            self.x.append(self.features(m.config))
            self.y.append(math.log(m.us) - self.log_bytes)

    def resume(self, earlier: Iterable[Measurement]) -> int:
        """Take measurements made before (the records); returns how many were usable. :meth:`refit` before
        proposing (not done here: a search resumed at its budget proposes nothing).

        A config recorded before a knob existed gets the knob's old choice
        (:meth:`~.space.Space.complete`); one the space no longer has is
        passed over.
        """
        taken = 0
        for m in earlier:
            config = self.space.complete(m.config)
            try:
                self.space.check(config)
            except InvalidConfig:
                continue
            self.add(Measurement(config, m.us, m.error, m.status))
            taken += 1
        return taken

    def refit(self) -> None:
        """Fit the model on the prior and everything measured; failures as 4x the slowest, to avoid their region."""
        if not self.y:
            return
        worst = max(self.y) + math.log(4.0)
        fx = self.x + [self.features(m.config) for m in self.measurements if not math.isfinite(m.us)]
        fy = self.y + [worst] * (len(fx) - len(self.y))
        self.model = self.model or self.cost_model(self.seed)
        self.model.fit(self.prior_x + fx, self.prior_y + fy)


def tune(
    conv: DepthwiseConv,
    op: str,
    target: Target,
    device: torch.device,
    *,
    trials: int,
    batch: int = 8,
    patience: int = 4,
    seed: int = 0,
    on_measure: Callable[[Measurement, TuneResult], None] | None = None,
    min_ms: float = 20.0,
    layout: str = "NCHW",
    history: History | None = None,
    builder: Builder[K] | None = None,
    runner: Runner[K] | None = None,
    cost_model: Callable[[int], CostModel] = XGBoostModel,
    resume: Iterable[Measurement] = (),
) -> TuneResult:
    """Search the template's space for ``op`` on ``conv`` with ``layout`` activations.

    Every new measurement goes to ``on_measure``; with ``history`` the model
    starts from earlier problems' measurements and this one's are added.
    ``resume`` is this problem's earlier measurements (from the records):
    they count towards ``trials``, are never measured again, and the model
    starts from them. ``builder`` and ``runner`` default to building and
    running in this process; ``cost_model`` makes a model from the seed.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    build_with = LocalBuilder() if builder is None else builder
    run_with = LocalRunner() if runner is None else runner
    hkey = history_key(conv, op, target, layout)
    search = Search(conv, op, target, layout=layout, seed=seed, cost_model=cost_model,
                    prior=history.get(hkey) if history is not None else None)
    result = TuneResult(op, conv, target_key(target), layout, search.measurements)
    if search.resume(resume) and len(search.measurements) < trials:
        search.refit()
    best = min((m.us for m in search.measurements), default=math.inf)
    stale = 0
    while len(result.measurements) < trials:
        cands = search.propose(min(batch, trials - len(result.measurements)))
        if not cands:
            break  # the space is exhausted
        improved = False
        for cfg in cands:
            m = _measure(build_with, run_with, conv, op, cfg, target, device, min_ms)
            search.add(m)
            if math.isfinite(m.us) and m.us < best * 0.995:
                best, improved = m.us, True
            if on_measure is not None:
                on_measure(m, result)
        search.refit()
        stale = 0 if improved else stale + 1
        if stale >= patience:
            break
    if history is not None:
        history.add(hkey, search.x, search.y)
    return result


def _measure(builder: Builder[K], runner: Runner[K], conv: DepthwiseConv, op: str, cfg: Config, target: Target,
             device: torch.device, min_ms: float) -> Measurement:
    try:
        kernel = builder.build(conv, op, cfg, target)
        us = runner.run(kernel, conv, op, layout_of(cfg), device, min_ms)
    except Exception as e:  # a compile error, a wrong result, a crash or a hang: never a time
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return Measurement(cfg, math.inf, f"{type(e).__name__}: {first}", str(getattr(e, "status", "error")))
    return Measurement(cfg, us)
