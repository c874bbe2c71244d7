"""pipedp.wrap end to end on CPU: exactness against plain training, state, errors."""

import itertools

import pytest
import torch
from torch import nn

import pipedp
from pipedp.models import resnet18, resnet50
from pipedp.pipeline import microbatch
from pipedp.partition import blocks_of
from tests.reference import TwoPaths, clone, data, max_diff, plain_steps, sequential_cnn

TOL = 1e-5


def engine_for(model, *, microbatches, stages, schedule="1f1b", lr=0.05, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return pipedp.wrap(
        model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=microbatches,
        stages=stages, schedule=schedule, profile=False, progress=False, **kw,
    )


MODELS = {
    "sequential": lambda: sequential_cnn(),
    "resnet18": lambda: resnet18(width=4),
    "resnet50": lambda: resnet50(width=2),
}


@pytest.mark.parametrize("name", ["sequential", "resnet18",
                                  pytest.param("resnet50", marks=pytest.mark.slow)])  # 18 s: the slow run
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_parameters_equal_plain_training(name, schedule, stages):
    for microbatches in range(1, 6):
        torch.manual_seed(microbatches)
        model = MODELS[name]()
        ref = clone(model)
        batches = data(n=10, size=8, steps=3, seed=microbatches)
        engine = engine_for(model, microbatches=microbatches, stages=stages, schedule=schedule)
        for x, y in batches:
            engine.train_step(x, y)
        assert len(engine.plan.stages) == stages
        # Without BatchNorm, microbatched training is full-batch training.
        plain_steps(ref, batches, microbatches=1 if name == "sequential" else microbatches)
        assert max_diff(model, ref) <= TOL, (name, schedule, stages, microbatches)


@pytest.mark.parametrize("stages", [2, 3])
def test_zero_bubble_equals_plain_training_on_torchvision_and_pipedp_resnets(stages):
    from tests.stock import torchvision_models

    models = {"resnet18": MODELS["resnet18"], "torchvision resnet18": lambda: torchvision_models().resnet18(
        num_classes=10)}
    for name, make in models.items():
        torch.manual_seed(0)
        model = make()
        ref = clone(model)
        batches = data(n=10, size=8 if name == "resnet18" else 32, steps=2, seed=1)
        engine = engine_for(model, microbatches=4, stages=stages, schedule="zb-h1")
        for x, y in batches:
            engine.train_step(x, y)
        assert "I" in engine.program and "W" in engine.program
        plain_steps(ref, batches, microbatches=4)
        assert max_diff(model, ref) <= TOL, (name, stages)


@pytest.mark.slow  # half a minute on 2 cores
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_every_schedule_in_one_process_equals_plain_training_on_stock_models(schedule):
    from tests.stock import timm, torchvision_models

    models = {"torchvision resnet18": (lambda: torchvision_models().resnet18(num_classes=10), 3),
              "timm dla46_c": (lambda: timm().create_model("dla46_c", num_classes=10), [16, 7, 7, 9])}  # at tuples
    for (name, (make, stages)), bn in itertools.product(models.items(), ("microbatch", "batch")):
        torch.manual_seed(0)
        model = make()
        ref = clone(model)
        batches = data(n=8, size=32, steps=2, seed=1)
        engine = engine_for(model, microbatches=4, stages=stages, schedule=schedule, batchnorm=bn)
        for x, y in batches:
            engine.train_step(x, y)
        plain_steps(ref, batches, microbatches=4)
        if bn == "microbatch":  # running statistics too: per microbatch, as the plain loop updates them
            assert max_diff(model, ref) <= TOL, name
        else:  # one running-statistics update per step from the whole batch: the parameters equal plain training
            got, want = dict(model.named_parameters()), dict(ref.named_parameters())
            assert max((got[k] - want[k]).abs().max().item() for k in want) <= TOL, name


def test_loss_is_the_batch_mean_and_stays_on_device():
    torch.manual_seed(0)
    model = sequential_cnn()
    x, y = data(n=9, size=8, steps=1)[0]
    expected = nn.CrossEntropyLoss()(model(x), y).item()
    engine = engine_for(model, microbatches=4, stages=3)
    loss = engine.train_step(x, y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_deferred_batchnorm_keeps_full_batch_running_statistics():
    torch.manual_seed(0)
    model = resnet18(width=4)
    micro = clone(model)
    x, y = data(n=12, size=8, steps=1)[0]
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    before = [(m.running_mean.clone(), m.running_var.clone()) for m in bns]
    inputs = {m: [] for m in bns}
    for m in bns:
        m.register_forward_pre_hook(lambda mod, args: inputs[mod].append(args[0].detach().clone()))
    engine = engine_for(model, microbatches=4, stages=3, batchnorm="batch")
    engine.train_step(x, y)
    for m, (rm, rv) in zip(bns, before):
        # Each BatchNorm's statistics are those of its inputs over the whole batch, applied once.
        seen = torch.cat(inputs[m][-4:])
        assert seen.shape[0] == 12
        mean = seen.mean(dim=(0, 2, 3))
        var = seen.var(dim=(0, 2, 3), unbiased=True)
        assert torch.allclose(m.running_mean, 0.9 * rm + 0.1 * mean, atol=TOL)
        assert torch.allclose(m.running_var, 0.9 * rv + 0.1 * var, atol=TOL)
        assert m.num_batches_tracked.item() == 1
    # Normalisation itself still uses microbatch statistics: parameters equal
    # plain microbatched training (whose running stats differ).
    plain_steps(micro, [(x, y)], microbatches=4)
    params = dict(model.named_parameters())
    assert max((p - params[n]).abs().max().item() for n, p in micro.named_parameters()) <= TOL


def test_deferred_batchnorm_equals_plain_full_batch_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 3))
    full = clone(model)
    x, y = torch.randn(10, 3, 8, 8), torch.randint(0, 3, (10,))
    engine_for(model, microbatches=3, stages=3, batchnorm="batch").train_step(x, y)
    with torch.no_grad():
        full(x)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.allclose(getattr(model[0], name).double(), getattr(full[0], name).double(), atol=TOL), name


