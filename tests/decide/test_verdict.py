"""The verdict on the timed trials: a plan only where it beats the bar by the margin, ties to the user's step."""

from pipedp.decide import Config

from .test_search import run, space


def test_a_tie_within_the_noise_goes_to_the_configuration_nearest_the_users_step():
    # channels_last 1% faster than the user's NCHW step: within the noise, so the plan keeps the user's layout
    # (the bar stays the faster one, and the note says why); the same choice on every run.
    d, _ = run(space(microbatches=(1, 2)), {"plain": 10.0, "plain channels_last": 9.9, "1x2 channels_last": 9.8})
    assert d.bar == "plain channels_last" and d.config == Config((4,), 1)
    assert "the plan is your step as plain (10.00 ms), within 2% of it and nearer your own" in d.notes[-1]
    # Plans that beat the bar and lie within the noise of each other: the fewest microbatches.
    d, _ = run(space(layouts=(False,), microbatches=(1, 2, 4)), {"plain": 10.0, "1x2": 8.0, "1x4": 7.9})
    assert d.chosen == "1x2"


def test_given_microbatches_keep_the_fastest_plan_with_them_and_say_why():
    table = {"plain": 10.0, "1x4": 12.0, "2x4": 11.0, "3x4": 13.0}
    d, _ = run(space(stages=(1, 2, 3), microbatches=(4,), layouts=(False,)), table)
    assert d.chosen == "2x4" and "kept the fastest with the given microbatches" in d.notes[-1]
