"""The accuracy model: a conservative lower bound over (batch, epochs), extrapolating flat or not at all."""

import math

import pytest

from pipedp.advisor.accuracy import AccuracyModel


def _true(batch, epoch):  # never better with a larger batch, never worse with more epochs
    return 1 - 0.9 * math.exp(-epoch * math.sqrt(512 / batch) / 4)


def test_lower_bound_never_exceeds_the_truth_and_extrapolates_flat():
    runs = {b: [_true(b, e) for e in range(1, 5)] for b in (64, 256)}
    model = AccuracyModel.from_runs(runs)
    for b in (16, 32, 64, 128, 256):
        for e in range(1, 12):
            lo = model.lower(b, e)
            assert lo is not None and lo <= _true(b, e) + 1e-12
    assert model.lower(64, 3) == pytest.approx(_true(64, 3))  # a measured point is its own bound
    assert model.lower(32, 3) == pytest.approx(_true(64, 3))  # a smaller batch: at least the measured larger one
    assert model.lower(64, 10) == pytest.approx(_true(64, 4))  # past the run: no gain assumed
    assert model.lower(512, 4) is None  # a batch larger than every run: unknown
    assert model.upper(64, 2) == pytest.approx(_true(64, 2)) and model.upper(16, 5) is None


def test_noisy_runs_are_pooled_not_cherry_picked():
    model = AccuracyModel.from_runs({32: [0.90, 0.84, 0.95]})
    assert model.lower(32, 1) == pytest.approx(0.87) and model.lower(32, 2) == pytest.approx(0.87)
    assert model.lower(32, 3) == pytest.approx(0.95)


def test_epochs_to_reach():
    model = AccuracyModel.from_runs({64: [0.5, 0.8, 0.9], 256: [0.3, 0.5, 0.6]})
    assert model.epochs_to_reach(64, 0.85, 10) == 3 and model.epochs_to_reach(128, 0.55, 10) == 3
    assert model.epochs_to_reach(128, 0.85, 10) is None and model.epochs_to_reach(16, 0.9, 2) is None


def test_bad_runs_are_named():
    with pytest.raises(ValueError, match="at least one run"):
        AccuracyModel.from_runs({})
    with pytest.raises(ValueError, match=r"batch 32 must give accuracies in \[0, 1\]"):
        AccuracyModel.from_runs({32: [0.5, 87.0]})
    with pytest.raises(ValueError, match="batch must be a positive int"):
        AccuracyModel.from_runs({0: [0.5]})
