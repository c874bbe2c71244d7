"""Weight gradients held back for W: equal to autograd's, and a zero-bubble step equal to plain accumulation."""

import copy

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline.executor import Executor
from pipedp.pipeline.schedule import one_f_one_b
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane
from pipedp.pipeline.weight_grad import Deferred, anchor, run_deferred
from pipedp.pipeline.zero_bubble import zb_h1

CPU = torch.device("cpu")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=False), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 5))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_convolutions_and_linears_hold_their_weight_gradients_until_w():
    ref, held = _model(), _model()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    ref(x).square().mean().backward()
    queue: list = []
    with Deferred(queue, anchor(CPU)):
        out = held(x)
    out.square().mean().backward()
    convs_linears = [m for m in held if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(queue) == len(convs_linears) == 5
    assert all(m.weight.grad is None for m in convs_linears)  # held back
    assert held[1].weight.grad is not None  # BatchNorm's come with the input gradient, as in a whole backward
    seen: list[torch.Tensor] = []
    run_deferred(queue, seen.append)
    assert not queue and len(seen) == 9  # 5 weights and 4 biases, each announced
    for g, e in zip(_grads(held), _grads(ref)):
        assert (g - e).abs().max().item() <= 1e-6


def test_outside_training_nothing_is_held():
    model, queue = _model(), []
    x = torch.randn(2, 3, 8, 8)
    with Deferred(queue, anchor(CPU)), torch.no_grad():
        model(x)
    assert queue == []


@pytest.mark.parametrize("kw", [
    dict(stride=1, padding=1, bias=True),
    dict(stride=2, padding=1, bias=False),
    dict(stride=1, padding=2, dilation=2, groups=2, bias=True),
    dict(stride=1, padding=0, groups=4, bias=False),  # depthwise
])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_held_convolution_and_linear_equal_plain_ones_under_autocast_too(kw, dtype):
    # Under autocast the held node casts as autocast would (output dtype and values equal) and casts the
    # gradients back to each tensor's dtype, as the backward of autocast's casts does; W adds to .grad in place.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, **kw), nn.Flatten(1), nn.LazyLinear(3))
    model(torch.randn(1, 4, 9, 9))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, 9, 9, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    queue: list = []
    heard: list = []
    for _ in range(2):  # the second W adds to .grad in place, as AccumulateGrad does
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            with Deferred(queue, anchor(CPU)):
                out = model(x)
            want = ref(xr)
        assert out.dtype == want.dtype and torch.equal(out, want)
        out.float().square().mean().backward()
        want.float().square().mean().backward()
        assert len(queue) == 2 and all(len(h.reads) >= 2 for h in queue)
        run_deferred(queue, heard.append)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and (p.grad - q.grad).abs().max().item() <= 1e-5
    assert x.grad.dtype == torch.float32 and (x.grad - xr.grad).abs().max().item() <= 1e-5
    params = list(model.parameters())
    assert len(heard) == 2 * len(params) and {id(p) for p in heard} == {id(p) for p in params}


def test_a_layer_with_a_frozen_weight_is_left_to_autograd():
    torch.manual_seed(0)
    conv, queue = nn.Conv2d(3, 4, 3, padding=1), []
    ref = copy.deepcopy(conv)
    for m in (conv, ref):
        m.weight.requires_grad_(False)
    x = torch.randn(2, 3, 6, 6)
    with Deferred(queue, anchor(CPU)):
        out = conv(x)
    out.sum().backward()
    ref(x).sum().backward()
    assert queue == []
    assert conv.weight.grad is None and torch.allclose(conv.bias.grad, ref.bias.grad, atol=1e-6)


def _executor(model: nn.Sequential, schedule) -> Executor:
    blocks = [Block(str(i), m) for i, m in enumerate(model)]
    stages = [Stage(0, Chain(blocks[:3]), CPU, new_lane(CPU, "s0")),
              Stage(1, Chain(blocks[3:6]), CPU, new_lane(CPU, "s1")),
              Stage(2, Chain(blocks[6:]), CPU, new_lane(CPU, "s2"))]
    return Executor(stages, schedule)


@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_a_zero_bubble_step_equals_plain_accumulation_and_1f1b(m):
    x = torch.randn(4 * m, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 5, (4 * m,), generator=torch.Generator().manual_seed(3))
    xs, ys, weights = x.chunk(m), y.chunk(m), [1.0 / m] * m
    loss_fn = nn.CrossEntropyLoss()
    plain = _model()
    for xi, yi, w in zip(xs, ys, weights):
        (loss_fn(plain(xi), yi) * w).backward()
    results = {}
    for name, schedule in (("zb-h1", zb_h1(3, m)), ("1f1b", one_f_one_b(3, m))):
        model = _model()
        loss = _executor(model, schedule).train(xs, ys, weights, loss_fn)
        results[name] = (loss, _grads(model), model[1].running_mean.clone())
    for name, (loss, grads, running) in results.items():
        for g, e in zip(grads, _grads(plain)):
            assert (g - e).abs().max().item() <= 1e-5 * max(1.0, e.abs().max().item()), name
        assert torch.allclose(running, plain[1].running_mean, atol=1e-6)
    assert torch.allclose(results["zb-h1"][0], results["1f1b"][0])


def _two_ranks(rank: int, world: int) -> dict:
    import datetime

    from pipedp.pipeline.p2p import Transport

    model = _model()
    blocks = [Block(str(i), m) for i, m in enumerate(model)]
    chains = [Chain(blocks[:5]), Chain(blocks[5:])]
    stage = Stage(rank, chains[rank], CPU, new_lane(CPU, f"s{rank}"))
    transport = Transport(None, CPU, datetime.timedelta(seconds=60))
    ex = Executor([stage], zb_h1(2, 4), stage_rank=[0, 1], rank=rank, transport=transport)
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 5, (16,), generator=torch.Generator().manual_seed(3))
    ex.train(x.chunk(4), y.chunk(4), [0.25] * 4, nn.CrossEntropyLoss())
    return {"grads": [p.grad.clone() for p in chains[rank].parameters()], "program": ex.program_text()}


