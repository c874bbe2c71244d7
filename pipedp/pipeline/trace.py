"""One training step as a Chrome / Perfetto trace: a lane per stream, a span per action.

Open the file in https://ui.perfetto.dev or ``chrome://tracing``. Each stage's
lane shows the forward (``F<i>``) and backward (``B<i>``) of every microbatch,
each gradient-sync lane the all-reduce of every bucket from launch to
completion, and the optimizer lane the update, so pipeline bubbles and the
overlap of gradient sync with backward can be seen. On CUDA the times come from
timing events on the streams themselves (device time); on the CPU the lanes run
in host order and the times are the host clock.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..atomic import write_text
from .stream import Lane, current_lane

__all__ = ["Clock", "Span", "step_spans", "chrome_trace", "write_trace"]


class Clock:
    """The origin of a traced step: the host clock, and an event on each CUDA device's current stream."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.host = time.perf_counter()
        self.origin: dict[torch.device, Any] = {}
        for d in devices:
            if torch.device(d).type == "cuda":
                self.origin[torch.device(d)] = self.mark(current_lane(d))

    def mark(self, lane: Lane) -> Any:
        """Now, on ``lane``: an event recorded on its stream (CUDA) or the host clock."""
        if not lane.is_cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(lane.stream)
        return ev

    def ms(self, mark: Any, device: torch.device | None = None) -> float:
        """Milliseconds from the origin to ``mark`` (an event waits until it has happened)."""
        if isinstance(mark, float):
            return (mark - self.host) * 1e3
        mark.synchronize()
        return self.origin[torch.device(device)].elapsed_time(mark)


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start_ms: float
    end_ms: float
    category: str = ""
    args: dict[str, Any] = field(default_factory=dict)


def lane_name(lane: Lane) -> str:
    if lane.is_cuda:
        assert lane.stream is not None
        return f"({lane.device}, stream {lane.stream.stream_id})"
    return f"({lane.device})"


def step_spans(stages: Sequence[Any], clock: Clock, timer: Any, sync: Any, updates: Sequence[tuple]) -> list[Span]:
    """The spans of one recorded step.

    ``stages`` are this rank's stages in the timer's order, ``timer`` a
    StepTimer made with ``clock``, ``sync`` the GradSync (or None) and
    ``updates`` (device, start mark, end mark) of the optimizer step.
    """
    spans = []
    for pos, label, start, end in timer.spans():
        st = stages[pos]
        kind = "forward" if label.startswith("F") else "backward"
        args = {"stage": st.index, "microbatch": int(label[1:]), "blocks": f"{st.names[0]}..{st.names[-1]}"}
        spans.append(Span(f"stage {st.index} {lane_name(st.lane)}", label, start, end, kind, args))
    if sync is not None:
        for pos, nbytes, start, end in sync.spans(clock):
            lane = f"gradsync stage {stages[pos].index} {lane_name(sync.lanes[pos])}"
            spans.append(Span(lane, f"all-reduce {nbytes / 2**20:.2f} MiB", start, end, "gradsync", {"bytes": nbytes}))
    for d, start, end in updates:
        spans.append(Span(f"optimizer {d}", "step", clock.ms(start, d), clock.ms(end, d), "optimizer"))
    return spans


def chrome_trace(spans: Sequence[Span], *, process: str = "pipedp", metadata: dict[str, Any] | None = None) -> dict:
    """The trace-event JSON object for ``spans`` (lanes in order of first appearance)."""
    lanes = list(dict.fromkeys(s.lane for s in spans))
    tid = {lane: k for k, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": process}}]
    for lane, k in tid.items():
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": k, "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": k, "args": {"sort_index": k}})
    for s in sorted(spans, key=lambda s: (tid[s.lane], s.start_ms)):
        events.append({
            "ph": "X", "name": s.name, "cat": s.category, "pid": 0, "tid": tid[s.lane],
            "ts": round(s.start_ms * 1e3, 3), "dur": round(max(s.end_ms - s.start_ms, 0.0) * 1e3, 3), "args": s.args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}


def write_trace(path: str | os.PathLike, spans: Sequence[Span], **kw: Any) -> None:
    """Write :func:`chrome_trace` to ``path`` atomically."""
    write_text(path, json.dumps(chrome_trace(spans, **kw)) + "\n")
