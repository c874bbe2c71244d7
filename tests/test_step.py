"""What a training step hands back: the loss, and on request the outputs loss_fn saw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from .reference import clone, data, sequential_cnn


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