@pytest.mark.slow
def test_a_zero_bubble_step_over_two_ranks_equals_plain_accumulation():
    from tests.multiproc import run

    res = run(_two_ranks, 2)
    plain = _model()
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 5, (16,), generator=torch.Generator().manual_seed(3))
    for xi, yi in zip(x.chunk(4), y.chunk(4)):
        (nn.CrossEntropyLoss()(plain(xi), yi) * 0.25).backward()
    layers = list(plain)
    for r, part in zip(res, (layers[:5], layers[5:])):
        expected = [p.grad for m in part for p in m.parameters()]
        assert len(r["grads"]) == len(expected) > 0
        for g, e in zip(r["grads"], expected):
            assert (g - e).abs().max().item() <= 1e-5 * max(1.0, e.abs().max().item())
    assert res[0]["program"].startswith("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0")
    assert "1I3 1SEND_B3" in res[0]["program"] and res[0]["program"] == res[1]["program"]


def _replicas(rank: int, world: int) -> list[torch.Tensor]:
    from pipedp.pipeline.gradsync import GradSync

    model = _model()
    ex = _executor(model, zb_h1(3, 2))
    sync = GradSync([list(st.chain.parameters()) for st in ex.stages], torch.distributed.group.WORLD,
                    bucket_bytes=2048)
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(10 + rank))
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(20 + rank))
    sync.attach()
    ex.train(x.chunk(2), y.chunk(2), [0.5, 0.5], nn.CrossEntropyLoss(), sync=sync)
    sync.wait()
    return _grads(model)


@pytest.mark.slow
def test_data_parallel_replicas_of_a_zero_bubble_pipeline_average_as_plain_training():
    from tests.multiproc import run

    res = run(_replicas, 2)
    plain = _model()
    for rank in range(2):
        x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(10 + rank))
        y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(20 + rank))
        for xi, yi in zip(x.chunk(2), y.chunk(2)):
            (nn.CrossEntropyLoss()(plain(xi), yi) * 0.25).backward()  # the mean over both replicas' samples
    for grads in res:
        for g, e in zip(grads, _grads(plain)):
            assert (g - e).abs().max().item() <= 1e-5 * max(1.0, e.abs().max().item())
    assert all(torch.equal(a, b) for a, b in zip(*res))
