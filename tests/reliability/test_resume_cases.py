"""Resuming from what a run saved: mid-window, another model's run state, warnings as errors, fp16 overflow.

Issue 58 items 5, 10 and 11. A save inside a gradient-accumulation window
keeps the gradients the window holds (under the engine entry, by parameter
name) so that resuming finishes the window bit for bit; a run state or
checkpoint of another model is refused before anything is applied, and so is
one whose warnings are errors (nothing half applied); an fp16 run whose
first batch overflowed (BatchNorm running statistics NaN, as under plain
autocast) resumes with the same options, as plain PyTorch with GradScaler does.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch import nn

import pipedp
from pipedp import checkpoint

from ..amp_reference import plain_amp_steps
from ..reference import bn_cnn, clone, data, sequential_cnn


def _engine(model: nn.Module, *, stages: int = 2, microbatches: int = 2, **kw) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=microbatches, stages=stages, profile=False,
                       progress=False, **kw)


def _fresh(seed: int = 0, model=bn_cnn, **kw) -> pipedp.Engine:
    torch.manual_seed(seed)
    return _engine(model(), **kw)


def _params(engine: pipedp.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


BATCHES = data(n=8, size=8, steps=4, seed=5)


def _window(engine: pipedp.Engine, batches) -> None:
    """Two batches accumulated into one update, as a plain loop with loss / 2 does."""
    (x0, y0), (x1, y1) = batches
    engine.train_step(x0, y0, update=False, loss_divisor=2)
    engine.train_step(x1, y1, update=True, loss_divisor=2)


def test_a_save_inside_an_accumulation_window_resumes_bit_for_bit(tmp_path):
    """Item 5: the held gradients are saved (by parameter name, loadable as data) and put back."""
    whole = _fresh()
    _window(whole, BATCHES[:2])
    _window(whole, BATCHES[2:])

    cut = _fresh()
    _window(cut, BATCHES[:2])
    cut.train_step(*BATCHES[2], update=False, loss_divisor=2)
    path = tmp_path / "mid.pt"
    cut.save(path)
    saved = torch.load(path, weights_only=True)
    held = saved["engine"]["window"]
    assert held["calls"] == 1
    assert set(held["grads"]) == {n for n, _ in cut.module.named_parameters()}
    assert all(torch.equal(held["grads"][n], p.grad) for n, p in cut.module.named_parameters())
    plain = bn_cnn()
    plain.load_state_dict(saved["model"])  # the model entry is still the plain model's state dict

    resumed = _fresh(seed=1)  # other initial weights: all of them come from the checkpoint
    resumed.load(path)
    assert all(p.grad is not None for p in resumed.module.parameters())
    resumed.train_step(*BATCHES[3], update=True, loss_divisor=2)
    assert resumed.steps == whole.steps == 4
    assert _equal(_params(resumed), _params(whole))
    assert _equal(resumed.optimizer.state_dict()["state"][0], whole.optimizer.state_dict()["state"][0])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_run_state_inside_a_window_resumes_with_the_scripts_own_model_and_optimizer_state(precision):
    """Item 5 for load_run_state: the window travels with the run state (a fresh engine, planned on its first
    call); under fp16 the held gradients are scaled by the loss scale saved beside them."""
    kw = {"stages": 1, "microbatches": 1, "precision": precision}
    whole = _fresh(**kw)
    _window(whole, BATCHES[:2])
    cut = _fresh(**kw)
    cut.train_step(*BATCHES[0], update=False, loss_divisor=2)
    mine = {"model": {k: v.clone() for k, v in cut.module.state_dict().items()},
            "optimizer": cut.optimizer.state_dict(), "run": cut.run_state()}
    resumed = _fresh(seed=1, **kw)
    resumed.module.load_state_dict(mine["model"])
    resumed.optimizer.load_state_dict(mine["optimizer"])
    resumed.load_run_state(mine["run"])
    resumed.train_step(*BATCHES[1], update=True, loss_divisor=2)
    assert _equal(_params(resumed), _params(whole))


def test_a_checkpoint_at_a_boundary_ends_a_window_and_old_checkpoints_load():
    """A checkpoint without held gradients is a boundary: loaded mid-window, the next call starts afresh.
    A checkpoint of the format before (no window, no model identity) loads as it did."""
    at_boundary = _fresh()
    _window(at_boundary, BATCHES[:2])
    state = copy.deepcopy(at_boundary.state_dict())  # a state dict holds the live tensors
    assert "window" not in state["engine"]
    old = {**state, "engine": {k: v for k, v in state["engine"].items() if k not in ("model",)} | {"format": 2}}
    engine = _fresh()
    engine.train_step(*BATCHES[0], update=False, loss_divisor=2)
    engine.load_state_dict(old)
    assert engine.steps == 2 and all(p.grad is None for p in engine.module.parameters())
    engine.train_step(*BATCHES[2], update=False, loss_divisor=2)
    engine.train_step(*BATCHES[3], update=True, loss_divisor=2)
    _window(at_boundary, BATCHES[2:])
    assert _equal(_params(engine), _params(at_boundary))


def _rng() -> tuple:
    return torch.get_rng_state(), random.getstate()


def _same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def _fp16_trained(model=sequential_cnn, **kw) -> pipedp.Engine:
    engine = _fresh(model=model, precision="fp16", **kw)
    for x, y in BATCHES[:2]:
        engine.train_step(x, y)
    return engine


def _narrow() -> nn.Sequential:
    """sequential_cnn with a narrower first layer: the same plan (2x2), other parameter shapes."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 16, 3, padding=1, stride=2), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


