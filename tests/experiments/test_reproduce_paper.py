"""reproduce-paper end to end on tiny models: results, table, plots, trace, errors; the console script's contract."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import pipedp
from experiments.paper_report import PAPER_SPEEDUP, table_markdown
from experiments.reproduce_paper import main, reproduce
from tests.experiments.test_data import make_cifar10

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--width", "4", "--batch-size", "8", "--microbatches", "2", "--no-progress"]
# A few seconds: one small model, a handful of images.
SMALL = ["--dataset", "synthetic", "--models", "resnet18", "--epochs", "1", "--image-size", "16",
         "--train-images", "16", "--test-images", "8", *TINY]
EXTRA = ("sklearn", "sklearn.datasets", "matplotlib", "matplotlib.pyplot", "PIL", "PIL.Image")


def test_synthetic_run_writes_results_table_plots_and_a_trace(tmp_path):
    out = tmp_path / "out"
    res = reproduce(["--dataset", "synthetic", "--models", "resnet18,resnet50", "--epochs", "1", "--image-size", "16",
                     "--train-images", "32", "--test-images", "12", "--stages", "2", "--trace",
                     str(tmp_path / "t.json"), "--window", "2", "--out", str(out), *TINY])
    saved = json.loads((out / "results.json").read_text())
    assert [r["model"] for r in saved["runs"]] == ["resnet18", "resnet50"] and saved["machine"]["device"] == "cpu"
    for r in saved["runs"]:
        for side in ("plain", "pipedp"):
            (ep,) = r[side]["epochs"]
            assert ep["time_s"] > 0 and ep["images_per_s"] > 0 and math.isfinite(ep["train_loss"])
            assert 0 <= ep["test_acc"] <= 100
        assert r["speedup"] == pytest.approx(r["plain"]["time_s"] / r["pipedp"]["time_s"])
        assert r["plan_summary"].startswith("2 stage(s)")
        # Every timing window's time, both sides: 32 images at batch 8 are 4 steps, windows of 2 (--window 2).
        assert r["window_steps"] == [2, 2]
        for side in ("plain", "pipedp"):
            assert len(r[side]["window_s"]) == 2 and sum(r[side]["window_s"]) == pytest.approx(r[side]["time_s"])
        ratios = [a / b for a, b in zip(r["plain"]["window_s"], r["pipedp"]["window_s"])]
        spread = r["speedup_windows"]
        assert spread["windows"] == 2 and (spread["min"], spread["max"]) == pytest.approx((min(ratios), max(ratios)))
    assert saved["data"] == {"name": "synthetic", "train": 32, "test": 12, "classes": 10, "image_size": 16}
    table = (out / "table.md").read_text()
    assert "| resnet18 | synthetic |" in table and "| resnet50 | synthetic |" in table and "n/a" in table
    s = saved["runs"][0]["speedup_windows"]
    assert f"| {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}, 2) |" in table
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
    res = reproduce(["--dataset", "digits", "--models", "resnet18", "--epochs", "2", "--train-images", "48",
                     "--test-images", "40", "--stages", "1", "--out", str(tmp_path), *TINY[:4], "--microbatches", "1",
                     "--no-progress"])
    (r,) = res["runs"]
    for a, b in zip(r["plain"]["epochs"], r["pipedp"]["epochs"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["test_acc"] == b["test_acc"]
    assert [e["epoch"] for e in r["plain"]["epochs"]] == [1, 2]


def test_cifar_table_puts_the_papers_speedup_beside_ours(tmp_path):
    make_cifar10(tmp_path / "data", n=8)
    res = reproduce(["--dataset", "cifar10", "--data-root", str(tmp_path / "data"), "--models", "resnet18",
                     "--epochs", "1", "--stages", "2", "--out", str(tmp_path / "out"), *TINY])
    table = table_markdown(res)
    assert "| resnet18 | CIFAR-10 |" in table and f"| {PAPER_SPEEDUP['cifar10']:.2f}x |" in table
    assert (tmp_path / "out" / "table.md").read_text() == table


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, match", [
    (["--dataset", "cifar10", "--data-root", "/nonexistent"], "cifar-10-batches-py"),
    (["--dataset", "caltech101"], "pass --data-root"),
    (["--models", "vgg"], "unknown model"),
    (["--batch-size", "2", "--microbatches", "4"], "smaller than --microbatches"),
    (["--stages", "two"], "--stages must be"),
])
def test_bad_arguments_are_clear_errors(tmp_path, capsys, argv, match):
    with pytest.raises((ValueError, OSError), match=match):
        reproduce([*argv, "--out", str(tmp_path)])
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path)]) == 1  # the console script: status 1, one line naming the problem
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("reproduce-paper: error:") and match in line


@pytest.mark.parametrize("argv", [["--epochs", "x"], ["--schedule", "zigzag"], ["--no-such-option"]])
def test_bad_option_values_are_one_line_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert _one_line(capsys.readouterr().err).startswith("reproduce-paper: error: ")


def test_quick_is_small_and_explicit_choices_win():
    from experiments.reproduce_paper import QUICK, _parser, _resolve

    args = _resolve(_parser().parse_args(["--quick"]))
    assert args.model_list == ["resnet18"] and args.epochs == QUICK["epochs"] and args.train_images == QUICK["train"]
    assert args.window == 2 and args.data_root is None and args.trace is None and args.width == QUICK["width"]
    args = _resolve(_parser().parse_args(["--quick", "--models", "resnet18,resnet34", "--epochs", "3"]))
    assert args.model_list == ["resnet18", "resnet34"] and args.epochs == 3
    assert _resolve(_parser().parse_args([])).model_list == ["resnet18", "resnet34", "resnet50"]
    full = _resolve(_parser().parse_args([]))
    assert (full.epochs, full.batch_size, full.train_images, full.image_size, full.window) == (10, 128, None, None, 4)


def test_main_returns_0_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*SMALL, "--out", str(out)]) == 0
    for name in ("results.json", "table.md", "speedup.png", "accuracy.png"):
        assert (out / name).stat().st_size > 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'results.json'}" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["args"]["epochs"] == 1
    # The plan against the strongest alternative its trials timed, not only against plain eager.
    run = res["runs"][0]
    assert run["bar"] in ("plain", "plain channels_last") and run["bar_ms"] > 0 and run["planning_s"] > 0
    assert run["bar"] in [label for label, _ in run["trials"]]
    assert f"pipedp timed its plans against your step at its fastest ({run['bar']}," in printed


def test_help_and_version_exit_0_and_show_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in ("(default: digits)", "(default: pipedp's: your step's math", "(default: 10; 5 with --quick)", "(default: reproduce-out)",
                    "(default: resnet18,resnet34,resnet50; resnet18 with --quick)", "(default: all)",
                    "(default: 4; 2 with --quick)", "(default: none; needed by cifar10, cifar100, caltech101)"):
        assert default in text
    assert "(default: None)" not in text  # every default says what it means
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and pipedp.__version__ in capsys.readouterr().out


def test_every_option_has_help_and_a_default_that_says_what_it_means():
    from experiments.reproduce_paper import _parser

    parser = _parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help and action.default is not None, action.option_strings
        assert f"{' '.join(action.help.split())} (default: {action.default})" in text, action.option_strings


def _without_extra(code: str) -> subprocess.CompletedProcess:
    block = f"import sys; sys.modules.update(dict.fromkeys({EXTRA!r}))\n"  # None there: every import of them fails
    env = {k: v for k, v in os.environ.items() if k != "PIPEDP_DIGITS_NPZ"}
    return subprocess.run([sys.executable, "-c", block + code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_help_needs_no_experiments_extra():
    done = _without_extra("from experiments.reproduce_paper import main; sys.exit(main(['--help']))")
    assert done.returncode == 0, done.stderr
    assert "--dataset" in done.stdout


def test_a_run_that_needs_the_missing_extra_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PIPEDP_DIGITS_NPZ", raising=False)
    for name in EXTRA:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["--dataset", "digits", "--out", str(tmp_path)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "--dataset digits" in line and "pip install 'pipedp[experiments]'" in line
    # Without matplotlib a run still writes its results and table, and says up front the plots will be skipped.
    with pytest.warns(UserWarning, match="plots skipped"):
        assert main([*SMALL, "--out", str(tmp_path / "out")]) == 0
    assert "pipedp[experiments]" in capsys.readouterr().err
    assert (tmp_path / "out" / "table.md").exists() and not (tmp_path / "out" / "speedup.png").exists()
