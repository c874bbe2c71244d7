"""A step that fails, wherever it fails, leaves parameters, optimizer state, buffers and gradients as they were.

Issue item 3: a failure inside ``optimizer.step()`` itself, after the
optimizer updated some parameters or created its state, is undone too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from ..reference import bn_cnn, clone, data, max_diff, plain_steps


class HalfThenFail(torch.optim.SGD):
    """Updates the first half of its parameters (and their momentum), then raises: a partial update."""

    armed = False

    @torch.no_grad()
    def step(self, closure=None):
        if not self.armed:
            return super().step(closure)
        params = self.param_groups[0]["params"]
        for p in params[: len(params) // 2]:
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buf.mul_(0.9).add_(p.grad)
            p.add_(buf, alpha=-0.05)
        self.state[params[-1]]["extra"] = torch.ones(1)  # state a failed step made up
        self.param_groups[0]["lr"] = 123.0  # and a hyperparameter it changed
        raise RuntimeError("optimizer blew up half way")


def _snapshot(engine: pipedp.Engine) -> dict[str, object]:
    out: dict[str, object] = {f"m.{k}": v.clone() for k, v in engine.module.state_dict().items()}
    for i, st in enumerate(engine.optimizer.state.values()):
        out.update({f"o.{i}.{k}": v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()})
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    out["grads"] = [p.grad for p in engine.module.parameters()]
    return out


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif k == "grads":
            if any(g is not None for g in y):
                return False
        elif x != y:
            return False
    return True


def _engine(model: nn.Module, optimizer: torch.optim.Optimizer, **kw) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=2,
                       profile=False, progress=False, **kw)


@pytest.mark.parametrize("batchnorm", ["microbatch", "batch"])
def test_a_partial_optimizer_update_that_raises_is_rolled_back(batchnorm):
    """Item 3: parameters, momentum, added state, hyperparameters, BatchNorm statistics and grads all put back."""
    model = bn_cnn()
    opt = HalfThenFail(model.parameters(), lr=0.05, momentum=0.9)
    engine = _engine(model, opt, batchnorm=batchnorm)
    batches = data(n=8, steps=3)
    engine.train_step(*batches[0])  # momentum buffers exist now
    before = _snapshot(engine)
    tracked = [m.num_batches_tracked.item() for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    opt.armed = True
    with pytest.raises(RuntimeError, match="blew up half way"):
        engine.train_step(*batches[1])
    assert [m.num_batches_tracked.item() for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == tracked
    assert _same(before, _snapshot(engine))


def test_an_optimizer_failing_at_its_first_step_leaves_no_state_behind():
    """Item 3: state the optimizer created during the failed step is dropped; training then goes on as plain."""
    torch.manual_seed(0)
    from ..reference import sequential_cnn

    model = sequential_cnn()
    ref = clone(model)
    opt = HalfThenFail(model.parameters(), lr=0.05, momentum=0.9)
    engine = _engine(model, opt)
    batches = data(n=8, steps=3)
    opt.armed = True
    with pytest.raises(RuntimeError, match="blew up half way"):
        engine.train_step(*batches[0])
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 0.05
    assert all(p.grad is None for p in model.parameters())
    opt.armed = False
    for x, y in batches:
        engine.train_step(x, y)
    plain_steps(ref, batches, microbatches=2)
    assert max_diff(model, ref) <= 1e-5  # as if the failed step had never been tried


def test_rollback_false_skips_the_copy_and_says_what_it_leaves():
    """The memory lever: with rollback=False a failing optimizer's partial update stays (documented)."""
    model = bn_cnn()
    opt = HalfThenFail(model.parameters(), lr=0.05, momentum=0.9)
    engine = _engine(model, opt, rollback=False)
    runner = engine._runner_for(torch.zeros(2, 3, 16, 16))
    assert runner.before_update is None and runner.rollback is None
    batches = data(n=8, steps=2)
    engine.train_step(*batches[0])
    first = next(model.parameters()).detach().clone()
    opt.armed = True
    with pytest.raises(RuntimeError):
        engine.train_step(*batches[1])
    assert not torch.equal(first, next(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # gradients and buffers are still put back


def test_adam_state_created_and_updated_in_place_is_rolled_back(monkeypatch):
    """Item 3 with torch's own Adam (foreach): its step counters and moments go back too."""
    model = bn_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = _engine(model, opt)
    batches = data(n=8, steps=2)
    engine.train_step(*batches[0])
    before = _snapshot(engine)
    real = torch.optim.Adam.step

    def step_then_fail(self, closure=None):
        real(self, closure)
        raise RuntimeError("after the update")

    monkeypatch.setattr(torch.optim.Adam, "step", step_then_fail)
    with pytest.raises(RuntimeError, match="after the update"):
        engine.train_step(*batches[1])
    assert _same(before, _snapshot(engine))
