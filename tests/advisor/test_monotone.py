"""The monotone fits: exact NNLS and isotonic projections, and held-out predictions of synthetic step-time laws."""

from itertools import combinations, product

import numpy as np
import pytest

from pipedp.advisor.monotone import Isotonic, MonotoneLaw, isotonic, nnls, precedes


def _nnls_brute(a, b):
    """Every active set's least squares; the best feasible one (the NNLS optimum is one of them)."""
    n = a.shape[1]
    best, best_r = np.zeros(n), np.linalg.norm(b)
    for k in range(1, n + 1):
        for s in combinations(range(n), k):
            x = np.zeros(n)
            x[list(s)] = np.linalg.lstsq(a[:, list(s)], b, rcond=None)[0]
            r = np.linalg.norm(a @ x - b)
            if (x >= -1e-12).all() and r < best_r - 1e-12:
                best, best_r = x, r
    return best


@pytest.mark.parametrize("seed", range(5))
def test_nnls_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(12, 5)), rng.normal(size=12)
    x = nnls(a, b)
    assert (x >= 0).all()
    np.testing.assert_allclose(x, _nnls_brute(a, b), atol=1e-9)


def test_isotonic_on_one_axis_is_pava():
    sk = pytest.importorskip("sklearn.isotonic")
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, 40)
    y = x + rng.normal(0, 3, 40)
    w = rng.uniform(0.5, 2, 40)
    ref = sk.IsotonicRegression().fit_transform(x, y, sample_weight=w)
    np.testing.assert_allclose(isotonic(x[:, None], y, (1,), w), ref, atol=1e-9)
    ref_down = sk.IsotonicRegression(increasing=False).fit_transform(x, y)
    np.testing.assert_allclose(isotonic(x[:, None], y, (-1,)), ref_down, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_isotonic_over_a_partial_order_is_the_projection(seed):
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 1, (30, 2))
    d = (1, -1)
    y = p[:, 0] - p[:, 1] + rng.normal(0, 0.4, 30)
    z = isotonic(p, y, d)
    for i, j in product(range(30), repeat=2):
        if precedes(p[i], p[j], d):
            assert z[i] <= z[j] + 1e-9
    # the projection onto a convex cone K: <y - z, z> = 0 and <y - z, k> <= 0 for every k in K
    assert abs(np.dot(y - z, z)) < 1e-8
    for _ in range(200):
        a, b, c = rng.uniform(0, 2, 3)
        k = a * p[:, 0] - b * p[:, 1] + c * np.maximum(p[:, 0] - p[:, 1], 0) - rng.uniform(-1, 1)
        assert np.dot(y - z, k) <= 1e-8
    assert np.sum((y - z) ** 2) <= np.sum((y - np.clip(y, None, None).mean()) ** 2) + 1e-9  # beats a constant


def test_monotone_values_are_kept_and_bounds_come_from_the_order():
    p = [(1, 1), (1, 2), (2, 1), (2, 2)]
    y = [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_allclose(isotonic(p, y, (1, 1)), y)
    fit = Isotonic.fit(p, y, (1, 1))
    assert fit.lower((2, 1.5)) == 3.0 and fit.upper((2, 1.5)) == 4.0 and fit.middle((2, 1.5)) == 3.5
    assert fit.lower((0, 0)) is None and fit.upper((0, 0)) == 1.0 and fit.middle((0, 0)) == 1.0
    assert fit.upper((3, 3)) is None and fit.lower((3, 3)) == 4.0
    pooled = Isotonic.fit([(1,), (2,)], [2.0, 1.0], (1,))
    np.testing.assert_allclose(pooled.fitted, [1.5, 1.5])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="directions must give"):
        isotonic([(1, 2)], [1.0], (1,))
    with pytest.raises(ValueError, match="one per point"):
        isotonic([(1,), (2,)], [1.0], (1,))
    with pytest.raises(ValueError, match="positive finite"):
        MonotoneLaw.fit([(1,), (2,)], [1.0, 0.0], (1,))
    with pytest.raises(ValueError, match="positive coordinates"):
        MonotoneLaw.fit([(0,), (2,)], [1.0, 2.0], (1,))


