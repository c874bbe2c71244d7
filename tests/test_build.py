"""The build step on its own: a ready pipeline from a model, a batch, options and a communicator."""

import pytest
import torch
from torch import nn

from pipedp.build import build_pipeline, in_layout
from pipedp.comm import Local
from pipedp.options import PipelineOptions, TrainingOptions
from pipedp.step import StepRunner
from tests.reference import clone, data, max_diff, plain_steps, sequential_cnn

CPU = [torch.device("cpu")]


def test_build_gives_a_pipeline_and_leaves_the_weights_alone():
    model = sequential_cnn()
    before = clone(model)
    pipe = build_pipeline(model, torch.randn(8, 3, 16, 16), PipelineOptions(microbatches=2, stages=3, profile=False),
                          CPU, Local())
    assert pipe.plan.counts == [len(st.chain.names) for st in pipe.executor.stages] and len(pipe.plan.stages) == 3
    assert sum(pipe.plan.counts) == 9 and pipe.plan.microbatch_size == 4
    assert pipe.sync is None and pipe.transport is None and pipe.batchnorm is None
    assert max_diff(model, before) == 0 and all(p.grad is None for p in model.parameters())


def test_batchnorm_batch_mode_gets_its_deferred_statistics():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    pipe = build_pipeline(model, torch.randn(4, 3, 8, 8),
                          PipelineOptions(microbatches=2, stages=2, batchnorm="batch", profile=False), CPU, Local())
    assert pipe.batchnorm is not None


def test_a_step_runner_over_a_built_pipeline_equals_plain_training():
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8)
    opts = PipelineOptions(microbatches=2, stages=2, profile=False)
    pipe = build_pipeline(model, batches[0][0], opts, CPU, Local())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    runner = StepRunner(model, pipe, opt, nn.CrossEntropyLoss(), Local(), opts)
    for i, (x, y) in enumerate(batches):
        runner.step(x, y, i)
    plain_steps(ref, batches, microbatches=2)
    assert max_diff(model, ref) <= 1e-5


def _bn_used_twice() -> nn.Sequential:
    bn = nn.BatchNorm2d(4)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn, nn.Conv2d(4, 4, 3, padding=1), bn,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def test_a_batchnorm_used_by_two_stages_gets_deferred_updates_and_one_within_a_stage_does_not():
    def pipe(stages):
        return build_pipeline(_bn_used_twice(), torch.randn(4, 3, 8, 8),
                              PipelineOptions(microbatches=2, stages=stages, profile=False), CPU, Local())

    split = pipe([2, 5])
    assert split.batchnorm is not None and len(split.batchnorm) == 1 and split.batchnorm.per_microbatch
    assert pipe([4, 3]).batchnorm is None  # both uses in stage 0: the stage updates them in plain order


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return {"main": self.a(x), "aux": (self.b(x),)}


def test_one_stage_plans_a_model_whose_output_is_not_a_tensor():
    model = _Pair()
    pipe = build_pipeline(model, torch.randn(6, 4), PipelineOptions(microbatches=2, stages=1, progress=False),
                          CPU, Local())
    assert pipe.plan.counts == [1] and pipe.plan.stages[0].predicted_ms > 0
    assert pipe.executor.stages[0].chain.parts[0] is model  # profiled through a wrapper, run as it is
    assert all(p.grad is None for p in model.parameters())


def test_stages_are_dressed_as_the_training_options_say():
    opts = PipelineOptions(microbatches=2, stages=3, profile=False)
    training = TrainingOptions(precision="bf16", compile=True, recompute=[2])
    pipe = build_pipeline(sequential_cnn(), torch.randn(4, 3, 8, 8), opts, CPU, Local(), training=training)
    stages = pipe.executor.stages
    assert all(st.autocast is torch.bfloat16 and st.autocast_cache for st in stages)
    # torch.compile wraps lazily: nothing is compiled until the first step.
    assert [type(st.body).__name__ for st in stages] == ["OptimizedModule", "OptimizedModule", "Recompute"]
    assert type(stages[2].body.fn).__name__ == "OptimizedModule"  # compiled inside the recompute


def test_batches_change_layout_only_when_they_must():
    cl = TrainingOptions(channels_last=True)
    x = torch.randn(2, 3, 4, 4)
    y = in_layout(x, cl)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(x, y)
    assert in_layout(y, cl) is y  # already channels_last: no copy
    assert in_layout(x, TrainingOptions()) is x
    flat = torch.randn(2, 3)
    assert in_layout(flat, cl) is flat  # only 4-d batches have a channels-last layout


@pytest.mark.slow  # inductor compiles the stages on first use (about 20 s on 2 cores)
def test_compiled_stages_train_as_eager_stages():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 10))
    ref = clone(model)
    batches = data(n=8, size=8, steps=2)
    opts = PipelineOptions(microbatches=2, stages=2, profile=False)
    pipe = build_pipeline(model, batches[0][0], opts, CPU, Local(), training=TrainingOptions(compile=True))
    runner = StepRunner(model, pipe, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                        nn.CrossEntropyLoss(), Local(), opts)
    for i, (x, y) in enumerate(batches):
        runner.step(x, y, i)
    assert all(type(st.body).__name__ == "OptimizedModule" for st in pipe.executor.stages)
    plain_steps(ref, batches, microbatches=2)
    assert max_diff(model, ref) <= 1e-5  # inductor may order sums differently: fp32 tolerance
