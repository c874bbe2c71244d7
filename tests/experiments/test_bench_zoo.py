"""The zoo benchmark's row for one model: random layers on as users build them, every contract column filled."""

from __future__ import annotations

import pytest

from experiments import bench_zoo, zoo


def test_a_row_wraps_the_default_build_and_checks_each_contract():
    try:
        zoo.timm()
    except ImportError as e:
        pytest.skip(str(e))
    row = bench_zoo.one("timm", "mobilenetv3_small_050")
    assert row["wraps"] and row["cut"], row
    assert row["exact1"] <= bench_zoo.TOL and row["repeat2"] == 0.0, row  # dropout on: masks as plain, repeatable
    assert row["exact2"] <= bench_zoo.TOL and row["exact4"] <= bench_zoo.TOL, row
    summary = bench_zoo.summary([row, {"library": "timm", "model": "x", "wraps": False, "wrap_error": "E: no"}])
    assert summary["timm"] == {"models": 2, "wraps": 1, "cut": 1, "exact1": 1, "repeat2": 1, "exact2": 1, "exact4": 1}
    table = bench_zoo.markdown([row], {"cpu": "test"})
    assert "| exact 1 | repeat 2 | exact 2 | exact 4 |" in table and "mobilenetv3_small_050" in table
