"""The build step on its own: a ready pipeline from a model, a batch, options and a communicator."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from pipedp.build import Trials, build_pipeline, in_layout
from pipedp.comm import Local, communicator
from pipedp.options import DataParallelOptions, PipelineOptions, TrainingOptions
from pipedp.planner import MIN_TRIAL_GAIN
from pipedp.step import StepRunner
from tests import multiproc
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


def _trials(times, bar, seen=None):
    """Trials whose clocks read a table (ms per plan label) instead of a GPU."""
    def plan(c):
        if seen is not None:
            seen.append(c.label)
        return times.get(c.label, 50.0)

    return Trials(plan, lambda: bar)


def test_auto_builds_the_plan_the_trials_chose_and_prints_them():
    seen = []
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU, Local(),
                          trials=_trials({"1x1": 10.0, "2x4": 7.0, "3x4": 8.0}, 10.0, seen))
    assert seen[:3] == ["1x1", "1x2", "2x2"] and "4x8" in seen  # every M of 1, 2, 4, 8 the batch of 8 allows
    assert len(pipe.executor.stages) == 2 and pipe.executor.microbatches == 4 and pipe.plan.microbatches == 4
    assert pipe.plan.microbatch_size == 2 and pipe.plan.trial_baseline_ms == 10.0
    text = str(pipe.plan)
    assert "trials (ms per forward+backward step; the bar is the plain step, 10.00 ms):" in text
    lines = text.splitlines()
    assert [ln.split() for ln in lines if ln.strip().startswith("2x4")] == [["2x4", "7.00", "1.43", "chosen"]]
    assert "stages=auto chose 2x4" in text


def test_auto_falls_back_to_the_plain_step_which_trains_exactly_as_plain_pytorch():
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8)
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    pipe = build_pipeline(model, batches[0][0], opts, CPU, Local(), trials=_trials({"2x2": 9.9}, 10.0))
    assert pipe.plan.counts == [9] and pipe.plan.microbatches == 1
    assert [ln.split() for ln in str(pipe.plan).splitlines() if ln.startswith("  1x1")] == [
        ["1x1", "50.00", "0.20", "chosen"]]
    runner = StepRunner(model, pipe, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                        nn.CrossEntropyLoss(), Local(), replace(opts, microbatches=1))
    for i, (x, y) in enumerate(batches):
        runner.step(x, y, i)
    plain_steps(ref, batches, microbatches=1)
    assert max_diff(model, ref) <= 1e-5


def test_microbatches_auto_without_trials_follows_the_stage_count():
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU, Local())
    assert pipe.plan.counts == [9] and pipe.plan.microbatches == 1 and not pipe.plan.trials
    assert any("microbatches=auto: 1 for 1 stage(s)" in n for n in pipe.plan.notes)


def _follow_rank0(rank, world):
    # Rank 1's own trials would choose 1 stage; it must follow rank 0's choice of 3 stages x 4 microbatches.
    times = {"3x4": 5.0} if rank == 0 else {"1x1": 1.0}
    seen = []
    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    torch.manual_seed(0)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU,
                          communicator(DataParallelOptions()), trials=_trials(times, 10.0, seen))
    return pipe.plan.counts, pipe.plan.microbatches, len(seen)


def test_distributed_ranks_follow_the_first_ranks_trials():
    (c0, m0, n0), (c1, m1, n1) = multiproc.run(_follow_rank0, 2)
    assert (len(c0), m0) == (3, 4) and (c1, m1) == (c0, m0)
    assert n0 > 0 and n1 == 0  # only the deciding rank ran trials


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph", [False, True])
def test_auto_on_one_gpu_times_real_trials_beside_the_plain_step(graph):
    cuda = [torch.device("cuda")]
    opts = PipelineOptions(microbatches="auto", stages="auto", cuda_graph=graph, progress=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(16, 3, 16, 16), opts, cuda, Local(),
                          training=TrainingOptions(precision="bf16"))
    plan = pipe.plan
    assert plan.trial_baseline_ms is not None and plan.trial_baseline_ms > 0
    labels = [label for label, _ in plan.trials]
    assert labels[0] == "1x1" and "2x2" in labels and all(ms > 0 for _, ms in plan.trials)
    chosen = dict(plan.trials).get(plan.label)
    # The decision rule on real clocks: a pipeline only when its trial beat the plain step by the margin.
    assert plan.label == "1x1" or chosen <= plan.trial_baseline_ms * (1 - MIN_TRIAL_GAIN)
    assert "chosen" in str(plan)


def test_auto_keeps_the_concurrency_pieces_only_where_trials_found_them_faster():
    from pipedp.models import resnet18
    from pipedp.options import ConcurrencyOptions

    opts = PipelineOptions(microbatches="auto", stages="auto", profile=False)
    side = ConcurrencyOptions(branches=True)
    for concurrent_ms, kept in ((8.0, True), (9.9, False)):
        seen = []
        pipe = build_pipeline(resnet18(width=4), torch.randn(4, 3, 16, 16), opts, CPU, Local(),
                              trials=_trials({"1x1": 10.0, "1x1 concurrent": concurrent_ms}, 10.0, seen),
                              concurrency=side)
        assert "1x1 concurrent" in seen and pipe.plan.counts == [sum(pipe.plan.counts)]
        assert (pipe.concurrency is not None) is kept and pipe.plan.label == ("1x1 concurrent" if kept else "1x1")


def test_a_concurrent_trial_times_the_pieces_and_puts_the_model_back(monkeypatch):
    from pipedp import build
    from pipedp.models import resnet18
    from pipedp.options import ConcurrencyOptions
    from pipedp.partition.blocks import blocks_of, check_chain
    from pipedp.planner import Candidate

    model = resnet18(width=4)
    before = [type(m) for m in model.modules()]
    x = torch.randn(4, 3, 16, 16)
    blocks = blocks_of(model)
    parts = build._Parts(blocks, check_chain(model, blocks, x))
    cand = Candidate((len(blocks),), 2, concurrent=True)
    installed = []

    def spy(executor, options):
        installed.append(real(executor, options))
        return installed[-1]

    real = build.install
    monkeypatch.setattr(build, "install", spy)
    ms = build._trial_ms(parts, cand, x, model, CPU, PipelineOptions(), Local(), TrainingOptions(),
                         ConcurrencyOptions(branches=True, split_grads=True))
    assert ms > 0 and [type(m) for m in model.modules()] == before
    assert all(p.grad is None for p in model.parameters())
    assert len(installed) == 1 and installed[0].branches is not None and installed[0].split is not None


def test_auto_builds_a_compiled_finalist_when_it_wins_the_trials():
    opts = PipelineOptions(microbatches=2, stages="auto", profile=False)
    pipe = build_pipeline(sequential_cnn(), torch.randn(8, 3, 16, 16), opts, CPU, Local(),
                          training=TrainingOptions(compile=True),
                          trials=_trials({"1x2": 9.0, "2x2": 9.5, "2x2 compiled": 6.0, "1x2 compiled": 8.0}, 10.0))
    # torch.compile wraps lazily: building compiles nothing yet.
    assert [type(st.body).__name__ for st in pipe.executor.stages] == ["OptimizedModule"] * 2
    assert pipe.plan.compiled and pipe.plan.label == "2x2 compiled" and ", compiled" in str(pipe.plan).splitlines()[0]
