"""The build step on its own: a ready pipeline from a model, a batch, options and a communicator."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from pipedp.build import build_pipeline
from pipedp.comm import Local, communicator
from pipedp.decide.layout import Layout
from pipedp.decide.search import MIN_TRIAL_GAIN
from pipedp.lower import in_layout
from pipedp.models import resnet18
from pipedp.options import ConcurrencyOptions, DataParallelOptions, PipelineOptions, TrainingOptions
from pipedp.partition.blocks import blocks_of
from pipedp.step import StepRunner
from tests import multiproc
from tests.decide.clock_tables import TableClock
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


def test_a_given_world_layout_is_the_plan_whatever_the_options_left_auto():
    """pp="auto" hands its layout to the build: its cut and microbatches, not the options' "auto" choice."""
    model = sequential_cnn()
    opts = PipelineOptions(profile=False)  # stages="auto" would have timed plans of its own
    pipe = build_pipeline(model, torch.randn(8, 3, 16, 16), opts, CPU, Local(), given=Layout(1, (4, 5), 2))
    assert pipe.plan.counts == [4, 5] and pipe.plan.microbatch_size == 4
    assert any("pp=auto: dp 1 x pp 2" in n for n in pipe.plan.notes)
    pieces = build_pipeline(resnet18(width=4), torch.randn(8, 3, 32, 32), opts, CPU, Local(),
                            concurrency=ConcurrencyOptions(branches=True), given=Layout(1, (len(blocks_of(
                                resnet18(width=4))),), 1))
    assert pieces.decision.concurrent  # the user's concurrency pieces ride along with the chosen layout
    with pytest.raises(ValueError, match="cut into 9 here: pass pp=N"):
        build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU, Local(), given=Layout(1, (4, 4), 2))


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
    runner = StepRunner(model, pipe, opt, nn.CrossEntropyLoss(), Local())
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
    x = torch.randn(2, 3, 4, 4)
    y = in_layout(x, True)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(x, y)
    assert in_layout(y, True) is y  # already channels_last: no copy
    assert in_layout(x, False) is x
    flat = torch.randn(2, 3)
    assert in_layout(flat, True) is flat  # only 4-d batches have a channels-last layout


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
                        nn.CrossEntropyLoss(), Local())
    for i, (x, y) in enumerate(batches):
        runner.step(x, y, i)
    assert all(type(st.body).__name__ == "OptimizedModule" for st in pipe.executor.stages)
    plain_steps(ref, batches, microbatches=2)
    assert max_diff(model, ref) <= 1e-5  # inductor may order sums differently: fp32 tolerance


def _clock(times, default=50.0):
    """Trials whose clocks read a table (ms per configuration label) instead of a device."""
    return TableClock(times, default=default)


def test_auto_builds_the_plan_the_trials_chose_and_prints_them():
    clock = _clock({"plain": 10.0, "2x4": 7.0, "3x4": 8.0})
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU, Local(),
                          training=TrainingOptions(channels_last=False), measure=clock)
    assert clock.seen[:2] == ["plain", "1x2"]  # the user's step first, then plans by microbatches
    assert len(pipe.executor.stages) == 1  # a CPU runs stages one after another: only 1xM plans are timed
    assert not any(s.startswith(("2x", "3x")) for s in clock.seen)
    assert pipe.plan.trial_baseline_ms == 10.0 and pipe.plan.bar == "plain"
    text = str(pipe.plan)
    assert "the bar is the strongest alternative, plain, 10.00 ms" in text
    assert opts.microbatches == "auto" and pipe.microbatches == pipe.plan.microbatches == 1


def test_the_plan_is_the_decision_and_the_options_keep_what_the_user_asked():
    clock = _clock({"plain": 10.0, "plain channels_last": 9.0, "1x2 channels_last": 6.0})
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    training = TrainingOptions()
    model = sequential_cnn()
    pipe = build_pipeline(model, torch.randn(8, 3, 16, 16), opts, CPU, Local(), training=training,
                          measure=clock)
    assert opts == PipelineOptions(microbatches="auto", stages="auto", profile=False)
    assert training.channels_last == "auto" and training == TrainingOptions()
    d = pipe.decision
    assert (d.microbatches, d.channels_last, d.chosen) == (2, True, "1x2 channels_last")
    assert pipe.executor.microbatches == 2 and pipe.plan.channels_last and pipe.plan.label == "1x2 channels_last"
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # the model runs in the chosen layout


def test_auto_falls_back_to_the_bar_which_trains_exactly_as_plain_pytorch():
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8)
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    pipe = build_pipeline(model, batches[0][0], opts, CPU, Local(), measure=_clock({"plain": 10.0, "1x2": 9.9}))
    assert pipe.plan.counts == [9] and pipe.plan.microbatches == 1 and pipe.plan.label == "1x1"
    runner = StepRunner(model, pipe, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                        nn.CrossEntropyLoss(), Local())
    for i, (x, y) in enumerate(batches):
        runner.step(x, y, i)
    plain_steps(ref, batches, microbatches=1)
    assert max_diff(model, ref) <= 1e-5


def test_microbatches_auto_without_trials_follows_the_stage_count():
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU * 2, Local())  # no trials
    assert pipe.plan.counts == [9] and pipe.plan.microbatches == 1 and not pipe.plan.trials
    assert any("microbatches=auto: 1 for 1 stage(s)" in n for n in pipe.plan.notes)


