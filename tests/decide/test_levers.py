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
                        nn.CrossEntropyLoss(), Local())
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


# -- the resolved levers (pipedp.decide.levers): pure, no model -----------------------------------------------


def test_levers_resolve_each_request_against_the_cut():
    from pipedp.decide.levers import resolve_levers
    from pipedp.options import ConcurrencyOptions, PipelineOptions, TrainingOptions

    pipeline = PipelineOptions(batchnorm="batch", cuda_graph=True, rollback=False, measure_steps=5)
    training = TrainingOptions(precision="bf16", recompute=True, clip_grad_norm=2.0)
    pieces = ConcurrencyOptions(branches=True, split_grads=True, early_update=True)
    lv = resolve_levers(training, pipeline, pieces, stages=3)
    assert lv.recompute == (0, 1, 2) and lv.autocast is torch.bfloat16 and lv.batchnorm == "batch"
    assert lv.cuda_graph and not lv.rollback and lv.clip_grad_norm == 2.0 and lv.measure_steps == 5
    assert lv.branches and lv.split_grads and lv.early_update
    # A trial cut of two stages recomputes the named ones it has; a plan the trials found faster without the
    # pieces keeps none of them (early updates are not timed: they stay as asked).
    lv = resolve_levers(TrainingOptions(recompute=[0, 2]), PipelineOptions(), pieces, stages=2, concurrent=False)
    assert lv.recompute == (0,) and lv.recomputes(0) and not lv.recomputes(1) and lv.autocast is None
    assert not lv.branches and not lv.split_grads and lv.early_update


def test_settle_places_every_stage_and_refuses_recompute_past_the_cut():
    from pipedp.decide.config import Config
    from pipedp.decide.decision import Decision
    from pipedp.decide.levers import settle
    from pipedp.options import PipelineOptions, TrainingOptions

    cpu = [torch.device("cpu")]
    with pytest.raises(RuntimeError, match="not settled"):
        Decision(Config((2, 2), 4)).settled
    d = settle(Decision(Config((1, 1, 1, 1), 4), schedule="interleaved"), PipelineOptions(), TrainingOptions(),
               None, cpu, pp=2, dp=3)
    assert [r for r, _ in d.places] == [0, 1, 0, 1] and (d.pp, d.dp) == (2, 3) and d.settled.recompute == ()
    with pytest.raises(ValueError, match=r"recompute names stage\(s\) \[4\] but the pipeline has 4"):
        settle(Decision(Config((1, 1, 1, 1), 4)), PipelineOptions(), TrainingOptions(recompute=[4]), None, cpu, 1)
    trial = settle(Decision(Config((2, 2), 4)), PipelineOptions(), TrainingOptions(recompute=[3]), None, cpu, 1,
                   trial=True)  # a trial's cut may be shorter than the one recompute names
    assert trial.settled.recompute == ()
    two = [torch.device("cpu"), torch.device("cpu", 1)]
    d = settle(Decision(Config((3,), 1)), PipelineOptions(), TrainingOptions(), None, two, 1)
    assert any("1 stage(s) per rank use 1 of 2 devices" in n for n in d.notes)
