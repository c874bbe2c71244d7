import random

import pytest

from pipedp.decide import Config
from pipedp.decide.search import MIN_TRIAL_GAIN, Budget, Space, allowed, search

from .clock_tables import FakeTime, TableClock


def space(blocks=4, stages=(1,), microbatches=(1, 2, 4), layouts=(False, True), compile=(False,), **kw):
    return Space(cut=lambda s: tuple([blocks // s] * (s - 1) + [blocks - (blocks // s) * (s - 1)]), blocks=blocks,
                 stages=stages, microbatches=microbatches, layouts=layouts, compile=compile, **kw)


def run(sp, table, budget_s=1e9, default=50.0, **kw):
    clock = TableClock(table, default=default, **kw)
    return search(sp, clock, Budget(budget_s, clock.time), where="cpu"), clock


def test_the_bar_is_the_strongest_alternative_not_plain_eager():
    table = {"plain": 10.0, "plain channels_last": 8.0, "1x2 channels_last": 7.9, "1x4 channels_last": 9.0}
    d, clock = run(space(), table)
    assert d.bar == "plain channels_last" and d.bar_ms == 8.0
    # 7.9 ms beats plain eager by 1.27x but the bar by less than the margin: the bar's own step is the plan.
    assert d.config == Config((4,), 1, channels_last=True) and not d.config.own
    assert "no plan beat the strongest alternative, plain channels_last (8.00 ms)" in d.notes[-1]
    # Plans are timed in the bar's layout only.
    assert clock.seen[:2] == ["plain", "plain channels_last"] and "1x2" not in clock.seen


def test_a_plan_that_beats_the_bar_by_the_margin_is_chosen():
    table = {"plain": 10.0, "plain channels_last": 8.0, "1x2 channels_last": 6.0, "1x4 channels_last": 7.0}
    d, _ = run(space(), table)
    assert d.config == Config((4,), 2, channels_last=True) and d.chosen == "1x2 channels_last"
    assert "1.33x the strongest alternative, plain channels_last (8.00 ms)" in d.notes[-1]
    assert dict(d.trials)["1x2 channels_last"] == 6.0


def test_drift_during_the_trials_favours_neither_side():
    # The bar is timed again at the end; the faster of its timings is the bar.
    table = {"plain": [10.0, 9.0], "1x2": 9.5, "1x4": 9.7}
    d, _ = run(space(layouts=(False,)), table)
    assert d.bar_ms == 9.0 and d.config == Config((4,), 1)


def test_the_bar_is_not_timed_again_where_no_plan_was_timed():
    # Steps of 20 s against a 30 s budget: the own steps spend it, so no plan is timed, and timing the bar
    # again (another whole step) could change nothing.
    table = {"plain": 20000.0, "plain channels_last": [15000.0, 1000.0]}  # a second timing would read 1000
    d, clock = run(space(), table, budget_s=30.0, default=10000.0)
    assert clock.seen == ["plain", "plain channels_last"] and d.config == Config((4,), 1, channels_last=True)
    assert clock.calls == {"plain channels_last": 1} and d.bar_ms == 15000.0
    assert any("the budget ran out before" in n for n in d.notes)


def test_a_chosen_plan_is_never_slower_than_the_bar_over_many_random_tables():
    rng = random.Random(0)
    labels = ["plain", "plain channels_last"] + [f"{s}x{m}{c}" for m in (2, 4, 8) for s in (1, 2, 3)
                                                 for c in ("", " channels_last")]
    for _ in range(300):
        table = {k: rng.uniform(5, 15) for k in labels}
        d, _ = run(space(stages=(1, 2, 3), microbatches=(1, 2, 4, 8)), table)
        bar = min(table["plain"], table["plain channels_last"])
        assert d.bar_ms == pytest.approx(bar)
        if d.config.plain:  # the user's own step, run by pipedp: the bar, or a layout within the margin of it
            own = table["plain channels_last" if d.config.channels_last else "plain"]
            assert own <= bar * (1 + MIN_TRIAL_GAIN)
            assert not d.config.channels_last or table["plain"] > bar * (1 + MIN_TRIAL_GAIN)  # NCHW is nearer
        else:
            assert table[d.chosen] <= bar * (1 - MIN_TRIAL_GAIN)


def test_more_microbatches_stop_once_they_stop_paying():
    table = {"plain": 10.0, "1x2": 9.0, "1x4": 9.8, "1x8": 1.0}
    d, clock = run(space(layouts=(False,), microbatches=(1, 2, 4, 8)), table)
    assert "1x8" not in clock.seen and d.chosen == "1x2"


def test_the_budget_is_respected_and_the_plan_says_what_it_skipped():
    # 0.5 s per step: 3 own steps, then every plan costs ~1.5 s more; a 6 s budget stops early.
    table = {"plain": 500.0, "plain channels_last": 400.0}
    d, clock = run(space(stages=(1, 2, 3, 4), microbatches=(1, 2, 4, 8)), table, budget_s=6.0, default=450.0)
    assert any("the budget ran out before" in n and "plan_budget_s=6" in n for n in d.notes)
    assert clock.time.t <= 6.0 + 1.5  # at most one trial past the budget (the bar's timing again)
    # With the budget sized for it every plan is tried.
    d, clock = run(space(stages=(1, 2, 3, 4), microbatches=(1, 2, 4, 8)), table, default=450.0)
    assert not any("budget" in n for n in d.notes) and "4x8 channels_last" in clock.seen


def test_a_slow_first_call_shortens_its_trial_instead_of_spending_the_budget():
    clock = TableClock({"plain": 10.0, "1x2": 5000.0}, time=FakeTime())
    search(space(layouts=(False,), microbatches=(1, 2)), clock, Budget(20.0, clock.time))
    assert clock.time.t < 20.0 + 5.0 + 1.0  # warm-up, one timed step, the final re-timing of the bar


def test_compile_auto_times_compiled_finalists_when_the_budget_covers_a_compile():
    table = {"plain": 10.0, "plain channels_last": 9.0, "1x2 channels_last": 8.0, "1x4 channels_last": 8.5,
             "plain channels_last compiled": 7.0, "1x2 channels_last compiled": 5.0,
             "1x4 channels_last compiled": 6.0}
    d, clock = run(space(compile=(False, True), compile_estimate_s=20.0), table, budget_s=100.0, compile_s=20.0)
    assert clock.seen[-3:] == ["plain channels_last compiled", "1x2 channels_last compiled",
                               "1x4 channels_last compiled"]
    assert d.bar == "plain channels_last compiled" and d.chosen == "1x2 channels_last compiled"
    assert d.config.compiled and d.config.channels_last
    # A compile estimated past the budget is not tried, and the plan says so.
    d, clock = run(space(compile=(False, True), compile_estimate_s=200.0), table, budget_s=100.0)
    assert not any("compiled" in s for s in clock.seen) and not d.config.compiled
    assert any("compile=auto: plain channels_last compiled not tried" in n for n in d.notes)


def test_compile_asked_for_compiles_everything_whatever_the_budget():
    d, clock = run(space(compile=(True,), layouts=(False,), compile_estimate_s=500.0),
                   {"plain compiled": 10.0, "1x2 compiled": 8.0}, budget_s=100.0, compile_s=60.0)
    assert all(s.endswith("compiled") for s in clock.seen) and d.chosen == "1x2 compiled"


def test_concurrent_finalists_are_timed_with_the_pieces():
    table = {"plain": 10.0, "1x2": 9.5, "2x2": 9.9, "1x1 concurrent": 8.0, "1x2 concurrent": 9.8}
    d, clock = run(space(stages=(1, 2), microbatches=(1, 2), layouts=(False,), concurrent=True), table)
    assert "1x1 concurrent" in clock.seen and "1x2 concurrent" in clock.seen
    assert d.chosen == "1x1 concurrent" and d.config.concurrent


def test_concurrent_finalists_keep_the_microbatch_counts_the_user_fixed():
    # microbatches=2 fixed: a one-microbatch finalist would train with other BatchNorm statistics than asked
    # (MobileNetV2, stages="auto", split_grads on the H100: parameters 1.96 away from plain 2-microbatch training).
    table = {"plain": 10.0, "1x2": 9.5, "2x2": 9.9, "1x1 concurrent": 1.0, "1x2 concurrent": 8.0}
    d, clock = run(space(stages=(1, 2), microbatches=(2,), layouts=(False,), concurrent=True), table)
    assert "1x1 concurrent" not in clock.seen and "1x2 concurrent" in clock.seen
    assert d.chosen == "1x2 concurrent" and d.config.microbatches == 2 and d.config.concurrent
    assert all(label.split()[0].endswith("x2") for label in clock.seen if not label.startswith("plain"))


def test_allowed_values_of_a_lever():
    assert allowed("auto") == (False, True) and allowed(True) == (True,) and allowed(False) == (False,)


def test_every_timing_is_reported_as_it_is_taken():
    heard = []
    clock = TableClock({"plain": 10.0, "1x2": 9.0})
    d = search(space(layouts=(False,), microbatches=(1, 2)), clock, Budget(1e9, clock.time),
               report=lambda c, ms: heard.append((c.label, ms)))
    assert heard[:2] == [("plain", 10.0), ("1x2", 9.0)]
    assert [label for label, _ in heard].count("plain") == 2  # timed again at the end, beside the best plan
    assert {label for label, _ in heard} == {label for label, _ in d.trials}


def test_a_sampled_plan_costs_its_share_so_the_budget_covers_more_plans():
    table = {"plain": 2000.0}
    sp = space(layouts=(False,), microbatches=(1, 2, 4))
    full = TableClock(table, default=1500.0)
    search(sp, full, Budget(10.0, full.time))
    sampled = TableClock(table, default=1500.0)
    sampled.shares = {"1x2": 0.5, "1x4": 0.25}
    search(sp, sampled, Budget(10.0, sampled.time))
    assert "1x2" not in full.seen and {"1x2", "1x4"} <= set(sampled.seen)


def test_a_first_call_that_is_a_step_counts_as_one_so_the_budget_covers_more_plans():
    table = {"plain": 2000.0, "plain channels_last": 1900.0}
    sp = space(microbatches=(1, 2, 4, 8))
    warmed = TableClock(table, default=1800.0)
    search(sp, warmed, Budget(12.0, warmed.time))
    counted = TableClock(table, default=1800.0, warm_counts=True)
    d = search(sp, counted, Budget(12.0, counted.time))
    assert len(counted.seen) > len(warmed.seen) and "1x4 channels_last" in counted.seen
    assert counted.time.t <= 12.0 + 2.0  # at most the final re-timing past the budget
    assert dict(d.trials)["plain channels_last"] == 1900.0  # the first call's ms is a timing of its own


def test_first_calls_that_count_still_give_the_bar_its_best_timing():
    # Drift: the bar's first call is slow, its later steps fast; the plan is judged against the later ones.
    table = {"plain": 10.0, "plain channels_last": [12.0, 8.0, 8.0], "1x2 channels_last": 7.95}
    d, _ = run(space(microbatches=(1, 2)), table, warm_counts=True)
    assert d.bar_ms == 8.0 and d.config == Config((4,), 1, channels_last=True)


def test_the_model_changes_layout_only_on_warm_windows_side_by_side_never_on_a_first_call():
    # The user's NCHW step is known by a slow first call (100 ms, warm 80); channels_last warm at 92 ms. Judged on
    # that first call the plan would convert the user's model to a layout that runs slower.
    table = {"plain": [100.0, 80.0], "plain channels_last": 92.0, "1x2": 150.0, "1x2 channels_last": 150.0}
    d, clock = run(space(microbatches=(1, 2)), table, budget_s=30.0, warm_counts="own")
    assert d.config == Config((4,), 1) and not d.config.channels_last and d.bar == "plain"
    assert clock.calls["plain"] >= 4  # its first call, then its windows beside the bar's
    # One lucky window of channels_last taken apart (70 ms) does not outweigh the windows side by side.
    table = {"plain": [100.0, 80.0], "plain channels_last": [92.0, 70.0, 92.0], "1x2": 150.0,
             "1x2 channels_last": 150.0}
    d, _ = run(space(microbatches=(1, 2)), table, budget_s=30.0, warm_counts="own")
    assert not d.config.channels_last and dict(d.trials)["plain channels_last"] == 92.0
    # Where channels_last is faster warm, side by side, the plan takes it.
    table = {"plain": [100.0, 95.0], "plain channels_last": 80.0, "1x2": 150.0, "1x2 channels_last": 150.0}
    d, _ = run(space(microbatches=(1, 2)), table, budget_s=30.0, warm_counts="own")
    assert d.config.channels_last and d.bar == "plain channels_last"
    # Within the margin of the bar, the tie goes to the user's layout.
    table = {"plain": [100.0, 81.0], "plain channels_last": 80.0, "1x2": 150.0, "1x2 channels_last": 150.0}
    d, _ = run(space(microbatches=(1, 2)), table, budget_s=30.0, warm_counts="own")
    assert not d.config.channels_last


def test_where_a_plan_wins_or_the_budget_is_short_the_own_steps_are_not_settled():
    # A plan beats the channels_last bar by far: the plain step cannot be the plan, so NCHW's first call stands.
    table = {"plain": [100.0, 80.0], "plain channels_last": 92.0, "1x2": 150.0, "1x2 channels_last": 40.0}
    d, clock = run(space(microbatches=(1, 2)), table, budget_s=30.0, warm_counts="own")
    assert d.chosen == "1x2 channels_last" and clock.calls["plain"] <= 2  # its first call, one warm timing at most
    # Where the windows and the final re-timing's room do not fit what is left, nothing is settled.
    table = {"plain": [100.0, 80.0], "plain channels_last": 92.0, "1x2": 150.0, "1x2 channels_last": 150.0}
    d, clock = run(space(microbatches=(1, 2)), table, budget_s=0.5, warm_counts="own")
    assert clock.calls["plain"] == 1 and clock.time.t <= 0.5 + 0.25  # the final re-timing at most past it


def test_a_runner_up_timed_once_and_close_to_the_fastest_plan_is_timed_again():
    # Steps of seconds and a 30 s budget: one timed step per trial. One noisy step had 1x4 slower than 1x2;
    # its second timing shows it is the faster plan.
    table = {"plain": 3000.0, "plain channels_last": 2800.0, "1x2 channels_last": [1900.0, 1880.0],
             "1x4 channels_last": [2200.0, 1650.0], "1x8 channels_last": 2400.0}
    d, clock = run(space(microbatches=(1, 2, 4, 8)), table, budget_s=30.0, warm_counts=True)
    assert clock.seen.count("1x4 channels_last") == 1 and clock.calls["1x4 channels_last"] >= 2
    assert d.chosen == "1x4 channels_last" and dict(d.trials)["1x4 channels_last"] == 1650.0
    # Far behind the fastest (more than RETIME_PLANS): not timed again.
    table["1x4 channels_last"] = [2600.0, 1650.0]
    d, clock = run(space(microbatches=(1, 2, 4, 8)), table, budget_s=30.0, warm_counts=True)
    assert clock.calls["1x4 channels_last"] == 1 and d.chosen == "1x2 channels_last"


def sampled(table, **kw):
    """A table clock whose one-stage plans are timed on one of their microbatches (a CPU's trials)."""
    clock = TableClock(table, **kw)
    clock.shares = {f"1x{m}{c}{k}": 1 / m for m in (2, 4, 8) for c in ("", " channels_last")
                    for k in ("", " tuned kernels")}
    return clock


def test_where_plans_are_sampled_the_own_step_follows_the_cheap_probes_and_the_walk_fits_what_is_left():
    # ResNet-50, batch 128, 2-core EPYC: own steps of 18 s (NCHW) and 14 s (channels_last) against a 30 s
    # budget. Own steps first spent it before any plan, and an own step timed last ran 1.6x the rate its room
    # was kept at (planning 34 s). The probes at 8 microbatches (an eighth of a step each) name the bar's
    # layout; the bar is timed next, and the walk fits what is then known to be left once room is kept to time
    # the bar again, warm (its first call is an upper bound, and plans beat it).
    table = {"plain": 18000.0, "plain channels_last": 14000.0, "1x8": 13000.0, "1x8 channels_last": 10600.0,
             "1x4 channels_last": 10200.0, "1x2 channels_last": 11000.0, "1x4": 14000.0}
    sp = space(microbatches=(1, 2, 4, 8))
    clock = sampled(table, default=1e5, warm_counts="own")
    d = search(sp, clock, Budget(30.0, clock.time))
    assert clock.seen == ["1x8", "1x8 channels_last", "plain channels_last"]
    assert d.chosen == "1x8 channels_last" and d.bar == "plain channels_last" and d.bar_ms == 14000.0
    assert any("ran out before 1x4 channels_last" in n for n in d.notes)
    assert any("plain not timed: the budget ran out" in n for n in d.notes)
    assert clock.time.t <= 30.0 + 14.0  # at most the bar's second timing past the budget
    # More budget reaches the plans; the bar's second timing still fits.
    for budget, walked in ((40.0, ["1x4 channels_last"]), (55.0, ["1x4 channels_last", "1x2 channels_last"])):
        clock = sampled(table, default=1e5, warm_counts="own")
        d = search(sp, clock, Budget(budget, clock.time))
        assert clock.seen[3:] == walked and d.chosen == "1x4 channels_last" and clock.time.t <= budget
    # Timed whole (no sampling), the same table spends the budget on the own steps and keeps the plain step.
    whole = TableClock(table, warm_counts="own")
    assert search(sp, whole, Budget(30.0, whole.time)).chosen == "1x1 channels_last"


def test_where_plans_are_sampled_room_to_time_the_bar_again_is_kept_while_it_is_cold_or_a_plan_is_close():
    # The bar's first call is an upper bound (a first touch of its memory): where a probe already beats it by more
    # than RETIME_WITHIN its warm step is timed at once, and the walk is judged against that; closer, room is
    # kept for the final side-by-side timing of the bar and the fastest plan, a whole step, so the walk is shorter.
    far = {"plain channels_last": 10000.0, "plain": 12000.0, "1x8 channels_last": 9700.0,
           "1x4 channels_last": 9600.0, "1x2 channels_last": 9500.0, "1x8": 11000.0, "1x4": 11500.0}
    near = far | {"1x8 channels_last": 8000.0, "1x4 channels_last": 7900.0, "1x2 channels_last": 7800.0}
    sp = space(microbatches=(1, 2, 4, 8))
    seen = {}
    for name, table in (("far", far), ("near", near)):
        clock, heard = sampled(table, warm_counts="own"), []
        d = search(sp, clock, Budget(30.0, clock.time), report=lambda c, ms: heard.append(c.label))
        assert clock.time.t <= 30.0
        seen[name] = (heard, d.chosen)
    bar2 = ["plain channels_last"] * 2
    # Far: no room for a walk; the close runner-up and then the close pair are timed again at the end.
    assert seen["far"] == (["1x8", "1x8 channels_last", "plain channels_last", "1x8", "plain channels_last",
                            "1x8 channels_last"], "1x8 channels_last")
    # Near: the bar's warm step at once, then the walk, and the close runner-up once more.
    assert seen["near"] == (["1x8", "1x8 channels_last"] + bar2 + ["1x4 channels_last", "1x8 channels_last"],
                            "1x4 channels_last")


def test_a_plan_that_beats_only_the_first_call_of_the_bar_loses_to_its_warm_step():
    # ResNet-50, bf16, batch 128, the AVX-512 EPYC (run k): the plain channels_last step's first call took
    # 6052 ms, its later steps 3870; 1x8 channels_last (4107 ms) was chosen against the first call, and ran
    # 0.93x of the plain step. Timed warm, the bar keeps the plain step.
    table = {"1x8": 4884.0, "1x8 channels_last": 4107.0, "plain channels_last": [6052.0, 3870.0, 3870.0],
             "1x4 channels_last": 4119.0, "1x2 channels_last": 4332.0, "1x4": 4343.0, "1x2": 4306.0,
             "plain": [7000.0, 4700.0]}
    clock = sampled(table, warm_counts="own")
    d = search(space(microbatches=(1, 2, 4, 8)), clock, Budget(30.0, clock.time))
    assert d.chosen == "1x1 channels_last" and d.bar_ms == 3870.0 and clock.time.t <= 30.0 + 3.9
    # A bar that wins against its first call is not timed again: it can only be faster.
    clock = sampled(table | {"plain channels_last": [3500.0, 3000.0]}, warm_counts="own")
    d = search(space(microbatches=(1, 2, 4, 8)), clock, Budget(30.0, clock.time))
    assert d.chosen == "1x1 channels_last" and clock.calls["plain channels_last"] == 1


def test_sampled_plans_walk_both_layouts_and_stop_where_fewer_microbatches_stop_paying():
    # Channels_last is faster at 8 microbatches, NCHW at 4 (ResNet-50 on the 2-core EPYC had NCHW faster at 16
    # samples a microbatch, channels_last on the whole batch): with the budget for it both layouts are walked.
    table = {"plain": 10.0, "plain channels_last": 9.0, "1x8": 9.0, "1x8 channels_last": 8.0,
             "1x4 channels_last": 7.0, "1x2 channels_last": 7.5, "1x4": 6.0, "1x2": 6.5}
    clock, heard = sampled(table), []
    d = search(space(microbatches=(1, 2, 4, 8)), clock, Budget(1e9, clock.time),
               report=lambda c, ms: heard.append(c.label))
    plans = [label for label in clock.seen if not label.startswith("plain")]
    assert plans == ["1x8", "1x8 channels_last", "1x4 channels_last", "1x2 channels_last", "1x4", "1x2"]
    assert d.chosen == "1x4"
    # The bar's own step follows the probes, in the faster probe's layout; the other own step comes last.
    assert clock.seen[2] == "plain channels_last" and clock.seen[-1] == "plain" and d.bar == "plain channels_last"
    assert heard.count("plain") == 1 and heard.count("plain channels_last") == 1
    # 4 microbatches slower than 8 by more than the slack: fewer (larger) ones are not timed, however fast.
    clock = sampled(table | {"1x4 channels_last": 9.0, "1x2 channels_last": 1.0, "1x4": 9.9})
    d = search(space(microbatches=(1, 2, 4, 8)), clock, Budget(1e9, clock.time))
    assert "1x2 channels_last" not in clock.seen and "1x2" not in clock.seen and d.chosen == "1x8 channels_last"


def test_sampled_search_finds_the_fastest_configuration_where_time_falls_then_rises_with_microbatches():
    # Each layout's time falls then rises with the microbatch count (its own best count and slope): walking
    # from the most microbatches down finds the optimum over every configuration (within the tie rule's
    # margin), own steps included, or
    # keeps the own step where no plan beats it by the margin.
    rng = random.Random(1)
    counts = (1, 2, 4, 8)
    for _ in range(300):
        table = {}
        for cl in ("", " channels_last"):
            best_m, slope, scale = rng.choice(counts), rng.uniform(0.06, 0.4), rng.uniform(6.0, 10.0)
            for m in counts:
                ms = scale * (1 + slope * abs(counts.index(m) - counts.index(best_m)))
                table[("plain" if m == 1 else f"1x{m}") + cl] = ms
        clock = sampled(table)
        d = search(space(microbatches=counts), clock, Budget(1e9, clock.time))
        fastest = min(table.values())
        if d.config.plain:
            assert d.bar_ms <= fastest / (1 - MIN_TRIAL_GAIN) + 1e-9
        else:  # the fastest, or one nearer the user's step within the noise of it (the tie rule)
            assert table[d.chosen] <= fastest * (1 + MIN_TRIAL_GAIN) + 1e-9


def test_a_plan_close_to_the_bar_is_timed_again_beside_it_so_two_timings_meet_two():
    # ResNet-18, batch 64, 2-core EPYC: single steps spread 15%; the plan's faster of two timings beat the bar's
    # one by 3% and it was chosen, then ran 0.79x of the plain channels_last step. Both now get a second timing.
    table = {"1x8": 2751.0, "1x8 channels_last": 2911.0, "1x4 channels_last": [2100.0, 2067.0],
             "1x2 channels_last": 2193.0, "1x4": 2404.0, "1x2": 2323.0, "plain channels_last": [2130.0, 1800.0],
             "plain": 2612.0}
    clock, heard = sampled(table), []
    d = search(space(microbatches=(1, 2, 4, 8)), clock, Budget(1e9, clock.time),
               report=lambda c, ms: heard.append(c.label))
    assert heard.count("plain channels_last") == 2 and heard.count("1x4 channels_last") == 2
    assert d.config == Config((4,), 1, channels_last=True) and d.bar_ms == 1800.0


def test_a_bar_known_only_by_its_first_call_is_timed_warm_before_a_plan_wins_against_it():
    # The early second timing of the bar does not fit (14 s steps, 30 s budget), so the walk keeps room for it
    # and it is timed at the end: warm, the plain step beats the plan its first call lost to.
    table = {"plain": 18000.0, "plain channels_last": [14000.0, 9000.0], "1x8": 13000.0, "1x8 channels_last": 10600.0}
    sp = space(microbatches=(1, 2, 4, 8))
    clock = sampled(table, default=1e5, warm_counts="own")
    d = search(sp, clock, Budget(30.0, clock.time))
    assert clock.seen == ["1x8", "1x8 channels_last", "plain channels_last"]
    assert d.chosen == "1x1 channels_last" and d.bar_ms == 9000.0 and clock.calls["plain channels_last"] == 2
    # Both own steps known by first calls: each is timed warm while the plan would win, and the other layout's
    # warm step becomes the bar.
    table = {"1x8": 4000.0, "1x8 channels_last": 3500.0, "plain channels_last": [4500.0, 3870.0],
             "plain": [5000.0, 3000.0]}
    clock = sampled(table, warm_counts="own")
    d = search(space(microbatches=(1, 8)), clock, Budget(30.0, clock.time))
    assert d.chosen == "1x1" and d.bar == "plain" and d.bar_ms == 3000.0
    # Where the user fixed the microbatches the plain step is no choice: its first call is not timed again.
    clock = sampled(table, warm_counts="own")
    d = search(space(microbatches=(8,)), clock, Budget(30.0, clock.time))
    assert d.chosen == "1x8 channels_last" and clock.calls["plain channels_last"] == 1


def test_where_plans_are_sampled_a_close_runner_up_is_timed_again_before_the_other_layouts_walk():
    # ResNet-50, batch 128, the AVX-512 EPYC (run j): one sampled timing each put 1x8 CL 3% ahead of 1x4 CL, and
    # the second timing waited for room to time the bar again (1.5 steps) that was never needed: the plans beat
    # the bar by 60%. The plan ran 0.91x of accum4 (1x4's computation). A table shaped like run j's trials: a
    # second timing of a runner-up costs a quarter step and keeps no room for the bar once plans beat it by 10%.
    table = {"1x8": 7930.0, "1x8 channels_last": 6656.0, "plain channels_last": [10786.0, 8405.0],
             "1x4 channels_last": [6837.0, 6300.0], "1x2 channels_last": 7185.0, "1x4": 8500.0, "plain": 12000.0}
    clock = sampled(table, warm_counts="own")
    d = search(space(microbatches=(1, 2, 4, 8)), clock, Budget(30.0, clock.time))
    assert clock.calls["1x4 channels_last"] == 2 and d.chosen == "1x4 channels_last"
    assert clock.time.t <= 30.0


@pytest.mark.parametrize("kernels", [(False,), (False, True)])
def test_where_plans_are_sampled_the_budget_is_overrun_by_at_most_the_mandatory_trials_over_random_tables(kernels):
    # The probes and the bar's own step are always timed, and a close plan and the bar always get their second
    # timing; everything else fits in what the budget has left (the kernel trials too). Over random tables
    # (steps of 5-21 s, budgets of 15-60 s: a 2-core CPU's ResNet-50) planning ends within the budget plus about
    # one own step.
    rng, krng = random.Random(3), random.Random(4)  # the same tables with and without kernel trials
    for _ in range(300):
        table = {}
        for cl in ("", " channels_last"):
            base = rng.uniform(5000.0, 15000.0)
            for m in (1, 2, 4, 8):
                table[("plain" if m == 1 else f"1x{m}") + cl] = base * rng.uniform(0.6, 1.4)
                table[f"1x{m}{cl} tuned kernels"] = base * krng.uniform(0.6, 1.4)
        budget = rng.uniform(15.0, 60.0)
        clock = sampled(table, warm_counts="own")
        search(space(microbatches=(1, 2, 4, 8), kernels=kernels), clock, Budget(budget, clock.time))
        own_s = max(table["plain"], table["plain channels_last"]) / 1e3
        assert clock.time.t <= budget + 1.25 * own_s


# -- tuned depthwise kernels: a lever timed on the fastest plan, kept only where the step is faster ---------------


@pytest.mark.parametrize("tuned_ms, chosen", [(5.0, "1x2 channels_last tuned kernels"), (6.5, "1x2 channels_last")])
def test_tuned_kernels_are_kept_only_where_the_plan_runs_faster_with_them(tuned_ms, chosen):
    table = {"plain": 10.0, "plain channels_last": 8.0, "1x2 channels_last": 6.0, "1x4 channels_last": 7.0,
             "1x2 channels_last tuned kernels": tuned_ms}
    d, clock = run(space(kernels=(False, True)), table)
    assert d.chosen == chosen and d.config.kernels == ("tuned" in chosen)
    # The plans are walked on torch's kernels, the two fastest are timed on the tuned ones; the user's own steps
    # (the bar) always run torch's, and the plain step on the kernels is not tried where a plan beats the bar.
    assert [s for s in clock.seen if "tuned" in s] == ["1x2 channels_last tuned kernels",
                                                        "1x4 channels_last tuned kernels"]
    assert d.bar == "plain channels_last"
    assert any(n.startswith("kernels=auto: 1x2 channels_last ran") for n in d.notes)


def test_where_no_plan_beats_the_bar_the_plain_step_is_tried_on_the_kernels():
    table = {"plain": 10.0, "plain channels_last": 8.0, "1x2 channels_last": 7.9, "1x4 channels_last": 9.0,
             "1x2 channels_last tuned kernels": 8.2, "1x1 channels_last tuned kernels": 7.0}
    d, clock = run(space(kernels=(False, True)), table)
    assert d.config == Config((4,), 1, channels_last=True, kernels=True) and d.bar_ms == 8.0
    assert "1x1 channels_last tuned kernels" in clock.seen


def test_without_tuned_kernels_no_kernel_trial_is_run():
    d, clock = run(space(), {"plain": 10.0, "1x2": 6.0})
    assert not any("tuned" in s for s in clock.seen) and not d.config.kernels


@pytest.mark.parametrize("plain_ms, chosen", [(50.0, "1x2 channels_last tuned kernels"),
                                               (7.0, "1x1 channels_last tuned kernels")])
def test_kernels_tvm_runs_every_plan_on_the_kernels_and_keeps_the_fastest_timed(plain_ms, chosen):
    # No plan beats the bar (torch's kernels): the plan is still on the kernels, the fastest of those timed,
    # the plain step on them included.
    table = {"plain": 10.0, "plain channels_last": 8.0, "1x2 channels_last tuned kernels": 7.9,
             "1x1 channels_last tuned kernels": plain_ms}
    d, clock = run(space(kernels=(True,)), table)
    plans = [s for s in clock.seen if not s.startswith("plain")]
    assert plans and all(s.endswith("tuned kernels") for s in plans) and "1x1 channels_last tuned kernels" in plans
    assert d.chosen == chosen and d.config.kernels and d.bar == "plain channels_last"
    # Where none beats the bar by the margin, the note says why a slower plan is kept.
    assert ("kernels='tvm' runs every plan on the tuned kernels" in d.notes[-1]) == (plain_ms == 50.0)


def test_the_plain_step_on_the_kernels_is_judged_against_the_warm_bar():
    # The bar's first call (1000 ms) is an upper bound that 1x8 beats by 5% (too little to time the bar again
    # at once); warm, the bar (800) beats every plan, so the plain step is tried on the kernels, and wins.
    table = {"plain": 1500.0, "plain channels_last": [1000.0, 800.0], "1x8 channels_last": 950.0,
             "1x8": 1400.0, "1x1 channels_last tuned kernels": 700.0}
    clock = sampled(table, default=1000.0, warm_counts="own")
    d = search(space(microbatches=(1, 2, 4, 8), kernels=(False, True)), clock, Budget(1e9, clock.time))
    assert d.bar_ms == 800.0 and d.chosen == "1x1 channels_last tuned kernels"


def test_a_sampled_walk_times_the_two_fastest_plans_on_the_kernels_too():
    # Kernels tuned at the size of 4 microbatches: slower at 8, where torch was fastest.
    table = {"plain": 1000.0, "plain channels_last": 800.0, "1x8 channels_last": 500.0, "1x4 channels_last": 520.0,
             "1x8": 900.0, "1x8 channels_last tuned kernels": 560.0, "1x4 channels_last tuned kernels": 470.0}
    clock = sampled(table, default=1000.0, warm_counts="own")
    d = search(space(microbatches=(1, 2, 4, 8), kernels=(False, True)), clock, Budget(1e9, clock.time))
    assert d.chosen == "1x4 channels_last tuned kernels" and d.config.kernels


class KernelsFail(TableClock):
    """A table clock whose trials on the tuned kernels raise ``RuntimeError(message)``."""

    def __init__(self, table, message):
        super().__init__(table)
        self.message = message

    def warm(self, config):
        if config.kernels:
            raise RuntimeError(self.message)
        return super().warm(config)


def test_a_kernel_trial_that_fails_leaves_torchs_kernels_and_says_why():
    clock = KernelsFail({"plain": 10.0, "1x2": 6.0, "1x4": 7.0}, "kernel library could not run")
    d = search(space(layouts=(False,), kernels=(False, True)), clock, Budget(1e9, clock.time))
    assert d.chosen == "1x2" and not d.config.kernels
    assert any("1x2 tuned kernels failed (RuntimeError: kernel library could not run)" in n for n in d.notes)


def test_kernels_tvm_times_the_plain_step_on_the_kernels_even_where_a_plan_beats_the_bar():
    table = {"plain": 10.0, "1x2 tuned kernels": 6.0, "1x1 tuned kernels": 5.0}
    d, clock = run(space(layouts=(False,), kernels=(True,)), table)
    assert d.chosen == "1x1 tuned kernels" and d.config == Config((4,), 1, kernels=True)


def test_kernels_tvm_with_a_compiled_bar_keeps_the_plain_step_where_no_plan_beats_it():
    # The plain step is not tried on the kernels (it would be a second compile): where no plan beats the bar,
    # the plan is that step on the kernels, not the fastest of slower plans.
    table = {"plain compiled": 8.0, "1x2 compiled tuned kernels": 7.9, "1x4 compiled tuned kernels": 30.0}
    d, clock = run(space(layouts=(False,), compile=(True,), kernels=(True,)), table)
    assert "1x1 compiled tuned kernels" not in clock.seen
    assert d.config == Config((4,), 1, compiled=True, kernels=True)
    assert "the plan is that step itself" in d.notes[-1]


def test_a_cuda_error_in_a_kernel_trial_stops_the_planning():
    clock = KernelsFail({"plain": 10.0, "1x2": 6.0, "1x4": 7.0}, "CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        search(space(layouts=(False,), kernels=(False, True)), clock, Budget(1e9, clock.time))
