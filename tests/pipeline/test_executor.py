"""The executor's cross-lane ordering, checked on CPU with lanes that log their events."""

import contextlib
import itertools

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline import forward_only, gpipe, one_f_one_b
from pipedp.pipeline.executor import Executor
from pipedp.pipeline.schedule import Action
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import Lane


class LoggingLane(Lane):
    """A lane that pretends to be a stream: it logs records, waits and kept tensors."""

    counter = itertools.count()

    def __init__(self, name, log):
        super().__init__(torch.device("cpu"), None, name)
        self.log = log

    @contextlib.contextmanager
    def use(self):
        self.log.append(("use", self.name))
        yield self

    def record(self):
        ev = next(self.counter)
        self.log.append(("record", self.name, ev))
        return ev

    def wait(self, event):
        if event is not None:
            self.log.append(("wait", self.name, event))

    def keep(self, tensor):
        self.log.append(("keep", self.name))


def make(stages, schedule, log):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(stages)]
    st = [Stage(i, Chain([Block(str(i), layers[i])]), torch.device("cpu"), LoggingLane(f"L{i}", log))
          for i in range(stages)]
    return Executor(st, schedule(stages, 3)), layers


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_every_cross_stage_dependency_waits_on_the_producers_event(schedule):
    log = []
    ex, layers = make(3, schedule, log)
    xs = list(torch.randn(6, 4).split(2))
    ys = list(torch.randn(6, 4).split(2))
    # Which event did each (stage, action) record, and what did it wait for?
    events, waits, current = {}, {}, None
    order = iter(ex.program(3))  # every action of the program runs on its stage's lane, in order
    ex.train(xs, ys, [1 / 3] * 3, lambda out, y: (out - y).pow(2).mean())
    for entry in log:
        if entry[0] == "use":
            op = next(order)
            current = (op.stage, Action(op.kind, op.microbatch))
            waits[current] = []
        elif entry[0] == "wait":
            waits[current].append(entry[2])
        elif entry[0] == "record":
            events[current] = entry[2]
    assert set(events) == set(ex.train_order)
    closes = [(op.kind, op.stage) for op in ex.program(3) if op.kind not in ("F", "B")]
    assert closes == [("reduce", 2), ("update", 2), ("reduce", 1), ("update", 1), ("reduce", 0), ("update", 0)]
    for (s, a), w in waits.items():
        if a.kind == "F" and s > 0:
            assert events[(s - 1, a)] in w, f"F{a.microbatch} on stage {s} does not wait for stage {s - 1}"
        if a.kind == "B" and s < 2:
            assert events[(s + 1, a)] in w, f"B{a.microbatch} on stage {s} does not wait for stage {s + 1}"
    assert all(p.grad is not None for layer in layers for p in layer.parameters())


def test_forward_only_and_fewer_microbatches():
    log = []
    ex, layers = make(2, one_f_one_b, log)
    xs = list(torch.randn(6, 4).split(2))
    with torch.no_grad():
        out = torch.cat(ex.forward(xs))
        expected = layers[1](layers[0](torch.cat(xs)))
    assert torch.allclose(out, expected)
    assert ex.infer_order == [(s, a) for s, a in ex.infer_order]  # a plain list of (stage, action)
    assert len(ex.infer_order) == sum(len(a) for a in forward_only(2, 3))
    with torch.no_grad():  # fewer microbatches (a small batch): the first two's actions, in the schedule's order
        assert torch.allclose(torch.cat(ex.forward(xs[:2])), expected[:4])
    assert ex.orders(2)[1] == [(s, a) for s, a in ex.infer_order if a.microbatch < 2]
    with pytest.raises(ValueError, match="runs 1 to 3 microbatches, got 4"):
        ex.forward(xs + xs[:1])


