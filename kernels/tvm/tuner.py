"""The search: an xgboost cost model steering batched proposals over a template's knob space.

Each round measures a batch of configs, refits the model on everything
measured so far (log µs from knob values plus the template's loop-structure
features: tile sizes, threads, shared bytes, vector width), and proposes the
next batch by simulated annealing on the model's prediction, keeping a few
random picks to explore. The model is used from the second batch on (from
the first with a :class:`History`, below): with a handful of points a
shallow boosted tree already ranks tile shapes better than chance, and a
wrong early model costs only one batch. Every candidate
is checked against torch before it can become a record; a candidate that
fails to compile or to match is remembered as failed and never retried.
Stops at the trial budget, when the space is exhausted, or after
``patience`` batches without improvement.

A model's many problems are tuned one after another, and what a template's
knobs do carries over between them (streaming stores pay for large outputs,
a pixel-order grad-weight for many channels). A :class:`History` passed to
every call keeps each template's measurements with the problem's shape as
extra features and µs per byte moved as the target, so the model of the next
problem starts from them and steers its first batch too (transfer learning,
as AutoTVM does across tasks).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from . import build as B
from .ops import DepthwiseConv
from .space import Config, InvalidConfig, Space

__all__ = ["TuneResult", "tune", "Measurement", "History"]


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


@dataclass
class History:
    """Measurements of earlier problems, per (template, operator, knob names): the next model's prior."""

    points: dict[tuple[Any, ...], tuple[list[list[float]], list[float]]] = field(default_factory=dict)

    @staticmethod
    def key(space: Space, op: str) -> tuple[Any, ...]:
        return (space.template, op, tuple(space.names))

    def get(self, key: tuple[Any, ...]) -> tuple[list[list[float]], list[float]]:
        x, y = self.points.get(key, ([], []))
        return list(x), list(y)

    def add(self, key: tuple[Any, ...], x: list[list[float]], y: list[float]) -> None:
        old_x, old_y = self.points.setdefault(key, ([], []))
        old_x.extend(x)
        old_y.extend(y)


def _problem_features(conv: DepthwiseConv, op: str) -> list[float]:
    """What tells one problem from another to a model shared between them."""
    oh, ow = conv.out_hw
    return [math.log2(conv.output_bytes(op)), math.log2(conv.out_channels), math.log2(ow * oh),
            float(conv.stride[0]), float(conv.kernel[0] * conv.kernel[1])]


def _key(cfg: Config) -> str:
    return json.dumps(cfg, sort_keys=True)


def _valid(conv: DepthwiseConv, op: str, target: B.Target, cfg: Config) -> bool:
    try:
        B.template(target, B.layout_of(cfg)).validate(conv, op, cfg)
        return True
    except InvalidConfig:
        return False


class _Model:
    """xgboost regression of log(µs) on config features (the core API: no scikit-learn needed)."""

    def __init__(self, seed: int) -> None:
        import xgboost as xgb

        self.xgb = xgb
        self.params = {"max_depth": 4, "eta": 0.3, "objective": "reg:squarederror", "seed": seed, "nthread": 1}
        self.booster: Any = None

    def fit(self, x: list[list[float]], y: list[float]) -> None:
        data = self.xgb.DMatrix(np.asarray(x, dtype=np.float64), label=np.asarray(y, dtype=np.float64))
        self.booster = self.xgb.train(self.params, data, num_boost_round=60)

    def predict(self, x: list[list[float]]) -> np.ndarray:
        return self.booster.predict(self.xgb.DMatrix(np.asarray(x, dtype=np.float64)))


def _propose(
    space: Space, feats: Callable[[Config], list[float]], model: _Model | None, seen: set[str],
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
    if guided:
        # Simulated annealing on the model's prediction, from the best measured configs and random ones.
        pool: dict[str, tuple[float, Config]] = {}
        walkers = [dict(c) for c in start[:4]] + [space.sample(rng) for _ in range(4)]
        scores = list(model.predict([feats(c) for c in walkers]))
        temp = 1.0
        for _ in range(60):
            nxt = [space.neighbours(c, rng, moves=rng.choice((1, 1, 2))) for c in walkers]
            pred = model.predict([feats(c) for c in nxt])
            for w, (c, p) in enumerate(zip(nxt, pred)):
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
    target: B.Target,
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
) -> TuneResult:
    """Search the template's space for ``op`` on ``conv`` with ``layout`` activations.

    Every measurement goes to ``on_measure``; with ``history`` the model
    starts from earlier problems' measurements and this one's are added.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    space = B.space(conv, op, target, layout)
    tmpl = B.template(target, layout)
    rng = random.Random(seed)
    result = TuneResult(op, conv, B.target_key(target), layout)
    seen: set[str] = set()
    x: list[list[float]] = []
    y: list[float] = []
    model: _Model | None = None
    stale = 0
    best = math.inf
    log_bytes = math.log(conv.min_bytes(op))  # targets are log(µs / byte): comparable between problems
    hkey = History.key(space, op)
    prior_x, prior_y = history.get(hkey) if history is not None else ([], [])
    if prior_y:
        model = _Model(seed)
        model.fit(prior_x, prior_y)

    def feats(c: Config) -> list[float]:
        return space.features(c) + tmpl.features(conv, op, c) + _problem_features(conv, op)

    def valid(c: Config) -> bool:
        return _valid(conv, op, target, c)

    while len(result.measurements) < trials:
        start = [m.config for m in sorted(result.measurements, key=lambda m: m.us) if math.isfinite(m.us)]
        cands = _propose(space, feats, model, seen, valid, min(batch, trials - len(result.measurements)), rng, start)
        if not cands:
            break  # the space is exhausted
        improved = False
        for cfg in cands:
            seen.add(_key(cfg))
            m = _measure(conv, op, cfg, target, device, min_ms)
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
            model = model or _Model(seed)
            model.fit(prior_x + fx, prior_y + fy)
        stale = 0 if improved else stale + 1
        if stale >= patience:
            break
    if history is not None:
        history.add(hkey, x, y)
    return result


def _measure(conv: DepthwiseConv, op: str, cfg: Config, target: B.Target, device: torch.device,
             min_ms: float) -> Measurement:
    try:
        kernel = B.build(conv, op, cfg, target)
        B.check(kernel, conv, op, device, B.layout_of(cfg))
        us = B.measure_us(kernel, conv, op, device, repeat=3, min_ms=min_ms, layout=B.layout_of(cfg))
    except Exception as e:  # a compile error or a wrong result: never a record
        return Measurement(cfg, math.inf, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return Measurement(cfg, us)
