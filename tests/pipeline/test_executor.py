"""The executor's cross-lane ordering, checked on CPU with lanes that log their events."""

import contextlib
import itertools

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline import forward_only, gpipe, one_f_one_b
from pipedp.pipeline.executor import Executor
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
    order = iter(ex.train_order)
    ex.train(xs, ys, [1 / 3] * 3, lambda out, y: (out - y).pow(2).mean())
    for entry in log:
        if entry[0] == "use":
            current = next(order)
            waits[current] = []
        elif entry[0] == "wait":
            waits[current].append(entry[2])
        elif entry[0] == "record":
            events[current] = entry[2]
    assert set(events) == set(ex.train_order)
    for (s, a), w in waits.items():
        if a.kind == "F" and s > 0:
            assert events[(s - 1, a)] in w, f"F{a.microbatch} on stage {s} does not wait for stage {s - 1}"
        if a.kind == "B" and s < 2:
            assert events[(s + 1, a)] in w, f"B{a.microbatch} on stage {s} does not wait for stage {s + 1}"
    assert all(p.grad is not None for layer in layers for p in layer.parameters())


def test_forward_only_and_microbatch_count_check():
    log = []
    ex, layers = make(2, one_f_one_b, log)
    xs = list(torch.randn(6, 4).split(2))
    with torch.no_grad():
        out = torch.cat(ex.forward(xs))
        expected = layers[1](layers[0](torch.cat(xs)))
    assert torch.allclose(out, expected)
    assert ex.infer_order == [(s, a) for s, a in ex.infer_order]  # a plain list of (stage, action)
    assert len(ex.infer_order) == sum(len(a) for a in forward_only(2, 3))
    with pytest.raises(ValueError, match="expected 3 microbatches"):
        ex.forward(xs[:2])
