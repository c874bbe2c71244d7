"""bench_dp end to end on tiny settings (2 gloo processes)."""

import json

import pytest

from experiments import bench_dp


@pytest.mark.slow
def test_bench_dp_reports_ratios_and_hidden_sync(tmp_path):
    out = tmp_path / "dp.json"
    assert bench_dp.main(["--procs", "2", "--models", "resnet18", "--batch", "4", "--rounds", "2",
                          "--steps", "1", "--warmup", "1", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert set(row["images_per_s"]) == {"ddp", "pipedp", "nosync"}
    assert row["pipedp_vs_ddp"] > 0 and row["pipedp_vs_nosync"] > 0
    assert 0 <= row["sync_hidden_fraction"] <= 1 and row["buckets"] > 1
    assert out.exists()
