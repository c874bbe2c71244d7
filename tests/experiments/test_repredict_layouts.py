import json
from dataclasses import asdict

import pytest

from experiments.repredict_layouts import GOAL, main, report, summary
from pipedp.decide.layout import BlockCosts, Layout, predict
from pipedp.decide.links import Link
from pipedp.partition.profile import BlockProfile


def _run(measured=(100.0, 150.0)):
    blocks = [BlockProfile(f"b{i}", 10.0, 20.0, 1 << 16, 1 << 16, 4096) for i in range(4)]
    small = [BlockProfile(f"b{i}", 4.0, 8.0, 1 << 14, 1 << 14, 4096) for i in range(4)]
    link = Link("test", 1e-5, 1e9)
    lays = [Layout(2, (4,), 1), Layout(1, (2, 2), 4)]
    costs = BlockCosts(tuple(blocks), 16, tuple(small), 4)
    rows = [{"layout": lay.label, "dp": lay.dp, "pp": lay.pp, "counts": list(lay.counts),
             "microbatches": lay.microbatches, "measured_ms": ms,
             "predicted_ms": 1.25 * predict(costs, lay, 32, link, p2p=link, update_ms=1.0).step_ms}
            for lay, ms in zip(lays, measured)]
    return {"model": "toy", "global_batch": 32, "world": 2, "bucket_mb": 25.0,
            "allreduce_link": asdict(link), "p2p_link": asdict(link),
            "profile": {"batch": 16, "update_ms": 1.0, "blocks": [asdict(b) for b in blocks], "small_batch": 4,
                        "small": [asdict(b) for b in small]}, "rows": rows}


def test_a_run_is_predicted_again_by_the_current_model_beside_what_it_recorded(tmp_path):
    path = tmp_path / "layouts.json"
    path.write_text(json.dumps({"results": [_run()]}))
    rep = report([str(path)])
    (run,) = rep["runs"]
    for row in run["rows"]:
        assert row["recorded_ms"] == pytest.approx(1.25 * row["predicted_ms"])
        assert row["error"] == pytest.approx(row["predicted_ms"] / row["measured_ms"] - 1)
    assert rep["current"]["layouts"] == 2 and rep["recorded"]["layouts"] == 2


def test_the_summary_counts_the_layouts_within_the_goal():
    rows = [{"error": e} for e in (0.0, GOAL, -GOAL - 0.01, 0.3)]
    s = summary(rows)
    assert s["within_goal"] == 2 and s["mean_abs_error"] == pytest.approx((0 + GOAL + GOAL + 0.01 + 0.3) / 4)


def test_a_file_that_is_not_a_layouts_run_is_named(tmp_path, capsys):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main([str(bad)]) != 0
    err = capsys.readouterr().err
    assert "other.json" in err and "bench_layouts" in err
