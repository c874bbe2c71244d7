"""The one resolved value of planning: what the build executes, and why it was chosen.

The user's options keep meaning what the user asked (``"auto"`` included);
every choice made for them lives here, frozen, and is what every rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config

__all__ = ["Decision"]


@dataclass(frozen=True)
class Decision:
    """The chosen configuration, the trials behind it and the bar it had to beat.

    ``trials``: (label, ms per forward+backward step) of every configuration
    timed, the user's own steps (the bar's alternatives) included; ``bar`` and
    ``bar_ms``: the fastest of those alternatives; ``hint``: one line when this
    device ran another precision measurably faster (never applied).
    """

    config: Config
    notes: tuple[str, ...] = ()
    trials: tuple[tuple[str, float], ...] = ()
    bar: str = ""
    bar_ms: float | None = None
    planning_s: float = 0.0
    hint: str = ""
    source: str = "profile"  # where the block times came from: "profile" (measured) or "cost model"
    schedule: str = "1f1b"  # the schedule the plan runs: the user's, or the one schedule="auto" chose

    @property
    def counts(self) -> tuple[int, ...]:
        return self.config.counts

    @property
    def microbatches(self) -> int:
        return self.config.microbatches

    @property
    def compiled(self) -> bool:
        return self.config.compiled

    @property
    def channels_last(self) -> bool:
        return self.config.channels_last

    @property
    def concurrent(self) -> bool:
        return self.config.concurrent

    @property
    def kernels(self) -> bool:
        return self.config.kernels

    @property
    def threads(self) -> tuple[int, ...] | None:
        return self.config.threads

    @property
    def chosen(self) -> str:
        """The chosen configuration's trial label ("" without trials)."""
        return self.config.label if self.trials else ""
