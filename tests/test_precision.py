"""Mixed precision, loss scaling and gradient clipping (pipedp/precision.py, pipedp/update.py) on CPU.

The reference is torch's AMP recipe on the plain model with the same
microbatches (tests/amp_reference.py): forward and loss under autocast,
backward outside, ``torch.amp.GradScaler`` for fp16, ``clip_grad_norm_`` after
unscaling. On the CPU the same kernels run in the same order, so pipedp must
agree to the fp32 tolerance (1e-5 max abs difference) in every precision.
"""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.models import resnet18
from pipedp.precision import LossScaler
from tests.amp_reference import plain_amp_steps
from tests.reference import clone, data, max_diff, sequential_cnn

TOL = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def engine_for(model, *, microbatches=2, stages=2, schedule="1f1b", lr=0.05, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=microbatches,
                       stages=stages, schedule=schedule, profile=False, progress=False, **kw)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_mixed_precision_equals_plain_autocast_training(precision, schedule, stages):
    torch.manual_seed(stages)
    model = resnet18(width=4)
    ref = clone(model)
    batches = data(n=9, size=8, steps=3, seed=stages)
    engine = engine_for(model, microbatches=3, stages=stages, schedule=schedule, precision=precision,
                        sample=batches[0][0])
    seen = []
    model.conv1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = [engine.train_step(x, y) for x, y in batches]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    expected = plain_amp_steps(ref, batches, microbatches=3, dtype=DTYPES[precision], scaler=scaler)
    assert seen and set(seen) == {DTYPES[precision]}  # the layers ran in half precision
    assert all(p.dtype == torch.float32 for p in model.parameters())  # parameters stay fp32
    assert max_diff(model, ref) <= TOL
    for got, want in zip(losses, expected):
        assert got.dtype == torch.float32 and abs(got.item() - want["loss"].item()) <= TOL  # unscaled
    if scaler is not None:  # this model overflows at 2**16 and backs off, as GradScaler does
        assert engine.scaler.get_scale() == scaler.get_scale() < 2.0**16


def test_fp32_default_runs_no_autocast_and_no_scaler():
    engine = engine_for(sequential_cnn(), sample=(4, 3, 8, 8))
    assert engine.training_options.autocast_dtype is None and engine.scaler is None
    assert all(st.autocast is None and st.body is None for st in engine.executor.stages)


def _poison(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0, 0, 0] = 1e6  # past fp16's range: inf activations, NaN gradients
    return x


def test_fp16_skips_a_step_with_inf_gradients_like_grad_scaler():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8, size=8, steps=4)
    batches[2] = (_poison(batches[2][0]), batches[2][1])
    engine = engine_for(model, stages=3, precision="fp16")
    scales, skipped = [], []
    for k, (x, y) in enumerate(batches):
        before = ({n: p.detach().clone() for n, p in model.named_parameters()},
                  [s["momentum_buffer"].clone() for s in engine.optimizer.state.values()])
        loss = engine.train_step(x, y)
        scales.append(engine.scaler.get_scale())
        skipped.append(engine._runner.grads.skipped)
        if k == 2:
            assert not torch.isfinite(loss)
            assert all(torch.equal(p, before[0][n]) for n, p in model.named_parameters())
            assert all(torch.equal(b, s["momentum_buffer"]) for b, s in zip(before[1], engine.optimizer.state.values()))
    scaler = torch.amp.GradScaler("cpu")
    expected = plain_amp_steps(ref, batches, microbatches=2, dtype=torch.float16, scaler=scaler)
    assert skipped == [0, 0, 1, 1]
    assert scales == [e["scale"] for e in expected] and scales[2] == scales[1] / 2  # backed off
    assert max_diff(model, ref) <= TOL


def test_loss_scaler_grows_after_its_interval():
    scaler = LossScaler(init_scale=4.0, growth_interval=2)
    p = nn.Parameter(torch.ones(3))
    for k, (grad, scale) in enumerate([(1.0, 4.0), (1.0, 8.0), (float("inf"), 4.0), (1.0, 4.0), (1.0, 8.0)]):
        p.grad = torch.full((3,), grad) * scaler.get_scale()
        found = scaler.unscale_([p])
        assert (found.item() > 0) == (grad == float("inf"))
        if grad != float("inf"):
            assert torch.equal(p.grad, torch.full((3,), grad))  # unscaled
        scaler.update()
        assert scaler.get_scale() == scale, k


