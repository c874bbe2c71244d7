"""The gradient buckets' layout: which parameters share a flat buffer, and a stamp of that layout.

Packing follows DDP's caps (last layers first, closing at the cap) with
the first layers of the forward apart, since whatever waits for them is
exposed. The stamp lets ranks check, with the batch count they send
anyway, that they all train the same parameters before any bucket travels.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["Bucket", "pack", "layout_stamp", "same_stamp", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket


@dataclass
class Bucket:
    """A flat buffer of one stage's gradients, one slot a parameter, and its all-reduce of this step."""

    stage: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's slot, shaped like it
    attached: list[bool] = field(default_factory=list)  # whose ``.grad`` is its slot this step
    scaled: list[bool] = field(default_factory=list)  # whose slot is already divided by the group size
    pending: int = 0
    work: Any = None
    wire: torch.Tensor | None = None  # the reduce_dtype copy in flight
    issued: float = 0.0
    done: list[float] = field(default_factory=list)
    events: tuple[Any, Any] | None = None


def pack(params: Sequence[nn.Parameter], cap: int, first_cap: int | None = None) -> list[list[nn.Parameter]]:
    """Buckets in launch order: last layers first, one dtype/device each, closed once they hold ``cap`` bytes.

    As in DDP, a bucket closes when it *reaches* its cap (so it may pass it by
    one tensor), and the first one (the last layers) at ``first_cap``: it
    closes with the first big tensor it gets, so an all-reduce starts as soon
    as the last big layer's gradient is ready rather than waiting to fill a
    bucket with earlier layers. Unlike DDP, the first layers of the forward
    (``first_cap`` bytes of the last bucket) also get a bucket of their own:
    their gradients are ready only when backward ends, and whatever waits for
    them is exposed, so the less the better (on a slow link this decides how
    much of the sync shows; see the results page's "Across slow links").
    """
    out: list[list[nn.Parameter]] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in reversed(list(params)):
        if cur and not _same_kind(p, cur[0]):
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= (cap if out or first_cap is None else min(cap, first_cap)):
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    if first_cap is not None and len(out) > 1:
        *_, last = out
        size, k = 0, len(last)
        while k > 1 and size < first_cap:  # ``last`` runs backward: its end is the forward's start
            k -= 1
            size += last[k].numel() * last[k].element_size()
        if 0 < k < len(last) and size >= first_cap:
            out[-1:] = [last[:k], last[k:]]
    return out


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.device) == (b.dtype, b.device)


_STAMP_BITS = 16  # per digest: its square summed over up to 1024 ranks stays exact in float64


def layout_stamp(stage_params: Sequence[Sequence[nn.Parameter]]) -> list[float]:
    """``[0, d1, d1**2, d2, d2**2]``: two digests of which parameters train, in what dtype and shape.

    Summed over the group (with the batch size in place of the 0), every rank
    had the same digest ``d`` exactly when ``ranks * sum(d**2) == sum(d)**2``.
    """
    layout = [(s, i, p.requires_grad, str(p.dtype), tuple(p.shape)) for s, ps in enumerate(stage_params)
              for i, p in enumerate(ps)]
    h = hashlib.sha256(repr(layout).encode()).digest()
    d1, d2 = (float(int.from_bytes(h[k : k + 2], "little") % (1 << _STAMP_BITS)) for k in (0, 2))
    return [0.0, d1, d1 * d1, d2, d2 * d2]


def same_stamp(sums: Sequence[float], ranks: int) -> bool:
    """Whether every rank sent the same layout stamp (``sums``: the group's sum of it, without the count)."""
    if ranks > 1024:  # beyond float64's exact range: not checked
        return True
    return all(ranks * sums[k + 1] == sums[k] * sums[k] for k in range(0, len(sums), 2))
