from collections import defaultdict

import pytest
import torch

from pipedp.partition import BlockProfile
from pipedp.planner import (
    AUTO_MICROBATCHES, MIN_TRIAL_GAIN, build_plan, choose_by_trials, resolve_counts, simulate_plan, stage_devices,
    stage_places, trial_candidates, trials_apply, untimed_microbatches,
)

CPU = torch.device("cpu")


def profiles(costs):
    return [BlockProfile(f"b{i}", c / 3, 2 * c / 3, 1000, 4000, 100) for i, c in enumerate(costs)]


def test_stage_devices_groups_stages_contiguously():
    d = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert stage_devices(4, d) == [d[0], d[0], d[1], d[1]]
    assert stage_devices(3, d) == [d[0], d[0], d[1]]
    assert stage_devices(1, d) == [d[0]]


def test_int_and_list_stages():
    profs = profiles([1, 1, 1, 5, 1, 1])
    assert resolve_counts(profs, 3, [CPU], 4, "1f1b")[0] == [3, 1, 2]
    assert resolve_counts(profs, [2, 2, 2], [CPU], 4, "1f1b") == ([2, 2, 2], ["cut given by the user"])
    with pytest.raises(ValueError, match="summing to the model's 6 blocks"):
        resolve_counts(profs, [2, 2], [CPU], 4, "1f1b")
    with pytest.raises(ValueError, match="stages must be an int, 'auto'"):
        resolve_counts(profs, "many", [CPU], 4, "1f1b")


def test_auto_on_a_serial_device_is_one_stage():
    counts, notes = resolve_counts(profiles([1.0] * 8), "auto", [CPU], 4, "1f1b")
    assert counts == [8] and "one after another" in notes[0]


def fake_clock(times, seen=None):
    """measure(candidate) from a table of ms per label (the trials a GPU would time)."""
    def measure(c):
        if seen is not None:
            seen.append(c)
        return times[c.label]
    return measure


def test_trials_pick_the_fastest_plan_that_beats_the_plain_step():
    seen, bar = [], iter([10.5, 10.0])  # the plain step before and after the candidates: the faster is the bar
    cands = trial_candidates([1.0] * 8, [1, 2, 4], batch=64)
    assert [c.label for c in cands] == ["1x1", "1x2", "2x2", "1x4", "2x4", "3x4", "4x4"]
    times = {"1x1": 10.1, "1x2": 10.3, "2x2": 9.0, "1x4": 11.0, "2x4": 8.0, "3x4": 8.5, "4x4": 9.5}
    d = choose_by_trials(cands, fake_clock(times, seen), baseline=lambda: next(bar), where="cuda:0")
    assert seen == cands and (len(d.counts), d.microbatches, d.compiled) == (2, 4, False)
    assert d.baseline_ms == 10.0 and dict(d.trials) == times
    assert d.notes == ("stages=auto chose 2x4 by timed trials on cuda:0: 8.00 ms per step, 1.25x the plain step "
                       "(10.00 ms)",)


def test_trials_fall_back_to_the_plain_step_when_nothing_beats_it_by_the_margin():
    cands = trial_candidates([1.0] * 4, [1, 2, 4], batch=64)
    times = {c.label: 10.0 for c in cands} | {"2x4": 10.0 * (1 - MIN_TRIAL_GAIN) + 0.01}
    d = choose_by_trials(cands, fake_clock(times), baseline=lambda: 10.0)
    assert (d.counts, d.microbatches, d.compiled) == ((4,), 1, False)
    assert "no plan beat the plain step (10.00 ms) by 2%" in d.notes[0] and "the plain step itself" in d.notes[0]
    # Just past the margin: the pipeline is chosen.
    times["2x4"] = 10.0 * (1 - MIN_TRIAL_GAIN) - 0.01
    assert choose_by_trials(cands, fake_clock(times), baseline=lambda: 10.0).microbatches == 4


def test_given_microbatches_keep_the_fastest_plan_and_say_why():
    cands = trial_candidates([1.0] * 4, [4], batch=64)
    d = choose_by_trials(cands, fake_clock({"1x4": 12.0, "2x4": 11.0, "3x4": 13.0, "4x4": 14.0}),
                         baseline=lambda: 10.0)
    assert (len(d.counts), d.microbatches) == (2, 4)
    assert "because the microbatches were given" in d.notes[0] and "microbatches='auto'" in d.notes[0]


def test_compiled_finalists_are_the_fastest_few_uncompiled_plans():
    seen = []
    cands = trial_candidates([1.0] * 4, [1, 2], batch=8)
    times = {"1x1": 10.0, "1x2": 9.5, "2x2": 9.0, "2x2 compiled": 7.0, "1x2 compiled": 8.0}
    d = choose_by_trials(cands, fake_clock(times, seen), baseline=lambda: 10.0, compile=True)
    assert [c.label for c in seen[len(cands):]] == ["2x2 compiled", "1x2 compiled"]
    assert (len(d.counts), d.microbatches, d.compiled) == (2, 2, True)
    # Nothing compiled beats the (compiled) plain step: the fallback is the plain step compiled, as asked.
    slow = defaultdict(lambda: 20.0)
    d = choose_by_trials(cands, fake_clock(slow), baseline=lambda: 10.0, compile=True)
    assert (d.counts, d.microbatches, d.compiled) == ((4,), 1, True)


