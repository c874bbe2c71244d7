"""How busy a GPU was and how much of that time several streams ran at once, from kernel intervals.

A pipeline on one GPU can only be faster than the plain step where the plain
step leaves the GPU idle (launch gaps, small kernels that do not fill it) and
the pipeline fills that idle time with another stream's kernels. Two numbers
say whether that happened: the busy fraction (time with any kernel running over
the wall time) and the concurrent share (of the busy time, the part with
kernels of two or more streams running together). Both are computed here from
plain ``(stream, start, end)`` intervals, so the sweep is tested without a GPU;
:func:`kernel_intervals` reads them from a ``torch.profiler`` Chrome trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

__all__ = ["Busy", "busy_time", "kernel_intervals"]

Interval = tuple[Hashable, float, float]  # (stream, start, end), any time unit


@dataclass(frozen=True)
class Busy:
    """Busy and concurrent time of a set of kernels over a wall-time window (same unit as the intervals)."""

    wall: float  # the window
    busy: float  # time with at least one kernel running
    concurrent: float  # time with kernels of two or more streams running
    streams: int  # distinct streams that ran a kernel

    @property
    def busy_fraction(self) -> float:
        return self.busy / self.wall if self.wall > 0 else 0.0

    @property
    def concurrent_share(self) -> float:
        """Of the busy time, the share with two or more streams active."""
        return self.concurrent / self.busy if self.busy > 0 else 0.0


def busy_time(intervals: Iterable[Interval], window: tuple[float, float] | None = None) -> Busy:
    """Sweep the intervals: time with any kernel, and with kernels of 2+ streams, inside ``window``.

    ``window`` defaults to the first start to the last end. Intervals on one
    stream may touch or overlap (profiler clocks are not exact); they count as
    one active stream. An interval with ``end < start`` is an error.
    """
    items = list(intervals)
    for stream, t0, t1 in items:
        if t1 < t0:
            raise ValueError(f"kernel interval on stream {stream!r} ends ({t1}) before it starts ({t0})")
    if window is None:
        window = (min((t0 for _, t0, _ in items), default=0.0), max((t1 for _, _, t1 in items), default=0.0))
    lo, hi = window
    if hi < lo:
        raise ValueError(f"window {window} ends before it starts")
    points: list[tuple[float, int, Hashable]] = []
    for stream, t0, t1 in items:
        t0, t1 = max(t0, lo), min(t1, hi)
        if t1 > t0:
            points += [(t0, 1, stream), (t1, -1, stream)]
    points.sort(key=lambda p: (p[0], p[1]))  # at equal times ends come first: touching kernels do not overlap
    depth: dict[Hashable, int] = {}
    active = 0
    busy = concurrent = 0.0
    last = lo
    for t, d, stream in points:
        if active:
            busy += t - last
            if active > 1:
                concurrent += t - last
        last = t
        before = depth.get(stream, 0)
        depth[stream] = before + d
        active += (before == 0 and d > 0) - (before == 1 and d < 0)
    return Busy(wall=hi - lo, busy=busy, concurrent=concurrent, streams=len({s for s, _, _ in items}))


def kernel_intervals(trace: Mapping[str, object]) -> list[Interval]:
    """``(stream, start_us, end_us)`` of every GPU kernel in a ``torch.profiler`` Chrome trace (as loaded JSON)."""
    events = trace.get("traceEvents", [])
    out: list[Interval] = []
    for ev in events if isinstance(events, Sequence) else []:
        if not isinstance(ev, Mapping) or ev.get("cat") != "kernel" or "dur" not in ev:
            continue
        args = ev.get("args")
        stream = args.get("stream", ev.get("tid")) if isinstance(args, Mapping) else ev.get("tid")
        t0 = float(ev["ts"])  # type: ignore[arg-type]
        out.append((stream, t0, t0 + float(ev["dur"])))  # type: ignore[arg-type]
    return out
