import json

import pytest

from experiments import forecast_table


@pytest.mark.slow  # profiles a full-width ResNet-18 twice on the CPU (about 10 s on 2 cores)
def test_one_call_profiles_and_forecasts_every_world_and_link(tmp_path):
    out = tmp_path / "f.json"
    forecast_table.table(["--device", "cpu", "--models", "resnet18", "--batch", "16", "--devices", "2,4",
                          "--links", "pcie4,eth10", "--out", str(out)])
    (m,) = json.loads(out.read_text())["models"]
    assert m["model"] == "resnet18" and m["profile"]["batch"] == 8 and m["profile"]["small_batch"] == 2
    assert [(f["ranks"], f["link"]["name"]) for f in m["forecasts"]] == [(2, "pcie4"), (4, "pcie4"), (2, "eth10"),
                                                                         (4, "eth10")]
    for f in m["forecasts"]:
        assert f["best_ms"] == min(p["step_ms"] for p in f["predictions"])
        assert f["best_vs_dp"] == pytest.approx(f["dp_ms"] / f["best_ms"]) and f["best_vs_dp"] >= 1.0
