"""schedule="auto": the fastest simulated schedule over pipeline ranks, with the cut it gets; 1F1B elsewhere."""

import pytest
import torch

from pipedp.decide.cut import simulate_plan
from pipedp.decide.schedules import candidates, choose_schedule, fixed, layout_schedules
from pipedp.partition import BlockProfile

CPU = torch.device("cpu")


def _blocks(n, output_bytes=1000):
    return [BlockProfile(f"b{i}", 1 / 3, 2 / 3, output_bytes, 4000, 100) for i in range(n)]


def test_where_nothing_is_weighed_auto_runs_1f1b_and_a_named_schedule_itself():
    assert fixed("auto") == "1f1b" and fixed("zb-h1") == "zb-h1"
    assert candidates(1) == ("1f1b",) and set(candidates(2)) == {"1f1b", "zb-h1", "interleaved"}
    assert layout_schedules("auto") == ("1f1b", "zb-h1", "interleaved") and layout_schedules("gpipe") == ("gpipe",)


def test_over_ranks_auto_takes_the_fastest_simulated_step_and_says_what_it_weighed():
    name, counts, notes = choose_schedule(_blocks(16), "auto", [CPU], 4, 2)
    best = simulate_plan(_blocks(16), counts, [CPU], 4, name, 2).makespan
    assert best < simulate_plan(_blocks(16), [8, 8], [CPU], 4, "1f1b", 2).makespan
    assert notes[-1].startswith(f"schedule=auto: {name}, the fastest simulated step (1f1b ")
    assert "zb-h1" in notes[-1] and "interleaved" in notes[-1]


def test_a_schedule_that_cannot_run_the_layout_is_left_out_and_a_bad_spec_raises_1f1bs_error():
    name, _, notes = choose_schedule(_blocks(16), "auto", [CPU], 3, 2)  # 3 microbatches do not go round 2 ranks
    assert name != "interleaved" and "interleaved" not in notes[-1]
    with pytest.raises(ValueError, match="multiple of 2"):
        choose_schedule(_blocks(16), 3, [CPU], 4, 2)


def test_in_one_process_auto_is_1f1b_without_a_note():
    name, counts, notes = choose_schedule(_blocks(8), 2, [CPU], 4, 1)
    assert name == "1f1b" and len(counts) == 2 and not any("schedule=auto" in n for n in notes)
