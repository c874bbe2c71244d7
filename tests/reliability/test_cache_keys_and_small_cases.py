"""Plan-cache keys that hold across processes, and the small cases of issue 58 item 13.

Item 6: a forward with a comprehension, a nested function or a lambda holds
code objects among its constants, whose ``repr`` is an address: a key built
from it differs in every process, so the plan cache never hits and grows an
entry per run. The key describes code by its own bytecode, constants and
names, recursively, and nothing by address or by hash-seed order. Item 13:
``plan_cache="~/plans"`` is the home folder's; a batch of meta tensors is
refused by name before anything changes; an engine says it cannot be copied
or pickled and what to do instead; a failed call keeps the gradients an
accumulation window held, including a window whose update raised.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import pipedp
from pipedp.decide.fingerprint import fingerprint

from ..reference import data, sequential_cnn

CPU = [torch.device("cpu")]
ROOT = Path(__file__).resolve().parents[2]

# A forward as people write them: a comprehension over branches, a nested def, a lambda, a generator,
# a set literal (a frozenset constant, whose repr's order follows the hash seed) and a default argument
# that is a function.
_BRANCHY = '''
import torch
from torch import nn


def _act(t, slope=0.1):
    return nn.functional.leaky_relu(t, slope)


class Branchy(nn.Module):
    def __init__(self, mode="mean"):
        super().__init__()
        self.mode = mode
        self.branches = nn.ModuleList([nn.Conv2d(3, 4, 3, padding=1) for _ in range(3)])
        self.head = nn.Linear(12, 10)

    def forward(self, x, act=_act):
        def pool(t):
            return t.mean((2, 3)) if self.mode in {"mean", "avg", "average"} else t.amax((2, 3))
        scale = lambda t: t * SCALE
        y = torch.cat([scale(act(b(x))) for b in self.branches], 1)
        y = y + sum(0.0 * b.bias.sum() for b in self.branches)
        return self.head(self._pooled(pool, y))

    def _pooled(self, pool, y):
        return pool(y) * HELPER
'''


def _branchy(scale: str = "2.0", helper: str = "1.0") -> nn.Module:
    """A fresh ``Branchy`` from its source: each call compiles new code objects (at new addresses)."""
    source = _BRANCHY.replace("SCALE", scale).replace("HELPER", helper)
    module = types.ModuleType("branchy")
    exec(compile(source, "branchy.py", "exec"), module.__dict__)
    return module.Branchy()


def _model_key(model: nn.Module) -> str:
    return fingerprint(model, torch.zeros(2, 3, 8, 8), CPU, {"stages": "auto"}).sections["model"]


_PRINT_KEYS = '''
import json, sys, types
sys.path.insert(0, {root!r})
import torch
from pipedp.decide.fingerprint import fingerprint
from tests.reliability.test_cache_keys_and_small_cases import _branchy, _model_key
keys = {{"branchy": _model_key(_branchy())}}
try:  # as the suite loads it (torchvision's compiled ops need not load); absent: the toy model alone
    from tests.stock import timm as load_timm
    timm = load_timm()
except BaseException:
    timm = None
if timm is not None:
    for name in ("mixnet_s", "skresnet18"):
        keys[name] = _model_key(timm.create_model(name, num_classes=10))
print(json.dumps(keys))
'''


def test_the_model_key_is_the_same_in_another_process():
    """Item 6: another process (another hash seed, other addresses) keys the same models alike, timm's too."""
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "2" else "2"
    run = subprocess.run([sys.executable, "-c", _PRINT_KEYS.format(root=str(ROOT))], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}, timeout=300)
    assert run.returncode == 0, run.stderr
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    ours = {"branchy": _model_key(_branchy())}
    if len(theirs) > 1:  # timm loaded there: here too
        from ..stock import timm

        models = timm()
        ours.update({n: _model_key(models.create_model(n, num_classes=10)) for n in theirs if n != "branchy"})
    assert theirs == ours


def test_the_model_key_follows_the_code_not_its_address():
    """Item 6: new code objects of the same source key alike; a constant changed anywhere in forward does not."""
    a, b = _branchy(), _branchy()
    assert a.forward.__code__ is not b.forward.__code__
    with torch.no_grad():
        for _ in range(20):  # run often enough for the interpreter to specialise its bytecode
            b(torch.randn(2, 3, 8, 8))
    assert _model_key(a) == _model_key(b)
    assert _model_key(_branchy(scale="3.0")) != _model_key(a)  # inside the lambda, inside forward
    assert _model_key(_branchy(helper="0.5")) != _model_key(a)  # in a method forward calls


