"""Every combination of the levers stages="auto" may pull trains as plain PyTorch does (fp32, CPU).

The reference is plain eager training with gradient accumulation over the
same microbatches, in the same memory layout: a layout changes the order of
fp32 sums in plain PyTorch too (by ~1e-6 a step on a well-conditioned model,
more where BatchNorm sees a few values), and pipedp adds nothing to that.
"""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.models import resnet18
from tests.decide.clock_tables import TableClock
from tests.reference import bn_cnn, clone, data, max_diff, plain_steps



def _model():
    torch.manual_seed(0)
    return resnet18(width=8)  # BatchNorm, downsample shortcuts, channels the channels-last hazard leaves alone


def _in(batches, channels_last):
    return [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches] if channels_last else batches


def _train(model, batches, **kw):
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), progress=False, **kw)
    for x, y in batches:
        engine.train_step(x, y)
    return engine


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("stages, microbatches, schedule", [(1, 1, "1f1b"), (1, 4, "1f1b"), (2, 2, "gpipe"),
                                                             (3, 4, "1f1b")])
def test_layout_stages_microbatches_and_schedules_equal_plain_training(channels_last, stages, microbatches,
                                                                        schedule):
    model = _model()
    ref = clone(model).to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    batches = data(n=8, size=16, steps=3)
    engine = _train(model, batches, stages=stages, microbatches=microbatches, schedule=schedule,
                    channels_last=channels_last)
    assert engine.plan.channels_last is channels_last
    plain_steps(ref, _in(batches, channels_last), microbatches=microbatches)
    assert max_diff(model, ref) <= 1e-5


def test_the_layout_auto_chose_trains_exactly_and_runs_its_batches_in_it():
    # An injected clock makes channels_last the faster layout; the engine then converts each batch.
    torch.manual_seed(0)
    model, batches = bn_cnn(), data(n=8, size=16, steps=3)
    ref = clone(model).to(memory_format=torch.channels_last)
    opts = pipedp.PipelineOptions(microbatches="auto", stages="auto", profile=False)
    clock = TableClock({"plain": 10.0, "plain channels_last": 8.0, "1x2 channels_last": 5.0})
    from pipedp.build import build_pipeline
    from pipedp.comm import Local
    from pipedp.step import StepRunner
    pipe = build_pipeline(model, batches[0][0], opts, [torch.device("cpu")], Local(), measure=clock)
    assert pipe.decision.channels_last and pipe.microbatches == 2
    runner = StepRunner(model, pipe, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                        nn.CrossEntropyLoss(), Local(), opts)
    for i, (x, y) in enumerate(batches):
        runner.step(x.contiguous(memory_format=torch.channels_last), y, i)
    plain_steps(ref, _in(batches, True), microbatches=2)
    assert max_diff(model, ref) <= 1e-5


@pytest.mark.slow  # inductor compiles forward and backward (tens of seconds on 2 cores)
def test_compiled_channels_last_microbatched_plan_equals_plain_training():
    model = _model()
    ref = clone(model).to(memory_format=torch.channels_last)
    batches = data(n=8, size=16, steps=3)
    engine = _train(model, batches, stages=1, microbatches=2, channels_last=True, compile=True)
    assert engine.plan.compiled and engine.plan.channels_last
    plain_steps(ref, _in(batches, True), microbatches=2)
    assert max_diff(model, ref) <= 1e-5  # inductor may order sums differently: fp32 tolerance
