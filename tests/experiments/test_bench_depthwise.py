"""bench_depthwise on a small batch: tuned rows vs torch's two layouts, summary, and the MetaSchedule curve."""

import json
import math

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")

from experiments import bench_depthwise  # noqa: E402


def test_rows_and_summary(tmp_path):
    out = tmp_path / "r.json"
    report = bench_depthwise.main(["--sets", "32x32", "--limit", "1", "--batch", "2", "--ops", "fwd,wgrad",
                                   "--trials", "2", "--allocator", "default", "--out", str(out)])
    rows = report["rows"]
    assert [r["op"] for r in rows] == ["fwd", "wgrad"]
    for r in rows:
        assert r["problem"]["n"] == 2
        assert set(r["us_by_layout"]) == {"NCHW", "NHWC"} and r["layout"] in r["us_by_layout"]
        assert r["us"] == min(r["us_by_layout"].values())
        assert r["speedup"] == pytest.approx(min(r["torch_us"].values()) / r["us"])
        assert r["bandwidth_fraction"] == pytest.approx(r["bound_us"] / r["us"])
        assert all(len(c) == 2 for c in r["curves"].values())
    s = report["summary"]
    assert s["kernels"] == 2
    assert s["geomean_speedup"] == pytest.approx(math.sqrt(rows[0]["speedup"] * rows[1]["speedup"]))
    # (the default, reuse, is process-wide and lasting: not in the test process)
    assert json.loads(out.read_text())["settings"]["allocator"] == "default"


def test_unknown_set_is_named():
    with pytest.raises(SystemExit, match="unknown set 'cifar'"):
        bench_depthwise.main(["--sets", "cifar"])


@pytest.mark.slow
def test_metaschedule_candidates_are_retimed_on_our_clock(tmp_path):
    report = bench_depthwise.main(["--sets", "32x32", "--limit", "1", "--batch", "2", "--ops", "fwd", "--trials", "4",
                                   "--layouts", "nhwc", "--metaschedule", "1", "--allocator", "default"])
    ms = report["metaschedule"][0]
    curve = ms["metaschedule_curve"]
    assert curve and all(b <= a for a, b in zip(curve, curve[1:], strict=False))  # best so far
    assert len(curve) == len(ms["metaschedule_curve_own_runner"])
    assert math.isfinite(ms["metaschedule_best_us"]) and ms["metaschedule_best_us"] == min(curve)


def test_side_by_side_alternates_and_takes_medians():
    calls = []

    def timer(name, values):
        it = iter(values)
        return lambda: calls.append(name) or next(it)

    timed = bench_depthwise.side_by_side({"ours": timer("ours", [5.0, 1.0, 3.0]),
                                          "torch": timer("torch", [9.0, 4.0, 6.0])}, rounds=3)
    assert calls == ["ours", "torch"] * 3  # each round times every contender once, in turn
    assert timed == {"ours": 3.0, "torch": 6.0}
