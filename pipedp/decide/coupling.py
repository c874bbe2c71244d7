"""Which microbatch counts keep the user's math, and what the plan promises about it.

Microbatching changes a step's math only through layers that couple the
samples of a batch: a BatchNorm in training normalises each microbatch with
that microbatch's statistics, not the batch's. Everything else (convolutions,
per-sample norms, a mean loss weighted by each microbatch's share) gives
plain PyTorch's step within fp32 rounding. So with the default
``microbatches=None`` the planner may microbatch a model without such a
layer, and keeps one microbatch, the user's own step, for a model with one;
a count or ``"auto"`` given by the user allows accumulation, and the plan's
first line says which of the two contracts holds.
"""

from __future__ import annotations

from typing import Literal, Union

from torch import nn

from ..options import DEFAULT_MICROBATCHES, MicrobatchSpec

__all__ = ["batch_coupled", "resolve_microbatches", "contract", "kept_note"]

Resolved = Union[int, Literal["auto"]]


def batch_coupled(model: nn.Module) -> str | None:
    """The name of the first layer that couples a batch's samples as the model trains (None: none does).

    A BatchNorm (torch's, SyncBatchNorm, subclasses such as timm's
    ``BatchNormAct2d``) in training mode; one the user froze in eval mode
    inside a training model normalises with its running statistics, per
    sample. A model left in eval mode as a whole (an engine whose first call
    is inference) says nothing about how it will train: its BatchNorms count.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not model.training):
            return name or type(m).__name__
    return None


def resolve_microbatches(requested: MicrobatchSpec, stages: object, coupled: str | None) -> Resolved:
    """The microbatch spec the planner works with: the user's count or ``"auto"``, or what ``None`` allows.

    ``None``: one microbatch where a layer couples the batch; else ``"auto"``
    with ``stages="auto"`` (the trials choose) and
    :data:`~pipedp.options.DEFAULT_MICROBATCHES` with a given stage count.
    """
    if requested is not None:
        return requested
    if coupled is not None:
        return 1
    return "auto" if stages == "auto" else DEFAULT_MICROBATCHES


def contract(microbatches: int, coupled: str | None) -> str:
    """The plan's promise about its math, in the words the README uses."""
    if microbatches == 1:
        return "the same math as your step"
    if coupled is None:
        return (f"the same math as your step (accumulation over {microbatches} microbatches; no layer couples the "
                f"samples of a batch)")
    return (f"accumulation over {microbatches} microbatches: BatchNorm normalises per microbatch (first: "
            f"'{coupled}')")


def kept_note(requested: MicrobatchSpec, stages: object, coupled: str | None, ranks: int = 1) -> list[str]:
    """Where ``None`` kept one microbatch for a pipeline the user asked for (stages, or ``ranks`` pipeline
    ranks): how to let it overlap."""
    single = stages == 1 or (isinstance(stages, (list, tuple)) and len(stages) == 1)
    asked = ranks > 1 or (stages != "auto" and not single)
    if requested is not None or coupled is None or not asked:
        return []
    return [f"microbatches: 1, the same math as your step (BatchNorm '{coupled}' normalises over the whole batch), "
            f"so the stages run one after another; pass microbatches=N or 'auto' to overlap them (accumulation: "
            f"BatchNorm then normalises per microbatch)"]
