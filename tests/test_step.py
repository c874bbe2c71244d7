"""What a training step hands back: the loss, and on request the outputs loss_fn saw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from .reference import clone, data, max_diff, sequential_cnn


@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 4)])
def test_train_step_returns_the_outputs_loss_fn_saw_on_request(stages, microbatches):
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.CrossEntropyLoss(),
                         stages=stages, microbatches=microbatches, profile=False, progress=False)
    (x, y), = data(n=8, steps=1)
    loss, out = engine.train_step(x, y, return_outputs=True)
    expected = ref(x)
    assert out.shape == (8, 10) and not out.requires_grad
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(expected, y).detach(), rtol=1e-5, atol=1e-6)
    assert isinstance(engine.train_step(x, y), torch.Tensor)  # without it: the loss alone, as before


def _dropout_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _plain_accumulating(model: nn.Module, batches, every: int) -> list[float]:
    """The loop training scripts write: loss / N and backward on each batch, a step on every N-th."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        (loss / every).backward()
        if (i + 1) % every == 0:
            opt.step()
            opt.zero_grad()
    return losses


@pytest.mark.parametrize("stages", [1, 2])
def test_accumulating_over_batches_trains_as_the_plain_accumulating_loop(stages):
    model = _dropout_cnn() if stages == 1 else sequential_cnn()  # masks across stages: the schedule's order
    ref = clone(model)
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), stages=stages, profile=False, progress=False,
                         sample=(8, 3, 16, 16))
    batches = data(n=8, steps=6)
    torch.manual_seed(3)
    losses = [engine.train_step(x, y, update=(i + 1) % 3 == 0, loss_divisor=3).item()
              for i, (x, y) in enumerate(batches)]
    torch.manual_seed(3)
    expected = _plain_accumulating(ref, batches, 3)
    assert max_diff(model, ref) <= 1e-6
    assert losses == pytest.approx(expected, rel=1e-5)  # each batch's own loss, not divided


def test_a_call_that_fails_inside_a_window_gives_back_the_gradients_the_window_held():
    model = sequential_cnn()
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the loader handed a bad batch")
        return nn.functional.cross_entropy(out, y)

    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=loss_fn,
                         stages=1, microbatches=1, profile=False, progress=False)
    (x, y), (x2, y2) = data(n=8, steps=2)
    engine.train_step(x, y, update=False, loss_divisor=2)
    held = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="bad batch"):
        engine.train_step(x2, y2, update=True, loss_divisor=2)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), held))
    before = [p.detach().clone() for p in model.parameters()]
    engine.train_step(x2, y2, update=True, loss_divisor=2)  # the window goes on: one update from both batches
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="loss_divisor must be a positive int"):
        engine.train_step(x, y, loss_divisor=0)
