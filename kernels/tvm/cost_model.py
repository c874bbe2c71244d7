"""The cost model the search ranks candidates with, its features, and what it keeps between problems.

Rules, and why:

- The model regresses log(µs / byte moved), not µs: a log keeps a fast
  and a slow config's errors comparable, and dividing by the bytes the
  operator must move makes problems of different sizes comparable, so one
  model serves a model's many problems.
- A config's features are its knob values (:meth:`~.space.Space.features`),
  the template's loop-structure features (tile sizes, threads, shared
  bytes, vector width: what the knobs do to the loop nest) and the
  problem's shape (:func:`problem_features`), so what is learnt on one
  problem carries over to the next.
- A :class:`History` keeps each template's measurements per (template,
  operator, knob names): features mean the same only within one such key.
  A model's many problems are tuned one after another, and what a
  template's knobs do carries over between them (streaming stores pay for
  large outputs, a pixel-order grad-weight for many channels), so the next
  problem's model starts from them and steers its first batch too
  (transfer learning, as AutoTVM does across tasks). A run's history starts
  from every measurement of its target in the records
  (:meth:`.database.TuningRecords.history`), so it carries across runs too.
- xgboost's core API only (no scikit-learn), one thread, a fixed seed: the
  same measurements give the same model and so the same proposals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import numpy as np

from pipedp.ops.problem import DepthwiseConv

from .space import Config, Space
from .template import Template

__all__ = ["CostModel", "XGBoostModel", "History", "HistoryKey", "problem_features", "config_features"]


class CostModel(Protocol):
    """A regression of a config's log time on its features: fit on what was measured, predict the rest."""

    def fit(self, x: list[list[float]], y: list[float]) -> None: ...

    def predict(self, x: list[list[float]]) -> Iterable[float]: ...


class XGBoostModel:
    """xgboost regression of log(µs) on config features (the core API: no scikit-learn needed)."""

    def __init__(self, seed: int) -> None:
        import xgboost as xgb

        self.xgb = xgb
        self.params = {"max_depth": 4, "eta": 0.3, "objective": "reg:squarederror", "seed": seed, "nthread": 1}
        self.booster: Any = None  # an xgboost.Booster once fit

    def fit(self, x: list[list[float]], y: list[float]) -> None:
        data = self.xgb.DMatrix(np.asarray(x, dtype=np.float64), label=np.asarray(y, dtype=np.float64))
        self.booster = self.xgb.train(self.params, data, num_boost_round=60)

    def predict(self, x: list[list[float]]) -> np.ndarray:
        return self.booster.predict(self.xgb.DMatrix(np.asarray(x, dtype=np.float64)))


HistoryKey = tuple[str, str, tuple[str, ...]]


@dataclass
class History:
    """Measurements of earlier problems, per (template, operator, knob names): the next model's prior."""

    points: dict[HistoryKey, tuple[list[list[float]], list[float]]] = field(default_factory=dict)

    @staticmethod
    def key(space: Space, op: str) -> HistoryKey:
        return (space.template, op, tuple(space.names))

    def get(self, key: HistoryKey) -> tuple[list[list[float]], list[float]]:
        x, y = self.points.get(key, ([], []))
        return list(x), list(y)

    def add(self, key: HistoryKey, x: list[list[float]], y: list[float]) -> None:
        old_x, old_y = self.points.setdefault(key, ([], []))
        old_x.extend(x)
        old_y.extend(y)


def problem_features(conv: DepthwiseConv, op: str) -> list[float]:
    """What tells one problem from another to a model shared between them."""
    oh, ow = conv.out_hw
    return [math.log2(conv.output_bytes(op)), math.log2(conv.out_channels), math.log2(ow * oh),
            float(conv.stride[0]), float(conv.kernel[0] * conv.kernel[1])]


def config_features(space: Space, template: Template, conv: DepthwiseConv, op: str, config: Config) -> list[float]:
    """The model's input for ``config``: knob values, loop-structure features, problem features."""
    return space.features(config) + template.features(conv, op, config) + problem_features(conv, op)
