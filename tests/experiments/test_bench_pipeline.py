import json

import pytest

from experiments.bench_pipeline import Config, main, parse_config


def test_parse_config():
    assert parse_config("plain") == Config("plain")
    assert parse_config("plain+graph").graph and parse_config("plain+compile").compile
    c = parse_config("pipedp:S=3,M=4,gpipe,graph")
    assert (c.kind, c.stages, c.microbatches, c.schedule, c.graph) == ("pipedp", 3, 4, "gpipe", True)
    assert parse_config("pipedp:S=auto,M=2").stages == "auto"
    with pytest.raises(ValueError, match="cannot read 'X=1'"):
        parse_config("pipedp:X=1")
    with pytest.raises(ValueError, match="unknown config"):
        parse_config("fast")


@pytest.mark.slow
def test_benchmark_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--models", "resnet18", "--batch", "8", "--steps", "1", "--rounds", "2",
                 "--warmup", "1", "--configs", "plain;pipedp:S=2,M=2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]["resnet18"]["rows"]
    assert rows["plain"]["speedup_vs_plain"] == 1.0
    assert rows["pipedp:S=2,M=2"]["images_per_s"] > 0
    assert rows["pipedp:S=2,M=2"]["peak_memory_mib"] > 0
    assert "pipedp plan: 2 stage(s)" in rows["pipedp:S=2,M=2"]["plan"]
    assert data["machine"]["device"] == "cpu"


def test_a_bad_config_is_one_line_and_status_1(capsys):
    assert main(["--device", "cpu", "--models", "resnet18", "--configs", "fast"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown config 'fast'" in line
