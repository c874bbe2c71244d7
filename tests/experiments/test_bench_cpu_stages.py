import json

from experiments.bench_cpu_stages import choosable, configs, main, ratios


def test_configs_cover_plain_every_single_stage_auto_and_an_even_split():
    c = configs(16, [1, 2, 4, 8], 4)
    assert list(c) == ["plain", "1stage:M=1", "1stage:M=2", "1stage:M=4", "1stage:M=8", "auto", "S=2,even"]
    assert c["plain"] is None and c["auto"]["threads"] == "auto" and c["S=2,even"]["threads"] == [8, 8]
    assert "S=2,even" not in configs(1, [1], 1)
    assert choosable(c) == ["1stage:M=4", "S=2,even"]
    assert choosable(configs(4, [1, 2], "auto")) == ["1stage:M=1", "1stage:M=2", "S=2,even"]


def test_ratios_compare_auto_with_the_best_fixed_row():
    rows = {k: {"ms_per_step": v} for k, v in
            {"plain": 100.0, "1stage:M=1": 90.0, "1stage:M=2": 80.0, "auto": 50.0, "S=2,even": 60.0}.items()}
    r = ratios(rows, ["1stage:M=1"])
    assert r["best_single_stage"] == "1stage:M=2" and r["best_fixed"] == "S=2,even"
    assert r["best_choosable"] == "1stage:M=1" and r["auto_vs_best_choosable"] == 1.8
    assert r["auto_vs_plain"] == 2.0 and r["auto_vs_best_single_stage"] == 1.6 and r["auto_vs_best_fixed"] == 1.2


def test_quick_run_writes_every_row_and_the_plan(tmp_path):
    out = tmp_path / "cpu.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["device"] == "cpu" and data["cores"] >= 1 and data["batch"] == 8
    res = data["results"]["resnet18"]
    rows = res["rows"]
    assert set(rows) >= {"plain", "1stage:M=1", "1stage:M=2", "auto"}
    assert all(len(r["windows_ms"]) == 2 and r["ms_per_step"] > 0 for r in rows.values())
    assert "CPU plans timed in trial steps" in rows["auto"]["plan"]
    assert res["auto_vs_plain"] > 0 and res["best_single_stage"].startswith("1stage")
