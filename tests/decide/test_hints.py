"""The hints after the search: another precision or accumulation, timed once and never applied."""

from pipedp.decide.hints import HINT_FACTOR
from pipedp.decide.search import Budget, search

from .clock_tables import TableClock
from .test_search import run, sampled, space


def test_the_precision_hint_needs_a_measured_factor_and_never_changes_the_plan():
    table = {"plain": 10.0, "plain channels_last": 8.0, "plain bf16 channels_last": 8.0 / 1.8}
    d, _ = run(space(hint="bf16"), table)
    assert d.hint.startswith("hint: bf16 autocast ran the plain step 1.80x faster here")
    assert d.config.precision is None and "precision='bf16'" in d.hint
    table["plain bf16 channels_last"] = 8.0 / (HINT_FACTOR - 0.05)
    assert run(space(hint="bf16"), table)[0].hint == ""
    assert run(space(), table | {"plain bf16 channels_last": 1.0})[0].hint == ""  # not asked: not timed


def test_a_model_kept_at_one_microbatch_hears_what_accumulation_would_give_and_keeps_its_math():
    table = {"plain": 10.0, "plain channels_last": 8.0, "1x4 channels_last": 4.0}
    d, clock = run(space(microbatches=(1,), accumulate=4), table)
    assert d.config.microbatches == 1 and d.chosen == "1x1 channels_last"
    assert d.hint.startswith("hint: accumulation over 4 microbatches ran the step 2.00x faster here")
    assert "microbatches='auto'" in d.hint and clock.seen.count("1x4 channels_last") == 1
    table["1x4 channels_last"] = 8.0 / (HINT_FACTOR - 0.05)
    assert run(space(microbatches=(1,), accumulate=4), table)[0].hint == ""
    d, clock = run(space(microbatches=(1,)), table | {"1x4 channels_last": 1.0})
    assert d.hint == "" and "1x4 channels_last" not in clock.seen  # not asked: not timed
    both = run(space(microbatches=(1,), accumulate=4, hint="bf16"),
               {"plain": 10.0, "plain channels_last": 8.0, "1x4 channels_last": 4.0, "plain bf16 channels_last": 4.0})
    assert [h.split(" ran")[0] for h in both[0].hint.splitlines()] == ["hint: bf16 autocast",
                                                                       "hint: accumulation over 4 microbatches"]


def test_the_hint_weighs_first_calls_against_first_calls_and_warm_steps_against_warm_steps():
    # MobileNetV2 fp32 on the AVX-512 EPYC: the bf16 step's first call (2223 ms) against the bar's first call
    # (2141 ms) read 0.96x, and no hint, where bf16 ran it twice as fast once warm. Against a warm bar the bf16
    # step gets a warm timing of its own; against a bar timed only by its first call, first calls are compared.
    sp = space(microbatches=(1, 2, 4, 8), hint="bf16")
    table = {"plain": 4000.0, "plain channels_last": [2141.0, 1780.0], "plain bf16 channels_last": [2223.0, 890.0],
             "1x8 channels_last": 1080.0, "1x4 channels_last": 900.0, "1x2 channels_last": 870.0}
    d = search(sp, sampled(table, default=5000.0, warm_counts="own"), Budget(1e9))
    assert d.hint.startswith("hint: bf16 autocast ran the plain step 2.00x faster here")
    # Steps of seconds (one timed step a trial) where no plan beats the bar: both first calls, 12 s over 7 s.
    slow_plans = {"plain": 13000.0, "plain channels_last": [12000.0, 11000.0],
                  "plain bf16 channels_last": [7000.0, 5000.0], "1x8": 20000.0, "1x8 channels_last": 16000.0}
    clock = sampled(slow_plans, warm_counts="own")
    d = search(space(microbatches=(1, 8), hint="bf16"), clock, Budget(100.0, clock.time))
    assert d.chosen == "1x1 channels_last" and d.hint.startswith("hint: bf16 autocast ran the plain step 1.71x")


def test_a_hint_trial_that_fails_leaves_no_hint_and_no_timing_behind():
    # A model that cannot run in the hinted precision: no hint, and the plan table is made without that trial.
    class Refusing(TableClock):
        def measure(self, config, steps):
            if config.precision is not None:
                raise RuntimeError("bf16 is not supported by this layer")
            return super().measure(config, steps)

    clock = Refusing({"plain": 10.0, "plain channels_last": 8.0}, default=50.0)
    d = search(space(hint="bf16"), clock, Budget(1e9, clock.time))
    assert d.hint == "" and "plain bf16 channels_last" in clock.seen
    assert all("bf16" not in label for label, _ in d.trials) and d.bar == "plain channels_last"
