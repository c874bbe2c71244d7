"""How much of a step's gradient sync ran behind compute, from the spans its all-reduces were in flight."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncStats", "union_ms"]


@dataclass
class SyncStats:
    """Timing of one step's gradient sync: how much of it ran behind compute."""

    buckets: int = 0
    sync_ms: float = 0.0  # time some bucket was in flight
    hidden_ms: float = 0.0  # part of that before the optimizer had to wait
    exposed_ms: float = 0.0  # the optimizer's wait

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ms / self.sync_ms if self.sync_ms > 0 else 1.0


def union_ms(intervals: list[tuple[float, float]], until: float) -> tuple[float, float]:
    """Length of the union of ``intervals`` and of its part before ``until`` (seconds in, ms out)."""
    total = before = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        a = max(a, end)
        if b > a:
            total += b - a
            before += max(0.0, min(b, until) - a)
            end = b
    return total * 1e3, before * 1e3
