"""What an engine attaches to the user's model: never makes it unpicklable, and leaves with the engine.

Issue 25 item 7: after ``wrap`` the user's model still deep-copies, pickles
and ``torch.save``s (a copy carries no live engine state and computes what
the plain model computes). Item 8: the hooks an engine puts on the user's
modules (deferred BatchNorm statistics, concurrent branches) leave when the engine is closed or garbage-collected, so the
plain model is as fast as before and holds nothing of dead engines.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn

import pipedp
from pipedp.models import resnet18

X, Y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return resnet18(width=8)


def _shared_bn() -> nn.Module:
    """One BatchNorm object used by two stages (stages=[2, 5] puts its uses apart)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn, nn.Conv2d(4, 4, 3, padding=1), bn,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


# (model, wrap options): every way an engine attaches something to the user's modules on a CPU
ATTACHING = {
    "batchnorm=batch": (_resnet, dict(batchnorm="batch", stages=2)),
    "a BatchNorm in two stages": (_shared_bn, dict(stages=[2, 5])),
    "recompute + batchnorm=batch": (_resnet, dict(batchnorm="batch", stages=2, recompute=True)),
    "branches": (_resnet, dict(stages=2, branches=True)),
}


def _engine(model: nn.Module, **kw) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=2, profile=False, progress=False, **kw)


def _trained(make, kw) -> tuple[nn.Module, pipedp.Engine]:
    model = make()
    engine = _engine(model, **kw)
    engine.train_step(X, Y)
    return model, engine


def _hooks(model: nn.Module) -> int:
    """Forward hooks on the model's modules, and modules whose forward or class an engine replaced."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + ("forward" in vars(m)) for m in model.modules())


@pytest.mark.parametrize("name", list(ATTACHING))
def test_a_wrapped_model_deep_copies_pickles_and_saves(name, tmp_path):
    """Item 7: deepcopy, pickle and torch.save of the user's model work; each copy computes what it computes."""
    model, engine = _trained(*ATTACHING[name])
    model.eval()
    with torch.no_grad():
        want = model(X)
    copies = {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model))}
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies["torch.save"] = torch.load(buf, weights_only=False)
    for how, twin in copies.items():
        with torch.no_grad():
            assert torch.equal(twin(X), want), how
    # the engine still trains the original after its model was copied
    model.train()
    assert torch.isfinite(engine.train_step(X, Y))


@pytest.mark.parametrize("name", list(ATTACHING))
def test_a_copy_of_a_wrapped_model_trains_as_the_plain_model(name):
    """Item 7: a copy holds no live engine state: its own BatchNorm statistics update in its own forward."""
    model, _ = _trained(*ATTACHING[name])
    twin = copy.deepcopy(model)
    twin.train()
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    nn.CrossEntropyLoss()(twin(X), Y).backward()
    after = twin.state_dict()
    moved = [k for k in before if k.endswith("running_mean") and not torch.equal(before[k], after[k])]
    assert moved, "the copy's BatchNorm statistics did not update in its forward"
    assert all(p.grad is not None for p in twin.parameters())


def test_split_grads_attaches_nothing_to_the_model():
    """Split weight gradients are actions (I, then W on a side lane): no module is swapped, hooked or patched."""
    model = _resnet()
    plain, types = _hooks(model), [type(m) for m in model.modules()]
    _engine(model, stages=2, split_grads=True).train_step(X, Y)
    assert _hooks(model) == plain and [type(m) for m in model.modules()] == types


def test_hooks_do_not_pile_up_over_engines():
    """Item 8: 22 engines over one model, each dropped in turn, leave the hooks of at most the live one."""
    model = _resnet()
    plain = _hooks(model)
    for _ in range(22):
        _engine(model, batchnorm="batch", stages=2, sample=X.shape)
    gc.collect()
    assert _hooks(model) == plain


@pytest.mark.parametrize("name", list(ATTACHING))
def test_close_takes_the_engines_hooks_off_the_model(name):
    """Item 8: engine.close() removes every hook and swap it made; the model then runs as plain PyTorch."""
    make, kw = ATTACHING[name]
    model = make()
    plain = _hooks(model)
    engine = _engine(model, **kw)
    engine.train_step(X, Y)
    assert _hooks(model) > plain
    engine.close()
    assert _hooks(model) == plain
    assert all(type(m) in (nn.Conv2d,) for m in model.modules() if isinstance(m, nn.Conv2d))
    engine.close()  # twice is harmless


@pytest.mark.parametrize("name", list(ATTACHING))
def test_a_dropped_engine_is_collected_and_its_hooks_leave(name):
    """Item 8: nothing on the user's model keeps a dropped engine alive; its hooks go with it."""
    make, kw = ATTACHING[name]
    model = make()
    plain = _hooks(model)
    engine = _engine(model, **kw)
    engine.train_step(X, Y)
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None
    assert _hooks(model) == plain


def test_a_closed_engine_trains_again_by_rebuilding():
    """Item 8: close() drops the built pipeline; a later step plans again and trains as before."""
    model = _resnet()
    engine = _engine(model, batchnorm="batch", stages=2)
    engine.train_step(X, Y)
    engine.close()
    assert torch.isfinite(engine.train_step(X, Y))
    assert _hooks(model) > 0
    engine.close()
