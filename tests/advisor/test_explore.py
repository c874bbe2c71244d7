"""Bound-driven exploration: train a batch size only while it could still beat the best plan so far."""

import math

from pipedp.advisor.accuracy import AccuracyModel
from pipedp.advisor.choose import Targets
from pipedp.advisor.explore import next_probe
from pipedp.advisor.space import Config

N = 1024
CANDIDATES = [Config(1, b) for b in (16, 32, 64, 128)]


def per_epoch_cost(b):  # resource-seconds per epoch: small batches cost more per epoch
    return {16: 4.0, 32: 2.0, 64: 1.0, 128: 0.8}[b]


def step_s(c):
    return per_epoch_cost(c.batch) / (N // c.batch)


def test_the_cheapest_optimistic_batch_is_probed_with_a_cap_that_can_still_win():
    model = AccuracyModel.from_runs({64: [0.5, 0.7, 0.9]})  # best plan so far: 3 epochs at 64, cost 3.0
    targets = Targets(0.9, 1000.0, 20)
    probe = next_probe(CANDIDATES, step_s, model, N, targets, 3.0, {64}, 8)
    # 32: no upper bound, so optimistically 1 epoch (cost 2.0 < 3.0), and worth at most 1 epoch (2 would cost 4.0)
    # 128: its upper bound comes from the run at 64 (0.9 after 3 epochs): optimistically 3 x 0.8 = 2.4
    assert probe is not None and (probe.batch, probe.cap, probe.optimistic_cost) == (32, 1, 2.0)
    after = AccuracyModel.from_runs({64: [0.5, 0.7, 0.9], 32: [0.8]})
    probe = next_probe(CANDIDATES, step_s, after, N, targets, 3.0, {64, 32}, 8)
    assert (probe.batch, probe.cap) == (128, 3)
    done = AccuracyModel.from_runs({64: [0.5, 0.7, 0.9], 32: [0.8], 128: [0.4, 0.6, 0.7]})
    # 16: optimistically 1 epoch at 4.0 > 3.0: never worth a run
    assert next_probe(CANDIDATES, step_s, done, N, targets, 3.0, {64, 32, 128}, 8) is None


def test_without_a_plan_the_run_is_capped_by_the_profiling_epochs():
    model = AccuracyModel.from_runs({128: [0.2, 0.3]})
    probe = next_probe(CANDIDATES, step_s, model, N, Targets(0.9, 1000.0, 20), math.inf, {128}, 5)
    assert probe is not None and probe.batch == 64 and probe.cap == 5


def test_a_time_limit_rules_out_batches_too_slow_even_optimistically():
    model = AccuracyModel.from_runs({64: [0.5, 0.7, 0.9]})
    probe = next_probe(CANDIDATES, step_s, model, N, Targets(0.9, 1.5, 20), 3.0, {64}, 8)
    assert probe is None  # 32 needs 2.0 s for even one epoch, 128 needs 2.4 s for three
