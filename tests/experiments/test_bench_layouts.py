import pytest

from experiments import bench_layouts


@pytest.mark.slow  # two gloo processes build and time four engines (about 20 s on 2 cores)
def test_the_layouts_benchmark_measures_and_forecasts_every_layout(tmp_path):
    out = tmp_path / "layouts.json"
    report = bench_layouts.bench(["--models", "resnet18", "--width", "8", "--batch", "16", "--microbatches", "2,4",
                                  "--rounds", "1", "--steps", "1", "--warmup", "1", "--out", str(out)])
    (r,) = report["results"]
    assert [row["layout"] for row in r["rows"]] == ["dp 2 x pp 1", "dp 1 x pp 2 x 2 mb 1f1b", "dp 1 x pp 2 x 4 mb 1f1b"]
    for row in r["rows"]:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
        assert row["error"] == pytest.approx(row["predicted_ms"] / row["measured_ms"] - 1)
    by = {row["layout"]: row for row in r["rows"]}
    assert r["best_predicted"] == min(by, key=lambda k: by[k]["predicted_ms"])
    assert r["best_measured"] == min(by, key=lambda k: by[k]["measured_ms"])
    assert r["forecast_choice_vs_best"] == pytest.approx(
        by[r["best_measured"]]["measured_ms"] / by[r["best_predicted"]]["measured_ms"])
    a = r["auto"]  # pp="auto" timed beside them: its pick is one of the layouts, its ratio against the fastest
    assert a["chosen"] in by and a["measured_ms"] > 0 and 0 < a["planning_s"] <= a["setup_s"]
    assert a["vs_best"] == pytest.approx(by[r["best_measured"]]["measured_ms"] / a["measured_ms"])
    assert "chosen" in a["table"]
    with pytest.raises(SystemExit, match="even number of ranks"):
        bench_layouts.bench(["--procs", "3"])
    assert out.exists()
