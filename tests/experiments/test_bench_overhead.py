import json
import statistics

import pytest
import torch

from experiments import bench_overhead
from pipedp.models import resnet18


def test_the_overhead_benchmark_pairs_each_engine_window_with_a_plain_one(tmp_path):
    out, md = tmp_path / "overhead.json", tmp_path / "overhead.md"
    report = bench_overhead.bench(["--widths", "4", "--batch", "4,8", "--rounds", "3", "--steps", "1",
                                   "--out", str(out), "--md", str(md)])
    assert [(r["width"], r["batch"]) for r in report["rows"]] == [(4, 4), (4, 8)]
    for r in report["rows"]:
        plain, engine = r["windows_ms"]["plain"], r["windows_ms"]["pipedp"]
        assert len(plain) == len(engine) == 3 and min(plain + engine) > 0
        assert r["ratio"] == pytest.approx(statistics.median(e / p for e, p in zip(engine, plain)))
        assert r["extra_ms"] == pytest.approx(statistics.median(e - p for e, p in zip(engine, plain)))
        assert r["ratio_spread"][0] <= r["ratio"] <= r["ratio_spread"][1]
        bare = r["windows_ms"]["pipedp-no-rollback"]
        assert r["ratio_no_rollback"] == pytest.approx(statistics.median(b / p for b, p in zip(bare, plain)))
    assert json.loads(out.read_text())["rows"][0]["model"] == "resnet18" and "extra ms per step" in md.read_text()


def test_the_engine_it_times_runs_the_plain_step():
    """The engine row must be the plan "the plain step": one stage, one microbatch."""
    engine = bench_overhead.plain_plan(resnet18(num_classes=10, width=4), torch.device("cpu"))
    engine.train_step(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))  # the plan is made on the first batch
    assert engine.plan.microbatches == 1 and len(engine.executor.stages) == 1


def test_in_bf16_every_step_runs_autocast_in_channels_last():
    report = bench_overhead.bench(["--widths", "4", "--batch", "4", "--rounds", "1", "--steps", "1",
                                   "--precision", "bf16"])
    assert report["rows"][0]["precision"] == "bf16"
    engine = bench_overhead.plain_plan(resnet18(num_classes=10, width=4), torch.device("cpu"), "bf16",
                                       rollback=False)
    engine.train_step(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    assert engine.plan.microbatches == 1 and engine.training_options.precision == "bf16"
    assert engine.options.rollback is False
