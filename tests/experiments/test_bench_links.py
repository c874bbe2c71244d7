"""bench_links on an emulated cluster: every configuration timed at each rate, the table made from the JSON."""

from __future__ import annotations

import json

import pytest

from experiments.bench_links import main, overtakes
from tests.experiments.test_cluster import needs_namespaces


@needs_namespaces
@pytest.mark.slow
def test_a_small_run_times_every_configuration_at_each_rate(tmp_path):
    out, md = tmp_path / "links.json", tmp_path / "links.md"
    assert main(["--rates", "none,200", "--models", "resnet18", "--width", "4", "--batch", "16",
                 "--microbatches", "2", "--rounds", "1", "--steps", "1", "--powersgd", "--out", str(out),
                 "--md", str(md)]) == 0
    report = json.loads(out.read_text())
    assert [r["link"] for r in report["runs"]] == ["unlimited", "200 Mbit/s"]
    for run in report["runs"]:
        (r,) = run["results"]
        assert set(r["ms"]) == {"ddp", "ddp-fp16", "ddp-powersgd", "pipedp-dp", "pipedp-dp-fp16", "pipedp-pp2x2",
                                "pp-auto", "pp-auto-16"}
        assert all(v > 0 for v in r["ms"].values()) and r["best_exact"] != "ddp-powersgd"
        assert r["vs_ddp"]["ddp"] == 1.0 and r["auto"]["pp-auto"]["chosen"]
        assert r["auto"]["pp-auto"]["bar"] == r["best_exact"] and r["auto"]["pp-auto-16"]["bar"] == r["best_any"]
        assert "bfloat16 reduce" in r["auto"]["pp-auto-16"]["table"]
        assert "bfloat16 reduce" not in r["auto"]["pp-auto"]["table"]
        # each pipedp row beside the prediction of its very layout (the 16-bit row's from the bf16-allowed plan)
        assert set(r["forecast"]) == {"pipedp-dp", "pipedp-dp-fp16", "pipedp-pp2x2"}
        assert r["forecast"]["pipedp-dp-fp16"]["allreduce_bytes"] == pytest.approx(
            r["forecast"]["pipedp-dp"]["allreduce_bytes"] / 2)
        assert r["auto"]["pp-auto"]["probed_bytes_per_s"]["allreduce"] > 0
        assert len(run["link_stats"]) == 2
        if run["rate_mbit"]:  # an unshaped link has no qdisc that counts
            assert all(n["sent_bytes"] > 0 and n["dropped"] >= 0 for n in run["link_stats"])
    text = md.read_text()
    assert text.count("| unlimited | resnet18 | pipedp-dp |") == 1 and "| resnet18 | " in text.split("overtakes")[-1]
    assert "Packets dropped" in text


def _run(rate, ddp, dp, pipe, pred_dp, pred_pipe):
    return {"rate_mbit": rate, "results": [{
        "model": "m", "ms": {"ddp": ddp, "pipedp-dp": dp, "pipedp-pp2x4": pipe},
        "forecast": {"pipedp-dp": {"predicted_ms": pred_dp}, "pipedp-pp2x4": {"predicted_ms": pred_pipe}}}]}


def test_the_overtaking_rate_is_the_fastest_link_where_a_pipeline_won():
    report = {"runs": [_run(None, 100, 101, 150, 100, 140), _run(1000, 200, 190, 180, 200, 210),
                       _run(300, 500, 480, 200, 500, 190)]}
    assert overtakes(report) == {"m": ("1000 Mbit/s", "300 Mbit/s")}
    report["runs"][0] = _run(None, 100, 101, 99, 100, 140)
    assert overtakes(report)["m"][0] == "unlimited"
    assert overtakes({"runs": [_run(None, 1, 1, 2, 1, 2)]}) == {"m": ("not at the rates run", "not at the rates run")}
    delayed = {**_run(1000, 200, 190, 180, 200, 210), "delay_ms": 1.0}
    assert overtakes({"runs": [_run(1000, 200, 190, 250, 200, 250), delayed]}) == {
        "m": ("not at the rates run", "not at the rates run"), "m, 1 ms": ("1000 Mbit/s", "not at the rates run")}
