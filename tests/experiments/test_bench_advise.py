"""bench_advise on a tiny grid: the grid's best, the advisor's choice and the cost ratios agree with the data."""

import json

import pytest

from experiments import bench_advise

ARGS = ["--quick", "--train-images", "96", "--batches", "16,32", "--microbatches", "1,2", "--max-epochs", "2",
        "--steps", "1", "--accuracy", "0.02"]  # at least 2 of 96 test images right: a plan exists


def test_tiny_run_reports_consistent_figures(tmp_path):
    out = tmp_path / "advise.json"
    report = bench_advise.main([*ARGS, "--out", str(out)])
    assert json.loads(out.read_text())["machine"]["cpu_cores"] == report["machine"]["cpu_cores"]
    n = report["train_images"]
    step_s = {(r["resources"], r["batch"], r["microbatches"]): r["step_s"] for r in report["grid"]["step_s"]}
    curves = {int(b): c for b, c in report["grid"]["curves"].items()}
    assert len(step_s) == 4 and all(len(c) == 2 for c in curves.values())
    first = report["scenarios"][0]
    assert first["scenario"] == "no time limit"
    # the grid's best is the cheapest measured configuration whose measured curve reaches the target
    costs = []
    for (r, b, _m), t in step_s.items():
        e = next((i + 1 for i, a in enumerate(curves[b]) if a >= 0.02), None)
        if e is not None:
            costs.append(r * e * (n // b) * t)
    best = first["grid_best"]
    assert best is not None and best["cost"] == pytest.approx(min(costs))
    assert "advisor_error" not in first, first.get("advisor_error")
    choice = first["advisor"]["choice"]
    (phase,) = choice["phases"]
    key = (phase["resources"], phase["batch"], phase["microbatches"])
    assert choice["measured_cost"] == pytest.approx(phase["resources"] * phase["epochs"] * (n // phase["batch"])
                                                    * step_s[key])
    assert first["cost_over_grid_best"] == pytest.approx(choice["measured_cost"] / best["cost"])
    assert choice["measured_accuracy"] == curves[phase["batch"]][phase["epochs"] - 1]
    assert choice["meets_targets"] == (choice["measured_accuracy"] >= 0.02)
    ratios = first["profiling_over_grid"]
    assert ratios["as_run"] == pytest.approx(first["advisor"]["profiling_cost"] / first["grid_cost"]["as_run"])
    acc = first["accuracy"]
    assert acc["points"] == 4 and acc["bound_held"] + acc["bound_violated"] + acc["unknown"] == 4
