"""Swapping depthwise layers: same objects and keys; clear errors when kernels are demanded but absent."""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.ops.swap import TunedDepthwiseConv2d, is_depthwise, swap_depthwise


def _net_module(root) -> object:
    """The model file the exported fixture was tuned with (``net.py`` in ``root``), imported."""
    import importlib
    import sys

    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("net")
    finally:
        sys.path.remove(str(root))


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1, groups=8),
                         nn.Conv2d(16, 16, 3, groups=4), nn.Flatten())


def test_only_depthwise_layers_qualify():
    net = _net()
    assert [is_depthwise(m) for m in net] == [False, True, False, False]


def test_tvm_without_exported_kernels_names_the_command(tmp_path):
    with pytest.raises(RuntimeError, match="tune-kernels --model"):
        swap_depthwise(_net(), "tvm", str(tmp_path), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="tune-kernels"):
        pipedp.wrap(_net(), kernels="tvm", kernel_db=str(tmp_path))


def test_auto_and_torch_leave_a_model_without_kernels_alone(tmp_path):
    net = _net()
    keys = list(net.state_dict())
    assert swap_depthwise(net, "auto", str(tmp_path), torch.device("cpu")).count == 0
    assert swap_depthwise(net, "torch", None, torch.device("cpu")).count == 0
    assert type(net[1]) is nn.Conv2d and list(net.state_dict()) == keys
    with pytest.raises(ValueError, match="kernels must be one of"):
        swap_depthwise(net, "fast", None, torch.device("cpu"))


def test_a_swapped_layer_is_the_same_module_computing_the_same_values():
    net = _net()
    layer = net[1]
    keys = list(net.state_dict())
    x = torch.randn(2, 3, 8, 8)
    ref = net(x)
    layer.__class__ = TunedDepthwiseConv2d  # what swap_depthwise does when kernels exist
    assert net[1] is layer and isinstance(layer, nn.Conv2d) and list(net.state_dict()) == keys
    assert torch.allclose(net(x), ref, atol=1e-6)


def test_torch_puts_swapped_layers_back():
    net = _net()
    net[1].__class__ = TunedDepthwiseConv2d
    assert is_depthwise(net[1])  # a swapped layer is still one of the model's depthwise layers
    assert swap_depthwise(net, "torch", None, torch.device("cpu")).count == 0
    assert type(net[1]) is nn.Conv2d and "kernels" not in vars(net[1])


def test_undo_puts_each_layer_back_as_it_was():
    from pipedp.ops.runtime import KernelChoice

    net = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 8, 3, groups=8))
    earlier = KernelChoice("a.so@0", strict=True)
    net[0].__class__ = TunedDepthwiseConv2d  # as an earlier engine left it
    net[0].kernels = earlier
    swap = swap_depthwise(net, "torch", None, torch.device("cpu"))
    assert swap.count == 0 and all(type(m) is nn.Conv2d and "kernels" not in vars(m) for m in net)
    swap.undo()
    assert type(net[0]) is TunedDepthwiseConv2d and net[0].kernels is earlier  # not plain nn.Conv2d
    assert type(net[1]) is nn.Conv2d and "kernels" not in vars(net[1])


# -- with an exported library: each model runs the kernels its own wrap asked for ------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A kernel database for tests.model_files.DEPTHWISE_NET at batch 4 (NCHW, one trial per kernel)."""
    pytest.importorskip("tvm")
    pytest.importorskip("xgboost")
    from pipedp.kernels.tvm import cli
    from tests.model_files import DEPTHWISE_NET

    root = tmp_path_factory.mktemp("kernels")
    (root / "net.py").write_text(DEPTHWISE_NET)
    db = root / "db"
    code = cli.main(["--model", f"{root / 'net.py'}:build", "--input-shape", "4,3,16,16", "--trials", "1",
                     "--layouts", "nchw", "--allocator", "default", "--db", str(db), "--no-progress"])
    assert code == 0
    return root, db


def _mark_slower_than_torch(db, op):
    """Rewrite the export's timings as if every ``op`` kernel had lost to torch when tuned."""
    from pipedp.ops import records as R

    path = db / R.RECORDS_FILE
    records = R.read(path)
    export = [r for r in records if r["kind"] == "export"][-1]
    for key in export["timings"]:
        if key.startswith(f'["{op}"'):
            export["timings"][key] = {"us": 2.0, "torch_us": 1.0}
    path.unlink()
    for r in records:
        R.append(path, r)