def _follow_rank0(rank, world):
    # Rank 1's own trials would choose another plan; it must follow rank 0's choice of 1 stage x 4 microbatches.
    times = {"plain": 10.0, "1x2": 9.0, "1x4": 5.0} if rank == 0 else {"plain": 1.0}
    clock = _clock(times)
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    torch.manual_seed(0)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU,
                          communicator(DataParallelOptions()), training=TrainingOptions(channels_last=False),
                          measure=clock)
    return pipe.plan.counts, pipe.plan.microbatches, len(clock.seen)


def test_distributed_ranks_follow_the_first_ranks_trials():
    (c0, m0, n0), (c1, m1, n1) = multiproc.run(_follow_rank0, 2)
    assert (len(c0), m0) == (1, 4) and (c1, m1) == (c0, m0)
    assert n0 > 0 and n1 == 0  # only the deciding rank ran trials


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph", [False, True])
def test_auto_on_one_gpu_times_real_trials_beside_the_strongest_alternative(graph):
    cuda = [torch.device("cuda")]
    opts = PipelineOptions(microbatches="auto", stages="auto", cuda_graph=graph, progress=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(16, 3, 16, 16), opts, cuda, Local(),
                          training=TrainingOptions(precision="bf16"))
    plan = pipe.plan
    assert plan.trial_baseline_ms is not None and plan.trial_baseline_ms > 0
    labels = [label for label, _ in plan.trials]
    assert labels[:2] == ["plain", "plain channels_last"] and all(ms > 0 for _, ms in plan.trials)
    assert any(label.startswith("2x2") for label in labels)
    chosen = dict(plan.trials).get(plan.label)
    # The decision rule on real clocks: a plan only when its trial beat the bar by the margin.
    assert plan.stages and (chosen is None or chosen <= plan.trial_baseline_ms * (1 - MIN_TRIAL_GAIN)
                            or plan.microbatches == 1)
    assert "chosen" in str(plan)


def test_real_trials_on_a_cpu_time_both_layouts_and_leave_the_model_as_it_was():
    model = sequential_cnn()
    before = clone(model)
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False, plan_budget_s=5.0)
    pipe = build_pipeline(model, torch.randn(8, 3, 16, 16), opts, CPU, Local())
    labels = [label for label, _ in pipe.plan.trials]
    # One-stage plans are sampled on one microbatch, so they go first, from the most microbatches down.
    assert labels[:2] == ["1x4", "1x4 channels_last"] and pipe.plan.planning_s > 0
    assert labels[2].startswith("plain")  # the bar, in the faster probe's layout, before the walk
    assert {"plain", "plain channels_last"} <= set(labels)
    assert pipe.plan.bar in labels and max_diff(model, before) == 0  # trials train nothing
    assert all(p.grad is None for p in model.parameters())


def test_on_a_cpu_the_concurrency_pieces_are_kept_as_asked_without_a_trial():
    from pipedp.models import resnet18
    from pipedp.options import ConcurrencyOptions

    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    side = ConcurrencyOptions(branches=True)
    clock = _clock({"plain": 10.0, "1x1 concurrent": 1.0})
    pipe = build_pipeline(resnet18(width=4), torch.randn(4, 3, 16, 16), opts, CPU, Local(),
                          training=TrainingOptions(channels_last=False), measure=clock, concurrency=side)
    assert "1x1 concurrent" not in clock.seen  # a CPU runs the pieces in order: nothing to gain, nothing timed
    assert pipe.concurrency is not None and pipe.decision.concurrent


def test_a_concurrent_trial_times_the_pieces_and_puts_the_model_back():
    from pipedp.decide import Config
    from pipedp.partition.parts import Parts
    from pipedp.trials.clock import DeviceClock
    from pipedp.models import resnet18
    from pipedp.options import ConcurrencyOptions
    from pipedp.partition.blocks import blocks_of
    from pipedp.partition.check import check_chain

    model = resnet18(width=4)
    before = [type(m) for m in model.modules()]
    x = torch.randn(4, 3, 16, 16)
    blocks = blocks_of(model)
    parts = Parts(blocks, check_chain(model, blocks, x))
    clock = DeviceClock(model, parts, x, CPU, PipelineOptions(), Local(), TrainingOptions(),
                        ConcurrencyOptions(branches=True, split_grads=True))
    seen = []
    real = clock._plan

    def spy(config):
        run, undo = real(config)
        seen.append(any("forward" in vars(m) for m in model.modules()))  # blocks swapped while timed
        return run, undo

    clock._plan = spy
    c = Config((len(blocks),), 2, concurrent=True)
    clock.warm(c)
    ms = clock.measure(c, 2)
    assert ms > 0 and seen == [True, True] and [type(m) for m in model.modules()] == before
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_auto_builds_a_compiled_finalist_when_it_wins_the_trials():
    opts = PipelineOptions(microbatches=2, stages="auto", profile=False)
    clock = _clock({"plain compiled": 10.0, "1x2 compiled": 6.0})
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU, Local(),
                          training=TrainingOptions(compile=True, channels_last=False), measure=clock)
    # torch.compile wraps lazily: building compiles nothing yet.
    assert [type(st.body).__name__ for st in pipe.executor.stages] == ["OptimizedModule"]
    assert pipe.plan.compiled and pipe.plan.label == "1x2 compiled" and ", compiled" in str(pipe.plan).splitlines()[0]
