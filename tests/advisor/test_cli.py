"""pipedp-advise: help with defaults, a tiny run that prints and writes its advice, failures in one line."""

import json

import numpy as np
import pytest

from pipedp import __version__
from pipedp.advisor import cli


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "(default: synthetic)" in out and "--staged" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pipedp-advise (pipedp) {__version__}"


def test_a_tiny_run_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "advice.json"
    status = cli.main(["--width", "4", "--train-images", "64", "--resources", "1", "--batches", "8,16",
                       "--microbatches", "1,2", "--steps", "1", "--accuracy-epochs", "1", "--accuracy", "0.05",
                       "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0 and "<- chosen" in printed and f"wrote {out}" in printed
    advice = json.loads(out.read_text())
    (phase,) = advice["plan"]["phases"]
    assert phase["resources"] == 1 and phase["batch"] in (8, 16) and advice["plan"]["accuracy_at_least"] >= 0.05
    assert len(advice["measured_step_s"]) == 4  # a 1 x 2 x 2 grid: every corner


def test_an_npz_file_is_read_and_a_missing_key_named(tmp_path, capsys):
    rng = np.random.default_rng(0)
    good = tmp_path / "d.npz"
    np.savez(good, train_x=rng.integers(0, 255, (32, 3, 8, 8), dtype=np.uint8), train_y=rng.integers(0, 3, 32),
             test_x=rng.integers(0, 255, (8, 3, 8, 8), dtype=np.uint8), test_y=rng.integers(0, 3, 8))
    task = cli.load_task(str(good), "resnet18", 4, 0.05, None)
    assert task.train_x.dtype.is_floating_point and len(task.train_x) == 32
    assert task.model()(task.train_x[:2]).shape == (2, 3)
    bad = tmp_path / "bad.npz"
    np.savez(bad, train_x=np.zeros((2, 3, 8, 8)))
    assert cli.main(["--data", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks train_y, test_x, test_y" in err


def test_bad_options_fail_in_one_line(capsys):
    assert cli.main(["--batches", "16,x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected comma-separated whole numbers" in err
    assert cli.main(["--accuracy", "2"]) == 1 and "accuracy target must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.slow
def test_ranks_are_measured_through_torchrun(capsys):
    status = cli.main(["--resource", "ranks", "--width", "4", "--train-images", "64", "--resources", "1",
                       "--batches", "8", "--microbatches", "1", "--steps", "1", "--accuracy-epochs", "1",
                       "--accuracy", "0.05"])
    assert status == 0 and "r=1 b=8 m=1" in capsys.readouterr().out