def test_deferred_batchnorm_with_cumulative_average():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.Flatten(), nn.Linear(4 * 36, 3))
    full = clone(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    engine = engine_for(model, microbatches=3, stages=2, batchnorm="batch")
    for _ in range(2):
        engine.train_step(x, y)
        with torch.no_grad():
            full(x)
        full[0].weight.data.copy_(model[0].weight.data)
        full[0].bias.data.copy_(model[0].bias.data)
    assert torch.allclose(model[1].running_mean, full[1].running_mean, atol=TOL)
    assert torch.allclose(model[1].running_var, full[1].running_var, atol=TOL)
    assert model[1].num_batches_tracked.item() == 2


def test_module_is_the_users_model_and_checkpoint_keys_are_unchanged():
    model = resnet18(width=4)
    keys = list(model.state_dict())
    engine = engine_for(model, microbatches=2, stages=3)
    x, y = data(n=4, size=8, steps=1)[0]
    engine.train_step(x, y)
    assert engine.module is model
    state = engine.state_dict()
    assert list(state["model"]) == keys
    plain = resnet18(width=4)
    plain.load_state_dict(state["model"])  # loads into plain PyTorch code
    fresh = engine_for(resnet18(width=4), microbatches=2, stages=3)
    fresh.load_state_dict(state)
    assert fresh.steps == 1 and max_diff(fresh.module, model) == 0
    assert fresh.optimizer.state_dict()["state"].keys() == engine.optimizer.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="not an engine checkpoint .*engine.module.load_state_dict"):
        fresh.load_state_dict(model.state_dict())


