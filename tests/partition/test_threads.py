"""Thread planning: the Amdahl fit, the joint cut/threads DP (against brute force), choice by measured trials."""

import itertools

import pytest
import torch
from torch import nn

from pipedp.partition import Block
from pipedp.partition.threads import (
    CpuPlan, ThreadCurve, choose_cpu_plan, fit_amdahl, neighbours, predict, profile_counts,
    profile_threads, split_threads,
)


def test_fit_recovers_amdahl_curve_and_stays_non_negative():
    ps = [1, 2, 4, 8]
    a, b = fit_amdahl(ps, [3.0 + 12.0 / p for p in ps])
    assert a == pytest.approx(3.0) and b == pytest.approx(12.0)
    a, b = fit_amdahl(ps, [5.0, 5.5, 6.0, 6.5])  # slower with more threads: no parallel part
    assert b == 0.0 and a == pytest.approx(5.75)
    a, b = fit_amdahl([1, 2], [10.0, 4.0])  # super-linear: no negative serial part
    assert a == 0.0 and b > 0
    assert fit_amdahl([2], [5.0]) == (0.0, 10.0)


def test_profile_counts():
    assert profile_counts(1) == [1]
    assert profile_counts(2) == [1, 2]
    assert profile_counts(16) == [1, 2, 4, 8, 16]
    assert profile_counts(12) == [1, 2, 4, 8, 12]


def _curves(spec):
    return [ThreadCurve(f"b{i}", (a / 3, b / 3), (2 * a / 3, 2 * b / 3)) for i, (a, b) in enumerate(spec)]


def _brute(curves, stages, cores):
    n, best = len(curves), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        for threads in itertools.product(range(1, cores + 1), repeat=stages):
            if sum(threads) > cores:
                continue
            worst = max(sum(c.cost_ms(p) for c in curves[bounds[s] : bounds[s + 1]]) for s, p in enumerate(threads))
            if best is None or worst < best - 1e-9:
                best = worst
    return best


@pytest.mark.parametrize("stages,cores", [(1, 4), (2, 4), (3, 6), (2, 5)])
def test_split_threads_is_optimal(stages, cores):
    g = torch.Generator().manual_seed(stages * 10 + cores)
    spec = [(float(a), float(b)) for a, b in (torch.rand(6, 2, generator=g) * torch.tensor([2.0, 20.0])).tolist()]
    curves = _curves(spec)
    counts, threads = split_threads(curves, stages, cores)
    assert sum(counts) == 6 and len(counts) == stages and sum(threads) <= cores
    start, worst = 0, 0.0
    for k, p in zip(counts, threads):
        worst = max(worst, sum(c.cost_ms(p) for c in curves[start : start + k]))
        start += k
    assert worst == pytest.approx(_brute(curves, stages, cores))


def test_concurrent_plan_beats_one_team_when_scaling_is_poor():
    # Blocks with a large serial part: two stages of 1 thread each beat one stage on 2 threads in the model.
    curves = _curves([(8.0, 2.0)] * 4)
    host = CpuPlan((4,), None, 4)
    both = CpuPlan((2, 2), (1, 1), 4)
    assert predict(curves, both, "1f1b", 2)[0] < predict(curves, host, "1f1b", 2)[0]
    # Perfectly parallel blocks: one team on all cores is as good as it gets.
    curves = _curves([(0.0, 10.0)] * 4)
    assert predict(curves, host, "1f1b", 2)[0] < predict(curves, both, "1f1b", 2)[0]


def test_neighbours_move_one_core_or_one_block():
    plan = CpuPlan((2, 3), (3, 1), 4)
    moves = neighbours(plan, 4)
    assert CpuPlan((2, 3), (2, 2), 4) in moves and CpuPlan((1, 4), (3, 1), 4) in moves
    assert CpuPlan((3, 2), (3, 1), 4) in moves
    assert all(sum(p.threads) <= 4 and min(p.counts) >= 1 for p in moves)
    assert plan not in moves
    assert neighbours(CpuPlan((5,), None, 4), 4) == []


def test_auto_keeps_the_host_plan_unless_a_concurrent_one_is_measured_faster():
    curves = _curves([(8.0, 2.0)] * 4)  # the model favours concurrent stages
    kw = dict(cores=2, host_threads=2, microbatches=[4], schedule="1f1b")
    slow = choose_cpu_plan(curves, measure=lambda p: 100.0 if p.threads is None else 99.0, **kw)
    assert slow.plan.threads is None  # 1% faster is within noise
    fast = choose_cpu_plan(curves, measure=lambda p: 100.0 if p.threads is None else 80.0, **kw)
    assert fast.plan.threads == (1, 1) and fast.measured_ms == 80.0
    assert any("1x4 (host threads)" in n for n in fast.notes)


