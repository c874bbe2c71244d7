"""Weight gradients of convolutions on a side lane (pipedp/pipeline/split_grad.py): exact, announced, undone."""

import copy

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline.split_grad import SplitGradConv2d, split_grads
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane
from tests.pipeline.concurrency_reference import LoggingLane, train_both
from tests.reference import max_diff

TOL = 1e-5
CPU = torch.device("cpu")


def stage_of(module, index=0):
    return Stage(index, Chain([Block("m", module)]), CPU, new_lane(CPU, f"s{index}"))


@pytest.mark.parametrize("kw", [
    dict(stride=1, padding=1, bias=True),
    dict(stride=2, padding=1, bias=False),
    dict(stride=1, padding=2, dilation=2, groups=2, bias=True),
    dict(stride=1, padding=0, groups=4, bias=False),  # depthwise
])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gradients_equal_plain_conv_over_accumulated_backwards(kw, dtype):
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3, **kw)
    ref = copy.deepcopy(conv)
    owner = split_grads([stage_of(conv)])
    assert owner.count == 1 and type(conv) is SplitGradConv2d
    heard = []
    owner.on_accumulate.append(heard.append)
    x = torch.randn(3, 4, 9, 9, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    for _ in range(2):  # the second backward adds to .grad in place, as AccumulateGrad does
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out, want = conv(x), ref(xr)
        assert out.dtype == want.dtype and torch.equal(out, want)
        out.float().square().mean().backward()
        want.float().square().mean().backward()
    for p, q in zip(conv.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and (p.grad - q.grad).abs().max().item() <= TOL
    assert (x.grad - xr.grad).abs().max().item() <= TOL
    params = list(conv.parameters())
    assert len(heard) == 2 * len(params) and {id(p) for p in heard} == {id(p) for p in params}


def test_input_without_grad_and_frozen_weight():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    ref = copy.deepcopy(conv)
    split_grads([stage_of(conv)])
    conv.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    x = torch.randn(2, 3, 6, 6)
    conv(x).sum().backward()
    ref(x).sum().backward()
    assert conv.weight.grad is None and torch.allclose(conv.bias.grad, ref.bias.grad, atol=TOL)
    with torch.no_grad():  # no graph: the plain forward
        assert torch.equal(conv(x), ref(x))


def test_swap_keeps_names_skips_subclasses_and_string_padding_and_undoes():
    class MyConv(nn.Conv2d):
        pass

    model = nn.Sequential(nn.Conv2d(3, 4, 3), MyConv(4, 4, 1), nn.Conv2d(4, 4, 3, padding="same"), nn.Linear(4, 2))
    keys = list(model.state_dict())
    owner = split_grads([stage_of(model)])
    assert owner.count == 1 and type(model[0]) is SplitGradConv2d
    assert type(model[1]) is MyConv and type(model[2]) is nn.Conv2d
    assert list(model.state_dict()) == keys
    assert copy.deepcopy(model)[0].__dict__["_pipedp_split"] is owner  # shared, not copied
    owner.undo()
    owner.undo()
    assert type(model[0]) is nn.Conv2d and "_pipedp_split" not in model[0].__dict__


def test_side_lane_is_found_from_the_stages_stream_only():
    a, b = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)
    owner = split_grads([stage_of(a, 0), stage_of(b, 1)])
    assert owner.count == 2
    assert owner.sides.current(CPU) is owner.lanes(0)[0]  # on a CPU every stage shares the in-order stand-in
    assert len(owner.lanes()) == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_engine_with_split_grads_equals_plain_training(optimizer, schedule, stages):
    engine, model, ref, _ = train_both(seed=stages, optimizer=optimizer, stages=stages, schedule=schedule,
                                       split_grads=True)
    assert max_diff(model, ref) <= TOL
    assert any("9 convolution(s) compute their weight gradient" in n for n in engine.plan.notes)


def test_bf16_with_split_grads_equals_plain_autocast():
    _, model, ref, _ = train_both(stages=3, split_grads=True, dtype=torch.bfloat16)
    assert max_diff(model, ref) <= TOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_weight_gradient_runs_on_the_side_stream_and_is_joined():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    conv = nn.Conv2d(16, 32, 3, padding=1).to(dev)
    ref = copy.deepcopy(conv)
    stage = Stage(0, Chain([Block("c", conv)]), dev, new_lane(dev, "s0"))
    owner = split_grads([stage])
    side = owner.lanes(0)[0]
    streams = []
    owner.on_accumulate.append(lambda p: streams.append(torch.cuda.current_stream(dev)))
    x = torch.randn(8, 16, 32, 32, device=dev, requires_grad=True)
    with stage.lane.use():
        conv(x).square().mean().backward()
    cur = torch.cuda.current_stream(dev)
    cur.wait_stream(stage.lane.stream)
    cur.wait_stream(side.stream)  # what the executor's join does
    ref(x.detach()).square().mean().backward()
    assert streams and all(s == side.stream for s in streams)
    for p, q in zip(conv.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_the_weight_gradient_forks_from_the_backwards_start_by_an_event(monkeypatch):
    from pipedp.pipeline import split_grad as split_module

    log = []
    conv = nn.Conv2d(3, 4, 3)
    owner = split_grads([stage_of(conv)])
    side, main = LoggingLane("side", log), LoggingLane("main", log)
    owner.sides.by_stream[next(iter(owner.sides.by_stream))] = side
    monkeypatch.setattr(split_module, "current_lane", lambda device: main)
    owner.on_accumulate.append(lambda p: log.append(("accumulated", p.dim())))
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    x.register_hook(lambda g: log.append(("input gradient",)))
    conv(x).sum().backward()
    fork = log[0][2]
    assert log == [
        ("record", "main", fork), ("wait", "side", fork),  # grad_output and the input are ready here
        ("keep", "side"), ("keep", "side"), ("keep", "side"),  # and read on the side lane
        ("enter", "side"), ("accumulated", 4), ("accumulated", 1), ("exit", "side"),
        ("input gradient",),  # issued on the stage's lane, not waiting for the side lane
    ]
