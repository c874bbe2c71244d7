import pytest
import torch
from torch import nn

from pipedp.comm import Local
from pipedp.decide.choose import decide
from pipedp.options import PipelineOptions, TrainingOptions
from pipedp.partition.blocks import blocks_of
from pipedp.partition.check import check_chain
from pipedp.partition.parts import Parts
from pipedp.partition.threads import CpuPlan
from pipedp.trials.built import BuiltTrials
from pipedp.trials.clock import DeviceClock

CPU = [torch.device("cpu")]


def _parts(model, x):
    blocks = blocks_of(model)
    return Parts(blocks, check_chain(model, blocks, x[:2]))


def test_built_trials_time_thread_plans_on_the_executor_and_keep_them_warm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(8, 6)
    before = [p.detach().clone() for p in model.parameters()]
    trials = BuiltTrials(model, _parts(model, x), x, CPU, PipelineOptions(), Local(), TrainingOptions())
    in_order = CpuPlan((3,), None, 2)
    assert trials.thread_plan_ms(in_order) > 0
    run = trials.runs[in_order]
    assert trials.thread_plan_ms(in_order) > 0 and trials.runs[in_order] is run  # timed again, warm
    assert trials.thread_plan_ms(CpuPlan((2, 1), (1, 1), 2)) > 0 and len(trials.runs) == 2
    # A trial runs forward and backward, never an update.
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert isinstance(trials.clock(None), DeviceClock)


def test_a_timed_plan_needs_the_trials():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(8, 6)
    with pytest.raises(ValueError, match="trials="):
        decide(_parts(model, x), model, x[:4], x, CPU, PipelineOptions(stages="auto", progress=False), Local(),
               TrainingOptions())
