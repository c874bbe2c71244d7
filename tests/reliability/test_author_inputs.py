"""What the author hands to wrap: 5-D inputs, summed losses, optimizers that need a closure (issue 43, 6/9/11).

Each trains as plain PyTorch does or is refused at wrap with the reason and
the fix, the model's parameters and memory format untouched:

- 6: a Conv3d (video) model on 5-D batches trains with the defaults
  (``channels_last="auto"`` keeps its layout for inputs that are not 4-D);
  ``channels_last=True`` puts 5-D tensors in ``channels_last_3d``.
- 9: a summed loss (``reduction="sum"``) adds its microbatches' losses, as
  plain full-batch training sums the batch; a loss module that does not
  reduce (``reduction="none"``) is refused at wrap.
- 11: an optimizer whose ``step`` needs a closure (LBFGS) is refused at wrap.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipedp
from tests import multiproc
from tests.reference import clone, max_diff, sequential_cnn


def _video(classes: int = 5) -> nn.Module:
    """A small video classifier (Conv3d, as torchvision's r3d_18 without BatchNorm), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv3d(8, 8, 3, padding=1, stride=(1, 2, 2)), nn.ReLU(),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, classes),
    )


def _clips(steps: int = 2, n: int = 8, classes: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 4, 8, 8, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(steps)]


def _images(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(steps)]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _plain(model: nn.Module, batches, loss_fn) -> list[float]:
    """Plain full-batch training: the losses it reports."""
    opt, losses = _sgd(model), []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _matches_plain(model: nn.Module, batches, loss_fn, **options) -> pipedp.Engine:
    """Train ``model`` with pipedp and a copy of it plainly on ``batches``: same losses and parameters."""
    ref = clone(model)
    engine = pipedp.wrap(model, optimizer=_sgd(model), loss_fn=loss_fn, progress=False, **options)
    losses = [engine.train_step(x, y).item() for x, y in batches]
    assert losses == pytest.approx(_plain(ref, batches, loss_fn), rel=1e-5, abs=1e-6)
    assert max_diff(model, ref) <= 1e-5
    return engine


def _snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    return {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before) -> bool:
    now = model.state_dict()
    return all(torch.equal(now[k], t) and now[k].stride() == s for k, (t, s) in before.items())


# --- case 6: 5-D inputs -------------------------------------------------------------------------------------


def test_a_video_model_trains_with_the_defaults_as_plain_pytorch():
    model = _video()
    engine = _matches_plain(model, _clips(), nn.CrossEntropyLoss(), microbatches=1)
    assert not engine.plan.channels_last
    assert all(p.is_contiguous() for p in model.parameters())


def test_a_video_model_microbatched_with_stages_auto_plans_and_trains():
    model, batches = _video(), _clips()
    engine = pipedp.wrap(model, optimizer=_sgd(model), loss_fn=nn.CrossEntropyLoss(), progress=False)
    assert torch.isfinite(engine.train_step(*batches[0]))
    assert all(p.is_contiguous() for p in model.parameters())


def test_channels_last_true_runs_a_video_model_in_channels_last_3d():
    model, batches = _video(), _clips()
    engine = _matches_plain(model, batches, nn.CrossEntropyLoss(), microbatches=1, stages=1, profile=False,
                            channels_last=True)
    conv = model[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last_3d) and not conv.is_contiguous()
    assert engine(batches[0][0]).shape == (8, 5)


def test_channels_last_true_with_a_3d_input_keeps_the_layouts_it_cannot_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                          nn.Linear(8, 5))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 3, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]
    _matches_plain(model, batches, nn.CrossEntropyLoss(), microbatches=1, stages=1, profile=False,
                   channels_last=True)


# --- case 9: loss reductions --------------------------------------------------------------------------------


def _summed_closure(out, y):
    return F.cross_entropy(out, y, reduction="sum")


_summed_closure.reduction = "sum"  # type: ignore[attr-defined]

