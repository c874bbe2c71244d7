"""Whether a layer couples the samples of a batch is read from what the forward computes (issue 58, 2, 3 and 9).

- 2: a normalisation of the user's own calling ``F.batch_norm`` over the batch, or a forward subtracting
  ``x.mean(0)``: detection looked at module classes only, so ``stages=2`` ran 4 microbatches and the plan
  promised the user's math. Now the ops of a forward decide, and such a model keeps one microbatch by default,
  with the op and the module named. A model whose norms stay within a sample (GroupNorm, LayerNorm,
  InstanceNorm, which itself calls batch_norm on a per-sample view) is still microbatched.
- 3: ``torch.utils.checkpoint(..., use_reentrant=True)``: fx traces through it as a no-grad region, and the
  chain check, whose ``torch.autograd.grad`` such a checkpoint refuses, left the model unjudged, so blocks
  without its gradients were cut. Now ``stages=2`` refuses it by name and ``stages="auto"`` trains it whole.
- 9: timm ResNet-18 with frozen BatchNorm (``freeze_batch_norm_2d``): fx baked the frozen statistics into
  tensor constants, named anew in each mode's trace, so the mode check saw other operations in eval mode and
  blamed ``self.training``. A module with buffers of its own is now kept whole, as torch's BatchNorm is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipedp
from pipedp.decide.coupling import batch_coupled
from pipedp.snapshot import rng_state

from ..reference import TwoConvs, clone, data, max_diff, plain_steps
from ..stock import timm

LR = 0.05


class OwnBatchNorm(nn.Module):
    """A normalisation of the user's own over the batch, without running statistics (no torch BatchNorm)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, self.weight, self.bias, training=True)


class Centered(nn.Module):
    """Subtracts the batch's mean sample, as some feature whitening does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class Scale(torch.autograd.Function):
    """Doubles in forward; its backward is code pipedp cannot read."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * 2


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(x)


