"""A stage's optimizer update started as soon as that stage's gradients are final.

After a stage's last backward of the step (and, data-parallel, its gradient
sync), nothing changes its parameters' gradients any more, so their update
need not wait for the earlier stages' backward. The executor announces each
stage's last backward (:meth:`EarlyUpdate.stage_done`); the update of that
stage's parameters is issued then, on the stage's update lane (a side
stream on CUDA, ordered after the stage's stream, its weight-gradient side
lane and its gradient sync by events only, so the step stays capturable),
and :meth:`EarlyUpdate.finish` updates whatever no stage covered.

The user's one optimizer does each part: its ``param_groups`` are narrowed
to the part's parameters for one ``optimizer.step()`` and put back in a
``finally``. Group dicts, hyperparameters, per-parameter state and
``state_dict`` stay the optimizer's own, so LR schedulers and checkpoints
see the usual optimizer. Exact for an optimizer whose update of a parameter
reads only that parameter's gradient and state (every ``torch.optim``
optimizer but ``LBFGS``, which ``wrap`` refuses: its step needs a closure); step hooks run once per part.
What needs all gradients first is refused by the engine: global gradient
clipping and fp16 loss scaling (its inf/NaN check decides for all).

A parameter used by several stages belongs to the one whose last backward
comes last. A failure after some stage was updated is undone by the
engine's rollback, which copies parameters and optimizer state before the
step's first forward when this is on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Protocol, Sequence

import torch

from .deps import ACCUMULATES
from .schedule import Action
from .stage import Stage
from .stream import Lane, current_lane, new_lane

__all__ = ["EarlyUpdate", "narrowed"]


class StageSync(Protocol):
    def wait_stage(self, stage: int) -> None: ...


@contextlib.contextmanager
def narrowed(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """``optimizer`` sees only ``params`` (its groups keep their dicts; groups left empty are hidden)."""
    keep = {id(p) for p in params}
    groups = optimizer.param_groups
    full = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        optimizer.param_groups = [g for g in groups if g["params"]]
        yield
    finally:
        optimizer.param_groups = groups
        for g, ps in zip(groups, full):
            g["params"] = ps


class EarlyUpdate:
    """Per local stage, the parameters whose gradients are final after its last backward, and their update."""

    def __init__(self, optimizer: torch.optim.Optimizer, stages: Sequence[Stage],
                 train_order: Sequence[tuple[int, Action]], wait_lanes: dict[int, list[Lane]] | None = None) -> None:
        self.optimizer = optimizer
        self.stages = sorted(stages, key=lambda st: st.index)
        last = {s: k for k, (s, a) in enumerate(train_order) if a.kind in ACCUMULATES}  # the last accumulation's
        owner: dict[int, int] = {}  # parameter id -> the stage position whose last backward comes last
        for pos, st in enumerate(self.stages):
            for p in st.chain.parameters():
                prev = owner.get(id(p))
                if prev is None or last[st.index] > last[self.stages[prev].index]:
                    owner[id(p)] = pos
        params = {id(p): p for st in self.stages for p in st.chain.parameters()}
        self.parts: list[list[torch.Tensor]] = [[] for _ in self.stages]
        for pid, pos in owner.items():
            self.parts[pos].append(params[pid])
        self.covered = set(owner)
        self.lanes = [new_lane(st.device, f"update{st.index}") for st in self.stages]
        self.wait_lanes = wait_lanes or {}
        self.sync: StageSync | None = None
        self.done: list[int] = []  # stage positions updated in this step, in order
        # CPU worker lanes may finish two stages at once: one narrowing of the optimizer at a time.
        self._lock = threading.Lock()

    def begin(self, sync: StageSync | None) -> None:
        """A step starts; ``sync`` is the gradient sync its updates wait for (None: not distributed)."""
        self.sync = sync
        self.done = []

    def stage_done(self, pos: int) -> None:
        """Local stage ``pos`` ran its last backward (issued on the current stream): update its parameters."""
        params = self.parts[pos]
        if not params:
            return
        st, lane = self.stages[pos], self.lanes[pos]
        lane.wait_lane(current_lane(st.device))
        for other in self.wait_lanes.get(st.index, ()):
            lane.wait_lane(other)
        with lane.use(), self._lock:
            if self.sync is not None:
                self.sync.wait_stage(pos)
            with narrowed(self.optimizer, params):
                self.optimizer.step()
            self.done.append(pos)

    @property
    def rest(self) -> list[torch.Tensor]:
        """The optimizer's parameters that no local stage holds (read each step: groups may be added)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in self.covered]

    def finish(self) -> None:
        """After the step's backward: update the optimizer's parameters that no local stage holds."""
        rest = self.rest
        if rest:
            with self._lock, narrowed(self.optimizer, rest):
                self.optimizer.step()

    def join(self) -> None:
        """The caller's streams wait for every update lane."""
        for st, lane in zip(self.stages, self.lanes):
            current_lane(st.device).wait_lane(lane)
