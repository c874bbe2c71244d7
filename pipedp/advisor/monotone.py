"""Monotone regression over a partial order: "more of this never makes that smaller".

Each axis of a point has a direction, +1 (the value never falls as the axis
grows) or -1 (it never rises). Point ``a`` precedes ``b`` when every axis
moves from ``a`` to ``b`` in its own direction; a monotone function has
``f(a) <= f(b)`` whenever ``a`` precedes ``b``. scikit-learn's
IsotonicRegression orders one axis only (and is no runtime dependency), so the
fits here are our own, exact and small (tens of points):

- :func:`isotonic` is the weighted L2 projection of measured values onto the
  monotone cone of the partial order. Its dual is a non-negative least-squares
  problem (one multiplier per ordered pair), solved exactly by Lawson-Hanson
  (:func:`nnls`), so the result is the projection itself, not an approximation
  by alternating projections.
- :class:`Isotonic` keeps the fitted values and bounds a new point by the
  measured points around it: at least the largest fitted value it dominates,
  at most the smallest one dominating it. Alone it is piecewise constant, so
  it predicts a point between two measured ones no better than the nearer of
  them: right for a conservative bound (accuracy), wrong for an estimate.
- :class:`MonotoneLaw` is what predicts step time. A law ``f = sum_k w_k
  phi_k`` with ``w_k >= 0`` over basis functions that are each monotone in the
  right direction (products ``prod x_i^{d_i}`` over subsets of the axes:
  ``1, b, 1/r, b/r, ...``, Amdahl's serial plus parallel parts) is monotone by
  construction and interpolates smoothly; it is fitted in relative error (a
  1 ms step matters as much as a 100 ms one, and one wild measurement on a
  busy machine can pull the fit by at most its own weight). On the tests'
  synthetic laws, ones the basis cannot express among them, it predicts
  held-out points within a few percent where isotonic regression alone is
  off by tens of percent. ``correct=True`` multiplies in an isotonic fit of
  the log residual ``log(t / f)`` (monotone in the same directions, so the
  product stays monotone; between measured points the middle of its bounds).
  It is off by default: it fits the measured points closer but moves a
  held-out prediction by the residuals of measured points that may lie far
  away in the order, which made the worst held-out error larger on those laws
  whenever timing noise was present.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import numpy as np

__all__ = ["Directions", "precedes", "nnls", "isotonic", "Isotonic", "MonotoneLaw"]

Directions = tuple[int, ...]  # per axis: +1 (the value grows with it) or -1 (it shrinks)


def _directions(directions: Sequence[int], axes: int) -> Directions:
    d = tuple(int(v) for v in directions)
    if len(d) != axes or any(v not in (1, -1) for v in d):
        raise ValueError(f"directions must give +1 or -1 for each of the {axes} axes, got {tuple(directions)}")
    return d


def _points(points: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    p = np.asarray(points, dtype=float)
    if p.ndim != 2 or len(p) == 0:
        raise ValueError(f"points must be a non-empty (n, axes) array, got shape {p.shape}")
    if not np.isfinite(p).all():
        raise ValueError("points must be finite numbers")
    return p


def precedes(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, directions: Directions) -> bool:
    """Whether every axis moves from ``a`` to ``b`` in its direction (so a monotone f has f(a) <= f(b))."""
    return bool(np.all(np.asarray(directions) * (np.asarray(b, float) - np.asarray(a, float)) >= 0))


def _order(points: np.ndarray, directions: Directions) -> np.ndarray:
    """``le[i, j]``: point i precedes point j."""
    diff = (points[None, :, :] - points[:, None, :]) * np.asarray(directions, float)
    return np.all(diff >= 0, axis=2)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """``argmin ||a x - b||`` over ``x >= 0``: Lawson and Hanson's active-set method (exact in finitely many steps)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    tol = 10 * np.finfo(float).eps * max(a.shape) * max(1.0, float(np.abs(a).sum(axis=0).max(initial=0.0)))
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 50):
        free = ~passive & (w > tol)
        if not free.any():
            return x
        passive[np.argmax(np.where(~passive, w, -np.inf))] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            bad = passive & (s <= tol)
            if not bad.any():
                break
            alpha = np.min(x[bad] / (x[bad] - s[bad]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
        w = a.T @ (b - a @ x)
    if (~passive & (w > tol)).any():
        raise RuntimeError(f"non-negative least squares did not converge in {max_iter or 3 * n + 50} iterations "
                           f"({a.shape[0]} x {n}); pass fewer or less collinear points")
    return x


def isotonic(points: Sequence[Sequence[float]] | np.ndarray, values: Sequence[float] | np.ndarray,
             directions: Sequence[int], weights: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """The monotone values closest to ``values`` in weighted L2 (the projection onto the monotone cone).

    Solved through the dual: with ``A`` the rows ``e_i - e_j`` of the
    ordered pairs (i precedes j), the fit is ``y - W^-1 A^T lam`` where
    ``lam >= 0`` minimises ``||W^-1/2 A^T lam - W^1/2 y||``, an NNLS problem.
    """
    p = _points(points)
    y = np.asarray(values, float)
    if y.shape != (len(p),) or not np.isfinite(y).all():
        raise ValueError(f"values must be {len(p)} finite numbers, one per point")
    w = np.ones(len(p)) if weights is None else np.asarray(weights, float)
    if w.shape != y.shape or not (w > 0).all():
        raise ValueError("weights must be positive, one per point")
    le = _order(p, _directions(directions, p.shape[1]))
    pairs = [(i, j) for i, j in combinations(range(len(p)), 2) if le[i, j] or le[j, i]]
    pairs = [(i, j) if le[i, j] else (j, i) for i, j in pairs]
    if not pairs:
        return y.copy()
    at = np.zeros((len(p), len(pairs)))  # A^T: column k is e_i - e_j of pair k
    for k, (i, j) in enumerate(pairs):
        at[i, k], at[j, k] = 1.0, -1.0
    root = np.sqrt(w)
    lam = nnls(at / root[:, None], root * y)
    return y - (at @ lam) / w


@dataclass(frozen=True)
class Isotonic:
    """Monotone fitted values at measured points, and the bounds they put on any other point."""

    points: np.ndarray
    fitted: np.ndarray
    directions: Directions

    @classmethod
    def fit(cls, points: Sequence[Sequence[float]] | np.ndarray, values: Sequence[float] | np.ndarray,
            directions: Sequence[int], weights: Sequence[float] | np.ndarray | None = None) -> "Isotonic":
        p = _points(points)
        return cls(p, isotonic(p, values, directions, weights), _directions(directions, p.shape[1]))

    def _side(self, x: Sequence[float], below: bool) -> float | None:
        diff = (self.points - np.asarray(x, float)) * np.asarray(self.directions, float)
        mask = np.all(diff <= 0, axis=1) if below else np.all(diff >= 0, axis=1)
        if not mask.any():
            return None
        return float(self.fitted[mask].max() if below else self.fitted[mask].min())

    def lower(self, x: Sequence[float]) -> float | None:
        """The largest fitted value of a point ``x`` dominates (None: ``x`` dominates no measured point)."""
        return self._side(x, below=True)

    def upper(self, x: Sequence[float]) -> float | None:
        """The smallest fitted value of a point dominating ``x`` (None: no measured point dominates it)."""
        return self._side(x, below=False)

    def middle(self, x: Sequence[float], default: float = 0.0) -> float:
        """The middle of the bounds; the one bound there is; ``default`` with neither."""
        lo, hi = self.lower(x), self.upper(x)
        if lo is None and hi is None:
            return default
        if lo is None or hi is None:
            return lo if hi is None else hi  # type: ignore[return-value]
        return (lo + hi) / 2


def _basis(x: np.ndarray, directions: Directions, scale: np.ndarray) -> np.ndarray:
    """Every product of ``(x_i / scale_i)^{d_i}`` over a subset of the axes (the empty one: 1)."""
    z = (x / scale) ** np.asarray(directions, float)
    k = x.shape[1]
    cols = [np.prod(z[:, list(s)], axis=1) if s else np.ones(len(x))
            for r in range(k + 1) for s in combinations(range(k), r)]
    return np.stack(cols, axis=1)


@dataclass(frozen=True)
class MonotoneLaw:
    """``f(x) * exp(c(x))``: a non-negative sum of monotone basis functions times an isotonic correction."""

    directions: Directions
    scale: np.ndarray
    weights: np.ndarray
    correction: Isotonic | None

    @classmethod
    def fit(cls, points: Sequence[Sequence[float]] | np.ndarray, values: Sequence[float] | np.ndarray,
            directions: Sequence[int], correct: bool = False) -> "MonotoneLaw":
        """Fit positive ``values`` (seconds per step, say) at positive ``points``; ``correct``: the isotonic factor."""
        p = _points(points)
        y = np.asarray(values, float)
        if y.shape != (len(p),) or not (np.isfinite(y).all() and (y > 0).all()):
            raise ValueError(f"values must be {len(p)} positive finite numbers, one per point")
        if not (p > 0).all():
            raise ValueError("a monotone law needs positive coordinates (resources, batch sizes, microbatches)")
        d = _directions(directions, p.shape[1])
        scale = np.exp(np.log(p).mean(axis=0))
        phi = _basis(p, d, scale)
        w = nnls(phi / y[:, None], np.ones(len(y)))  # relative error: (f(x) - y) / y
        law = cls(d, scale, w, None)
        if not correct:
            return law
        resid = np.log(y) - np.log(law._law(p))
        return cls(d, scale, w, Isotonic.fit(p, resid, d))

    def _law(self, p: np.ndarray) -> np.ndarray:
        f = _basis(p, self.directions, self.scale) @ self.weights
        return np.maximum(f, np.finfo(float).tiny)

    def predict(self, x: Sequence[float]) -> float:
        p = _points([x])
        if not (p > 0).all():
            raise ValueError(f"cannot predict at {tuple(x)}: coordinates must be positive")
        f = float(self._law(p)[0])
        return f if self.correction is None else f * float(np.exp(self.correction.middle(p[0])))