@pytest.mark.parametrize("how", ["run_state", "state_dict"])
def test_another_models_run_state_is_refused_and_changes_nothing(how):
    """Item 10: another model with the same plan label (2x2): refused, naming the model, before any change."""
    other = _fp16_trained(model=_narrow)
    engine = _fp16_trained()
    engine.scaler.load_state_dict({"scale": 1024.0, "growth_tracker": 3})  # another scale than the other run's
    before, rng, scale, steps = _params(engine), _rng(), engine.scaler.state_dict(), engine.steps
    random.seed(3)
    rng = _rng()
    with pytest.raises(ValueError, match=r"saved by another model than this engine.s Sequential.*Nothing was loaded"):
        if how == "run_state":
            engine.load_run_state(other.run_state())
        else:  # a checkpoint composed of this model's weights and the other run's engine entry
            engine.load_state_dict({**engine.state_dict(), "engine": other.state_dict()["engine"]})
    assert _same_rng(_rng(), rng) and engine.steps == steps and engine.scaler.state_dict() == scale
    assert _equal(_params(engine), before)


@pytest.mark.parametrize("how", ["run_state", "state_dict"])
@pytest.mark.parametrize("warning", ["plan", "ranks"])
def test_a_warning_turned_into_an_error_leaves_steps_rng_and_scaler_unchanged(how, warning):
    """Item 10: with warnings as errors, the warning raises before RNG, steps or scale change."""
    saved = _fp16_trained()
    state = saved.state_dict()
    if warning == "ranks":  # RNG states of two ranks, loaded by one process
        state["engine"]["rng"] = state["engine"]["rng"] * 2
    engine = _fresh(seed=1, model=sequential_cnn, precision="fp16",
                    stages=1 if warning == "plan" else 2, sample=BATCHES[0][0])
    engine.train_step(*BATCHES[0])
    engine.scaler.load_state_dict({"scale": 1024.0, "growth_tracker": 3})
    before, scale, steps = _params(engine), engine.scaler.state_dict(), engine.steps
    random.seed(3)
    rng = _rng()
    match = r"trained with the plan 2x2.*this engine runs 1x2" if warning == "plan" else "RNG states of 2 rank"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=match):
            if how == "run_state":
                engine.load_run_state(state["engine"])
            else:
                engine.load_state_dict(state)
    assert _same_rng(_rng(), rng) and engine.steps == steps and engine.scaler.state_dict() == scale
    assert _equal(_params(engine), before)
    with pytest.warns(UserWarning, match=match):  # warned, the load goes on as before
        engine.load_run_state(state["engine"]) if how == "run_state" else engine.load_state_dict(state)
    assert engine.steps == saved.steps and engine.scaler.state_dict() == saved.scaler.state_dict()


def _poisoned(batches):
    (x, y), *rest = batches
    x = x.clone()
    x[0, 0, 0, 0] = 1e6  # past fp16's range: inf activations, NaN running statistics, NaN gradients
    return [(x, y), *rest]