def _cnn(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


class Checkpointed(TwoConvs):
    """``b`` under torch.utils.checkpoint, reentrant or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.b, self.a(x), use_reentrant=self.reentrant))


def _wrap(model: nn.Module, **options: object) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), progress=False, plan_budget_s=3, plan_cache=False,
                       **options)  # type: ignore[arg-type]


def _trains_as_plain(model: nn.Module, batches, **options: object) -> tuple[pipedp.Engine, float]:
    """The engine after ``batches`` and its parameters' distance to plain PyTorch over the plan's microbatches."""
    ref = clone(model)
    engine = _wrap(model, **options)
    for x, y in batches:
        assert torch.isfinite(engine.train_step(x, y))
    if engine.plan.channels_last:
        ref.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    plain_steps(ref, batches, microbatches=engine.plan.microbatches, lr=LR)
    return engine, max_diff(model, ref)


def _full_batch_diff(model: nn.Module, engine_model: nn.Module, batches, channels_last: bool) -> float:
    if channels_last:
        model.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    plain_steps(model, batches, microbatches=1, lr=LR)
    return max_diff(engine_model, model)


# --- 2: coupling read from the ops, not the classes -----------------------------------------------------------


@pytest.mark.parametrize("make, expected", [
    (lambda: _cnn(OwnBatchNorm(8)), "'1' calls batch_norm over the batch"),
    (lambda: _cnn(Centered()), "'1' calls mean over the batch"),
    (lambda: _cnn(nn.BatchNorm2d(8)), "'1' calls batch_norm over the batch"),
    (lambda: _cnn(Scaled()), "'1' applies the custom autograd function Scale"),
], ids=["own-batch-norm", "batch-mean", "torch-batchnorm", "custom-function"])
def test_a_layer_that_reduces_over_the_batch_is_named_with_its_op(make, expected):
    assert expected in (batch_coupled(make(), torch.randn(8, 3, 8, 8)) or "")


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 8), nn.InstanceNorm2d(8, affine=True), nn.LayerNorm([8, 8, 8])],
                         ids=["groupnorm", "instancenorm", "layernorm"])
def test_norms_within_a_sample_do_not_couple_and_are_microbatched_by_default(norm):
    model = _cnn(norm)
    assert batch_coupled(model, torch.randn(8, 3, 8, 8)) is None
    batches = data(n=8, size=8, steps=2)
    ref = clone(model)
    engine = _wrap(model, stages=2)
    for x, y in batches:
        engine.train_step(x, y)
    assert engine.plan.microbatches == 4 and len(engine.plan.stages) == 2
    assert "no layer couples the samples of a batch" in str(engine.plan).splitlines()[0]
    assert _full_batch_diff(ref, model, batches, engine.plan.channels_last) <= 1e-5


@pytest.mark.parametrize("norm, op", [(OwnBatchNorm(8), "batch_norm"), (Centered(), "mean")],
                         ids=["own-batch-norm", "batch-mean"])
def test_a_coupling_layer_keeps_one_microbatch_by_default_and_the_plan_names_it(norm, op):
    # Before: 4 microbatches, "the same math as your step (no layer couples the samples of a batch)", and
    # parameters off the user's full-batch step.
    model = _cnn(norm)
    ref = clone(model)
    batches = data(n=8, size=8, steps=2)
    engine = _wrap(model, stages=2)
    for x, y in batches:
        engine.train_step(x, y)
    plan = str(engine.plan)
    assert engine.plan.microbatches == 1 and len(engine.plan.stages) == 2
    assert plan.splitlines()[0].startswith("pipedp plan: the same math as your step;")
    assert f"'1' calls {op} over the batch" in plan  # the note on how to overlap the stages names it
    assert _full_batch_diff(ref, model, batches, engine.plan.channels_last) <= 1e-5


def test_accumulation_the_user_asked_for_says_which_layer_changes_the_math():
    engine = _wrap(_cnn(Centered()), stages=1, microbatches=2)
    engine.train_step(*data(n=8, size=8, steps=1)[0])
    head = str(engine.plan).splitlines()[0]
    assert ("accumulation over 2 microbatches, which can change the math of your step: '1' calls mean over the "
            "batch") in head


def test_a_custom_autograd_function_keeps_one_microbatch_and_says_why():
    engine = _wrap(_cnn(Scaled()), stages=2)
    engine.train_step(*data(n=8, size=8, steps=1)[0])
    assert engine.plan.microbatches == 1
    assert "custom autograd function Scale" in str(engine.plan)


def test_reading_the_ops_leaves_the_users_model_and_generators_as_they_were():
    model = _cnn(nn.BatchNorm2d(8))
    model[1].momentum = None  # a cumulative average: num_batches_tracked counts each forward
    x = torch.randn(8, 3, 8, 8)
    before, x0, draws = {k: v.clone() for k, v in model.state_dict().items()}, x.clone(), rng_state()
    assert batch_coupled(model, x) is not None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(x, x0) and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), draws["torch"])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.training and all(m.training for m in model.modules())


# --- 3: torch.utils.checkpoint with reentrant autograd ---------------------------------------------------------


def test_a_reentrant_checkpoint_is_refused_by_name_where_a_cut_is_asked_for():
    # Before: cut, and parameters 1.3e-2 off plain PyTorch (the checkpointed part got no gradients).
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"use_reentrant=True.*'b'.*use_reentrant=False"):
        _wrap(Checkpointed(reentrant=True), stages=2, sample=(8, 3, 8, 8))


def test_a_reentrant_checkpoint_trains_whole_with_auto_and_a_non_reentrant_one_is_cut():
    torch.manual_seed(0)
    batches = data(n=8, size=8, steps=2)
    engine, diff = _trains_as_plain(Checkpointed(reentrant=True), batches)
    assert len(engine.plan.stages) == 1 and "use_reentrant=False" in str(engine.plan)
    assert diff <= 1e-5
    torch.manual_seed(0)
    engine, diff = _trains_as_plain(Checkpointed(reentrant=False), batches, stages=2)
    assert len(engine.plan.stages) == 2
    assert diff <= 1e-5


# --- 9: timm ResNet-18 with frozen BatchNorm ------------------------------------------------------------------


def _timm_resnet(frozen: bool) -> nn.Module:
    t = timm()
    torch.manual_seed(0)
    model = t.create_model("resnet18", num_classes=5)
    return t.layers.freeze_batch_norm_2d(model) if frozen else model


def test_timm_resnet_with_frozen_batchnorm_is_cut_and_trains_as_plain_pytorch():
    # Before: "ResNet.forward runs other operations in eval mode than in train mode (it branches on
    # self.training outside any submodule)"; the frozen statistics had been baked into renamed constants.
    assert "'bn1' calls batch_norm over the batch" in (batch_coupled(_timm_resnet(False), torch.randn(4, 3, 32, 32))
                                                         or "")
    model = _timm_resnet(True)
    assert batch_coupled(model, torch.randn(4, 3, 32, 32)) is None  # frozen statistics: per sample
    engine, diff = _trains_as_plain(model, data(n=8, size=32, classes=5, steps=2), stages=2)
    assert len(engine.plan.stages) == 2 and engine.plan.microbatches == 4
    assert diff <= 1e-5
    assert not any(k.startswith("_tensor_constant") for k in vars(model))  # fx left nothing on the user's model


class Halved(TwoConvs):
    """A tensor constant built in the root's own forward, which fx stows as an attribute of the model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x) * torch.tensor(0.5)))


def test_a_tensor_constant_in_the_roots_forward_is_not_taken_for_a_mode_branch():
    # Before: the same refusal as frozen BatchNorm's (each mode's trace names its constants anew), and fx left
    # its _tensor_constant attributes on the user's model.
    torch.manual_seed(0)
    model = Halved()
    engine, diff = _trains_as_plain(model, data(n=8, size=8, steps=2), stages=2)
    assert len(engine.plan.stages) == 2 and diff <= 1e-5
    assert not any(k.startswith("_tensor_constant") for k in vars(model))
