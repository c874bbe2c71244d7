"""Splitting a batch into microbatches along dim 0 and gathering results back.

Chunk sizes differ by at most one (the first ``batch % m`` chunks are one
larger), so the last chunk may be smaller but never empty. Each microbatch's
loss is weighted by its share of the batch, which makes the accumulated
gradient equal the gradient of the batch-mean loss.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..checks import positive_int

__all__ = ["count", "sizes", "split", "gather", "shares"]

MIN_SAMPLES = 2  # per microbatch, where the batch has them: a BatchNorm in training needs more than one value


def count(batch: int, planned: int) -> int:
    """The microbatches a step of ``batch`` samples runs: the plan's ``planned``, fewer for a small batch.

    A microbatch holds at least :data:`MIN_SAMPLES` samples where the batch
    has them: a BatchNorm over a 1x1 map (the end of most CNNs, their
    squeeze-excitation) cannot train on one sample, while plain training of the
    same batch can. So a batch smaller than ``2 * planned`` (the last one of an
    epoch, a small first batch) is split into ``batch // 2`` microbatches, and
    a batch of 1 to 3 samples runs as one: never refused for being small.
    """
    positive_int("microbatches", planned)
    if batch < 1:
        raise ValueError(f"the batch is empty ({batch} samples): there is nothing to split into microbatches. Skip "
                         f"empty batches, or check what produced it")
    return max(1, min(planned, batch // MIN_SAMPLES))


def sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes of the ``microbatches`` chunks a batch of ``batch`` samples is cut into."""
    positive_int("microbatches", microbatches)
    if batch == 0:
        raise ValueError("the batch is empty (0 samples): there is nothing to split into microbatches. Skip empty "
                         "batches, or check what produced it")
    if batch < microbatches:
        raise ValueError(
            f"a batch of {batch} samples cannot be split into {microbatches} microbatches: "
            f"use microbatches <= {batch} or a larger batch"
        )
    base, extra = divmod(batch, microbatches)
    return [base + 1 if i < extra else base for i in range(microbatches)]


def split(x: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """Views of ``x`` cut along dim 0 into ``microbatches`` chunks (see :func:`sizes`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor to split into microbatches, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("cannot split a 0-dim tensor into microbatches: it has no batch dimension")
    return list(torch.split(x, sizes(x.shape[0], microbatches), dim=0))


def shares(chunk_sizes: Sequence[int], reduction: str = "mean") -> list[float]:
    """The weight of each chunk's loss in the batch's: its fraction of the batch for a mean loss, 1 for a
    summed one (``reduction="sum"``: the batch's sum is the sum of its chunks')."""
    if reduction == "sum":
        return [1.0] * len(chunk_sizes)
    total = sum(chunk_sizes)
    return [n / total for n in chunk_sizes]


def gather(outputs: Sequence[Any]) -> Any:
    """Per-microbatch outputs as one: tensors concatenated along dim 0 (memory format kept).

    Outputs may be what ``loss_fn`` takes (tuples, named tuples, lists, dicts
    of tensors): they are gathered part by part. A part without a batch
    dimension (a 0-dim tensor, a number) cannot be gathered exactly unless it
    is the same in every microbatch: a clear error otherwise.
    """
    if not outputs:
        raise ValueError("no microbatch outputs to gather")
    if len(outputs) == 1:
        return outputs[0]
    return _gather(outputs)


def _gather(outs: Sequence[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in outs):
        if first.dim() == 0:
            raise ValueError(
                "the model's output holds a 0-dim tensor, which has no batch dimension to gather over "
                "microbatches: for this forward call engine.module(x), or use microbatches=1"
            )
        return torch.cat(list(outs), dim=0)
    if isinstance(first, dict) and all(isinstance(o, dict) and o.keys() == first.keys() for o in outs):
        return type(first)((k, _gather([o[k] for o in outs])) for k in first)
    if isinstance(first, (tuple, list)) and all(type(o) is type(first) and len(o) == len(first) for o in outs):
        parts = [_gather([o[j] for o in outs]) for j in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if all(type(o) is type(first) and o == first for o in outs):
        return first
    raise ValueError(
        f"the model's outputs of the microbatches ({type(first).__name__}) differ in a way that cannot be "
        f"gathered into one: for this forward call engine.module(x), or use microbatches=1"
    )
