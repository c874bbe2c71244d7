import json

import pytest
import torch

from experiments.bench_concurrency import PIECES, main, rows_for


def test_rows_are_the_baselines_and_each_piece_on_and_off():
    names = [r.name for r in rows_for(torch.device("cpu"))]
    assert names == ["eager", "pipedp", *(f"pipedp+{p}" for p in PIECES), "pipedp+all"]
    assert "graph" in [r.name for r in rows_for(torch.device("cuda"))]


def test_quick_cpu_run_times_every_row_and_names_the_machine(tmp_path):
    out = tmp_path / "c.json"
    assert main(["--device", "cpu", "--quick", "--stages", "2", "--microbatches", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["device"] == "cpu" and data["width"] == 4
    group = data["results"]["4"]["fp32"]
    assert not group["errors"] and group["best_baseline"] == "eager"
    rows = group["rows"]
    assert set(rows) == {r.name for r in rows_for(torch.device("cpu"))}
    assert all(r["images_per_s"] > 0 and len(r["images_per_s_windows"]) == 2 for r in rows.values())
    assert rows["pipedp"]["vs_off"] == 1.0 and rows["eager"]["vs_off"] is None
    assert "residual block(s)" in rows["pipedp+branches"]["notes"]
    assert "weight gradient" in rows["pipedp+split_grads"]["notes"]


def test_graph_needs_cuda():
    with pytest.raises(SystemExit, match="--graph needs a CUDA device"):
        main(["--device", "cpu", "--quick", "--graph"])
