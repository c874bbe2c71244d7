"""The user's gradient hook: called once a step's gradients are final, before clipping and the update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from .reference import clone, data, max_diff, sequential_cnn


def _plain_clipped(model: nn.Module, batches, microbatches: int, value: float) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (nn.functional.cross_entropy(model(xm), ym) / microbatches).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), value)
        opt.step()


@pytest.mark.parametrize("stages", [1, 2])
def test_a_hook_that_clips_by_value_trains_as_the_plain_loop_that_does(stages):
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    seen: list[list[torch.Tensor]] = []

    def hook(params):
        seen.append([p.grad.clone() for p in params if p.grad is not None])
        torch.nn.utils.clip_grad_value_(params, 0.01)

    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), stages=stages, microbatches=2, profile=False, progress=False,
                         grad_hook=hook)
    batches = data(n=8, steps=2)
    for x, y in batches:
        engine.train_step(x, y)
    _plain_clipped(ref, batches, 2, 0.01)
    assert max_diff(model, ref) <= 1e-6
    assert len(seen) == 2 and len(seen[0]) == len(list(model.parameters()))  # every gradient, once a step
    assert max(g.abs().max().item() for g in seen[0]) > 0.01  # it saw them before clipping


def test_a_hook_with_an_early_update_is_refused_at_wrap():
    model = sequential_cnn()
    with pytest.raises(ValueError, match="early_update=True with grad_hook"):
        pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                    grad_hook=lambda params: None, early_update=True)
    with pytest.raises(ValueError, match="grad_hook must be callable"):
        pipedp.TrainingOptions(grad_hook=3)  # type: ignore[arg-type]

