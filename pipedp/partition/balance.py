"""Optimal contiguous partition of a chain of blocks into pipeline stages.

A pipeline's steady-state period is set by its slowest stage, so the cut we want
minimises the largest stage cost. The problem is the classic "linear partition"
(bottleneck) problem; we solve it exactly with dynamic programming over prefix
sums, vectorised with numpy (O(stages * n^2) work, n = number of blocks), instead
of the greedy heuristics some pipeline libraries use.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..checks import positive_int

__all__ = ["balance", "stage_costs", "refine"]


def _check_costs(costs: Sequence[float], name: str, length: int | None = None) -> np.ndarray:
    arr = np.asarray(list(costs), dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of numbers, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(
            f"{name} has {arr.shape[0]} entries but needs {length} "
            f"(one per cut between consecutive blocks)"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and non-negative, got {list(arr)}")
    return arr


def _check_stages(stages: int, blocks: int) -> None:
    positive_int("stages", stages)
    if stages > blocks:
        raise ValueError(
            f"cannot cut {blocks} blocks into {stages} non-empty stages: use stages <= {blocks}, "
            f"or give the model finer blocks (e.g. nested nn.Sequential with a larger depth)"
        )


def stage_costs(
    costs: Sequence[float], counts: Sequence[int], *, transfer: Sequence[float] | None = None
) -> list[float]:
    """Cost of each stage for a cut given as block counts per stage.

    A stage costs the sum of its blocks plus, unless it is the last stage, the
    transfer cost of the cut after its last block (it sends that activation
    forward and receives its gradient back).
    """
    c = _check_costs(costs, "costs")
    t = None if transfer is None else _check_costs(transfer, "transfer", max(len(c) - 1, 0))
    if sum(counts) != len(c) or any(k < 1 for k in counts):
        raise ValueError(f"counts {list(counts)} must be positive and sum to {len(c)} blocks")
    out: list[float] = []
    start = 0
    for k in counts:
        end = start + k
        cost = float(c[start:end].sum())
        if t is not None and end < len(c):
            cost += float(t[end - 1])
        out.append(cost)
        start = end
    return out


def balance(
    costs: Sequence[float], stages: int, *, transfer: Sequence[float] | None = None
) -> list[int]:
    """Block counts per stage for the contiguous cut minimising the slowest stage.

    ``costs[i]`` is block i's cost; ``transfer[i]`` (optional, ``len(costs) - 1``
    entries) is added to the stage that ends with block i when a cut falls there.
    The result is optimal: no other cut into ``stages`` non-empty contiguous
    stages has a smaller maximum stage cost. Ties are broken deterministically.
    """
    c = _check_costs(costs, "costs")
    n = len(c)
    if n == 0:
        raise ValueError("costs is empty: a model needs at least one block")
    _check_stages(stages, n)
    t = np.zeros(n) if transfer is None else np.append(_check_costs(transfer, "transfer", n - 1), 0.0)

    prefix = np.concatenate([[0.0], np.cumsum(c)])
    idx = np.arange(n + 1)
    # seg[a, b]: cost of one stage holding blocks a..b-1 (inf where a >= b).
    # The transfer term for b == n is 0 (t[n-1] was padded with a 0 at the end).
    seg = prefix[None, :] - prefix[:, None] + np.concatenate([[0.0], t])[None, :]
    seg[idx[:, None] >= idx[None, :]] = math.inf

    best = seg[0].copy()  # best[b]: optimal bottleneck of blocks 0..b-1 in j stages
    choice = np.zeros((stages, n + 1), dtype=np.int64)
    for j in range(1, stages):
        cand = np.maximum(best[:, None], seg)  # [a, b]: first a blocks in j stages, then a..b-1
        choice[j] = np.argmin(cand, axis=0)
        best = cand[choice[j], idx]
    counts: list[int] = []
    end = n
    for j in range(stages - 1, 0, -1):
        start = int(choice[j, end])
        counts.append(end - start)
        end = start
    counts.append(end)
    counts.reverse()
    assert sum(counts) == n and all(k >= 1 for k in counts), counts
    return counts


def refine(counts: Sequence[int], step_ms: Callable[[Sequence[int]], float | Sequence[float]]) -> list[int]:
    """``counts`` with one cut point at a time moved by one block while ``step_ms`` of the cut gets shorter.

    ``step_ms`` may give several figures, compared in order (the busiest
    rank's load, then the next one's: a tie at the top is still broken).

    Where a rank holds several stages (interleaved), the slowest stage does
    not set the step: each rank's sum and the flow between its stages do, so
    the bottleneck-optimal cut (:func:`balance`) is a start, not the answer.
    A local search on the simulated step from there never returns a cut the
    simulator thinks slower than the one given; it stops at the first cut no
    single move improves.
    """
    best = [int(k) for k in counts]
    if any(k < 1 for k in best):
        raise ValueError(f"counts must be positive block counts, got {list(counts)}")
    best_ms = _figures(step_ms(best))
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for d in (-1, 1):
                cand = list(best)
                cand[i], cand[i + 1] = cand[i] + d, cand[i + 1] - d
                if min(cand) < 1:
                    continue
                ms = _figures(step_ms(cand))
                if _shorter(ms, best_ms):
                    best, best_ms, improved = cand, ms, True
    return best


def _figures(value: float | Sequence[float]) -> tuple[float, ...]:
    return (float(value),) if isinstance(value, (int, float)) else tuple(float(v) for v in value)


def _shorter(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """``a`` before ``b`` in order, each figure equal within a relative 1e-9 passing to the next."""
    for x, y in zip(a, b):
        if x < y * (1 - 1e-9):
            return True
        if x > y * (1 + 1e-9):
            return False
    return False
