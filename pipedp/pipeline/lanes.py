"""This rank's lanes: each stage's own, the side lanes its work also runs on, the copy lanes between devices.

The interpreter issues every action on a lane from here and moves tensors
between lanes and devices through here; the executor forks them all at a
step's start and joins them at its end; the readers of a stage's gradients
(the gradient sync, an early update) wait for the stage's side lanes. Order
between lanes is events only, so a step never waits on the host.
"""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

from ..device import canonical_device
from .stage import Stage
from .stream import Lane, current_lane, new_lane
from .weight_grad import anchor

__all__ = ["RankLanes", "LaneOp"]


class LaneOp(Protocol):
    """What places an action on a lane: its kind and its stage (global index)."""

    @property
    def kind(self) -> str: ...

    @property
    def stage(self) -> int: ...


class RankLanes:
    """The lanes of ``stages`` (this rank's, by global index).

    ``side_weights``: each stage's W runs on a side lane of its own, beside
    the stage's next action (``split_grads``). ``held``: backwards are split
    (I and W), so each device gets the leaf that held weight-gradient nodes
    hang from.
    """

    def __init__(self, stages: Mapping[int, Stage], *, side_weights: bool = False, held: bool = False) -> None:
        self.stages = stages  # read at each use: a stage's lane is the stage's own attribute
        self.devices = list(dict.fromkeys(canonical_device(s.device) for s in stages.values()))
        # One copy lane per device: cross-device copies run on the source device's copy lane.
        self.copy = {d: new_lane(d, f"copy:{d}") for d in self.devices if len(self.devices) > 1}
        self.weights = {s: new_lane(st.device, f"wgrad{s}") for s, st in stages.items()} if side_weights else {}
        # Per stage, the lanes it issues work on besides its own: W's side lane, a block's shortcut (installed
        # later by the concurrency pieces).
        self.extra: dict[int, list[Lane]] = {s: [lane] for s, lane in self.weights.items()}
        self._anchors = {d: anchor(d) for d in self.devices} if held else {}

    @property
    def side(self) -> list[Lane]:
        """Every lane the stages issue work on besides their own."""
        return list(dict.fromkeys(lane for lanes in self.extra.values() for lane in lanes))

    def of_stage(self, stage: int) -> list[Lane]:
        """The lanes besides its own on which stage ``stage`` accumulates gradients (their readers wait for them)."""
        return list(self.extra.get(stage, ()))

    def of(self, op: LaneOp) -> Lane:
        """The lane ``op`` runs on: its stage's, or for W the stage's side lane where there is one."""
        if op.kind == "W" and op.stage in self.weights:
            return self.weights[op.stage]
        return self.stages[op.stage].lane

    def anchor(self, device: torch.device) -> torch.Tensor:
        """The leaf the held weight-gradient nodes of ``device`` hang from (:mod:`.weight_grad`)."""
        return self._anchors[canonical_device(device)]

    def fork(self) -> None:
        """Every lane starts after what the caller issued before the step.

        The copy and side lanes too, although their work waits for a stage's
        lane anyway: :meth:`join` makes the caller wait for each of them, and
        under CUDA-graph capture a stream may only wait for a stream that joined
        the capture. A side lane a step never uses (a model without a forking
        block, a stage without a convolution) would otherwise be an uncaptured
        stream, and waiting for it invalidates the capture.
        """
        for s in self.stages.values():
            s.lane.wait_lane(current_lane(s.device))
        for lane in (*self.copy.values(), *self.side):
            lane.wait_lane(current_lane(lane.device))

    def join(self) -> None:
        """The caller's streams wait for everything the step issued."""
        for d in self.devices:
            cur = current_lane(d)
            for s in self.stages.values():
                if s.device == d:
                    cur.wait_lane(s.lane)
            if d in self.copy:
                cur.wait_lane(self.copy[d])
            for side in self.side:
                if side.device == d:
                    cur.wait_lane(side)

    def move(self, t: torch.Tensor, ready: "torch.cuda.Event | None", src: torch.device, dst: Lane) -> torch.Tensor:
        """``t`` (made on ``src`` when ``ready`` fires) usable on lane ``dst``."""
        src = canonical_device(src)
        if src == dst.device:
            dst.wait(ready)
            dst.keep(t)
            return t
        if src.type != "cuda" or dst.device.type != "cuda":
            dst.wait(ready)
            return t.to(dst.device)
        copy = self.copy[src]
        copy.wait(ready)
        # torch copies across devices on the source's current stream and makes the
        # destination's current stream wait for it: make those our copy lane and dst.
        with copy.use(), dst.use():
            out = t.to(dst.device, non_blocking=True)
        copy.keep(t)
        return out
