"""Shortcut paths of residual blocks on a side lane (pipedp/pipeline/branches.py): found, exact, ordered, undone."""

import copy

import pytest
import torch
from torch import nn

from pipedp.models import BasicBlock, Bottleneck, InvertedResidual
from pipedp.partition import Block, Chain
from pipedp.pipeline import branches as branches_module
from pipedp.pipeline.branches import BranchPlan, concurrent_branches, plan_block
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane
from tests.pipeline.concurrency_reference import LoggingLane, tiny_resnet, train_both
from tests.reference import max_diff

TOL = 1e-5
CPU = torch.device("cpu")


class TorchvisionStyleBlock(nn.Module):
    """torchvision's BasicBlock shape: the shortcut computed last and added in place."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = self.downsample(x)
        out += identity
        return self.relu(out)


class InplaceShortcut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.a(x) + self.b(x)


class DropoutBoth(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Conv2d(4, 4, 1), nn.Dropout(0.5)), nn.Dropout(0.5)

    def forward(self, x):
        return self.a(x) + self.b(x)


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return x.relu() + y.relu()


class Untraceable(nn.Module):
    def forward(self, x):
        return x.relu() + x.tanh() if x.sum() > 0 else x


def test_the_downsample_path_is_the_side_path():
    plan = plan_block(BasicBlock(4, 8, 2))
    assert isinstance(plan, BranchPlan)
    assert [str(n.target) for n in plan.side] == ["downsample"]  # submodules stay one call (hooks fire)
    assert [str(n.target) for n in plan.main] == ["conv1", "bn1", "relu", "conv2", "bn2"]
    assert [str(n.target) for n in plan.tail] == ["relu"]
    assert isinstance(plan_block(Bottleneck(4, 2, 2)), BranchPlan)
    assert isinstance(plan_block(TorchvisionStyleBlock(4, 8, 2)), BranchPlan)


@pytest.mark.parametrize("module, why", [
    (BasicBlock(4, 4), "has no fork joined by an addition"),  # identity shortcut: nothing to run beside
    (InvertedResidual(4, 4, 1, 2), "has no fork joined by an addition"),
    (InplaceShortcut(), "a path writes the block's input in place"),
    (DropoutBoth(), "both paths draw random numbers"),
    (TwoInputs(), "takes 2 inputs"),
    (Untraceable(), "does not trace"),
    (nn.Sequential(nn.Conv2d(3, 3, 1), BasicBlock(3, 6, 2), nn.Conv2d(6, 6, 1)), "has no fork"),
])
def test_blocks_without_a_usable_fork_are_left_alone(module, why):
    assert why in plan_block(module)


def stage_of(module, index=0, lane=None):
    return Stage(index, Chain([Block("m", module)]), CPU, lane or new_lane(CPU, f"s{index}"))


@pytest.mark.parametrize("make", [lambda: BasicBlock(4, 8, 2), lambda: Bottleneck(4, 2, 2),
                                  lambda: TorchvisionStyleBlock(4, 8, 2)])
def test_a_concurrent_block_computes_what_the_block_computes(make):
    torch.manual_seed(0)
    block = make()
    ref = copy.deepcopy(block)
    keys = list(block.state_dict())
    done = concurrent_branches([stage_of(block)])
    assert done.count == 1 and "forward" in block.__dict__
    assert list(block.state_dict()) == keys
    x = torch.randn(4, 4, 8, 8, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    for _ in range(2):
        out, want = block(x), ref(xr)
        assert torch.equal(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
    assert max_diff(block, ref) == 0.0  # running statistics too
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(block.parameters(), ref.parameters()))
    assert torch.equal(x.grad, xr.grad)
    twin = copy.deepcopy(block)  # a copy runs its own modules
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    assert not torch.equal(twin(x), block(x))
    done.undo()
    done.undo()
    assert "forward" not in block.__dict__ and done.count == 0


def test_blocks_inside_a_concurrent_block_and_torch_layers_are_not_traced_again():
    model = tiny_resnet()
    done = concurrent_branches([stage_of(model)])
    assert done.names == ["m.1", "m.3"]  # the two blocks with a downsample shortcut


def test_the_side_lane_forks_and_joins_by_events(monkeypatch):
    log = []
    block = BasicBlock(4, 8, 2)
    done = concurrent_branches([stage_of(block)])
    side, main = LoggingLane("side", log), LoggingLane("main", log)
    key = next(iter(done.lanes.by_stream))
    done.lanes.by_stream[key] = side
    monkeypatch.setattr(branches_module, "current_lane", lambda device: main)
    block.downsample.register_forward_hook(lambda *a: log.append(("shortcut",)))
    block.conv1.register_forward_hook(lambda *a: log.append(("main path",)))
    block(torch.randn(2, 4, 8, 8))
    fork = next(e[2] for e in log if e[:2] == ("record", "main"))
    join = next(e[2] for e in log if e[:2] == ("record", "side"))
    assert log == [
        ("record", "main", fork), ("wait", "side", fork), ("keep", "side"),  # the input is ready and kept
        ("enter", "side"), ("shortcut",), ("exit", "side"), ("record", "side", join),
        ("main path",), ("wait", "main", join), ("keep", "main"),  # the addition waits for the shortcut
    ]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_engine_with_branches_equals_plain_training(optimizer, schedule, stages):
    engine, model, ref, _ = train_both(seed=stages, optimizer=optimizer, stages=stages, schedule=schedule,
                                       branches=True)
    assert max_diff(model, ref) <= TOL
    assert any("2 residual block(s) run their shortcut on a side stream" in n for n in engine.plan.notes)


def test_bf16_with_branches_equals_plain_autocast():
    _, model, ref, _ = train_both(stages=2, branches=True, dtype=torch.bfloat16)
    assert max_diff(model, ref) <= TOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_shortcut_runs_on_the_side_stream():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    block = BasicBlock(16, 32, 2).to(dev)
    ref = copy.deepcopy(block)
    stage = Stage(0, Chain([Block("b", block)]), dev, new_lane(dev, "s0"))
    done = concurrent_branches([stage])
    streams = []
    block.downsample.register_forward_hook(lambda *a: streams.append(torch.cuda.current_stream(dev)))
    x = torch.randn(8, 16, 16, 16, device=dev, requires_grad=True)
    with stage.lane.use():
        out = block(x)
        out.square().mean().backward()
    torch.cuda.current_stream(dev).wait_stream(stage.lane.stream)
    want = ref(x.detach())
    want.square().mean().backward()
    assert streams == [done.lanes.by_stage[0].stream]
    assert torch.allclose(out, want, atol=1e-5)
    for p, q in zip(block.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)
