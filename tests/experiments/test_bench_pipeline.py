import json

import pytest
import torch

from experiments.bench_pipeline import Config, main, parse_config


def test_parse_config():
    assert parse_config("eager") == Config("eager") and parse_config("max-autotune").baseline == "max-autotune"
    auto = parse_config("pipedp")
    assert (auto.kind, auto.stages, auto.microbatches, auto.graph, auto.compile) == ("pipedp", "auto", "auto",
                                                                                      False, False)
    c = parse_config("pipedp:S=3,M=4,gpipe,graph,compile,recompute")
    assert (c.stages, c.microbatches, c.schedule, c.graph, c.compile, c.recompute) == (3, 4, "gpipe", True, True,
                                                                                        True)
    c = parse_config("pipedp:graph,branches,split_grads")
    assert (c.stages, c.branches, c.split_grads, c.recompute) == ("auto", True, True, False)
    assert parse_config("pipedp:S=auto,M=2").stages == "auto" and parse_config("pipedp:S=auto,M=2").microbatches == 2
    with pytest.raises(ValueError, match="cannot read 'X=1'"):
        parse_config("pipedp:X=1")
    with pytest.raises(ValueError, match="cannot read 'M=many'"):
        parse_config("pipedp:M=many")
    with pytest.raises(ValueError, match="unknown config"):
        parse_config("fast")


def test_quick_cpu_run_times_what_runs_and_records_why_the_rest_is_skipped(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--quick", "--models", "resnet18@16", "--batch", "4", "--out", str(out),
                 "--configs", "eager;graph;compile;max-autotune;pipedp;pipedp:S=2,M=2;pipedp:graph;"
                 "pipedp:branches"]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["device"] == "cpu" and data["width"] == 8
    for num in ("fp32", "bf16cl"):
        group = data["results"]["resnet18@16/10"]["4"][num]
        rows = group["rows"]
        assert set(rows) == {"eager", "pipedp", "pipedp:S=2,M=2", "pipedp:branches"}
        assert group["best_baseline"] == "eager" and "shortcut" in rows["pipedp:branches"]["plan"]
        assert rows["eager"]["vs_best_baseline"] == 1.0 and rows["eager"]["plan"] is None
        assert set(group["skipped"]) == {"graph", "compile", "max-autotune", "pipedp:graph"}
        assert "--compile-on-cpu" in group["skipped"]["compile"] and "CUDA" in group["skipped"]["graph"]
        auto = rows["pipedp"]
        assert auto["images_per_s"] > 0 and len(auto["images_per_s_windows"]) == 2 and auto["setup_s"] > 0
        assert auto["plan_label"].startswith("1x")  # a CPU runs stages one after another: one stage
        assert "2 stage(s) x 2 microbatch(es)" in rows["pipedp:S=2,M=2"]["plan"]
        assert "peak_memory_mib" not in auto and not group["errors"]


@pytest.mark.slow  # a child process per configuration for its peak RSS
def test_cpu_memory_probe(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--quick", "--batch", "4", "--numerics", "fp32", "--memory",
                 "--configs", "eager;pipedp:S=2,M=2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["resnet18"]["4"]["fp32"]["rows"]
    assert rows["eager"]["peak_memory_mib"] > 0 and rows["pipedp:S=2,M=2"]["peak_memory_mib"] > 0


@pytest.mark.slow  # inductor compiles each model on first use
def test_compile_rows_run_on_cpu_when_asked(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--quick", "--batch", "4", "--numerics", "fp32", "--compile-on-cpu",
                 "--configs", "eager;compile;pipedp:S=1,M=1,compile", "--out", str(out)]) == 0
    group = json.loads(out.read_text())["results"]["resnet18"]["4"]["fp32"]
    assert set(group["rows"]) == {"eager", "compile", "pipedp:S=1,M=1,compile"} and not group["errors"]
    assert ", compiled" in group["rows"]["pipedp:S=1,M=1,compile"]["plan"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_have_memory_and_busy_fractions(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cuda", "--quick", "--batch", "16", "--memory", "--out", str(out),
                 "--configs", "eager;graph;pipedp:graph;pipedp:S=2,M=2,graph"]) == 0
    for group in json.loads(out.read_text())["results"]["resnet18"]["16"].values():
        assert not group["errors"] and len(group["rows"]) == 4
        for row in group["rows"].values():
            assert 0 < row["gpu"]["busy_fraction"] <= 1 and 0 <= row["gpu"]["concurrent_share"] <= 1
            assert row["peak_memory_mib"] > 0


def test_bad_input_is_one_line_and_status_1(capsys):
    assert main(["--device", "cpu", "--models", "resnet18", "--configs", "fast"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown config 'fast'" in line
    assert main(["--device", "cpu", "--quick", "--batch", "0"]) == 1
    assert "--batch must be a comma list of positive ints" in capsys.readouterr().err
    assert main(["--device", "cpu", "--quick", "--numerics", "fp8"]) == 1
    assert "unknown numerics 'fp8'" in capsys.readouterr().err
