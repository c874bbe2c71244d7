"""``pipedp.inspect``: where a model can be cut, and what keeps it from being cut elsewhere.

Before any training step a user can see what ``stages="auto"`` will find:
the blocks (stages are contiguous runs of them), the modules kept whole
while tracing and why, the stretches of the forward where no cut can pass
what is live (with those values), and, for a model that
cannot be cut at all, the reason it would train as one stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .blocks import CutError, Point, blocks_of, carried, fx_blocks, is_resnet, traced_points
from .check import check_chain

__all__ = ["CutReport", "inspect_cut"]

MAX_LISTED = 12  # blocked stretches listed in the text; the rest are counted


@dataclass(frozen=True)
class CutReport:
    """What :func:`inspect_cut` found (``str()`` prints it)."""

    model: str
    structure: str  # "nn.Sequential", "ResNet layout", "fx graph"
    blocks: tuple[str, ...]  # block names in order; the cut points lie between them
    kept_whole: tuple[tuple[str, str], ...]  # (module, why) kept as one call while tracing
    blocked: tuple[str, ...]  # stretches of the forward with no cut point, and the values that keep it so
    reason: str | None = None  # why the model is not cut at all (stages="auto" trains it as one stage)

    def __str__(self) -> str:
        lines = [f"{self.model} ({self.structure}): "
                 + (f"{len(self.blocks)} blocks, {max(len(self.blocks) - 1, 0)} cut points"
                    if self.reason is None else f"not cut: {self.reason}")]
        if self.blocks and self.reason is None:
            lines.append("blocks: " + ", ".join(self.blocks))
        groups: dict[str, list[str]] = {}
        for m, why in self.kept_whole:
            groups.setdefault(why, []).append(m)
        for why, names in groups.items():
            more = f", ... ({len(names)} modules)" if len(names) > 3 else ""
            lines.append(f"kept whole ({why}): {', '.join(names[:3])}{more}")
        lines += [f"no cut: {b}" for b in self.blocked[:MAX_LISTED]]
        if len(self.blocked) > MAX_LISTED:
            lines.append(f"no cut: ... and {len(self.blocked) - MAX_LISTED} more stretches")
        return "\n".join(lines)


def _stretches(points: Sequence[Point]) -> list[str]:
    """Runs of consecutive points without a cut, each with the live values no cut can pass."""
    out: list[str] = []
    run: list[Point] = []
    for p in [*points, None]:
        if p is not None and not p.cut:
            run.append(p)
            continue
        if run:
            held = list(dict.fromkeys(v for q in run for v in q.live if not carried(v)))
            names = ", ".join(v.name for v in held[:4]) + (", ..." if len(held) > 4 else "")
            where = (f"after '{run[0].after.name}'" if len(run) == 1
                     else f"from '{run[0].after.name}' to '{run[-1].after.name}'")
            why = f"live there and not a tensor: {names} (a shape read, or a tuple taken apart later)"
            out.append(f"{where}: {why}")
            run = []
    return out


def _structure(model: nn.Module) -> str:
    if isinstance(model, nn.Sequential):
        return "nn.Sequential"
    return "ResNet layout" if is_resnet(model) else "fx graph"


def inspect_cut(model: nn.Module, sample: torch.Tensor, *, depth: int = 1) -> CutReport:
    """Where ``model`` can be cut on ``sample`` (a batch it takes), and what blocks the other places.

    Changes nothing on the model, the batch or the random generators (the
    check runs on copies, puts back every module's mode, buffers and
    ``.grad``, and forks the generators).
    """
    name, structure = type(model).__name__, _structure(model)
    kept: tuple[tuple[str, str], ...] = ()
    blocked: tuple[str, ...] = ()
    try:
        if structure == "fx graph":  # traced once: the blocks and the report's details from the same graph
            traced, points = traced_points(model)
            kept, blocked = tuple(traced.kept_whole.items()), tuple(_stretches(points))
            blocks = fx_blocks(name, traced, points)
        else:
            blocks = blocks_of(model, depth=depth)
        check_chain(model, blocks, sample)
    except CutError as e:
        return CutReport(name, structure, (), kept, blocked, e.reason)
    return CutReport(name, structure, tuple(b.name for b in blocks), kept, blocked)