def test_optimizer_factory_and_resumed_training_match():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8, size=8, steps=4)
    factory = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    engine = pipedp.wrap(model, optimizer=factory, loss_fn=nn.CrossEntropyLoss(), microbatches=2,
                         stages=2, profile=False, progress=False)
    for x, y in batches[:2]:
        engine.train_step(x, y)
    state = engine.state_dict()
    resumed_model = sequential_cnn()
    resumed = pipedp.wrap(resumed_model, optimizer=factory, loss_fn=nn.CrossEntropyLoss(), microbatches=2,
                          stages=2, profile=False, progress=False)
    resumed.load_state_dict(state)
    for x, y in batches[2:]:
        resumed.train_step(x, y)
    plain_steps(ref, batches, microbatches=1)
    assert max_diff(resumed_model, ref) <= TOL


def test_inference_equals_the_model():
    torch.manual_seed(0)
    model = resnet18(width=4)
    engine = engine_for(model, microbatches=3, stages=3)
    x = torch.randn(7, 3, 8, 8)
    engine.eval()
    with torch.no_grad():
        expected = model(x)
    out = engine(x)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(engine(x[:2]), expected[:2], atol=1e-6)  # fewer samples than microbatches
    assert not out.requires_grad


def test_channels_last_passes_through():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(6, 3, 8, 8).to(memory_format=torch.channels_last)
    engine = pipedp.wrap(model, microbatches=3, stages=2, profile=False, progress=False)
    out = engine(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out, model(x), atol=1e-6)
    ref = clone(model)
    loss = lambda out, y: (out - y).pow(2).mean()  # noqa: E731
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss,
                         microbatches=3, stages=2, profile=False, progress=False)
    y = torch.randn(6, 8, 8, 8)
    engine.train_step(x, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss(ref(x), y).backward()
    opt.step()
    assert max_diff(model, ref) <= TOL


def test_channels_last_option_converts_the_model_and_every_batch():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model).to(memory_format=torch.channels_last)
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last)))
    batches = data(n=8, size=8, steps=2)  # contiguous (NCHW) batches
    engine = engine_for(model, microbatches=2, stages=2, channels_last=True)
    for x, y in batches:
        engine.train_step(x, y)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) and seen and all(seen)
    seen.clear()
    assert engine(batches[0][0]).shape == (8, 10) and all(seen)  # inference too
    plain_steps(ref, [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches], microbatches=1)
    assert max_diff(model, ref) <= TOL


def test_autocast_passes_through():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    x, y = data(n=8, size=8, steps=1)[0]
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    engine = engine_for(model, microbatches=2, stages=3, lr=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.train_step(x, y)
    assert seen and all(d == torch.bfloat16 for d in seen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_steps(ref, [(x, y)], microbatches=2)
    assert max_diff(model, ref) <= 1e-3


def test_plan_before_and_after_steps():
    model = resnet18(width=4)
    engine = engine_for(model, microbatches=2, stages=3, measure_steps=2)
    with pytest.raises(RuntimeError, match="pass sample="):
        _ = engine.plan
    batches = data(n=4, size=8, steps=3)
    for x, y in batches:
        engine.train_step(x, y)
    plan = engine.plan
    assert plan.counts == [len(s.blocks) for s in plan.stages] and sum(plan.counts) == 4 + 8 + 3
    assert all(s.measured_ms is not None and s.measured_ms > 0 for s in plan.stages)
    text = str(plan)
    assert "3 stage(s) x 2 microbatch(es) of 2" in text and "meas ms" in text and "layer" in text


def test_sample_shape_plans_at_wrap_and_auto_picks_one_stage_on_cpu():
    engine = pipedp.wrap(resnet18(width=4), microbatches=2, sample=(4, 3, 8, 8), progress=False)
    assert len(engine.plan.stages) == 1
    assert any("one after another" in n for n in engine.plan.notes)
    assert engine.plan.source == "profile"


def test_stages_as_block_counts():
    engine = engine_for(sequential_cnn(), microbatches=2, stages=[2, 3, 4], sample=(4, 3, 8, 8))
    assert engine.plan.counts == [2, 3, 4]
    # the step as each rank runs it: here one rank, three stages, two microbatches of 1F1B
    assert engine.program.startswith("rank 0: 0F0 0F1 1F0 1F1 2F0 2B0 1B0 ") and engine.program.count("B") == 6
    with pytest.raises(ValueError, match=r"positive block counts summing to the model's 9 blocks"):
        engine_for(sequential_cnn(), microbatches=2, stages=[2, 3], sample=(4, 3, 8, 8))


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(schedule="zigzag"), ValueError, "unknown schedule 'zigzag'"),
        (dict(batchnorm="sync"), ValueError, "batchnorm must be one of"),
        (dict(microbatches=0), ValueError, "microbatches must be a positive int"),
        (dict(stages="many"), ValueError, "stages must be an int, 'auto' or a list"),
        (dict(stages=20, sample=(4, 3, 8, 8)), ValueError, "cannot cut 9 blocks into 20 non-empty stages"),
        (dict(devices="cuda:7"), ValueError, r"cuda:7"),
        (dict(devices="tpu"), ValueError, "not a device"),
        (dict(devices=["cpu", "cpu"]), ValueError, "lists a device twice"),
        (dict(devices=[]), ValueError, "devices is empty"),
        (dict(optimizer=42), TypeError, "optimizer must be a torch.optim.Optimizer or a factory"),
        (dict(optimizer=lambda p: 3), TypeError, "factory returned int"),
        (dict(loss_fn="mse"), TypeError, "loss_fn must be callable"),
    ],
)
def test_bad_arguments(kw, exc, match):
    args = dict(microbatches=2, profile=False, progress=False)
    args.update(kw)
    with pytest.raises(exc, match=match):
        pipedp.wrap(sequential_cnn(), **args)


