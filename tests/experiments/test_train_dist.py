"""The README's torchrun example runs as documented: ranks, checkpoint, resume (on another world size too)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from experiments.train_dist import DEFAULT_CKPT, main, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 4 steps an epoch (512 images over 2 replicas, 64 each a step): a resume at step 3 and 6 steps cross an epoch.
SMALL = ["--width", "4", "--batch", "64"]


def _torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m",
           "experiments.train_dist", *SMALL, *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step +(\d+) +loss (\S+)$", out, re.M)}


@pytest.mark.slow  # tens of seconds on 2 cores: the slow run (CI runs it) keeps the default suite short
def test_resume_on_another_world_size_continues_the_same_training(tmp_path):
    whole = _losses(_torchrun(2, "--steps", "6", "--ckpt", str(tmp_path / "whole.pt")).stdout)
    ckpt = str(tmp_path / "run.pt")
    first = _torchrun(2, "--steps", "3", "--save-every", "1", "--ckpt", ckpt).stdout
    assert "data-parallel replica 0 of 2" in first and torch.load(ckpt, weights_only=True)["engine"]["steps"] == 3
    done = _torchrun(4, "--steps", "6", "--ckpt", ckpt, "--resume", "--pp", "2")
    out = done.stdout
    assert "pipeline rank 0 of 2" in out and f"resumed at step 3 from {ckpt}" in out
    # Said once, by rank 0, instead of a warning from each of the 4 ranks.
    assert out.count("written by 2 rank(s), this run has 4") == 1 and "RNG states" not in done.stderr
    rest = _losses(out)
    assert sorted(rest) == [4, 5, 6]  # the steps left, in the data where the first run stopped (the next epoch)
    assert rest == pytest.approx({s: whole[s] for s in rest}, abs=2e-3)


def test_resume_with_nothing_left_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    ckpt = str(tmp_path / "sub" / "run.pt")  # a folder that is not there yet is made
    assert len(train([*SMALL, "--steps", "1", "--ckpt", ckpt])) == 1
    capsys.readouterr()
    assert main([*SMALL, "--steps", "1", "--ckpt", ckpt, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"nothing to do: {ckpt} is at step 1 and --steps is 1" in out and "step   1" not in out


def test_the_checkpoint_goes_to_an_ignored_folder_by_default():
    assert DEFAULT_CKPT == os.path.join("out", "train_dist.pt")
    ignored = subprocess.run(["git", "check-ignore", "-q", DEFAULT_CKPT], cwd=ROOT)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, f"{DEFAULT_CKPT} would show up as an untracked file"


def test_a_batch_larger_than_a_replicas_share_is_a_clear_error():
    # (In a process of its own: before this check such a run looked for steps in an empty loader forever.)
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run([sys.executable, "-m", "experiments.train_dist", "--width", "4", "--batch", "1000"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "--batch 1000 is more than the 512 images" in line and "--batch 512 or less" in line


def test_main_returns_an_exit_status(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--width", "4", "--stages", "two"]) == 1  # one line naming the bad value, no traceback
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m experiments.train_dist: error:") and "'two'" in line
