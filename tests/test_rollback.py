"""The rollback copy is taken while an update's structure is new, and a failure it covers is undone."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import pipedp
from pipedp.rollback import Rollback, proven_by_structure, structure

from .reference import bn_cnn, data


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _grads(model: nn.Module) -> None:
    model.zero_grad()
    model(torch.randn(3, 4)).square().mean().backward()


def _updates(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> list[bool]:
    rb, copied = Rollback(opt), []
    for _ in range(n):
        _grads(model)
        rb.before()
        opt.step()
        rb.succeeded()
        copied.append(rb.copied)
    return copied


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)])
def test_torch_optimizers_are_copied_until_an_update_of_their_structure_went_through(make):
    model = _model()
    opt = make(model.parameters())
    assert proven_by_structure(opt)
    rb = Rollback(opt)
    copied = []
    for _ in range(4):
        _grads(model)
        rb.before()
        opt.step()
        rb.succeeded()
        copied.append(rb.copied)
    assert copied == [True, True, False, False]  # no state yet, then state: two structures
    assert rb.snapshot.tensors.saved == {}  # the copy is freed once proven
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)  # a hyperparameter of another kind: a new structure
    _grads(model)
    rb.before()
    assert rb.copied


def test_a_changed_structure_is_copied_and_torchs_own_failure_on_it_undone():
    """Adam refuses a sparse gradient after it created state for the parameters before it: all put back."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rb = Rollback(opt)
    for _ in range(3):
        _grads(model)
        rb.before()
        opt.step()
        rb.succeeded()
    assert not rb.copied
    _grads(model)
    last = list(model.parameters())[-1]
    last.grad = last.grad.to_sparse()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    rb.before()
    assert rb.copied
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert rb.failed()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))


class Subclassed(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


def test_what_pipedp_cannot_see_into_is_copied_before_every_update():
    model = _model()
    assert _updates(model, Subclassed(model.parameters(), lr=0.1), 4) == [True] * 4
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *_: None)
    assert not proven_by_structure(hooked)
    assert _updates(model, hooked, 3) == [True] * 3
    replaced = torch.optim.SGD(model.parameters(), lr=0.1)
    replaced.step = replaced.step  # a step bound on the instance: not torch's class code alone
    assert not proven_by_structure(replaced)


def test_structure_follows_grads_state_and_hyperparameters_not_values():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _grads(model)
    a = structure(opt)
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(3)
    opt.param_groups[0]["lr"] = 0.5  # a scheduler's change of value
    assert structure(opt) == a
    next(model.parameters()).grad = None  # a parameter without a gradient this step
    assert structure(opt) != a


def test_an_update_failing_without_a_copy_says_so_and_the_next_is_copied(monkeypatch):
    """An update of a proven structure that still fails (a value-dependent failure inside torch's code) is not
    undone: the error says so, gradients and buffers are put back, and the next update is copied."""
    model = bn_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=2,
                         profile=False, progress=False)
    batches = data(n=8, steps=4)
    for x, y in batches[:3]:
        engine.train_step(x, y)
    rollback = engine._runner.rollback
    assert rollback is not None and not rollback.copied
    sgd_module = importlib.import_module("torch.optim.sgd")
    real = sgd_module.sgd

    def fails(params, *args, **kw):
        with torch.no_grad():
            params[0].add_(1.0)
        raise RuntimeError("out of memory midway")

    monkeypatch.setattr(sgd_module, "sgd", fails)
    with pytest.raises(RuntimeError, match="midway") as info:
        engine.train_step(*batches[3])
    assert any("not copied" in n for n in info.value.__notes__)
    assert all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(sgd_module, "sgd", real)
    engine.train_step(*batches[3])
    assert rollback.copied