def test_fp16_gradients_are_refused_with_the_fix():
    p = nn.Parameter(torch.ones(2, dtype=torch.float16))
    p.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"keep the model's parameters in fp32.*model.float\(\)"):
        LossScaler().unscale_([p])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_clipping_equals_clip_grad_norm_on_plain_training(schedule, stages):
    torch.manual_seed(0)
    model = resnet18(width=4)
    ref = clone(model)
    batches = data(n=8, size=8, steps=3)
    engine = engine_for(model, stages=stages, schedule=schedule, clip_grad_norm=0.5)
    norms = []
    for x, y in batches:
        engine.train_step(x, y)
        norms.append(engine._runner.grads.last_norm.item())
    expected = plain_amp_steps(ref, batches, microbatches=2, clip=0.5)
    for got, want in zip(norms, expected):
        assert abs(got - want["norm"].item()) <= 1e-6 * want["norm"].item()
        assert want["norm"].item() > 0.5  # clipping was active
    grads = dict(model.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    assert max((p.grad - grads[n].grad).abs().max().item() for n, p in ref.named_parameters()) <= 1e-6 * scale
    assert max_diff(model, ref) <= TOL


def test_fp16_with_clipping_unscales_first():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8, size=8, steps=3)
    engine = engine_for(model, stages=2, precision="fp16", clip_grad_norm=0.1)
    for x, y in batches:
        engine.train_step(x, y)
    expected = plain_amp_steps(ref, batches, microbatches=2, dtype=torch.float16,
                               scaler=torch.amp.GradScaler("cpu"), clip=0.1)
    assert abs(engine._runner.grads.last_norm.item() - expected[-1]["norm"].item()) <= 1e-6 * expected[-1]["norm"]
    assert max_diff(model, ref) <= TOL


class FailOnce(torch.optim.SGD):
    armed = False

    def step(self, closure=None):
        if self.armed:
            raise RuntimeError("optimizer failed")
        return super().step(closure)


def test_a_failed_fp16_step_leaves_the_scale_as_it_was():
    torch.manual_seed(0)
    model = sequential_cnn()
    opt = FailOnce(model.parameters(), lr=0.05, momentum=0.9)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=2,
                         profile=False, progress=False, precision="fp16")
    (x, y), = data(n=8, size=8, steps=1)
    engine.train_step(x, y)
    before = engine.scaler.state_dict()
    opt.armed = True
    with pytest.raises(RuntimeError, match="optimizer failed"):
        engine.train_step(x, y)
    assert engine.scaler.state_dict() == before and before["growth_tracker"] == 1
    opt.armed = False
    engine.train_step(x, y)
    assert engine.scaler.state_dict()["growth_tracker"] == 2


def test_the_loss_scale_is_saved_and_loaded_with_the_engine(tmp_path):
    torch.manual_seed(0)
    model = resnet18(width=4)
    engine = engine_for(model, precision="fp16")
    for x, y in data(n=8, size=8, steps=3):
        engine.train_step(x, y)
    saved = engine.scaler.state_dict()
    assert saved["scale"] < 2.0**16  # it backed off: the checkpoint must carry that
    engine.save(tmp_path / "ckpt.pt")
    fresh = engine_for(resnet18(width=4), precision="fp16")
    fresh.load(tmp_path / "ckpt.pt")
    assert fresh.scaler.state_dict() == saved
    # A checkpoint of another precision has no scale: the fp16 engine starts from the initial one.
    plain = engine_for(resnet18(width=4))
    state = plain.state_dict()
    assert "scaler" not in state["engine"]
    fresh.load_state_dict(state)
    assert fresh.scaler.state_dict() == {"scale": 2.0**16, "growth_tracker": 0}


@pytest.mark.parametrize("bad", [{"scale": -1.0, "growth_tracker": 0}, {"scale": float("nan"), "growth_tracker": 0},
                                 {"scale": 8.0}, "big"])
def test_a_malformed_loss_scale_is_refused_and_nothing_loads(bad):
    torch.manual_seed(0)
    engine = engine_for(sequential_cnn(), precision="fp16")
    x, y = data(n=8, size=8, steps=1)[0]
    engine.train_step(x, y)
    state = engine.state_dict()
    state["engine"]["scaler"] = bad
    state["engine"]["steps"] = 7
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(ValueError, match="loss-scaler entry .* is malformed.*Nothing was loaded"):
        engine.load_state_dict(state)
    assert engine.steps == 1 and all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())


def test_fp16_with_cuda_graph_is_refused_with_the_alternatives():
    with pytest.raises(ValueError, match=r"precision='fp16' with cuda_graph=True is not supported yet.*'bf16'"):
        engine_for(sequential_cnn(), precision="fp16", cuda_graph=True)