def test_no_address_reaches_the_key():
    """Item 6: nothing the model section digests carries a ``0x`` address (functions, lambdas, closures, ...)."""
    from pipedp.decide.fingerprint import _model

    model = _branchy()
    model.hook = lambda t: t  # a plain attribute: not part of the key, but nothing of it may leak an address
    model.head.register_forward_hook(lambda m, i, o: None)
    text = json.dumps(_model(model), sort_keys=True, default=repr)
    assert " at 0x" not in text


def test_plan_cache_in_the_home_folder(tmp_path, monkeypatch):
    """Item 13: ``plan_cache="~/plans"`` writes to the home folder's ``plans``, not to ``./~/plans``."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model = sequential_cnn()
    pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.CrossEntropyLoss(),
                stages=1, microbatches=1, profile=False, progress=False, plan_cache="~/plans",
                sample=(4, 3, 16, 16))
    assert not (work / "~").exists()
    assert len(list((home / "plans").glob("*.json"))) == 1


def _engine(model: nn.Module, **kw) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=2, profile=False, progress=False, **kw)


def test_a_batch_of_meta_tensors_is_refused_by_name_before_anything_changes():
    """Item 13: meta tensors have no data; the error says so and how to fix it, and nothing was planned."""
    model = sequential_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = _engine(model, stages=2)
    x, y = torch.empty(8, 3, 16, 16, device="meta"), torch.empty(8, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"meta.*no data.*(to_empty|real)"):
        engine.train_step(x, y)
    with pytest.raises(ValueError, match=r"meta.*no data"):
        engine.train_step(torch.randn(8, 3, 16, 16), y)
    with pytest.raises(ValueError, match=r"meta.*no data"):
        engine(x)
    assert engine._pipe is None and engine.steps == 0  # nothing planned, no step counted
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    xb, yb = data(n=8, steps=1)[0]
    engine.train_step(xb, yb)  # a real batch trains as ever
    with pytest.raises(ValueError, match=r"meta.*no data"):
        engine.train_step(x, y)
    assert engine.steps == 1


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_an_engine_says_it_cannot_be_copied_or_pickled_and_what_to_do(how, tmp_path):
    """Item 13: not torch's ``cannot pickle '_thread._local'``, but what to save or copy instead."""
    model = sequential_cnn()
    engine = _engine(model, stages=2)
    xb, yb = data(n=8, steps=1)[0]
    engine.train_step(xb, yb)  # built and stepped: its runner, stages and hooks exist
    do = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps,
          "torch.save": lambda e: torch.save(e, tmp_path / "engine.pt")}[how]
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict\(\).*deepcopy\(engine\.module\)"):
        do(engine)
    twin = copy.deepcopy(engine.module)  # what the message says works: the model copies, and its copy wraps
    assert torch.isfinite(_engine(twin, stages=2).train_step(xb, yb))
    assert torch.isfinite(engine.train_step(xb, yb))  # the engine itself is untouched


class FailOnce(torch.optim.SGD):
    """Raises from its first armed ``step()`` before changing anything."""

    armed = False

    def step(self, closure=None):
        if self.armed:
            self.armed = False
            raise RuntimeError("optimizer refused this step")
        return super().step(closure)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_window_whose_update_fails_keeps_the_gradients_it_held(stages):
    """Item 13: the window's gradients (None where a parameter has none) are put back, and the window goes on."""
    torch.manual_seed(0)
    model = sequential_cnn()
    model[0].bias.requires_grad_(False)  # a parameter with no gradient: None before, None after
    ref = copy.deepcopy(model)
    opt = FailOnce(model.parameters(), lr=0.05)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), stages=stages, microbatches=2,
                         profile=False, progress=False)
    (x, y), (x2, y2) = data(n=8, steps=2)
    engine.train_step(x, y, update=False, loss_divisor=2)
    held = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    assert held[1] is None and held[0] is not None
    opt.armed = True
    with pytest.raises(RuntimeError, match="refused this step"):
        engine.train_step(x2, y2, update=True, loss_divisor=2)
    after = [p.grad for p in model.parameters()]
    assert [g is None for g in after] == [g is None for g in held]
    assert all(g is None or torch.equal(a, g) for a, g in zip(after, held))
    engine.train_step(x2, y2, update=True, loss_divisor=2)  # the retried call closes the same window
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for xb, yb in ((x, y), (x2, y2)):
        (nn.functional.cross_entropy(ref(xb), yb) / 2).backward()
    ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert diff <= 1e-5