def test_optimizer_on_other_parameters_is_rejected():
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not the model's: build it on model.parameters"):
        pipedp.wrap(sequential_cnn(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def _plain_varying(model, batches, lr=0.05):
    """Plain SGD-momentum steps, each batch in the microbatches pipedp runs it in (``microbatch.count``)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        k = microbatch.count(x.shape[0], 4)
        for xi, yi, w in zip(microbatch.split(x, k), microbatch.split(y, k), microbatch.shares(
                [t.shape[0] for t in microbatch.split(x, k)])):
            (nn.functional.cross_entropy(model(xi), yi) * w).backward()
        opt.step()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_batch_too_small_for_the_microbatches_trains_with_fewer_and_exactly(schedule, stages):
    """An epoch's last batch may hold 2 to 7 samples: it trains (microbatches of >= 2 samples) as plain does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 10))  # a BatchNorm over a 1x1 map
    ref = clone(model)
    engine = engine_for(model, microbatches=4, stages=stages, schedule=schedule)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))
               for n in (12, 7, 3, 12, 2, 5)]  # (1 sample: plain training fails on the 1x1 BatchNorm too)
    for x, y in batches:
        assert torch.isfinite(engine.train_step(x, y))
    _plain_varying(ref, batches)
    assert max_diff(model, ref) <= TOL
    assert engine.plan.microbatches == 4  # the plan is the full batches'


def test_a_small_planning_batch_plans_fewer_microbatches_and_says_so():
    engine = engine_for(sequential_cnn(), microbatches=4, stages=2)
    engine.train_step(torch.randn(5, 3, 8, 8), torch.zeros(5, dtype=torch.long))
    assert engine.plan.microbatches == 2
    assert engine.plan.notes[0].startswith("microbatches=4: 2, as the planning batch has 5 samples")
    assert torch.isfinite(engine.train_step(torch.randn(1, 3, 8, 8), torch.zeros(1, dtype=torch.long)))


def test_train_step_input_errors():
    engine = engine_for(sequential_cnn(), microbatches=4, stages=2)
    with pytest.raises(ValueError, match="share the batch dimension"):
        engine.train_step(torch.randn(8, 3, 8, 8), torch.zeros(6, dtype=torch.long))
    bare = pipedp.wrap(sequential_cnn(), microbatches=2, profile=False, progress=False)
    with pytest.raises(RuntimeError, match="needs wrap\\(..., optimizer=..., loss_fn=...\\)"):
        bare.train_step(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))


