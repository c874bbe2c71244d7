"""Ranks as the resource: a torchrun launch per configuration reports the slowest rank's median step time."""

import math

import pytest

from pipedp.advisor.ranks import TorchrunStepTimer
from pipedp.advisor.space import Config

TINY = TorchrunStepTimer(width=4, image_size=8, steps=2, warmup=1)


def test_one_rank_is_timed_through_torchrun():
    t = TINY(Config(1, 8, 2))
    assert math.isfinite(t) and t > 0


@pytest.mark.slow
def test_two_ranks_each_take_half_the_global_batch():
    t = TINY(Config(2, 8, 2))
    assert math.isfinite(t) and t > 0


def test_a_batch_that_does_not_split_and_a_failing_launch_are_named():
    with pytest.raises(ValueError, match="does not split evenly over 2 ranks"):
        TINY(Config(2, 9))
    with pytest.raises(RuntimeError, match=r"torchrun with 1 rank\(s\) for r=1 b=8 m=1 failed"):
        TorchrunStepTimer(model="no_such_model", steps=1, warmup=1)(Config(1, 8))
