"""split_grads as actions: every backward lowered as I then W, W on the stage's side lane (lower.py, orders.py,
executor.py, interpreter.py): exact, printed, ordered by events, no module swapped."""

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline.executor import Executor
from pipedp.pipeline.orders import rank_orders, split_backwards
from pipedp.pipeline.schedule import Action
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane
from tests.pipeline.concurrency_reference import LoggingLane, train_both
from tests.reference import max_diff

TOL = 1e-5
CPU = torch.device("cpu")


def test_split_backwards_puts_i_in_bs_place_and_w_right_after_it():
    orders = rank_orders("1f1b", 2, 3, ranks=2)
    split = split_backwards(orders)
    for prog, mine in zip(orders, split):
        assert [(s, a) for s, a in mine if a.kind != "W"] == [(s, Action("I", a.microbatch) if a.kind == "B" else a)
                                                             for s, a in prog]
        for k, (s, a) in enumerate(mine):
            if a.kind == "W":
                assert mine[k - 1] == (s, Action("I", a.microbatch))
    # Already split (zero bubble): nothing to do.
    zb = rank_orders("zb-h1", 2, 3, ranks=2)
    assert split_backwards(zb) == zb


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_engine_with_split_grads_equals_plain_training(optimizer, schedule, stages):
    engine, model, ref, _ = train_both(seed=stages, optimizer=optimizer, stages=stages, schedule=schedule,
                                       split_grads=True)
    assert max_diff(model, ref) <= TOL
    assert any("split_grads=True" in n for n in engine.plan.notes)
    program = engine.program.splitlines()[0]
    assert "B" not in program.replace("BN_COMMIT", "") and "I0" in program and "W0" in program
    assert all(type(m) in (nn.Conv2d, nn.Linear) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))


def test_bf16_with_split_grads_equals_plain_autocast():
    _, model, ref, _ = train_both(stages=3, split_grads=True, dtype=torch.bfloat16)
    assert max_diff(model, ref) <= TOL


def _stages(model: nn.Sequential):
    blocks = [Block(str(i), m) for i, m in enumerate(model)]
    return [Stage(0, Chain(blocks[:2]), CPU, new_lane(CPU, "s0")), Stage(1, Chain(blocks[2:]), CPU, new_lane(CPU, "s1"))]


def test_w_waits_for_its_stages_lane_by_an_event_keeps_what_it_reads_and_runs_on_the_side_lane():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(1), nn.LazyLinear(2))
    model(torch.randn(1, 3, 6, 6))
    orders = split_backwards(rank_orders("1f1b", 2, 1))
    schedule = [[a for s, a in orders[0] if s == k] for k in range(2)]
    ex = Executor(_stages(model), schedule, orders=orders, side_weights=True)
    log: list = []
    side, main = LoggingLane("side0", log), LoggingLane("s0", log)
    ex.local[0].lane, ex.lanes.weights[0] = main, side
    ex.lanes.extra[0] = [side]
    assert ex.lanes.of_stage(0) == [side] and side in ex.lanes.side
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 2)
    ex.train([x], [y], [1.0], lambda o, t: (o - t).square().mean())
    w = log.index(("enter", "side0"))
    rec = log[w + 1]  # the stage's lane records where its I ends; the side lane waits for that, keeps what W reads
    assert rec[:2] == ("record", "s0") and log[w + 2] == ("wait", "side0", rec[2])
    assert log[w + 3:w + 7] == [("keep", "side0")] * 3 + [("exit", "side0")]  # the convolution's grad, input, weight
    assert log[w - 1] == ("exit", "s0")  # right after the stage's I, on its own lane
    assert model[0].weight.grad is not None


def test_w_without_a_side_lane_runs_on_the_stages_lane():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(1), nn.Linear(64, 2))
    orders = split_backwards(rank_orders("1f1b", 2, 1))
    schedule = [[a for s, a in orders[0] if s == k] for k in range(2)]
    ex = Executor(_stages(model), schedule, orders=orders)
    w = next(op for op in ex.program(1) if op.kind == "W")
    assert ex.lanes.of(w) is ex.local[w.stage].lane and ex.lanes.side == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_w_runs_on_the_side_stream_and_the_step_equals_plain_training():
    from tests.pipeline.concurrency_reference import engine_for, plain_train, tiny_resnet
    from tests.reference import clone, data

    torch.manual_seed(0)
    model = tiny_resnet().cuda()
    ref = clone(model)
    batches = [(x.cuda(), y.cuda()) for x, y in data(n=6, size=8, steps=2)]
    engine = engine_for(model, stages=2, split_grads=True, devices="cuda")
    streams = {st.index: engine._pipe.executor.lanes.weights[st.index].stream for st in engine._pipe.executor.stages}
    assert all(s is not None and s != torch.cuda.current_stream() for s in streams.values())
    for x, y in batches:
        engine.train_step(x, y)
    torch.cuda.synchronize()
    plain_train(ref, batches, microbatches=2)
    assert max_diff(model, ref) <= 1e-4
