"""pipedp.advise end to end on synthetic laws: few measurements, a choice near the true optimum, errors named."""

import json
import math
from itertools import product

import pytest

import pipedp
from pipedp.advisor import Config, NoPlan, Profiling, SearchSpace, Targets, advise

N = 1437
SPACE = SearchSpace((1, 2), (16, 32, 64, 128, 256), (1, 2, 4))


def true_step_s(c):  # not in the law's basis: super-linear in the batch, sub-linear scaling in cores
    return 0.004 + 0.00025 * c.batch ** 1.1 / c.resources ** 0.7 + 0.002 * c.microbatches ** 0.8


def true_accuracy(batch, epoch):
    return 1 - 0.9 * math.exp(-epoch * (400 / batch) ** 0.5 / 3)


class Recorder:
    def __init__(self):
        self.steps, self.runs = [], []

    def step(self, c):
        self.steps.append(c)
        return true_step_s(c)

    def run(self, batch, epochs, target=None):
        self.runs.append((batch, epochs, target))
        out = []
        for e in range(1, epochs + 1):
            out.append(true_accuracy(batch, e))
            if target is not None and out[-1] >= target:
                break
        return out


def _grid_best(targets):
    best = None
    for c, e in product(SPACE.configs(), range(1, targets.max_epochs + 1)):
        t = e * (N // c.batch) * true_step_s(c)
        if true_accuracy(c.batch, e) >= targets.accuracy and t <= targets.time_limit_s:
            if best is None or c.resources * t < best:
                best = c.resources * t
    return best


@pytest.mark.parametrize("limit", [100.0, 9.0])
def test_few_measurements_and_a_choice_near_the_grid_optimum(limit):
    rec = Recorder()
    targets = Targets(0.9, limit, 20)
    advice = pipedp.advise(rec.step, rec.run, space=SPACE, targets=targets, dataset_size=N,
                           profiling=Profiling(accuracy_epochs=8))
    assert sorted(rec.steps) == SPACE.design() and len(rec.steps) <= len(SPACE.configs()) / 2
    assert [(b, e, t) for b, e, t in rec.runs[:2]] == [(64, 8, 0.9), (256, 8, 0.9)]
    assert len(advice.accuracy_model.runs[64]) < 8  # stopped once the target was reached
    explored = rec.runs[2:]  # smaller batches, each trained only while it could still win
    assert explored and all(b in (16, 32, 128) and e < 8 for b, e, _ in explored)
    held_out = [c for c in SPACE.configs() if c not in rec.steps]
    errors = [abs(advice.predicted_step_s[c] / true_step_s(c) - 1) for c in held_out]
    assert max(errors) < 0.15
    (phase,) = advice.plan.phases
    true_cost = phase.config.resources * phase.epochs * (N // phase.config.batch) * true_step_s(phase.config)
    true_time = true_cost / phase.config.resources
    assert true_accuracy(phase.config.batch, phase.epochs) >= 0.9 and true_time <= limit
    assert true_cost <= 1.10 * _grid_best(targets)
    assert "<- chosen" in advice.table() and str(phase.config) in str(advice)
    json.dumps(advice.to_dict())  # plain JSON


def test_staged_advice_is_never_dearer():
    rec = Recorder()
    advice = advise(rec.step, rec.run, space=SPACE, targets=Targets(0.9, 100.0, 20), dataset_size=N,
                    profiling=Profiling(accuracy_epochs=8), staged=True)
    assert advice.staged is not None and advice.staged.cost <= advice.plan.cost


def test_explicit_profiling_points_are_the_ones_measured():
    rec = Recorder()
    points = (Config(1, 16, 1), Config(2, 256, 4), Config(1, 256, 1), Config(2, 16, 1))
    advise(rec.step, rec.run, space=SPACE, targets=Targets(0.5, 100.0, 20), dataset_size=N,
           profiling=Profiling(step_configs=points, accuracy_batches=(128,), accuracy_epochs=2))
    assert sorted(rec.steps) == sorted(points) and [b for b, _, _ in rec.runs][0] == 128


def test_without_exploring_only_the_given_batches_are_trained():
    rec = Recorder()
    advice = advise(rec.step, rec.run, space=SPACE, targets=Targets(0.9, 100.0, 20), dataset_size=N,
                    profiling=Profiling(accuracy_epochs=8, explore=False))
    assert [b for b, _, _ in rec.runs] == [64, 256] and advice.plan.phases[0].config.batch == 64


def test_what_cannot_be_met_is_named():
    rec = Recorder()
    with pytest.raises(NoPlan, match="profile accuracy for more epochs"):
        advise(rec.step, rec.run, space=SPACE, targets=Targets(0.99, 100.0, 20), dataset_size=N,
               profiling=Profiling(accuracy_epochs=2))
    with pytest.raises(ValueError, match=r"batch sizes \[256\] exceed the dataset"):
        advise(rec.step, rec.run, space=SPACE, targets=Targets(0.9, 100.0), dataset_size=200)

    def short(batch, epochs, target=None):
        return [0.1]

    with pytest.raises(ValueError, match="gave 1 accuracies for 3 epochs"):
        advise(rec.step, short, space=SPACE, targets=Targets(0.9, 100.0), dataset_size=N)