def snapshot(engine):
    return (
        {k: v.clone() for k, v in engine.module.state_dict().items()},
        {k: {n: t.clone() for n, t in s.items()} for k, s in engine.optimizer.state_dict()["state"].items()},
    )


def assert_unchanged(engine, before):
    model_state, opt_state = snapshot(engine)
    assert all(torch.equal(before[0][k], v) for k, v in model_state.items())
    assert opt_state.keys() == before[1].keys()
    for k in opt_state:
        assert all(torch.equal(before[1][k][n], t) for n, t in opt_state[k].items())
    assert all(p.grad is None for p in engine.module.parameters())


@pytest.mark.parametrize("batchnorm", ["microbatch", "batch"])
def test_failed_step_leaves_parameters_optimizer_and_buffers_unchanged(batchnorm):
    model = resnet18(width=4)
    calls = []

    def flaky_loss(out, y):
        calls.append(1)
        if len(calls) == 6:  # second step, after microbatches ran forward (and backward)
            return out.sum(dim=1)  # not a scalar
        return nn.functional.cross_entropy(out, y)

    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         loss_fn=flaky_loss, microbatches=4, stages=3, batchnorm=batchnorm,
                         profile=False, progress=False)
    x, y = data(n=8, size=8, steps=1)[0]
    engine.train_step(x, y)  # momentum buffers now exist
    before = snapshot(engine)
    with pytest.raises(ValueError, match=r"loss_fn returned a tensor of shape \(2,\); it must return a scalar"):
        engine.train_step(x, y)
    assert_unchanged(engine, before)
    # A shape error inside a stage leaves everything unchanged too, and training goes on.
    with pytest.raises(RuntimeError):
        engine.train_step(torch.randn(8, 5, 8, 8), y)
    assert_unchanged(engine, before)
    calls.clear()
    engine.train_step(x, y)


def test_loss_must_be_a_tensor():
    engine = pipedp.wrap(sequential_cnn(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         loss_fn=lambda out, y: 1.0, microbatches=2, stages=2, profile=False, progress=False)
    with pytest.raises(ValueError, match="loss_fn returned float; it must return a scalar tensor"):
        engine.train_step(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))


def _live_graph_tensors():
    import gc
    import warnings

    gc.collect()
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor) and o.grad_fn is not None:
                    out.append(tuple(o.shape))
            except Exception:
                continue
    return out


def test_no_autograd_graph_outlives_wrap_or_a_step():
    # A graph kept alive pins memory and keeps AccumulateGrad nodes on the stream
    # that made them, which breaks CUDA graph capture later.
    assert _live_graph_tensors() == []
    model = resnet18(width=4)
    x, y = data(n=8, size=8, steps=1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=3,
                         sample=x, progress=False)
    assert _live_graph_tensors() == []
    engine.train_step(x, y)
    assert _live_graph_tensors() == []


def test_save_and_load_resume_bit_identically_with_dropout(tmp_path):
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(sequential_cnn(), nn.Dropout(0.5))  # dropout draws from the RNG
        return engine_for(model, microbatches=2, stages=2, depth=2)

    batches = data(n=8, size=8, steps=6, seed=9)
    a = fresh()
    for x, y in batches[:3]:
        a.train_step(x, y)
    a.save(tmp_path / "ckpt.pt")
    for x, y in batches[3:]:
        a_loss = a.train_step(x, y)
    b = fresh()
    torch.manual_seed(1234)  # a new process would start from other RNG states
    b.load(tmp_path / "ckpt.pt")
    assert b.steps == 3
    for x, y in batches[3:]:
        b_loss = b.train_step(x, y)
    assert torch.equal(a_loss, b_loss)
    assert all(torch.equal(p, q) for p, q in zip(a.module.state_dict().values(), b.module.state_dict().values()))
    entry = torch.load(tmp_path / "ckpt.pt", weights_only=True)["engine"]
    assert set(entry) == {"steps", "format", "rng", "optimizer_class", "decision", "model"} and entry["optimizer_class"] == "SGD"


