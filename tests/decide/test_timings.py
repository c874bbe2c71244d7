"""The record of the search's trials: timings, first calls as upper bounds, what a trial costs."""

import pytest

from pipedp.decide import Config
from pipedp.decide.search import Budget
from pipedp.decide.timings import MAX_STEPS, MIN_STEPS, Timings, bar_of, steps_for

from .clock_tables import TableClock

PLAIN = Config((4,), 1, own=True)


def test_a_first_call_that_counts_as_a_step_is_an_upper_bound_until_timed_warm():
    clock = TableClock({"plain": [12.0, 8.0]}, warm_counts=True)
    trials = Timings(clock, Budget(1e9, clock.time))
    assert trials.time(PLAIN, 1) == 12.0 and PLAIN in trials.cold and clock.calls == {"plain": 1}
    assert trials.time(PLAIN) == 8.0 and PLAIN not in trials.cold
    assert trials.best(PLAIN) == 8.0 and bar_of(trials) == PLAIN and trials.order == [PLAIN]


def test_a_trial_that_raises_leaves_no_timing_behind():
    class Refusing(TableClock):
        def measure(self, config, steps):
            raise RuntimeError("cannot run")

    clock = Refusing({"plain": 10.0})
    trials = Timings(clock, Budget(1e9, clock.time))
    with pytest.raises(RuntimeError):
        trials.time(PLAIN)
    assert trials.order == [] and not trials.extra_s and not trials.cold


def test_trials_are_sized_to_fit_the_budget_within_the_bounds():
    assert steps_for(0.0, 0.0, 10, Budget(1.0)) == MAX_STEPS  # nothing timed yet: the most
    assert steps_for(1000.0, 0.0, 10, Budget(1.0)) == MIN_STEPS  # steps of a second against a second
    assert steps_for(1.0, 0.0, 1, Budget(1e9)) == MAX_STEPS