SUMMED = {
    "module": lambda: nn.CrossEntropyLoss(reduction="sum"),
    "partial": lambda: functools.partial(F.cross_entropy, reduction="sum"),
    "closure marked sum": lambda: _summed_closure,
}


@pytest.mark.parametrize("make", SUMMED.values(), ids=SUMMED.keys())
def test_a_summed_loss_over_four_microbatches_trains_as_plain_full_batch(make):
    _matches_plain(sequential_cnn(classes=10), _images(), make(), microbatches=4, stages=1, profile=False)


def test_a_summed_loss_over_two_stages_trains_as_plain_full_batch():
    _matches_plain(sequential_cnn(classes=10), _images(), nn.CrossEntropyLoss(reduction="sum"), microbatches=4,
                   stages=2, profile=False)


def _summed_versus_ddp(rank: int, world: int) -> float:
    torch.manual_seed(0)
    model = sequential_cnn(classes=10)
    twin = clone(model)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    engine = pipedp.wrap(model, optimizer=_sgd(model), loss_fn=loss_fn, microbatches=2, stages=1, profile=False,
                         progress=False)
    ddp = nn.parallel.DistributedDataParallel(twin)
    opt = _sgd(ddp)
    for x, y in _images():
        x, y = (x[:6], y[:6]) if rank == 0 else (x, y)  # unequal local batches: DDP averages the replicas plainly
        engine.train_step(x, y)
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    return max_diff(model, twin)


def test_a_summed_loss_under_data_parallel_trains_as_ddp():
    assert max(multiproc.run(_summed_versus_ddp, 2)) <= 1e-5


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(reduction="none"),
                                     functools.partial(F.cross_entropy, reduction="none"),
                                     nn.L1Loss(reduction="max")],
                         ids=["module none", "partial none", "unknown"])
def test_a_loss_that_does_not_reduce_is_refused_at_wrap_with_nothing_changed(loss_fn):
    model = sequential_cnn()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"reduction.*(mean|sum)"):
        pipedp.wrap(model, optimizer=_sgd(model), loss_fn=loss_fn, progress=False)
    assert _unchanged(model, before)


def test_a_closure_returning_per_sample_losses_is_refused_at_the_step_with_nothing_changed():
    model = sequential_cnn()
    engine = pipedp.wrap(model, optimizer=_sgd(model), loss_fn=lambda o, y: F.cross_entropy(o, y, reduction="none"),
                         microbatches=2, stages=1, profile=False, progress=False)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="scalar"):
        engine.train_step(torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    assert _unchanged(model, before)


# --- case 11: optimizers that need a closure ----------------------------------------------------------------


class _NeedsClosure(torch.optim.Optimizer):
    """Not LBFGS by name: its step needs a closure all the same."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1))

    def step(self, closure):  # type: ignore[override]
        loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-g["lr"])
        return loss


CLOSURE_OPTIMIZERS = {
    "LBFGS": lambda params: torch.optim.LBFGS(params, lr=0.1),
    "own optimizer": _NeedsClosure,
}


@pytest.mark.parametrize("factory", [True, False], ids=["factory", "instance"])
@pytest.mark.parametrize("make", CLOSURE_OPTIMIZERS.values(), ids=CLOSURE_OPTIMIZERS.keys())
def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_wrap(make, factory):
    model = sequential_cnn()
    before = _snapshot(model)
    optimizer = make if factory else make(model.parameters())
    with pytest.raises(ValueError, match=r"closure.*once per batch"):
        pipedp.wrap(model, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), progress=False)
    assert _unchanged(model, before)
    if not factory:
        assert not optimizer.state


def test_an_optimizer_whose_closure_is_optional_is_accepted():
    model = sequential_cnn()
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())):
        pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), progress=False).close()
    # An LR scheduler wraps the instance's step (functools.wraps: its signature reads as the unbound step's).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), progress=False).close()
