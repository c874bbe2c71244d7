"""The concurrent pieces of a built pipeline installed together, and the lanes their readers wait for.

:func:`install` puts the chosen pieces on the executor's stages: shortcut
branches (a block's forward on two lanes). Split weight gradients need no
installing: the lowering gives each backward as I then W and the executor
runs W on the stage's side lane (``Executor(side_weights=True)``).
:meth:`~pipedp.pipeline.gradsync.GradSync.follow_lanes` tells the gradient sync which lanes a
stage's gradients are accumulated on; the executor's end-of-step join and an early update read
them from :meth:`~pipedp.pipeline.lanes.RankLanes.of_stage`. The early update itself needs the
optimizer and is made by the engine
(:class:`~pipedp.pipeline.early_update.EarlyUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .branches import Branches, concurrent_branches
from .executor import Executor

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
    """What :func:`install` swapped in (None: that piece is off), and the pieces the plan runs besides."""

    branches: Branches | None = None
    split_grads: bool = False  # lowered as actions (W on a side lane), noted here with the others
    early_update: bool = False  # made by the engine (it needs the optimizer)

    def notes(self) -> list[str]:
        out = []
        if self.early_update:
            out.append("each stage's optimizer update starts after its last backward (early_update=True)")
        if self.branches is not None:
            out.append(self.branches.note())
        if self.split_grads:
            out.append("each backward runs as I then W, W (the convolutions' and linear layers' weight gradients) "
                       "on the stage's side stream beside its next action (split_grads=True)")
        return out

    def undo(self) -> None:
        """Put every swapped block back (safe to call more than once)."""
        if self.branches is not None:
            self.branches.undo()


def install(executor: Executor, pieces: Pieces) -> Concurrency:
    """Swap in the pieces the plan keeps on ``executor``'s stages; their lanes join the executor's."""
    done = Concurrency(split_grads=pieces.split_grads, early_update=pieces.early_update)
    if pieces.branches:
        done.branches = concurrent_branches(executor.stages)
        if done.branches.lanes is not None:
            for st in executor.stages:
                executor.lanes.extra.setdefault(st.index, []).append(done.branches.lanes.by_stage[st.index])
    return done
