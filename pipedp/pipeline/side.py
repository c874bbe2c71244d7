"""Side lanes: one extra stream per stage, found from the stream a layer runs on.

A layer swapped for concurrent work (a block's shortcut, a convolution's
weight gradient) does not know which stage it belongs to; it finds its side
lane from the current stream, which the executor sets to the stage's lane
for the stage's forward and backward (autograd runs a backward op on the
stream its forward ran on). On a device without streams every stage shares
one in-order stand-in, so the same code runs in host order. A stream that is
no stage's (a call outside the pipeline) has no side lane: the layer then
runs everything on the current stream.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .stage import Stage
from .stream import Lane, current_lane, new_lane

__all__ = ["SideLanes"]


def _key(lane: Lane) -> tuple[torch.device, Hashable]:
    return lane.device, lane.stream


class SideLanes:
    """A side lane for each of ``stages`` (named ``<name><stage index>``), keyed by the stage's stream.

    Shared, not copied, by ``copy.deepcopy`` (swapped layers hold it; a stream
    cannot be copied and a copy of the model runs on the same stages); pickled
    as no lanes, so a saved model stays picklable and runs in plain order.
    """

    def __init__(self, stages: Sequence[Stage], name: str) -> None:
        self.by_stream: dict[tuple[torch.device, Hashable], Lane] = {}
        self.by_stage: dict[int, Lane] = {}
        for st in stages:
            lane = self.by_stream.get(_key(st.lane))
            if lane is None:
                lane = self.by_stream[_key(st.lane)] = new_lane(st.device, f"{name}{st.index}")
            self.by_stage[st.index] = lane

    def current(self, device: torch.device) -> Lane | None:
        """The side lane of the stage whose stream is current on ``device`` (None: not a stage's stream)."""
        return self.by_stream.get(_key(current_lane(device)))

    def lanes(self) -> list[Lane]:
        return list(dict.fromkeys(self.by_stage.values()))

    def __deepcopy__(self, memo: dict) -> "SideLanes":
        return self

    def __reduce__(self) -> tuple[type, tuple[tuple[()], str]]:
        # A pickled model (torch.save, another process) has no stages: its layers run on the current stream.
        return SideLanes, ((), "")
