"""Whether the ranks of one pipeline were fed one batch.

Every rank of a pipeline is handed ``(x, y)``: the first stage's rank reads
the inputs, the last stage's the targets, the others only the batch's size
(the microbatches, and so the messages, follow it). Fed apart, as DDP's
sampler feeds replicas (each rank a shard of its own), a pipeline trains on
one rank's images with another's labels and says nothing; fed other sample
counts, its ranks split other microbatches and fail or hang inside the step.
So at the start of each step the ranks of a pipeline gather a short header of
their batch (:func:`header`: the step, the sample count, a digest of x's and
of y's shape and dtype, two sums over y's values read as integers) and compare
the rows (:func:`check`) before any activation travels
(:meth:`~pipedp.pipeline.p2p.Transport.compare_batch`). Every rank sees the
same rows, so every rank refuses the same step with the same cause, and the
messages between the ranks stay in step for the next one.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import torch

from ..distributed import StepMismatch, behind_note

__all__ = ["header", "check"]

STEP, SAMPLES, X_KIND, Y_KIND, Y_SUM, Y_WEIGHTED = range(6)
_COLUMNS = 16  # values of each sample's target read at most (a dense target is sampled evenly)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _kind(t: torch.Tensor) -> int:
    """A digest of what a batch holds per sample: its shape beyond dim 0 and its dtype."""
    return zlib.crc32(repr((tuple(t.shape[1:]), str(t.dtype))).encode())


def _values(y: torch.Tensor) -> torch.Tensor:
    """At most :data:`_COLUMNS` of each sample's target values, their bits read as int64 (where y lives)."""
    t = y.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.reshape(t.shape[0] if t.dim() else 1, -1)
    if t.shape[1] > _COLUMNS:
        t = t[:, :: -(-t.shape[1] // _COLUMNS)]
    if t.is_floating_point():
        t = t.contiguous().view(_INTS[t.element_size()])
    return t.reshape(-1).long()


def header(x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """This rank's batch as six int64s (on y's device: no host read of y), for :func:`check`.

    The sums over y wrap around (mod 2**64), so they do not depend on the
    order of the additions: numpy on the host (a few microseconds, where
    torch's small ops cost tens) and torch on a GPU give the same numbers.
    The second sum weighs each value by its position (from 1), so targets in
    another order differ too.
    """
    v = _values(y)
    head = [step, x.shape[0], _kind(x), _kind(y)]
    if v.device.type == "cpu":
        a = v.numpy()
        with np.errstate(over="ignore"):
            sums = [int(a.sum()), int((a * np.arange(1, a.size + 1, dtype=np.int64)).sum())]
        return torch.tensor(head + sums, dtype=torch.int64)
    at = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
    return torch.cat([torch.tensor(head, dtype=torch.int64, device=v.device), v.sum().reshape(1),
                      (v * at).sum().reshape(1)])


def check(rows: Sequence[Sequence[int]], ranks: Sequence[int], me: int, pp_rank: int) -> None:
    """Refuse a step whose pipeline ranks (``rows[i]``: the :func:`header` of pipeline rank i, global rank
    ``ranks[i]``) were not fed one batch or are not at one step; every rank raises the same error."""
    if all(list(r) == list(rows[0]) for r in rows):
        return
    steps = [r[STEP] for r in rows]
    if len(set(steps)) > 1:
        raise StepMismatch(behind_note("pipeline", steps, ranks, me))
    raise ValueError(
        f"the ranks of this pipeline were not fed the same batch at step {steps[0]} (this is rank {me}, pipeline "
        f"rank {pp_rank} of {len(rows)}): {_difference(rows)}. Every rank of a pipeline must get the same (x, y) "
        f"(the first stage's rank reads x, the last stage's y): shard the data over the engine.layout.dp "
        f"replicas by engine.layout.dp_rank, e.g. DistributedSampler(dataset, num_replicas=engine.layout.dp, "
        f"rank=engine.layout.dp_rank, seed=0) with the same seed and set_epoch on every rank, not "
        f"DistributedSampler(dataset), which gives each rank a shard of its own as DDP's replicas get. This step "
        f"trained nothing"
    )


def _difference(rows: Sequence[Sequence[int]]) -> str:
    """The first field the rows differ in, in words."""
    if len({r[SAMPLES] for r in rows}) > 1:
        return ", ".join(f"pipeline rank {i} got {r[SAMPLES]} samples" for i, r in enumerate(rows))
    others = [i for i, r in enumerate(rows) if list(r) != list(rows[0])]
    if len({r[X_KIND] for r in rows}) > 1:
        return f"the inputs (x) of pipeline rank(s) {others} differ from pipeline rank 0's in shape or dtype"
    if len({r[Y_KIND] for r in rows}) > 1:
        return f"the targets (y) of pipeline rank(s) {others} differ from pipeline rank 0's in shape or dtype"
    return (f"their targets (y) differ: pipeline rank(s) {others} got other values than pipeline rank 0, so the "
            f"ranks were given other samples")