def test_concurrent_finalists_are_timed_with_the_side_stream_pieces():
    seen = []
    cands = trial_candidates([1.0] * 4, [1, 2], batch=8)
    times = {"1x1": 9.0, "1x2": 9.5, "2x2": 10.0, "1x1 concurrent": 8.0, "1x2 concurrent": 9.9}
    d = choose_by_trials(cands, fake_clock(times, seen), baseline=lambda: 10.0, concurrent=True)
    assert [c.label for c in seen[len(cands):]] == ["1x1 concurrent", "1x2 concurrent"]
    assert (d.counts, d.microbatches, d.concurrent, d.chosen) == ((4,), 1, True, "1x1 concurrent")
    d = choose_by_trials(cands, fake_clock(times | {"1x1 concurrent": 9.9}), baseline=lambda: 10.0, concurrent=True)
    assert (d.counts, d.microbatches, d.concurrent, d.chosen) == ((4,), 1, False, "1x1")  # the plain step


def test_a_chosen_plan_is_never_slower_than_the_measured_plain_step():
    cands = trial_candidates([1.0, 2.0, 3.0, 1.0, 2.0], [1, 2, 4, 8], batch=32)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        times = {c.label: float(5 + 10 * torch.rand((), generator=gen)) for c in cands}
        bar = float(5 + 10 * torch.rand((), generator=gen))
        d = choose_by_trials(cands, fake_clock(times), baseline=lambda b=bar: b)
        label = f"{len(d.counts)}x{d.microbatches}"
        assert label == "1x1" or times[label] <= bar * (1 - MIN_TRIAL_GAIN)
        assert times[label] == min(times.values()) or label == "1x1"


def test_without_a_baseline_the_fastest_candidate_wins():
    cands = trial_candidates([1.0] * 4, [2], batch=8)
    d = choose_by_trials(cands, fake_clock({"1x2": 3.0, "2x2": 2.0}))
    assert len(d.counts) == 2 and d.baseline_ms is None and "2.00 ms per step" in d.notes[0]


def test_trial_candidates_and_untimed_microbatches_check_the_batch():
    assert [c.label for c in trial_candidates([1.0] * 2, [1, 4, 64], batch=4)] == ["1x1", "1x4", "2x4"]
    with pytest.raises(ValueError, match=r"no microbatch count in \[8\] fits a batch of 4"):
        trial_candidates([1.0] * 2, [8], batch=4)
    with pytest.raises(ValueError, match="no candidate plan"):
        choose_by_trials([], fake_clock({}))
    assert untimed_microbatches(1, 128) == 1 and untimed_microbatches(3, 128) == AUTO_MICROBATCHES[-1]
    assert untimed_microbatches(2, 3) == 2
    assert trials_apply("auto", [torch.device("cuda", 0)]) and not trials_apply("auto", [CPU])
    assert not trials_apply(2, [torch.device("cuda", 0)]) and not trials_apply("auto", [torch.device("cuda", 0)], 2)


def test_auto_over_separate_devices_prefers_a_pipeline():
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    counts, _ = resolve_counts(profiles([1.0] * 8), "auto", devs, 8, "1f1b")
    assert len(counts) >= 2


def test_serial_device_simulation_is_the_sum_of_the_work():
    profs = profiles([3.0] * 4)
    sim = simulate_plan(profs, [2, 2], [CPU], 4, "gpipe")
    assert sim.makespan == pytest.approx(4 * 12.0 + 2 * 2 * 4 * 0.05)


def test_build_plan_fills_stage_rows():
    profs = profiles([1.0, 2.0, 3.0])
    p = build_plan(profs, [2, 1], [CPU], microbatches=4, microbatch_size=8, schedule="1f1b",
                   batchnorm="batch", source="profile")
    assert [s.blocks for s in p.stages] == [("b0", "b1"), ("b2",)]
    assert p.stages[0].predicted_ms == pytest.approx(3.0) and p.stages[0].stream == "host"
    # 1F1B: stage 0 of 2 keeps 2 microbatches of saved activations, the last stage 1.
    assert p.stages[0].activation_mb == pytest.approx(2 * 2 * 4000 / 2**20)
    assert p.stages[1].activation_mb == pytest.approx(1 * 4000 / 2**20)


def test_pipeline_ranks_get_contiguous_stages_and_overlap():
    assert stage_places(4, [CPU], ranks=2) == [(0, CPU), (0, CPU), (1, CPU), (1, CPU)]
    profs = profiles([1, 1, 1, 1])
    assert resolve_counts(profs, "auto", [CPU], 4, "1f1b", ranks=2)[0] == [2, 2]
    # Stages on different ranks run concurrently even on CPUs: the step is shorter than serial.
    serial = simulate_plan(profs, [2, 2], [CPU], 4, "1f1b").makespan
    assert simulate_plan(profs, [2, 2], [CPU], 4, "1f1b", ranks=2).makespan < serial
    plan = build_plan(profs, [2, 2], [CPU], microbatches=4, microbatch_size=2, schedule="1f1b",
                      batchnorm="microbatch", source="cost model", ranks=2, layout="2 ranks")
    assert [s.device for s in plan.stages] == ["pp0:cpu", "pp1:cpu"] and "layout: 2 ranks" in str(plan)
    for bad in (3, [1, 1, 2]):
        with pytest.raises(ValueError, match="multiple of 2"):
            resolve_counts(profs, bad, [CPU], 4, "1f1b", ranks=2)
