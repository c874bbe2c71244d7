"""The README's torchrun example runs as documented: 2 ranks, checkpoint, resume."""

import os
import subprocess
import sys

import torch

from experiments.train_dist import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "experiments.train_dist",
           "--width", "4", "--batch", "8", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_torchrun_two_ranks_then_resume(tmp_path):
    ckpt = str(tmp_path / "run.pt")
    out = _torchrun("--steps", "2", "--save-every", "1", "--ckpt", ckpt)
    assert "step   2" in out and "data-parallel replica 0 of 2" in out
    assert torch.load(ckpt, weights_only=True)["engine"]["steps"] == 2
    out = _torchrun("--steps", "3", "--ckpt", ckpt, "--resume", "--pp", "2")
    assert "step   3" in out and "step   1 " not in out and "pipeline rank 0 of 2" in out


def test_main_returns_an_exit_status(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--width", "4", "--stages", "two"]) == 1  # one line naming the bad value, no traceback
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m experiments.train_dist: error:") and "'two'" in line