def test_every_lane_the_step_joins_was_forked_at_its_start(monkeypatch):
    # Under CUDA-graph capture the caller's stream may only wait for streams that joined the capture. A side lane
    # that a step never uses (no forking block for branches=True, as in MobileNetV2) was joined without being forked:
    # cudaErrorStreamCaptureInvalidated on the H100. Every lane joined at the end must be forked at the start.
    from pipedp.pipeline import lanes as lanes_module

    log = []

    class Waits(Lane):
        def __init__(self, name):
            super().__init__(torch.device("cpu"), None, name)

        def wait_lane(self, other):
            log.append((self.name, other.name))

    monkeypatch.setattr(lanes_module, "current_lane", lambda device: Waits("caller"))
    st = [Stage(i, Chain([Block(str(i), nn.Linear(4, 4))]), torch.device("cpu"), Waits(f"stage{i}"))
          for i in range(2)]
    ex = Executor(st, one_f_one_b(2, 2))
    ex.lanes.extra = {0: [Waits("side-used")], 1: [Waits("side-unused")]}
    xs = list(torch.randn(4, 4).split(2))
    ex.train(xs, xs, [0.5, 0.5], lambda out, y: (out - y).pow(2).mean())
    joined = [other for lane, other in log if lane == "caller"]
    assert set(joined) == {"stage0", "stage1", "side-used", "side-unused"}
    for name in joined:
        fork = log.index((name, "caller")) if (name, "caller") in log else None
        assert fork is not None and fork < log.index(("caller", name)), f"{name} is joined but was never forked"


def test_split_backwards_on_cpu_worker_lanes_are_refused_naming_the_fix():
    from pipedp.pipeline.stream import new_lane
    from pipedp.pipeline.zero_bubble import zb_h1

    cpu = torch.device("cpu")
    stages = [Stage(i, Chain([Block(str(i), nn.Linear(4, 4))]), cpu, new_lane(cpu, f"w{i}", threads=1))
              for i in range(2)]
    try:
        with pytest.raises(ValueError, match="runs one action at a time: give the stages no thread counts"):
            Executor(stages, zb_h1(2, 2))
    finally:
        for st in stages:
            st.lane.worker.close()


def test_each_ranks_program_of_a_step_prints_a_line_a_rank():
    ex, _ = make(2, one_f_one_b, [])  # 3 microbatches, both stages here
    assert ex.program_text() == ("rank 0: 0F0 0F1 1F0 1B0 0B0 1F1 1B1 0F2 0B1 1F2 1B2 1REDUCE_GRAD 1UPDATE 0B2 "
                                 "0REDUCE_GRAD 0UPDATE")


def test_an_interleaved_order_runs_a_ranks_stages_together_and_equals_1f1b():
    from pipedp.pipeline.orders import per_stage, rank_orders

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = lambda out, t: (out - t).pow(2).mean()  # noqa: E731
    grads = {}
    for name in ("1f1b", "interleaved"):
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4) for _ in range(4)]
        stages = [Stage(i, Chain([Block(str(i), layers[i])]), torch.device("cpu"), LoggingLane(f"L{i}", []))
                  for i in range(4)]
        orders = rank_orders(name, 4, 4)  # one rank: its four stages in the schedule's order
        ex = Executor(stages, per_stage(orders, 4), orders=orders)
        ex.train(list(x.split(2)), list(y.split(2)), [0.25] * 4, loss)
        assert ex.train_order == orders[0]
        grads[name] = [p.grad for m in layers for p in m.parameters()]
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads["1f1b"], grads["interleaved"]))


def test_orders_that_run_a_stage_otherwise_than_the_schedule_are_refused():
    log = []
    ex, _ = make(2, one_f_one_b, log)
    orders = [[(s, a) for s, acts in enumerate(gpipe(2, 3)) for a in acts]]
    with pytest.raises(ValueError, match="the orders run stage 0's actions as F0 F1 F2 B0 B1 B2, the schedule as"):
        Executor(ex.stages, one_f_one_b(2, 3), orders=orders)


def test_an_interleaved_rank_runs_inference_forwards_in_its_own_order():
    # Stage 0 slow: a per-stage simulation would let rank 0 send stage 2's first activation before stage 0's
    # second, while rank 1 takes them the other way round. Each rank's forwards in its training order match.
    from pipedp.pipeline.orders import per_stage, placement, rank_orders

    orders = rank_orders("interleaved", 4, 4, 2)
    place = placement("interleaved", 4, 2)
    slow = lambda s, a: 3.0 if s == 0 else 1.0  # noqa: E731
    for rank in (0, 1):
        stages = [Stage(s, Chain([Block(str(s), nn.Linear(4, 4))]), torch.device("cpu"), LoggingLane(f"L{s}", []))
                  for s in range(4) if place[s] == rank]
        ex = Executor(stages, per_stage(orders, 4), duration=slow, stage_rank=place, rank=rank,
                      transport=object(), orders=orders)  # the programs are checked here; nothing is sent
        assert ex.infer_order == [(s, a) for s, a in orders[rank] if a.kind == "F"]
