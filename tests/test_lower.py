import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from pipedp.comm import Local
from pipedp.decide.config import Config
from pipedp.decide.decision import Decision
from pipedp.decide.levers import settle
from pipedp.lower import make_executor
from pipedp.partition.parts import Parts
from pipedp.options import PipelineOptions, TrainingOptions
from pipedp.partition.blocks import blocks_of
from pipedp.partition.check import check_chain


@pytest.mark.slow  # three inductor compiles of a tiny stage (about 10 s on 2 cores)
def test_a_compiled_stage_keeps_static_shapes_for_each_microbatch_size():
    """Trials call one compiled Chain.forward with several microbatch sizes; none may turn its shapes symbolic.

    With dynamo's automatic dynamic shapes the second size would compile one symbolic graph that then
    serves every size, the chosen plan's too (slower kernels); static shapes compile once per size.
    """
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(8, 6)
    blocks = blocks_of(model)
    decision = settle(Decision(Config((len(blocks),), 1, compiled=True)), PipelineOptions(), TrainingOptions(), None,
                      [torch.device("cpu")], pp=1)
    executor, _ = make_executor(Parts(blocks, check_chain(model, blocks, x[:2])), decision, Local())
    (stage,) = executor.stages
    before = counters["stats"]["unique_graphs"]
    for n in (8, 4, 2, 8):
        out = stage.body(torch.randn(n, 6))
        assert out.shape == (n, 3)
    assert counters["stats"]["unique_graphs"] - before == 3  # 8, 4, 2 each its own graph; 8 again reuses its own
    torch._dynamo.reset()
