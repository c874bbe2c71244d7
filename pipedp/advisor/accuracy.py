"""Accuracy vs (batch size, epochs) from a few short training runs: a conservative monotone bound.

Assumed, and what makes a few runs enough: at a fixed learning-rate recipe,
test accuracy never falls with more epochs and never rises with a larger
batch (fewer optimizer steps per epoch). Resources and microbatches are
assumed not to change it (they change how fast a step runs, not what it
computes; pipedp's per-microbatch BatchNorm statistics are the one small
exception). Under these assumptions the accuracy of ``(batch, epochs)`` is at
least that of any measured run with a batch at least as large after at most
as many epochs: :meth:`AccuracyModel.lower` returns the largest such value
of the isotonic fit (so noisy runs are pooled, never cherry-picked).

The bound is conservative on purpose, and extrapolates conservatively: past
the epochs a run measured, it assumes no further gain; for a batch larger
than every measured one, or fewer epochs than any run measured, it knows
nothing and says so (None), so the advisor never picks such a configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..checks import positive_int
from .monotone import Isotonic

__all__ = ["AccuracyRun", "AccuracyBound", "AccuracyModel", "ACCURACY_DIRECTIONS"]

ACCURACY_DIRECTIONS = (-1, 1)  # (batch, epochs): never better with a larger batch, never worse with more epochs


class AccuracyRun(Protocol):
    """Trains at ``batch`` from scratch; the test accuracy (0..1) after each epoch.

    It trains ``epochs`` epochs, or stops after the first epoch whose accuracy
    reaches ``target`` (when given): under the model's assumption more epochs
    could only confirm what that epoch showed, so they are not paid for.
    """

    def __call__(self, batch: int, epochs: int, target: float | None = None) -> Sequence[float]: ...


class AccuracyBound(Protocol):
    """What the chooser needs of an accuracy model: bounds on the accuracy of ``(batch, epochs)``, None: unknown."""

    def lower(self, batch: int, epochs: float) -> float | None: ...

    def upper(self, batch: int, epochs: float) -> float | None: ...


@dataclass(frozen=True)
class AccuracyModel:
    """The isotonic fit of measured accuracy over (batch, epochs), and the runs it came from."""

    fit: Isotonic
    runs: Mapping[int, tuple[float, ...]]

    @classmethod
    def from_runs(cls, runs: Mapping[int, Sequence[float]]) -> "AccuracyModel":
        """``runs``: batch -> accuracy after epoch 1, 2, ... of one run at that batch."""
        if not runs:
            raise ValueError("the accuracy model needs at least one run: profile at least one batch size")
        points, values, kept = [], [], {}
        for batch, accs in sorted(runs.items()):
            positive_int("batch", batch)
            accs = tuple(float(a) for a in accs)
            if not accs or not all(np.isfinite(a) and 0.0 <= a <= 1.0 for a in accs):
                raise ValueError(f"the run at batch {batch} must give accuracies in [0, 1] after each epoch, "
                                 f"got {list(accs)}")
            kept[batch] = accs
            points += [(float(batch), float(e)) for e in range(1, len(accs) + 1)]
            values += list(accs)
        return cls(Isotonic.fit(points, values, ACCURACY_DIRECTIONS), kept)

    def lower(self, batch: int, epochs: float) -> float | None:
        """At least this accuracy at ``(batch, epochs)`` (None: no measured run bounds it from below)."""
        return self.fit.lower((float(batch), float(epochs)))

    def upper(self, batch: int, epochs: float) -> float | None:
        """At most this accuracy at ``(batch, epochs)`` (None: no measured run bounds it from above)."""
        return self.fit.upper((float(batch), float(epochs)))

    def epochs_to_reach(self, batch: int, target: float, max_epochs: int) -> int | None:
        """The fewest whole epochs after which the lower bound reaches ``target`` (None: not within ``max_epochs``)."""
        for e in range(1, max_epochs + 1):
            lo = self.lower(batch, e)
            if lo is not None and lo >= target:
                return e
        return None
