"""The one resolved value of planning: what the build executes, and why it was chosen.

The user's options keep meaning what the user asked (``"auto"`` included);
every choice made for them lives here, frozen, and is what every rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import Config

if TYPE_CHECKING:
    from .levers import Levers

__all__ = ["Choice", "Decision"]


@dataclass(frozen=True)
class Choice:
    """What one way of deciding chose (timed trials, CPU thread teams, predictions, a layout given), and why.

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
    hint: str = ""
    schedule: str = "1f1b"  # the schedule the plan runs: the user's, or the one schedule="auto" chose

    @property
    def chosen(self) -> str:
        """The chosen configuration's trial label ("" without trials)."""
        return self.config.label if self.trials else ""


@dataclass(frozen=True)
class Decision(Choice):
    """The choice as :func:`~pipedp.decide.choose.decide` made it whole, made once: what every rank runs.

    Adds what planning measured (``planning_s``, ``source``) and, from
    :func:`~pipedp.decide.levers.settle` on every rank before anything is
    built, the levers, each stage's place and the world layout.
    """

    planning_s: float = 0.0
    source: str = "profile"  # where the block times came from: "profile" (measured) or "cost model"
    levers: Levers | None = None  # precision, BatchNorm mode, CUDA graph, recompute, concurrency pieces, ...
    places: tuple[tuple[int, torch.device], ...] = ()  # (pipeline rank, device) of each stage
    pp: int = 1  # pipeline ranks
    dp: int = 1  # data-parallel replicas

    @property
    def settled(self) -> Levers:
        """The levers, once :func:`~pipedp.decide.levers.settle` made the decision whole (else an error)."""
        if self.levers is None:
            raise RuntimeError("the decision is not settled: pass it through pipedp.decide.levers.settle first")
        return self.levers

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
