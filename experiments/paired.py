"""Ratios of timings taken side by side, round by round."""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["paired_ratio"]


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Median over rounds of ``num``'s window over ``den``'s of the same round (None for no rounds).

    Each pair is timed back to back: a load that lasts a round slows both
    sides of its pair, where it would move one side's median alone.
    """
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(ratios) if ratios else None