def test_microbatches_auto_lets_the_plan_choose_them():
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8, steps=2)
    engine = engine_for(model, microbatches="auto", stages="auto")
    assert engine.microbatches == "auto"  # until the plan chose them
    for x, y in batches:
        engine.train_step(x, y)
    # On a CPU one stage is fastest, and one stage gains nothing from microbatches: the plain step.
    assert engine.microbatches == engine.plan.microbatches == 1 and engine.plan.counts == [9]
    plain_steps(ref, batches, microbatches=1)
    assert max_diff(model, ref) <= TOL


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, extra", [(2, {}), (4, {}), (3, {"batchnorm": "batch"}), (3, {"recompute": True})])
def test_stages_passing_tuples_of_tensors_train_exactly(schedule, stages, extra):
    """Two branches live side by side for the whole body: the stages between them pass (a, b) tuples."""
    torch.manual_seed(0)
    model = TwoPaths()
    ref = clone(model)
    batches = data(n=8, size=8, steps=2)
    engine = engine_for(model, microbatches=4, stages=stages, schedule=schedule, **extra)
    for x, y in batches:
        engine.train_step(x, y)
    assert len(engine.plan.stages) == stages
    outs, v = [], batches[0][0]
    with torch.no_grad():
        for b in blocks_of(TwoPaths()):
            v = b.module(v)
            outs.append(v)
    ends = list(itertools.accumulate(len(st.names) for st in engine.executor.stages))[:-1]
    assert any(isinstance(outs[e - 1], tuple) for e in ends)  # a boundary passes the two branches
    plain_steps(ref, batches, microbatches=4)
    params = dict(model.named_parameters())
    assert max((p - params[n]).abs().max().item() for n, p in ref.named_parameters()) <= TOL
    if not extra:  # batch mode updates the running statistics once per step, from the whole batch
        assert max_diff(model, ref) <= TOL


