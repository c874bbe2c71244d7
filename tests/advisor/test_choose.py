"""Choosing plans: the cheapest one-phase plan against brute force, staged plans, and misses named."""

import math
from itertools import product

import pytest

from pipedp.advisor.choose import NoPlan, Targets, cheapest, cheapest_staged, steps_per_epoch
from pipedp.advisor.space import Config, SearchSpace

N = 1024
SPACE = SearchSpace((1, 2, 4), (16, 32, 64, 128, 256), (1, 2, 4))


def step_s(c):  # Amdahl: a serial part and a part that scales with the cores
    return 0.002 * c.microbatches + 0.0002 * c.batch + 0.0008 * c.batch / c.resources


class Exact:
    """A known accuracy law as a bound (lower = upper = truth)."""

    def __init__(self, law):
        self.law = law

    def lower(self, batch, epochs):
        return self.law(batch, epochs)

    def upper(self, batch, epochs):
        return self.law(batch, epochs)


SMOOTH = Exact(lambda b, e: 1 - math.exp(-e * math.sqrt(256 / b) / 3))


def _brute(targets):
    best = None
    for c, e in product(SPACE.configs(), range(1, targets.max_epochs + 1)):
        if SMOOTH.law(c.batch, e) < targets.accuracy:
            continue
        t = e * (N // c.batch) * step_s(c)
        if t <= targets.time_limit_s and (best is None or c.resources * t < best[0]):
            best = (c.resources * t, c, e)
    return best


@pytest.mark.parametrize("limit", [1000.0, 3.0, 2.0])
def test_cheapest_is_the_brute_force_optimum(limit):
    targets = Targets(0.95, limit, 40)
    plan = cheapest(SPACE.configs(), step_s, SMOOTH, N, targets)
    cost, config, epochs = _brute(targets)
    assert plan.cost == pytest.approx(cost) and plan.phases[0].config == config and plan.epochs == epochs
    assert plan.time_s <= limit and plan.accuracy >= 0.95


def test_a_tight_time_limit_buys_resources():
    loose = cheapest(SPACE.configs(), step_s, SMOOTH, N, Targets(0.95, 1000.0, 40))
    tight = cheapest(SPACE.configs(), step_s, SMOOTH, N, Targets(0.95, 2.0, 40))
    assert loose.phases[0].config.resources == 1 and tight.phases[0].config.resources > 1
    assert tight.cost > loose.cost and tight.time_s < loose.time_s


def test_misses_are_named_with_what_would_help():
    with pytest.raises(NoPlan, match=r"reach accuracy 0\.999 within 5 epochs \(the best is 0\.99\d \(batch 16, 5 "
                       r"epochs\)\): profile accuracy for more epochs .*lower the accuracy"):
        cheapest(SPACE.configs(), step_s, SMOOTH, N, Targets(0.999, 1000.0, 5))
    with pytest.raises(NoPlan, match=r"takes .* s, over the 0\.1 s limit: raise the time limit, allow more resources"):
        cheapest(SPACE.configs(), step_s, SMOOTH, N, Targets(0.95, 0.1, 40))
    with pytest.raises(ValueError, match="accuracy target must be in"):
        Targets(95, 10.0)
    with pytest.raises(ValueError, match="larger than the dataset"):
        steps_per_epoch(100, 128)


# Large batches are cheap per epoch but plateau lower; small ones reach higher accuracy, slowly and dearly.
PLATEAU = Exact(lambda b, e: (0.97 if b <= 16 else 0.86) * (1 - math.exp(-e / 1.5)))


def test_staged_plan_is_cheaper_when_cheap_epochs_get_most_of_the_way():
    configs = [Config(1, 16), Config(1, 256)]

    def per_epoch(c):  # seconds per epoch: 4 at batch 16, 1 at batch 256
        return (4.0 if c.batch == 16 else 1.0) / (N // c.batch)

    targets = Targets(0.93, 1000.0, 20)
    single = cheapest(configs, per_epoch, PLATEAU, N, targets)
    assert single.phases[0].config.batch == 16 and single.epochs == 5 and single.cost == pytest.approx(20.0)
    staged = cheapest_staged(configs, per_epoch, PLATEAU, N, targets)
    first, second = staged.phases
    assert first.config.batch == 256 and second.config.batch == 16
    # the carried progress: the fewest batch-16 epochs whose accuracy reaches what the first phase reached
    reached = PLATEAU.law(256, first.epochs)
    credit = min(e for e in range(21) if PLATEAU.law(16, e) >= reached)
    assert staged.accuracy == pytest.approx(PLATEAU.law(16, credit + second.epochs)) and staged.accuracy >= 0.93
    assert PLATEAU.law(16, credit + second.epochs - 1) < 0.93  # the fewest second-phase epochs
    assert staged.cost < single.cost and staged.cost == pytest.approx(first.epochs * 1.0 + second.epochs * 4.0)


def test_staged_falls_back_to_one_phase_when_staging_does_not_pay():
    targets = Targets(0.95, 1000.0, 40)
    single = cheapest(SPACE.configs(), step_s, SMOOTH, N, targets)
    staged = cheapest_staged(SPACE.configs(), step_s, SMOOTH, N, targets)
    assert staged.cost <= single.cost
    if len(staged.phases) == 1:
        assert staged == single


def test_staged_credit_does_not_depend_on_the_last_bits_of_a_pooled_value():
    from pipedp.advisor.accuracy import AccuracyModel

    # (16, 1) and (32, 1) pool to one value, which the fit gives with different last bits on each side
    model = AccuracyModel.from_runs({16: [16 / 96], 32: [17 / 96, 19 / 96, 34 / 96], 64: [10 / 96, 11 / 96, 15 / 96]})
    configs = [Config(1, 16), Config(1, 32)]

    def step(c):  # one epoch: 0.2 s at batch 16, 0.12 s at batch 32
        return (0.2 if c.batch == 16 else 0.12) / (N // c.batch)

    targets = Targets(0.3, 1000.0, 3)
    staged = cheapest_staged(configs, step, model, N, targets)
    # one epoch at 16 reaches what one epoch at 32 does, no more: the credit is 1 epoch, so a staged plan needs
    # 2 more at 32 (0.44 s) and the single plan (3 epochs at 32, 0.36 s) wins
    assert len(staged.phases) == 1 and staged.phases[0].config.batch == 32 and staged.epochs == 3
