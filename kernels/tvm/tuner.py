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
process), so builders and runners elsewhere (worker processes, a GPU
machine without the compiler) plug in without changing the search. The
same seed, space and measurements give the same proposals.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from .builder import Builder, LocalBuilder
from .cost_model import CostModel, History, XGBoostModel, config_features
from .ops import DepthwiseConv
from .runner import LocalRunner, Runner
from .space import Config, InvalidConfig, Space
from .target import Target, target_key
from .template import get_template, layout_of

__all__ = ["TuneResult", "tune", "Measurement", "History"]

K = TypeVar("K")


@dataclass
class Measurement:
    config: Config
    us: float  # inf when it failed
    error: str = ""


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
) -> TuneResult:
    """Search the template's space for ``op`` on ``conv`` with ``layout`` activations.

    Every measurement goes to ``on_measure``; with ``history`` the model
    starts from earlier problems' measurements and this one's are added.
    ``builder`` and ``runner`` default to building and running in this
    process; ``cost_model`` makes a model from the seed.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    build_with = LocalBuilder() if builder is None else builder
    run_with = LocalRunner() if runner is None else runner
    tmpl = get_template(target, layout)
    space = tmpl.space(conv, op)
    rng = random.Random(seed)
    result = TuneResult(op, conv, target_key(target), layout)
    seen: set[str] = set()
    x: list[list[float]] = []
    y: list[float] = []
    model: CostModel | None = None
    stale = 0
    best = math.inf
    log_bytes = math.log(conv.min_bytes(op))  # targets are log(µs / byte): comparable between problems
    hkey = History.key(space, op)
    prior_x, prior_y = history.get(hkey) if history is not None else ([], [])
    if prior_y:
        model = cost_model(seed)
        model.fit(prior_x, prior_y)

    def feats(c: Config) -> list[float]:
        return config_features(space, tmpl, conv, op, c)

    def valid(c: Config) -> bool:
        try:
            tmpl.validate(conv, op, c)
            return True
        except InvalidConfig:
            return False

    while len(result.measurements) < trials:
        start = [m.config for m in sorted(result.measurements, key=lambda m: m.us) if math.isfinite(m.us)]
        cands = _propose(space, feats, model, seen, valid, min(batch, trials - len(result.measurements)), rng, start)
        if not cands:
            break  # the space is exhausted
        improved = False
        for cfg in cands:
            seen.add(_key(cfg))
            m = _measure(build_with, run_with, conv, op, cfg, target, device, min_ms)
            result.measurements.append(m)
            if math.isfinite(m.us):
                x.append(feats(cfg))
                y.append(math.log(m.us) - log_bytes)
                if m.us < best * 0.995:
                    best, improved = m.us, True
            if on_measure is not None:
                on_measure(m, result)
        if y:
            worst = max(y) + math.log(4.0)  # failures teach the model to avoid their region
            fx = x + [feats(m.config) for m in result.measurements if not math.isfinite(m.us)]
            fy = y + [worst] * (len(fx) - len(y))
            model = model or cost_model(seed)
            model.fit(prior_x + fx, prior_y + fy)
        stale = 0 if improved else stale + 1
        if stale >= patience:
            break
    if history is not None:
        history.add(hkey, x, y)
    return result


def _measure(builder: Builder[K], runner: Runner[K], conv: DepthwiseConv, op: str, cfg: Config, target: Target,
             device: torch.device, min_ms: float) -> Measurement:
    try:
        kernel = builder.build(conv, op, cfg, target)
        us = runner.run(kernel, conv, op, layout_of(cfg), device, min_ms)
    except Exception as e:  # a compile error or a wrong result: never a record
        return Measurement(cfg, math.inf, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return Measurement(cfg, us)