def test_an_fp16_run_whose_first_batch_overflowed_resumes_as_plain_grad_scaler_training(tmp_path):
    """Item 11: NaN running statistics after a skipped first step; the new process plans and trains on."""
    batches = _poisoned(BATCHES)
    first = _fresh(precision="fp16")
    reference = clone(first.module)
    first.train_step(*batches[0])
    assert first.module[1].running_var.isnan().all()  # as plain autocast leaves it
    first.save(tmp_path / "overflowed.pt")

    resumed = _fresh(seed=1, precision="fp16")  # same options, a new process: planned on the next batch
    resumed.load(tmp_path / "overflowed.pt")
    losses = [resumed.train_step(x, y) for x, y in batches[1:]]
    scaler = torch.amp.GradScaler("cpu")
    expected = plain_amp_steps(reference, batches, microbatches=2, dtype=torch.float16, scaler=scaler)
    assert all(torch.isfinite(loss) for loss in losses)
    assert resumed.scaler.get_scale() == scaler.get_scale() < 2.0**16  # the first step backed off
    mine, plain = resumed.module.state_dict(), reference.state_dict()
    for k, v in plain.items():
        assert torch.allclose(mine[k].double(), v.double(), rtol=0, atol=1e-5, equal_nan=True), k
    for got, want in zip(losses, expected[1:]):
        assert abs(got.item() - want["loss"].item()) <= 1e-5


def test_a_model_that_is_not_finite_in_train_mode_is_still_refused():
    """Item 11's bound: where the check cannot compare (train-mode output NaN), it refuses as before."""
    model = sequential_cnn()
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"not finite .*in train mode.*first appear in the output of block '0'"):
        _engine(model, sample=BATCHES[0][0])


def test_a_checkpoint_file_holding_a_window_is_read_as_data(tmp_path):
    """The window's tensors load with weights_only=True (checkpoint.load), and a damaged window is refused."""
    engine = _fresh()
    engine.train_step(*BATCHES[0], update=False, loss_divisor=2)
    engine.save(tmp_path / "w.pt")
    state = checkpoint.load(tmp_path / "w.pt")
    name = next(iter(state["engine"]["window"]["grads"]))
    state["engine"]["window"]["grads"][name] = torch.zeros(3)
    fresh = _fresh(seed=1)
    before = _params(fresh)
    with pytest.raises(ValueError, match=rf"held gradients.*'{name}'.*Nothing was loaded"):
        fresh.load_state_dict(state)
    assert _equal(_params(fresh), before) and fresh.steps == 0
    early = _fresh(seed=1, early_update=True, sample=BATCHES[0][0])  # updates on every call: cannot finish it
    before = _params(early)
    with pytest.raises(ValueError, match=r"inside an accumulation window.*early_update=False.*finish the window"):
        early.load(tmp_path / "w.pt")
    assert _equal(_params(early), before) and early.steps == 0


def _save_mid_window(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(0)
    engine = _engine(sequential_cnn(), stages=1, microbatches=1)
    (x, y), (x2, y2) = [(b[0][rank::world], b[1][rank::world]) for b in BATCHES[:2]]
    engine.train_step(x, y, update=False, loss_divisor=2)
    try:
        engine.save(path)
        refused = ""
    except ValueError as e:  # refused on every rank before any collective: the ranks go on together
        refused = str(e)
    engine.train_step(x2, y2, update=True, loss_divisor=2)
    engine.save(path)  # at the boundary
    return {"refused": refused, "saved": torch.load(path, weights_only=True)["engine"]["steps"]}


def test_a_save_inside_a_window_under_torch_distributed_is_refused_naming_the_boundary(tmp_path):
    """Item 5's distributed case: each pipeline rank holds only its stages' gradients; refused, not half saved."""
    from .. import multiproc

    for res in multiproc.run(_save_mid_window, 2, str(tmp_path / "ckpt.pt")):
        assert "inside an accumulation window under torch.distributed" in res["refused"]
        assert "after the call with update=True" in res["refused"] and res["saved"] == 2


def test_a_plan_of_the_same_label_and_another_cut_is_named_by_its_cut():
    """Item 10's message: 'trained with the plan 2x2, this engine runs 2x2' said nothing; the cut tells them apart."""
    saved = _engine(sequential_cnn(), stages=[4, 5], sample=BATCHES[0][0])
    saved.train_step(*BATCHES[0])
    engine = _engine(sequential_cnn(), stages=[5, 4], sample=BATCHES[0][0])
    with pytest.warns(UserWarning, match=r"plan 2x2 \(blocks per stage 4\+5\), this engine runs 2x2 \(blocks per "
                                         r"stage 5\+4\)"):
        engine.load_state_dict(saved.state_dict())