GRID = [(r, b, m) for r in (1, 2, 4) for b in (16, 32, 64, 128, 256) for m in (1, 2, 4)]
DESIGN = [(r, b, m) for r in (1, 4) for b in (16, 256) for m in (1, 4)] + [(r, 64, 2) for r in (1, 2, 4)]
DIRS = (-1, 1, 1)


def _amdahl(r, b, m):  # in the law's basis: serial + parallel work + per-microbatch overhead
    return 0.002 + 0.0001 * b + 0.0003 * b / r + 0.001 * m


def _outside(r, b, m):  # not in the basis: super-linear batch, sub-linear scaling in resources
    return 0.002 + 0.0004 * b ** 1.15 / r ** 0.8 + 0.003 * m ** 0.7


def _held_out_errors(law, predict):
    return [abs(predict(p) / law(*p) - 1) for p in GRID if p not in DESIGN]


def test_a_law_in_the_basis_is_recovered_exactly():
    fit = MonotoneLaw.fit(DESIGN, [_amdahl(*p) for p in DESIGN], DIRS)
    assert max(_held_out_errors(_amdahl, fit.predict)) < 1e-6


@pytest.mark.parametrize("seed", range(3))
def test_held_out_predictions_within_15_percent_where_isotonic_alone_is_not(seed):  # (the default: no correction)
    rng = np.random.default_rng(seed)
    measured = [_outside(*p) * rng.lognormal(0, 0.03) for p in DESIGN]  # 3% timing noise
    law = MonotoneLaw.fit(DESIGN, measured, DIRS)
    alone = Isotonic.fit(DESIGN, measured, DIRS)
    law_err = _held_out_errors(_outside, law.predict)
    alone_err = _held_out_errors(_outside, lambda p: alone.middle(p))
    assert max(law_err) < 0.15, max(law_err)
    assert max(alone_err) > 0.5 and np.mean(law_err) < np.mean(alone_err) / 5


@pytest.mark.parametrize("correct", [False, True])
def test_predictions_are_monotone_in_every_direction(correct):
    rng = np.random.default_rng(1)
    measured = [_outside(*p) * rng.lognormal(0, 0.1) for p in DESIGN]
    fit = MonotoneLaw.fit(DESIGN, measured, DIRS, correct=correct)
    fine = [(r, b, m) for r in (1, 1.5, 2, 3, 4) for b in (16, 24, 48, 64, 100, 256) for m in (1, 2, 3, 4)]
    pred = {p: fit.predict(p) for p in fine}
    for a, b in product(fine, repeat=2):
        if precedes(a, b, DIRS):
            assert pred[a] <= pred[b] * (1 + 1e-12), (a, b)


def test_the_isotonic_correction_never_fits_the_measurements_worse():
    rng = np.random.default_rng(2)
    measured = [_outside(*p) * rng.lognormal(0, 0.05) for p in DESIGN]
    law, corrected = MonotoneLaw.fit(DESIGN, measured, DIRS), MonotoneLaw.fit(DESIGN, measured, DIRS, correct=True)

    def sq_log_error(fit):
        return sum(np.log(fit.predict(p) / t) ** 2 for p, t in zip(DESIGN, measured, strict=True))

    # the residual's projection onto a cone that holds 0 is never farther from it than 0 is
    assert sq_log_error(corrected) < sq_log_error(law)


def test_nnls_that_cannot_finish_says_so():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(12, 5)), rng.normal(size=12) + 3 * rng.normal(size=(12, 5)).sum(axis=1)
    with pytest.raises(RuntimeError, match="did not converge in 1 iterations"):
        nnls(np.abs(a), np.abs(b) + 1, max_iter=1)
