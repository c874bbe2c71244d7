"""reproduce-paper end to end on tiny models: results, table, plots, trace, errors."""

from __future__ import annotations

import json
import math

import pytest

from experiments.paper_report import PAPER_SPEEDUP, table_markdown
from experiments.reproduce_paper import main
from tests.experiments.test_data import make_cifar10

TINY = ["--width", "4", "--batch-size", "8", "--microbatches", "2", "--no-progress"]


def test_synthetic_run_writes_results_table_plots_and_a_trace(tmp_path):
    out = tmp_path / "out"
    res = main(["--dataset", "synthetic", "--models", "resnet18,resnet50", "--epochs", "1", "--image-size", "16",
                "--train-images", "32", "--test-images", "12", "--stages", "2", "--trace", str(tmp_path / "t.json"),
                "--out", str(out), *TINY])
    saved = json.loads((out / "results.json").read_text())
    assert [r["model"] for r in saved["runs"]] == ["resnet18", "resnet50"] and saved["machine"]["device"] == "cpu"
    for r in saved["runs"]:
        for side in ("plain", "pipedp"):
            (ep,) = r[side]["epochs"]
            assert ep["time_s"] > 0 and ep["images_per_s"] > 0 and math.isfinite(ep["train_loss"])
            assert 0 <= ep["test_acc"] <= 100
        assert r["speedup"] == pytest.approx(r["plain"]["time_s"] / r["pipedp"]["time_s"])
        assert r["plan_summary"].startswith("2 stage(s)")
    table = (out / "table.md").read_text()
    assert "| resnet18 | synthetic |" in table and "| resnet50 | synthetic |" in table and "n/a" in table
    from PIL import Image

    for png in ("speedup.png", "accuracy.png"):
        with Image.open(out / png) as im:
            assert im.size[0] > 100 and im.size[1] > 100
    for model in ("resnet18", "resnet50"):
        trace = json.loads((tmp_path / f"t_{model}.json").read_text())
        lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert {"stage 0 (cpu)", "stage 1 (cpu)"} <= lanes
    assert res["runs"][0]["model"] == "resnet18"


def test_both_runs_see_the_same_batches(tmp_path):
    # One stage, one microbatch: pipedp's step is plain training, so identical data gives identical numbers.
    pytest.importorskip("sklearn")
    res = main(["--dataset", "digits", "--models", "resnet18", "--epochs", "2", "--train-images", "48",
                "--test-images", "40", "--stages", "1", "--out", str(tmp_path), *TINY[:4], "--microbatches", "1",
                "--no-progress"])
    (r,) = res["runs"]
    for a, b in zip(r["plain"]["epochs"], r["pipedp"]["epochs"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["test_acc"] == b["test_acc"]
    assert [e["epoch"] for e in r["plain"]["epochs"]] == [1, 2]


def test_cifar_table_puts_the_papers_speedup_beside_ours(tmp_path):
    make_cifar10(tmp_path / "data", n=8)
    res = main(["--dataset", "cifar10", "--data-root", str(tmp_path / "data"), "--models", "resnet18", "--epochs", "1",
                "--stages", "2", "--out", str(tmp_path / "out"), *TINY])
    table = table_markdown(res)
    assert "| resnet18 | CIFAR-10 |" in table and f"| {PAPER_SPEEDUP['cifar10']:.2f}x |" in table
    assert (tmp_path / "out" / "table.md").read_text() == table


@pytest.mark.parametrize("argv, match", [
    (["--dataset", "cifar10", "--data-root", "/nonexistent"], "cifar-10-batches-py"),
    (["--dataset", "caltech101"], "pass --data-root"),
    (["--models", "vgg"], "unknown model"),
    (["--batch-size", "2", "--microbatches", "4"], "smaller than --microbatches"),
    (["--stages", "two"], "--stages must be"),
])
def test_bad_arguments_are_clear_errors(tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        main([*argv, "--out", str(tmp_path)])


def test_quick_is_small_and_explicit_choices_win():
    from experiments.reproduce_paper import QUICK, _parser, _resolve

    args = _resolve(_parser().parse_args(["--quick"]))
    assert args.model_list == ["resnet18"] and args.epochs == QUICK["epochs"] and args.train_images == QUICK["train"]
    args = _resolve(_parser().parse_args(["--quick", "--models", "resnet18,resnet34", "--epochs", "3"]))
    assert args.model_list == ["resnet18", "resnet34"] and args.epochs == 3
    assert _resolve(_parser().parse_args([])).model_list == ["resnet18", "resnet34", "resnet50"]