def test_hill_climbing_keeps_a_move_only_if_measured_faster():
    curves = _curves([(1.0, 10.0)] * 6)
    start_counts, _ = split_threads(curves, 2, 4)
    target = CpuPlan(start_counts, (3, 1), 4)  # pretend this one is measured fastest

    def measure(p):
        return 50.0 if p == target else 100.0 + sum(p.threads or ())

    choice = choose_cpu_plan(curves, cores=4, host_threads=4, microbatches=[4], schedule="1f1b", measure=measure,
                             stages=2, climb_trials=20)
    assert choice.plan == target
    measured = dict(choice.trials)
    assert measured[target.label] == 50.0 and len(measured) >= 2


def test_fixed_cut_gets_threads_only():
    curves = _curves([(0.5, 10.0), (0.5, 10.0), (0.5, 30.0)])
    choice = choose_cpu_plan(curves, cores=4, host_threads=4, microbatches=[4], schedule="gpipe", measure=None,
                             stages=[2, 1])
    assert choice.plan.counts == (2, 1) and sum(choice.plan.threads) <= 4
    assert choice.plan.threads[1] >= choice.plan.threads[0]  # the heavier stage gets more cores


def test_profile_threads_fits_every_block():
    blocks = [Block("conv", nn.Conv2d(3, 8, 3, padding=1)), Block("relu", nn.ReLU()),
              Block("pool", nn.AdaptiveAvgPool2d(1))]
    curves = profile_threads(blocks, torch.randn(4, 3, 16, 16), counts=[1, 2], repeats=1)
    assert [c.name for c in curves] == ["conv", "relu", "pool"]
    assert all(c.cost_ms(1) > 0 and c.cost_ms(2) > 0 for c in curves[:1])


def test_split_with_fixed_threads_gives_the_busier_stage_fewer_blocks():
    curves = _curves([(0.0, 12.0)] * 6)
    counts, threads = split_threads(curves, 2, 8, fixed=(6, 2))
    assert threads == (6, 2) and counts == (5, 1)  # slowest stage 10 ms; (4, 2) would be 12


# -- through the engine -------------------------------------------------------------------------

def _engine(model, **pipeline):
    import pipedp

    pipeline.setdefault("profile", pipeline.get("threads") == "auto")  # the cost model, unless trials are wanted
    opts = pipedp.PipelineOptions(progress=False, **pipeline)
    return pipedp.Engine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), pipeline=opts)


class _Probe(nn.Module):
    def __init__(self, seen, tag):
        super().__init__()
        self.seen, self.tag = seen, tag

    def forward(self, x):
        import threading

        self.seen.append((self.tag, torch.get_num_threads(), threading.current_thread().name))
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_engine_with_given_threads_equals_plain_and_shows_them(schedule):
    import copy

    from tests.reference import data, max_diff, plain_steps, sequential_cnn

    torch.manual_seed(0)
    model = sequential_cnn()
    ref = plain_steps(copy.deepcopy(model), data(), microbatches=4)
    engine = _engine(model, microbatches=4, stages=[4, 5], threads=[1, 1], schedule=schedule)
    for x, y in data():
        engine.train_step(x, y)
    assert max_diff(model, ref) <= 1e-5
    plan = engine.plan
    assert [s.threads for s in plan.stages] == [1, 1] and plan.counts == [4, 5]
    assert "threads" in str(plan).splitlines()[1] and "worker1" in str(plan)
    assert [st.lane.worker.threads for st in engine.executor.stages] == [1, 1]