def _timed_engine(model, **kw):
    """stages='auto' as users run it: profiled and timed (the plan cache is the test's own folder)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), progress=False, plan_budget_s=5, **kw)


def test_a_checkpoints_decision_rebuilds_its_plan_without_planning_and_resumes_exactly(tmp_path, monkeypatch):
    batches = data(n=8, size=8, steps=4, seed=3)
    torch.manual_seed(0)
    a = _timed_engine(resnet18(width=4), microbatches="auto", sample=batches[0][0])
    a.train_step(*batches[0])
    a.save(tmp_path / "ckpt.pt")
    losses = [a.train_step(x, y) for x, y in batches[1:]]

    def no_planning(*args, **kw):
        raise AssertionError("a saved decision was planned anew")

    monkeypatch.setattr("pipedp.build.decide", no_planning)
    saved = pipedp.checkpoint.load(tmp_path / "ckpt.pt")
    torch.manual_seed(7)
    b = _timed_engine(resnet18(width=4), microbatches="auto", plan_cache=False, decision=saved["engine"]["decision"],
                      sample=batches[0][0])
    b.load_state_dict(saved)
    assert b.plan.microbatches == a.plan.microbatches and b.plan.trials == a.plan.trials
    assert b.plan.notes[0].startswith("plan replayed from the saved decision")
    assert [b.train_step(x, y) for x, y in batches[1:]] == losses
    assert b.decision_record() == a.decision_record()


def test_a_second_wrap_of_one_model_replays_the_cached_plan(monkeypatch):
    x = torch.randn(8, 3, 8, 8)
    torch.manual_seed(0)
    first = _timed_engine(resnet18(width=4), sample=x)
    monkeypatch.setattr("pipedp.build.decide", lambda *a, **k: pytest.fail("planned although the cache holds it"))
    torch.manual_seed(0)
    second = _timed_engine(resnet18(width=4), sample=x)
    assert second.decision_record() == first.decision_record()
    assert "plan replayed from the plan cache" in second.plan.notes[0]
    monkeypatch.undo()
    third = _timed_engine(resnet18(width=4), sample=x, plan_cache=False, microbatches=2)  # another request
    with pytest.raises(pipedp.decide.record.RecordError, match="the request differ"):
        _timed_engine(resnet18(width=4), sample=x, decision=third.decision_record())


def test_loading_a_checkpoint_of_another_plan_says_how_to_replay_it(tmp_path):
    torch.manual_seed(0)
    a = engine_for(sequential_cnn(), microbatches=2, stages=2)
    a.train_step(*data(n=8, size=8, steps=1)[0])
    a.save(tmp_path / "ckpt.pt")
    torch.manual_seed(0)
    b = engine_for(sequential_cnn(), microbatches=4, stages=1, sample=(8, 3, 8, 8))
    with pytest.warns(UserWarning, match=r"trained with the plan 2x2, this engine runs 1x4: .*decision="):
        b.load(tmp_path / "ckpt.pt")


def test_a_value_that_is_no_saved_decision_is_refused_at_wrap():
    with pytest.raises(ValueError, match="not a saved pipedp decision"):
        engine_for(sequential_cnn(), microbatches=2, stages=2, decision={"config": {}})


def test_a_script_that_saves_its_own_checkpoint_resumes_exactly_with_the_run_state(tmp_path):
    def fresh():
        torch.manual_seed(0)
        return engine_for(nn.Sequential(sequential_cnn(), nn.Dropout(0.5)), microbatches=2, stages=2, depth=2)

    batches = data(n=8, size=8, steps=5, seed=4)
    a = fresh()
    for x, y in batches[:2]:
        a.train_step(x, y)
    torch.save({"weights": a.module.state_dict(), "opt": a.optimizer.state_dict(), "pipedp": a.run_state()},
               tmp_path / "mine.pt")  # the script's own format
    losses = [a.train_step(x, y) for x, y in batches[2:]]
    b = fresh()
    torch.manual_seed(99)
    mine = torch.load(tmp_path / "mine.pt", weights_only=True)
    b.module.load_state_dict(mine["weights"])
    b.optimizer.load_state_dict(mine["opt"])
    b.load_run_state(mine["pipedp"])
    assert b.steps == 2 and [b.train_step(x, y) for x, y in batches[2:]] == losses
    with pytest.raises(ValueError, match="steps=-1"):
        b.load_run_state({**mine["pipedp"], "steps": -1})
    assert b.steps == 5


class _Poisoned:
    """Stands in for an options group once the decision is made: any read fails the test."""

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name):
        raise AssertionError(f"{self.group}.{name} was read after the decision was made")


def test_after_the_decision_nothing_reads_the_options():
    levers = dict(stages=2, microbatches=2, batchnorm="batch", recompute=[1], branches=True,
                  split_grads=True, early_update=True, rollback=True, measure_steps=2, progress=False,
                  plan_cache=False)
    batches = data(n=8, steps=3)
    trained = []
    for poison in (False, True):
        torch.manual_seed(0)
        model = resnet18(width=8)  # BatchNorm and downsample shortcuts: every lever above has work to do
        engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), sample=batches[0][0].shape, **levers)
        if poison:
            engine.options = _Poisoned("pipeline")
            engine.training_options = _Poisoned("training")
            engine.concurrency_options = _Poisoned("concurrency")
        for x, y in batches:
            engine.train_step(x, y)
        engine(batches[0][0])
        trained.append(model)
        d = engine.decision
        assert d.levers.batchnorm == "batch" and d.levers.recompute == (1,) and d.levers.early_update
        assert d.levers.branches and d.levers.split_grads and d.levers.rollback
        assert [r for r, _ in d.places] == [0, 0] and (d.pp, d.dp) == (1, 1)
        assert type(engine.executor.stages[1].body).__name__ == "Recompute"
        # Whole-batch statistics: each stage applies them after its last forward, an action of its program.
        assert "0F1 0BN_COMMIT" in engine.program and "1F1 1BN_COMMIT" in engine.program
        assert len(engine.plan.stages) == 2 and any("early_update" in n for n in engine.plan.notes)
    assert max_diff(*trained) == 0.0  # the same steps, whether or not the options could still be read
