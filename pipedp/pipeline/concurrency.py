"""The concurrent pieces of a built pipeline installed together, and the rules they must keep.

:func:`install` puts the chosen pieces on the executor's stages (shortcut
branches, split weight gradients); :class:`Concurrency` tells the readers of
gradients which side lanes to wait for (the executor's end-of-step join, the
gradient sync, an early update) and undoes the swaps. The early update
itself needs the optimizer and is made by the engine
(:class:`~pipedp.pipeline.early_update.EarlyUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .branches import Branches, concurrent_branches
from .executor import Executor
from .split_grad import SplitGrads, split_grads
from .stream import Lane

if TYPE_CHECKING:
    from .gradsync import GradSync

__all__ = ["Concurrency", "Pieces", "install"]


class Pieces(Protocol):
    """Which pieces a plan runs (the decision's levers)."""

    @property
    def branches(self) -> bool: ...

    @property
    def split_grads(self) -> bool: ...

    @property
    def early_update(self) -> bool: ...


@dataclass
class Concurrency:
    """What :func:`install` swapped in (None: that piece is off)."""

    branches: Branches | None = None
    split: SplitGrads | None = None
    early_update: bool = False  # made by the engine (it needs the optimizer); noted here with the others

    def notes(self) -> list[str]:
        out = []
        if self.early_update:
            out.append("each stage's optimizer update starts after its last backward (early_update=True)")
        if self.branches is not None:
            out.append(self.branches.note())
        if self.split is not None:
            out.append(f"{self.split.count} convolution(s) compute their weight gradient on a side stream "
                       f"(split_grads=True)")
        return out

    def lanes(self, stage: int) -> list[Lane]:
        """The side lanes stage ``stage`` (global index) issues work on."""
        out = []
        if self.split is not None:
            out += self.split.lanes(stage)
        if self.branches is not None and self.branches.lanes is not None:
            out.append(self.branches.lanes.by_stage[stage])
        return out

    def connect(self, executor: Executor, sync: GradSync | None) -> None:
        """The executor joins the side lanes at the end of a step; the gradient sync hears of split gradients."""
        executor.side_lanes = list(dict.fromkeys(lane for st in executor.stages for lane in self.lanes(st.index)))
        if sync is None:
            return
        for pos, st in enumerate(executor.stages):
            # A bucket's gradients may come from the stage's stream or a side lane, in any order on the host.
            sync.after[pos] = [st.lane, *self.lanes(st.index)]
        if self.split is not None:
            self.split.on_accumulate.append(sync.accumulated)

    def undo(self) -> None:
        """Put every swapped layer and block back (safe to call more than once)."""
        for part in (self.branches, self.split):
            if part is not None:
                part.undo()


def install(executor: Executor, pieces: Pieces) -> Concurrency:
    """Swap in the pieces the plan keeps on ``executor``'s stages (nothing when all are off)."""
    done = Concurrency(early_update=pieces.early_update)
    try:
        if pieces.branches:
            done.branches = concurrent_branches(executor.stages)
        if pieces.split_grads:
            done.split = split_grads(executor.stages)
    except BaseException:
        done.undo()
        raise
    return done


