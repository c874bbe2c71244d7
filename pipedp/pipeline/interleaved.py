"""Interleaved 1F1B: each rank holds several stages, spread along the pipeline.

With p ranks and v stages per rank (``stages = v * p``), rank r holds stages
r, r + p, r + 2p, ... A microbatch passes every rank v times, each time
through a stage of 1/v of the work, so the fill and drain that make the
bubble last 1/v as long: 1F1B's idle share (p-1)/(m+p-1) becomes about
(p-1)/(v*m+p-1), at v times the point-to-point messages (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters", 2021).

The order is per rank, not per stage, since one rank interleaves the
actions of its stages: forwards go through its stages in groups of p
microbatches (stage r for microbatches 0..p-1, then stage r + p for them,
...), backwards the same way from its last stage back, after a warm-up of
forwards that is longer the earlier the rank. One stage per rank is 1F1B.
"""

from __future__ import annotations

from ..checks import positive_int
from .schedule import Action

__all__ = ["interleaved", "interleaved_placement"]


def interleaved_placement(ranks: int, per_rank: int) -> list[int]:
    """The rank of each of ``ranks * per_rank`` stages: stage s on rank s mod ``ranks``."""
    positive_int("ranks", ranks)
    positive_int("per_rank", per_rank)
    return [s % ranks for s in range(ranks * per_rank)]


def interleaved(ranks: int, per_rank: int, microbatches: int) -> list[list[tuple[int, Action]]]:
    """Each rank's program of Interleaved 1F1B over ``ranks * per_rank`` stages (a multiple of ``ranks``
    microbatches: the forwards go round the ranks in groups of ``ranks``)."""
    p, v, m = positive_int("ranks", ranks), positive_int("per_rank", per_rank), positive_int("microbatches",
                                                                                               microbatches)
    if m % p:
        raise ValueError(f"interleaved 1F1B over {p} ranks takes a multiple of {p} microbatches, got {m}: pass "
                         f"microbatches={m + (-m) % p}, or schedule='1f1b'")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        """The (chunk, microbatch) of a rank's k-th forward or backward."""
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        # Two forwards of lead per later rank where the stages interleave (a rank's next forward may be of its
        # next stage, which waits for the whole round); one as in 1F1B where they do not (v = 1 is 1F1B).
        lead = (p - r - 1) * (2 if v > 1 else 1) + (v - 1) * p
        warmup = total if m == p and v > 1 else min(lead, total)
        prog: list[tuple[int, Action]] = []  # (stage, action) in the order the rank runs them

        def add(k: int, kind: str) -> None:
            chunk, mb = unit(k, kind == "F")
            prog.append((chunk * p + r, Action(kind, mb)))

        for k in range(warmup):
            add(k, "F")
        for k in range(total - warmup):
            add(warmup + k, "F")
            add(k, "B")
        for k in range(total - warmup, total):
            add(k, "B")
        out.append(prog)
    return out
