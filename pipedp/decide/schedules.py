"""The schedule a plan runs: the user's, or with ``schedule="auto"`` the one whose simulated step is fastest.

Over pipeline ranks the schedules differ in how long each rank waits: ZB-H1
fills 1F1B's bubble with the weight gradients, Interleaved 1F1B shortens the
fill and drain at the cost of more messages and stages. The simulator, fed
the profiled block times, the transfers between ranks and a cost per action,
weighs them with the cut each one gets. In one process every schedule runs
the same work in turn on a CPU, and the stages of one GPU share it: there
1F1B is kept (the least activation memory at the same step).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..options import StagesSpec
from ..partition.profile import BlockProfile
from .cut import resolve_counts, simulate_plan

__all__ = ["AUTO", "fixed", "candidates", "layout_schedules", "choose_schedule"]

AUTO = "auto"
KEPT = "1f1b"  # what "auto" runs where no schedule is weighed


def fixed(requested: str) -> str:
    """The schedule where none is weighed (timed trials in one process, CPU thread teams): the user's, or
    1F1B for ``"auto"``."""
    return KEPT if requested == AUTO else requested


def candidates(ranks: int) -> tuple[str, ...]:
    """The schedules ``"auto"`` weighs: 1F1B, ZB-H1 and interleaved over pipeline ranks, 1F1B in one process."""
    return ("1f1b", "zb-h1", "interleaved") if ranks > 1 else (KEPT,)


def layout_schedules(requested: str) -> tuple[str, ...]:
    """The schedules ``pp="auto"`` weighs for each pipeline layout: the user's, or for ``"auto"`` 1F1B, ZB-H1
    and interleaved (two stages per rank, :data:`~pipedp.decide.layout.INTERLEAVED_PER_RANK`)."""
    return candidates(2) if requested == AUTO else (requested,)


def choose_schedule(profiles: Sequence[BlockProfile], stages: StagesSpec, devices: Sequence[torch.device],
                    microbatches: int, ranks: int) -> tuple[str, list[int], list[str]]:
    """The fastest simulated schedule of :func:`candidates` with its cut, and notes saying what it weighed.

    A schedule that cannot run this layout (interleaved with microbatches
    that do not go round the ranks) is left out; a spec no schedule can cut
    raises the error 1F1B would.
    """
    rows: list[tuple[str, float, list[int], list[str]]] = []
    first: ValueError | None = None
    for name in candidates(ranks):
        try:
            counts, notes = resolve_counts(profiles, stages, devices, microbatches, name, ranks=ranks)
            ms = simulate_plan(profiles, counts, devices, microbatches, name, ranks).makespan
        except ValueError as e:
            first = first or e
            continue
        rows.append((name, ms, counts, notes))
    if not rows:
        assert first is not None
        raise first
    name, ms, counts, notes = min(rows, key=lambda r: r[1])  # ties: the first, 1F1B before the rest
    if len(rows) > 1:
        weighed = ", ".join(f"{n} {t:.1f} ms" for n, t, _, _ in rows)
        notes = [*notes, f"schedule=auto: {name}, the fastest simulated step ({weighed})"]
    return name, counts, notes
