"""The interpreter: a handler for every action a lowering makes; the sync armed before a stage's last B and
its buckets finished at the stage's REDUCE_GRAD, its update at UPDATE."""

import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline.executor import Executor
from pipedp.pipeline.interpreter import StepRun
from pipedp.pipeline.orders import NAMES, per_stage, placement, rank_orders
from pipedp.pipeline.ranks import close_stages, lower_programs
from pipedp.pipeline.schedule import one_f_one_b
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane

CPU = torch.device("cpu")


def test_every_action_a_lowering_makes_has_a_handler():
    ex = Executor([Stage(0, Chain([Block("0", nn.Linear(2, 2))]), CPU, new_lane(CPU, "s0"))], one_f_one_b(1, 1))
    handled = set(StepRun(ex, [torch.zeros(1, 2)], None, None, None, None).handlers)
    made = set()
    for name in NAMES:
        orders = rank_orders(name, 4, 4, 2)
        for ops in lower_programs(dict(enumerate(orders)), placement(name, 4, 2)).values():
            made |= {op.kind for op in close_stages(ops, commits=range(4))}
    assert made <= handled and {"F", "B", "I", "W", "send", "recv", "commit", "reduce", "update"} <= made


class Log:
    """A gradient sync and an early update that log their calls beside the model's backward hooks."""

    def __init__(self, log):
        self.log = log

    def arm(self, stage):
        self.log.append(f"arm {stage}")

    def accumulated(self, p):
        pass

    def finish(self, stage):
        self.log.append(f"finish {stage}")

    def stage_done(self, stage):
        self.log.append(f"update {stage}")

    def join(self):
        self.log.append("join")


def test_the_sync_arms_before_a_stages_last_backward_and_finishes_at_its_reduce():
    log = []
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    for k, layer in enumerate(layers):
        layer.register_full_backward_hook(lambda m, gi, go, k=k: log.append(f"backward {k}"))
    stages = [Stage(k, Chain([Block(str(k), layers[k])]), CPU, new_lane(CPU, f"s{k}")) for k in range(2)]
    orders = rank_orders("1f1b", 2, 2)
    ex = Executor(stages, per_stage(orders, 2), orders=orders)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    ex.train(list(x.split(2)), list(y.split(2)), [0.5, 0.5], lambda o, t: (o - t).pow(2).mean(),
             sync=Log(log), update=Log(log))
    assert log == ["backward 1", "backward 0", "arm 1", "backward 1", "finish 1", "update 1",
                   "arm 0", "backward 0", "finish 0", "update 0", "join"]


def test_a_stages_last_w_arms_the_sync_before_it_accumulates_and_its_reduce_finishes():
    # Zero bubble and split_grads end a stage's step with a W: arming there lets the buckets of the weights it
    # accumulates launch as they fill, not all at REDUCE_GRAD.
    from pipedp.pipeline.orders import split_backwards

    log = []

    class Heard(Log):
        def accumulated(self, p):
            self.log.append(f"accumulated {tuple(p.shape)}")

    layers = [nn.Linear(4, 4), nn.Linear(4, 3)]
    stages = [Stage(k, Chain([Block(str(k), layers[k])]), CPU, new_lane(CPU, f"s{k}")) for k in range(2)]
    orders = split_backwards(rank_orders("1f1b", 2, 2))
    ex = Executor(stages, per_stage(orders, 2), orders=orders)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    ex.train(list(x.split(2)), list(y.split(2)), [0.5, 0.5], lambda o, t: (o - t).pow(2).mean(), sync=Heard(log))
    for stage, shape in ((1, (3, 4)), (0, (4, 4))):
        arm = log.index(f"arm {stage}")
        # armed once, at the last W, before its weight and bias are announced; finished after them
        assert log.count(f"arm {stage}") == 1
        assert log[arm + 1:arm + 3] == [f"accumulated {shape}", f"accumulated {shape[:1]}"]
        assert log.index(f"finish {stage}") > arm + 2