def test_two_engines_in_one_process_each_get_their_kernels(exported, monkeypatch):

    from pipedp.ops import depthwise as D

    root, db = exported
    _mark_slower_than_torch(db, "fwd")
    net = _net_module(root)
    torch.manual_seed(0)
    strict, auto, plain = net.build(), net.build(), net.build()
    opts = dict(microbatches=2, profile=False, progress=False, kernel_db=str(db), sample=(8, 3, 16, 16))
    a = pipedp.wrap(strict, kernels="tvm", **opts)
    # Built last: must not change what a runs. A given cut: stages="auto" would time whether the kernels pay.
    b = pipedp.wrap(auto, kernels="auto", stages=1, **opts)
    c = pipedp.wrap(plain, kernels="torch", **opts)
    assert a.kernel_layers == b.kernel_layers == 2 and c.kernel_layers == 0
    assert all(type(m) is nn.Conv2d for m in plain.modules() if isinstance(m, nn.Conv2d))

    fallbacks = []
    real = D.F.conv2d

    class Counting:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def conv2d(*args, **kw):
            fallbacks.append(args[0].shape)
            return real(*args, **kw)

    monkeypatch.setattr(D, "F", Counting())
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        a(x)
        assert fallbacks == []  # kernels="tvm": the tuned forward kernels, though they lost to torch
        b(x)
        assert len(fallbacks) == 4  # kernels="auto": torch for both layers of both microbatches
        fallbacks.clear()
        a(x)
        assert fallbacks == []


def test_undo_takes_a_swapped_model_off_the_kernels(exported):
    _, db = exported
    net = _net()
    swap = swap_depthwise(net, "tvm", str(db), torch.device("cpu"))
    assert swap.count == 1 and type(net[1]) is TunedDepthwiseConv2d and net[1].kernels.strict
    swap.undo()
    assert type(net[1]) is nn.Conv2d and "kernels" not in vars(net[1])


def test_tvm_runs_the_tuned_kernels_at_batch_sizes_never_tuned(exported, monkeypatch):
    # Tuned at batch 4; trained with microbatches of 3 and 2 (7 samples: 3 microbatches of at least 2), which
    # kernels="tvm" refused before: a kernel tuned for a layer serves every batch size.
    import copy
    from collections import Counter

    from pipedp.ops.runtime import load_library

    root, db = exported
    lib = load_library(str(db), torch.device("cpu"))
    calls: Counter = Counter()
    for sym, f in list(lib._funcs.items()):
        monkeypatch.setitem(lib._funcs, sym, lambda *a, f=f, sym=sym: (calls.update([(sym, a[0].shape[0])]), f(*a))[1])
    monkeypatch.setattr(lib, "lookups", {})  # (looked-up kernels are remembered: look them up again, counted)
    net = _net_module(root)
    torch.manual_seed(0)
    model = net.build()
    ref = copy.deepcopy(model)
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                         microbatches=4, kernels="tvm", kernel_db=str(db), profile=False, progress=False,
                         sample=(7, 3, 16, 16))
    calls.clear()  # the plan's trials ran the whole batch of 7 too: count the step's calls only
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 3, 16, 16, generator=g), torch.randint(0, 10, (7,), generator=g)
    engine.train_step(x, y)
    assert {sym for sym, _ in calls} == set(lib._funcs)  # every tuned kernel of both layers ran ...
    assert {n for _, n in calls} == {3, 2}  # ... at microbatch sizes never tuned
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xs, ys in zip(x.split([3, 2, 2]), y.split([3, 2, 2])):
        (nn.CrossEntropyLoss()(ref(xs), ys) * len(ys) / 7).backward()
    opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_levers_a_swap_leaves_to_the_plan_and_use_switches_the_layers(exported):
    _, db = exported
    auto, strict, plain = _net(), _net(), _net()
    a = swap_depthwise(auto, "auto", str(db), torch.device("cpu"))
    assert a.levers == (False, True)
    assert swap_depthwise(strict, "tvm", str(db), torch.device("cpu")).levers == (True,)
    assert swap_depthwise(plain, "torch", None, torch.device("cpu")).levers == (False,)
    choice = auto[1].kernels
    assert a.on and a.running == 1
    a.use(False)
    assert type(auto[1]) is nn.Conv2d and "kernels" not in vars(auto[1]) and not a.on and a.running == 0
    a.use(True)
    assert type(auto[1]) is TunedDepthwiseConv2d and auto[1].kernels is choice and a.running == 1
    a.undo()
    assert type(auto[1]) is nn.Conv2d and a.running == 0


