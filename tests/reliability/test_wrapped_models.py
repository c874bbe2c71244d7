"""A model already wrapped by DataParallel, DDP, FSDP or torch.compile is refused, naming the model inside
(issue 44, point 7): each does a job pipedp does itself, and would do it twice or hide the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from ..reference import sequential_cnn


@pytest.mark.parametrize("wrapper,inner", [
    (torch.compile, r"model\._orig_mod\), with compile=True or compile='auto'"),
    (nn.DataParallel, r"model\.module\)"),
], ids=["torch.compile", "DataParallel"])
def test_a_wrapped_model_is_refused_at_wrap_with_the_inner_module_named(wrapper, inner):
    model = sequential_cnn()
    wrapped = wrapper(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"the model is wrapped in \w+: .*To proceed, pass the model inside \(" + inner):
        pipedp.wrap(wrapped, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                         stages=1, profile=False, progress=False)
    assert engine.module is model  # the model inside trains as any other


def test_a_subclass_of_the_users_own_named_like_a_wrapper_is_not_refused():
    class DataParallel(nn.Sequential):  # a user's own class that happens to share the name
        pass

    model = DataParallel(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                         stages=1, profile=False, progress=False)
    assert torch.isfinite(engine.train_step(torch.randn(4, 4), torch.randint(0, 2, (4,))))
