"""Forwards that do more than their operations: grad-mode regions and mode-dependent arguments (issue 43, 1 and 4).

- 1: a scale computed under ``torch.no_grad()`` inside forward. fx records the operations, not the grad
  mode, so blocks copied from the trace let gradients flow where the author stopped them.
- 4: timm's classifier dropout, ``F.dropout(x, p, training=self.training)`` in the root's own forward: fx
  bakes the mode in as a constant, so eval-mode blocks dropped out and the chain check refused the model
  with the wrong reason, moving the user's generator as it did.

Each trains as plain PyTorch does with the same seeds (one stage for random layers; the cut contract for
several), or is refused with the true reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp
from pipedp.partition import Chain, blocks_of

from ..reference import TwoConvs, clone, max_diff, plain_steps
from ..stock import timm

LR = 0.05


class NoGradScale(TwoConvs):
    """Normalises by a scale computed without gradient, as some normalisation-free networks do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            s = h.abs().mean((1, 2, 3), keepdim=True) + 1e-3
        return self.head(self.b(h / s))


def _batches(steps: int = 2, n: int = 8, size: int = 8, classes: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(steps)]


def _train_like_plain(model: nn.Module, batches, **options) -> tuple[pipedp.Engine, float]:
    ref = clone(model)
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), progress=False, plan_budget_s=3, **options)
    torch.manual_seed(7)
    for x, y in batches:
        assert torch.isfinite(engine.train_step(x, y))
    torch.manual_seed(7)
    if engine.plan.channels_last:
        ref.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    plain_steps(ref, batches, microbatches=engine.plan.microbatches, lr=LR)
    return engine, max_diff(model, ref)


# --- case 1: torch.no_grad() inside forward ---------------------------------------------------------------


def test_blocks_cut_from_a_no_grad_region_keep_its_gradients_stopped():
    torch.manual_seed(0)
    model = NoGradScale()
    blocks = blocks_of(model)
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    Chain(blocks)(x).sum().backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)
    with torch.no_grad():  # the region gives the caller's mode back: under no_grad the output needs no gradient
        assert not Chain(blocks)(x).requires_grad
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("options", [dict(), dict(stages=2, microbatches=2)], ids=["defaults", "two-stages"])
def test_a_no_grad_region_in_forward_trains_as_plain_pytorch(options):
    torch.manual_seed(0)
    engine, diff = _train_like_plain(NoGradScale(), _batches(), **options)
    assert diff <= 1e-5
    if options:
        assert len(engine.plan.stages) == 2


# --- case 4: timm's dropout with training=self.training, and drop path -------------------------------------


def _timm_resnet() -> nn.Module:
    torch.manual_seed(0)
    return timm().create_model("resnet18", num_classes=5, drop_rate=0.2, drop_path_rate=0.1)


def test_timm_dropout_and_drop_path_blocks_compute_the_model_in_both_modes():
    model = _timm_resnet()
    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(3)
    expected_draws = torch.rand(4)
    torch.manual_seed(3)
    report = pipedp.inspect(model, x)
    assert report.reason is None and len(report.blocks) > 4
    assert torch.equal(torch.rand(4), expected_draws)  # the check forked the generator and put it back
    chain = Chain(blocks_of(model))
    model.eval()
    torch.testing.assert_close(chain(x), model(x))  # eval mode: no dropout in the blocks either
    model.train()
    torch.manual_seed(11)
    got = chain(x)
    torch.manual_seed(11)
    torch.testing.assert_close(got, model(x))  # train mode: the same masks from the same seed


def test_timm_dropout_with_the_default_plan_trains_as_plain_pytorch_with_one_stage():
    # Before: 0.224 off plain after 3 steps with the plan 1x1, the chain check having moved the generator.
    engine, diff = _train_like_plain(_timm_resnet(), _batches(size=32, classes=5), stages=[24], microbatches=1)
    assert len(engine.plan.stages) == 1 and len(engine.plan.stages[0].blocks) == 24
    assert diff <= 1e-5


def test_timm_dropout_with_two_stages_is_cut_and_trains():
    # Before: refused as "not the chain of its blocks".
    model = _timm_resnet()
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), loss_fn=nn.CrossEntropyLoss(),
                         stages=2, microbatches=2, progress=False, profile=False)
    for x, y in _batches(size=32, classes=5):
        assert torch.isfinite(engine.train_step(x, y))
    assert len(engine.plan.stages) == 2
    engine.eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model(x))  # eval mode runs the eval graph: deterministic


# --- the train-mode check itself --------------------------------------------------------------------------


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * 2


class _Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DoubleGrad.apply(x)


def test_blocks_that_infer_alike_but_train_differently_are_refused_naming_the_gradient():
    from pipedp.partition.blocks import Block, CutError
    from pipedp.partition.check import check_chain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    blocks = [Block("0", model[0]), Block("twice", _Twice()), Block("1", model[1]), Block("2", model[2])]
    with pytest.raises(CutError, match=r"trains differently .* the gradient of '0\.weight' differs"):
        check_chain(model, blocks, torch.randn(6, 4))
    assert all(p.grad is None for p in model.parameters())