def _plan_on(model, swap, clock):
    """The pipeline of ``model`` on the CPU, planned on ``clock``'s timings, deciding ``swap``'s kernels."""
    from pipedp.build import build_pipeline
    from pipedp.comm import Local
    from pipedp.options import PipelineOptions, TrainingOptions

    return build_pipeline(model, torch.randn(8, 3, 16, 16), PipelineOptions(profile=False, microbatches=4),
                          [torch.device("cpu")],
                          Local(), training=TrainingOptions(channels_last=False), measure=clock, kernels=swap)


@pytest.mark.parametrize("faster", [True, False])
def test_stages_auto_keeps_the_kernels_only_where_its_trials_ran_faster(exported, faster):
    from tests.decide.clock_tables import TableClock

    root, db = exported
    model = _net_module(root).build()
    swap = swap_depthwise(model, "auto", str(db), torch.device("cpu"))
    table = {"plain": 10.0, "1x4": 7.0, "1x4 tuned kernels": 5.0 if faster else 7.5}
    pipe = _plan_on(model, swap, TableClock(table))
    assert pipe.decision.kernels == faster and pipe.plan.kernels == faster and swap.on == faster
    want = TunedDepthwiseConv2d if faster else nn.Conv2d
    assert [type(m) for m in model.modules() if is_depthwise(m)] == [want, want]
    assert ("tuned depthwise kernels" in str(pipe.plan).splitlines()[0]) == faster  # the plan's head line


def test_the_device_clock_switches_the_layers_and_the_build_leaves_them_as_decided(exported, monkeypatch):
    # The real clock: the user's own step runs torch's convolution, a kernel trial the tuned op; whatever the
    # trials on this machine decide, the model's layers and the engine's count follow the decision.
    from pipedp.ops import depthwise as D

    root, db = exported
    model = _net_module(root).build()
    tuned_calls = []
    real = D._Eager.apply
    monkeypatch.setattr(D._Eager, "apply", lambda *a: (tuned_calls.append(1), real(*a))[1])
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss_fn=nn.CrossEntropyLoss(), kernels="auto", kernel_db=str(db), progress=False,
                         sample=(8, 3, 16, 16))
    assert any("tuned kernels" in label for label, _ in engine.plan.trials) and tuned_calls  # a kernel trial ran
    on = engine.plan.kernels
    want = TunedDepthwiseConv2d if on else nn.Conv2d
    assert [type(m) for m in model.modules() if is_depthwise(m)] == [want, want]
    assert engine.kernel_layers == (2 if on else 0)


def test_a_failed_planning_leaves_the_layers_on_the_kernels_wrap_put_them_on(exported, monkeypatch):
    # The device clock's trials switch the layers per configuration; one fails after a trial on torch's kernels.
    from pipedp.build import build_pipeline
    from pipedp.comm import Local
    from pipedp.options import PipelineOptions, TrainingOptions
    from pipedp.trials.clock import DeviceClock

    switched = []
    real = DeviceClock._ready

    def ready(self, config):
        if config.kernels:
            raise KeyboardInterrupt
        out = real(self, config)
        switched.append(swap.on)
        return out

    monkeypatch.setattr(DeviceClock, "_ready", ready)
    root, db = exported
    model = _net_module(root).build()
    swap = swap_depthwise(model, "auto", str(db), torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt):
        build_pipeline(model, torch.randn(8, 3, 16, 16), PipelineOptions(profile=False, microbatches=4, plan_cache=False,
                                                                         progress=False),
                       [torch.device("cpu")], Local(), training=TrainingOptions(channels_last=False), kernels=swap)
    assert False in switched  # a trial ran on torch's kernels before the failure
    assert swap.on and all(type(m) is TunedDepthwiseConv2d for m in model.modules() if is_depthwise(m))