def test_each_stage_runs_with_its_planned_thread_count():
    from tests.reference import data

    seen = []
    model = nn.Sequential(_Probe(seen, 0), nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), _Probe(seen, 1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    engine = _engine(model, microbatches=2, stages=[3, 4], threads=[1, 1])
    (x, y), = data(steps=1)
    engine.train_step(x, y)
    planned = [s.threads for s in engine.plan.stages]
    assert {(tag, k, name) for tag, k, name in seen if name.startswith("pipedp-stage")} == {
        (0, planned[0], "pipedp-stage0"), (1, planned[1], "pipedp-stage1")}
    assert all(name.startswith("pipedp-stage") for _, _, name in seen[-4:])  # the step ran on the workers


def test_auto_threads_measure_and_stay_exact():
    import copy

    from tests.reference import data, max_diff, plain_steps, sequential_cnn

    torch.manual_seed(0)
    model = sequential_cnn()
    ref = plain_steps(copy.deepcopy(model), data(), microbatches=2)
    engine = _engine(model, microbatches=2, stages="auto", threads="auto")
    for x, y in data():
        engine.train_step(x, y)
    assert max_diff(model, ref) <= 1e-5
    text = str(engine.plan)
    assert "CPU plans timed in trial steps" in text and "(host threads)" in text and "chose" in text


def test_threads_option_errors():
    import pipedp

    with pytest.raises(ValueError, match="one count per stage"):
        pipedp.PipelineOptions(stages=[2, 2], threads=[1])
    with pytest.raises(ValueError, match="sum to <="):
        pipedp.PipelineOptions(threads=[64, 64])


@pytest.mark.parametrize("batchnorm", ["microbatch", "batch"])
def test_concurrent_stages_match_in_order_stages_with_batchnorm(batchnorm):
    import copy

    from tests.reference import data, max_diff

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    twin = copy.deepcopy(model)
    a = _engine(model, microbatches=4, stages=[3, 6], threads=[1, 1], batchnorm=batchnorm)
    b = _engine(twin, microbatches=4, stages=[3, 6], batchnorm=batchnorm)
    for x, y in data(n=12):
        a.train_step(x, y)
        b.train_step(x, y)
    assert max_diff(model, twin) <= 1e-5


def test_a_failed_step_on_workers_leaves_the_model_and_the_workers_usable():
    import copy

    import pipedp
    from tests.reference import data, max_diff, sequential_cnn

    model = sequential_cnn()
    before = copy.deepcopy(model)
    fail = [True]

    def loss_fn(out, t):
        return out.sum(dim=1) if fail[0] else nn.functional.cross_entropy(out, t)  # first: not a scalar

    engine = pipedp.Engine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                           loss_fn=loss_fn,
                           pipeline=pipedp.PipelineOptions(progress=False, microbatches=2, stages=[4, 5],
                                                           threads=[1, 1], profile=False))
    (x, y), = data(steps=1)
    with pytest.raises(ValueError, match="scalar") as info:
        engine.train_step(x, y)
    assert any("stage 1" in n for n in info.value.__notes__)
    assert max_diff(model, before) == 0.0
    fail[0] = False
    assert torch.isfinite(engine.train_step(x, y))  # the same workers run the next step
    assert max_diff(model, before) > 0


def test_a_batchnorm_shared_by_concurrent_stages_is_refused():
    bn = nn.BatchNorm2d(3)
    model = nn.Sequential(bn, nn.Conv2d(3, 3, 3, padding=1), bn, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(3, 10))
    engine = _engine(model, microbatches=2, stages=[2, 4], threads=[1, 1])
    from tests.reference import data

    (x, y), = data(steps=1)
    with pytest.raises(ValueError, match="threads=None"):
        engine.train_step(x, y)


def test_more_concurrent_stages_than_cores_is_a_clear_error():
    with pytest.raises(ValueError, match="pass stages <= 2"):
        split_threads(_curves([(1.0, 1.0)] * 4), 3, 2)


def test_auto_times_the_models_best_plan_of_every_stage_count_then_climbs_from_the_fastest():
    curves = _curves([(2.0, 6.0)] * 8)
    seen = []

    def measure(p):
        seen.append(p)
        return {None: 100.0, 2: 90.0, 3: 70.0, 4: 80.0}[len(p.counts) if p.threads else None] + 0.01 * len(seen)

    choice = choose_cpu_plan(curves, cores=4, host_threads=4, microbatches=[4], schedule="1f1b", measure=measure)
    assert {len(p.counts) for p in seen if p.threads} == {2, 3, 4}
    assert len(choice.plan.counts) == 3 and sum(choice.plan.threads) <= 4
    first_three = [p for p in seen if p.threads][:3]
    assert sorted(len(p.counts) for p in first_three) == [2, 3, 4]


def test_cost_model_threads_time_nothing():
    from pipedp.partition.profile import BlockProfile
    from pipedp.partition.threads import plan_cpu

    profs = [BlockProfile(f"b{i}", 1.0, 2.0, 8, 8, 8) for i in range(4)]

    def no_timing(_):
        raise AssertionError("profile=False must not time trial steps")

    choice, curves = plan_cpu([], torch.zeros(1), threads=[1, 1], stages="auto", microbatches=[2],
                              sizes=lambda m: 1.0, schedule="1f1b", measure=no_timing, host_profiles=profs,
                              profiled=False)
    host = torch.get_num_threads()
    assert choice.plan.counts == (2, 2) and choice.plan.threads == (1, 1)
    assert curves[0].cost_ms(1) == pytest.approx(3.0 * host)
