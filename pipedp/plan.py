"""The pipeline plan: which blocks run where, and how long each stage should take.

A plain value, printable as a table. Predicted times come from the block
profile (or cost model); measured times are filled in by the engine from the
first training steps, so a user can see whether the cut is balanced in practice.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

__all__ = ["StagePlan", "Plan"]


@dataclass(frozen=True)
class StagePlan:
    index: int
    blocks: tuple[str, ...]
    device: str
    stream: str
    predicted_ms: float  # forward+backward of one microbatch
    activation_mb: float = 0.0  # predicted peak saved activations (MiB) under the schedule
    param_mb: float = 0.0
    measured_ms: float | None = None  # per microbatch, from the first training steps
    threads: int | None = None  # a concurrent CPU stage's intra-op threads (None: the caller's)

    @property
    def label(self) -> str:
        if len(self.blocks) <= 2:
            return ", ".join(self.blocks)
        return f"{self.blocks[0]} .. {self.blocks[-1]} ({len(self.blocks)})"


def _ratio(values: list[float]) -> float:
    mean = statistics.fmean(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Plan:
    """Stages of a pipeline and their predicted (and measured) cost."""

    stages: tuple[StagePlan, ...]
    microbatches: int
    microbatch_size: int
    schedule: str
    batchnorm: str
    predicted_step_ms: float
    source: str = "profile"  # "profile", "cost model" or "given"
    notes: tuple[str, ...] = field(default=())
    contract: str = ""  # what the plan keeps of the user's math (:func:`pipedp.decide.coupling.contract`)
    layout: str = ""  # data parallel x pipeline ranks, when distributed
    sync: str = ""  # the last measured gradient sync, when distributed
    trials: tuple[tuple[str, float], ...] = ()  # stages="auto": (configuration label, ms per trial step)
    trial_baseline_ms: float | None = None  # the bar: the strongest alternative's ms, timed beside the trials
    trial_chosen: str = ""  # the chosen configuration's label among the trials
    compiled: bool = False  # the stages run through torch.compile
    channels_last: bool = False  # the model and batches run in channels-last memory format
    kernels: bool = False  # the depthwise layers run the tuned kernels of ``kernels="auto"``/``"tvm"``
    bar: str = ""  # the strongest alternative the trials measured (its label)
    planning_s: float = 0.0  # seconds the plan took: profiling, trials, compiles
    hint: str = ""  # a measured precision hint (never applied)

    @property
    def counts(self) -> list[int]:
        return [len(s.blocks) for s in self.stages]

    @property
    def balance(self) -> float:
        """Predicted slowest stage over the mean stage (1.0 is perfect balance)."""
        return _ratio([s.predicted_ms for s in self.stages])

    @property
    def measured_balance(self) -> float | None:
        ms = [s.measured_ms for s in self.stages]
        if any(m is None for m in ms):
            return None
        return _ratio([float(m) for m in ms])  # type: ignore[arg-type]

    def with_measured(self, measured_ms: "list[float | None]") -> "Plan":
        """The plan with measured ms per stage (None for a stage measured elsewhere)."""
        if len(measured_ms) != len(self.stages):
            raise ValueError(f"{len(measured_ms)} measurements for {len(self.stages)} stages")
        return replace(self, stages=tuple(replace(s, measured_ms=m) for s, m in zip(self.stages, measured_ms)))

    def with_threads(self, threads: "list[int]", predicted_ms: "list[float]", step_ms: float) -> "Plan":
        """The plan with concurrent CPU stages: each stage's threads and its ms predicted at that count."""
        if not (len(threads) == len(predicted_ms) == len(self.stages)):
            raise ValueError(f"{len(threads)} thread counts for {len(self.stages)} stages")
        stages = tuple(replace(s, threads=t, predicted_ms=ms, stream=f"worker{s.index}")
                       for s, t, ms in zip(self.stages, threads, predicted_ms))
        return replace(self, stages=stages, predicted_step_ms=step_ms)

    def with_sync(self, sync: str) -> "Plan":
        return replace(self, sync=sync)

    def __str__(self) -> str:
        head = (
            f"pipedp plan: {self.contract + '; ' if self.contract else ''}{len(self.stages)} stage(s) x {self.microbatches} microbatch(es) of "
            f"{self.microbatch_size}, schedule={self.schedule}, batchnorm={self.batchnorm}, costs from {self.source}"
            + (", channels_last" if self.channels_last else "") + (", compiled" if self.compiled else "")
            + (", tuned depthwise kernels" if self.kernels else "")
        )
        rows = [("stage", "device", "stream", "blocks", "pred ms", "meas ms", "act MiB", "param MiB")]
        for s in self.stages:
            meas = "-" if s.measured_ms is None else f"{s.measured_ms:.2f}"
            rows.append(
                (str(s.index), s.device, s.stream, s.label, f"{s.predicted_ms:.2f}", meas,
                 f"{s.activation_mb:.1f}", f"{s.param_mb:.1f}")
            )
        if any(s.threads is not None for s in self.stages):
            rows = [r[:3] + (t,) + r[3:] for r, t in zip(rows, ["threads"] + [str(s.threads) for s in self.stages])]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        mb = self.measured_balance
        tail = f"balance (slowest/mean): predicted {self.balance:.2f}"
        if mb is not None:
            tail += f", measured {mb:.2f}"
        tail += f"; predicted step {self.predicted_step_ms:.1f} ms"
        lines.append(tail)
        if self.layout:
            lines.append(f"layout: {self.layout}")
        if self.sync:
            lines.append(f"gradient sync: {self.sync}")
        lines.extend(self._trial_lines())
        lines.extend(f"note: {n}" for n in self.notes)
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)

    @property
    def label(self) -> str:
        """``"SxM"`` (and ``" compiled"``, ``" tuned kernels"``): the name trials give this plan."""
        levers = ((" channels_last" if self.channels_last else "") + (" compiled" if self.compiled else "")
                  + (" tuned kernels" if self.kernels else ""))
        return self.trial_chosen or f"{len(self.stages)}x{self.microbatches}{levers}"

    def _trial_lines(self) -> list[str]:
        """The timed trials of ``stages="auto"``: ms per step of each configuration against the bar."""
        if not self.trials:
            return []
        bar = self.trial_baseline_ms
        head = "trials (ms per forward+backward step"
        if bar is not None:
            head += f"; the bar is the strongest alternative, {self.bar or 'the plain step'}, {bar:.2f} ms"
        head += f"; planning took {self.planning_s:.1f} s):" if self.planning_s else "):"
        rows = [("configuration", "ms", "x bar", "")]
        matched = any(label == self.label for label, _ in self.trials)
        for label, ms in self.trials:
            ratio = f"{bar / ms:.2f}" if bar is not None and ms > 0 else "-"
            mark = "chosen" if label == self.label else ("bar" if label == self.bar else "")
            rows.append((label, f"{ms:.2f}", ratio, mark))
        if not matched:  # the bar's configuration, run by pipedp, without a trial of its own
            rows.append((self.label, "-", "-", "chosen"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
