"""What the advisor chooses among: configurations (resources, batch size, microbatches) and their grid.

``resources`` are what a run pays for: CPU cores (torch's threads) on one
machine, or GPUs / data-parallel ranks under torchrun. ``batch`` is the
global batch of one optimizer step (all ranks together), because that is what
the accuracy depends on; ``microbatches`` is pipedp's split of it. A
configuration's cost is ``resources x wall time``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..checks import positive_int

__all__ = ["Config", "SearchSpace", "STEP_DIRECTIONS"]

# Step time never rises with resources, never falls with the batch or the number of microbatches (on one device
# microbatches only split the work; a pipeline over several devices may want -1 here, see SearchSpace).
STEP_DIRECTIONS = (-1, 1, 1)


@dataclass(frozen=True, order=True)
class Config:
    """One configuration: ``resources`` cores or ranks, a global ``batch``, split into ``microbatches``."""

    resources: int
    batch: int
    microbatches: int = 1

    def __post_init__(self) -> None:
        for name in ("resources", "batch", "microbatches"):
            positive_int(name, getattr(self, name))
        if self.microbatches > self.batch:
            raise ValueError(f"{self.microbatches} microbatches do not fit a batch of {self.batch}: "
                             f"use at most {self.batch} microbatches")

    def point(self) -> tuple[float, float, float]:
        """The configuration as a point of the step-time model's axes."""
        return float(self.resources), float(self.batch), float(self.microbatches)

    def __str__(self) -> str:
        return f"r={self.resources} b={self.batch} m={self.microbatches}"


def _values(name: str, values: tuple[int, ...]) -> tuple[int, ...]:
    if not values:
        raise ValueError(f"{name} must list at least one value")
    for v in values:
        positive_int(name, v)
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class SearchSpace:
    """The grid of configurations: every resources x batch x microbatches that fits (microbatches <= batch).

    ``microbatch_direction``: +1 when more microbatches never make a step
    faster (one device: they only split the work), -1 when they never make
    it slower (a pipeline over several devices whose bubble they shrink).
    """

    resources: tuple[int, ...]
    batches: tuple[int, ...]
    microbatches: tuple[int, ...] = (1,)
    microbatch_direction: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", _values("resources", tuple(self.resources)))
        object.__setattr__(self, "batches", _values("batches", tuple(self.batches)))
        object.__setattr__(self, "microbatches", _values("microbatches", tuple(self.microbatches)))
        if self.microbatch_direction not in (1, -1):
            raise ValueError(f"microbatch_direction must be +1 or -1, got {self.microbatch_direction!r}")

    @property
    def directions(self) -> tuple[int, int, int]:
        return STEP_DIRECTIONS[0], STEP_DIRECTIONS[1], self.microbatch_direction

    def configs(self) -> list[Config]:
        return [Config(r, b, m) for r, b, m in product(self.resources, self.batches, self.microbatches) if m <= b]

    def design(self) -> list[Config]:
        """The configurations to profile by default: every corner of the grid plus its middle, at each resource level.

        Corners pin the law's ends on every axis; the middle batch and
        microbatch count at every resource level pin its curvature. Fewer than
        the grid once an axis has more than three values.
        """
        def ends(v: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(sorted({v[0], v[-1]}))

        def mid(v: tuple[int, ...]) -> int:
            return v[len(v) // 2]

        picked = {Config(r, b, m) for r, b, m in product(ends(self.resources), ends(self.batches),
                                                         ends(self.microbatches)) if m <= b}
        picked |= {Config(r, mid(self.batches), mid(self.microbatches)) for r in self.resources
                   if mid(self.microbatches) <= mid(self.batches)}
        return sorted(picked)
