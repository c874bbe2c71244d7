import pytest
import torch

from pipedp.partition import BlockProfile
from pipedp.decide import Config, Decision
from pipedp.decide.cut import (
    AUTO_MICROBATCHES, build_plan, resolve_counts, simulate_plan, stage_devices, stage_places, untimed_microbatches,
)
from pipedp.decide.levers import settle
from pipedp.options import PipelineOptions, TrainingOptions

CPU = torch.device("cpu")


def profiles(costs):
    return [BlockProfile(f"b{i}", c / 3, 2 * c / 3, 1000, 4000, 100) for i, c in enumerate(costs)]



def _settled(config, ranks=1, schedule="1f1b", source="profile", batchnorm="microbatch"):
    """A decision of ``config`` settled on the CPU over ``ranks`` pipeline ranks, as the build settles it."""
    return settle(Decision(config, schedule=schedule, source=source), PipelineOptions(batchnorm=batchnorm),
                  TrainingOptions(), None, [CPU], ranks)

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


def test_untimed_microbatches_follow_the_stage_count():
    assert untimed_microbatches(1, 128) == 1 and untimed_microbatches(3, 128) == AUTO_MICROBATCHES[-1]
    # at least two samples per microbatch (microbatch.count)
    assert untimed_microbatches(2, 3) == 1 and untimed_microbatches(2, 4) == 2 and untimed_microbatches(2, 16) == 8


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
    p = build_plan(profs, _settled(Config((2, 1), 4), batchnorm="batch"), microbatch_size=8)
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
    plan = build_plan(profs, _settled(Config((2, 2), 4), ranks=2, source="cost model"), microbatch_size=2,
                      layout="2 ranks")
    assert [s.device for s in plan.stages] == ["pp0:cpu", "pp1:cpu"] and "layout: 2 ranks" in str(plan)
    for bad in (3, [1, 1, 2]):
        with pytest.raises(ValueError, match="multiple of 2"):
            resolve_counts(profs, bad, [CPU], 4, "1f1b", ranks=2)


def test_an_interleaved_pipeline_places_stage_s_on_rank_s_mod_pp():
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert stage_places(4, [CPU], 2, "interleaved") == [(0, CPU), (1, CPU), (0, CPU), (1, CPU)]
    assert stage_places(8, devs, 2, "interleaved") == [(s % 2, devs[s // 4]) for s in range(8)]
    plan = build_plan(profiles([1] * 4), _settled(Config((1, 1, 1, 1), 2), ranks=2, schedule="interleaved",
                                                  source="cost model"), microbatch_size=2)
    assert [s.device for s in plan.stages] == ["pp0:cpu", "pp1:cpu", "pp0:cpu", "pp1:cpu"]


def test_auto_stages_of_an_interleaved_pipeline_weigh_the_shorter_fill_against_the_messages():
    counts, notes = resolve_counts(profiles([1.0] * 16), "auto", [CPU], 4, "interleaved", ranks=2)
    assert len(counts) in (4, 6, 8) and sum(counts) == 16 and "stage(s) per pipeline rank" in notes[0]
    four = simulate_plan(profiles([1.0] * 16), counts, [CPU], 4, "interleaved", ranks=2).makespan
    assert four < simulate_plan(profiles([1.0] * 16), [8, 8], [CPU], 4, "1f1b", ranks=2).makespan
    # An activation that takes a second to cross: one stage per rank, the fewest crossings.
    heavy = [BlockProfile(f"b{i}", 1 / 3, 2 / 3, 10**10, 4000, 100) for i in range(16)]
    assert len(resolve_counts(heavy, "auto", [CPU], 4, "interleaved", ranks=2)[0]) == 2
