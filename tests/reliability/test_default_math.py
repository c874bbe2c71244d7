"""With the defaults a step has the math of the user's own step (issue 44, point 1).

Microbatching changes the math only through layers that couple a batch's
samples (BatchNorm in training). The default ``microbatches=None`` keeps one
microbatch for a model with such a layer and lets the planner microbatch
one without; a count or ``"auto"`` given by the user allows accumulation.
The plan's first line says which contract holds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from ..reference import bn_cnn, clone, data, max_diff, plain_steps, sequential_cnn


def _trained(model: nn.Module, batches, **options) -> pipedp.Engine:
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), progress=False, plan_budget_s=3, **options)
    for x, y in batches:
        engine.train_step(x, y)
    return engine


def _plain_full_batch(model: nn.Module, batches, channels_last: bool) -> None:
    if channels_last:
        model.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    plain_steps(model, batches, microbatches=1)


@pytest.mark.parametrize("make", [bn_cnn, sequential_cnn], ids=["batchnorm", "no-batchnorm"])
@pytest.mark.parametrize("stages", ["auto", 2])
def test_the_defaults_train_as_the_users_full_batch_step(make, stages):
    torch.manual_seed(0)
    model = make()
    ref = clone(model)
    batches = data(n=16, steps=2)
    engine = _trained(model, batches, stages=stages)
    head = str(engine.plan).splitlines()[0]
    assert head.startswith("pipedp plan: the same math as your step"), head
    if make is bn_cnn:
        assert engine.plan.microbatches == 1
    _plain_full_batch(ref, batches, engine.plan.channels_last)
    assert max_diff(model, ref) <= 1e-5


def test_a_count_given_by_the_user_allows_accumulation_and_the_plan_says_so():
    torch.manual_seed(0)
    model = bn_cnn()
    ref = clone(model)
    batches = data(n=16, steps=2)
    engine = _trained(model, batches, stages=1, microbatches=4)
    head = str(engine.plan).splitlines()[0]
    assert ("accumulation over 4 microbatches, which can change the math of your step: '1' calls batch_norm over "
            "the batch") in head
    plain_steps(ref, batches, microbatches=4)
    assert max_diff(model, ref) <= 1e-5
