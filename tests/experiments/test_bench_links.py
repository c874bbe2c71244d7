"""bench_links on an emulated cluster: every configuration timed at each rate, the table made from the JSON."""

from __future__ import annotations

import json

import pytest

from experiments.bench_links import main
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
                                "pp-auto"}
        assert all(v > 0 for v in r["ms"].values()) and r["best_exact"] != "ddp-powersgd"
        assert r["vs_ddp"]["ddp"] == 1.0 and r["auto"]["chosen"]
    assert md.read_text().count("| resnet18 |") == 2
