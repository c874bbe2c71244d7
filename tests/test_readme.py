"""The README's commands and its "Use" example run as written, on a CPU, from a fresh checkout's point of view."""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import pipedp.models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PROGRAMS = ("torchrun", "tune-kernels", "reproduce-paper")  # console scripts only the venv has


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _blocks(lang: str, after: str = "") -> list[str]:
    """The README's fenced blocks of ``lang`` ('' for the shell ones) from the heading ``after`` on."""
    text = _readme()
    text = text[text.index(after):] if after else text
    return [body for kind, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S) if kind == lang]


def _commands(program: str) -> list[str]:
    return [line for block in _blocks("") for line in block.splitlines()
            if line.split() and os.path.basename(line.split()[0]) == program]  # (some blocks are not shell)


def test_the_venvs_programs_are_reachable_as_documented():
    # After `make setup` nothing is on PATH: every such command is written .venv/bin/..., or the README says before
    # it to activate the venv.
    text = _readme()
    activate = text.find("source .venv/bin/activate")
    for program in VENV_PROGRAMS:
        for line in _commands(program):
            assert line.startswith(".venv/bin/") or -1 < activate < text.index(line), line


def _run_line(line: str, cwd: str) -> subprocess.CompletedProcess:
    """One README command line, as written, from ``cwd`` standing in for the checkout's root."""
    argv = shlex.split(line, comments=True)
    assert argv[0].startswith(".venv/bin/"), line
    argv[0] = os.path.join(os.path.dirname(sys.executable), argv[0][len(".venv/bin/"):])  # the venv running the tests
    if not os.path.exists(argv[0]):
        pytest.skip(f"{argv[0]} is not installed beside {sys.executable}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, line + "\n" + done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _steps(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step +(\d+) ", out, re.M)]


@pytest.mark.slow  # tens of seconds on 2 cores: the slow run (CI runs it) keeps the default suite short
def test_the_torchrun_lines_run_in_order_as_written(tmp_path):
    # A temporary folder stands in for the checkout's root, so a checkpoint of the developer's own is not touched.
    first, second = _commands("torchrun")
    done = _run_line(first, str(tmp_path))
    assert _steps(done.stdout) == list(range(1, 11))
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == ["train_dist.pt"]  # ignored by git
    done = _run_line(second, str(tmp_path))
    assert "resumed at step 10 from out/train_dist.pt" in done.stdout and _steps(done.stdout) == list(range(11, 21))
    assert done.stdout.count("written by 2 rank(s), this run has 4") == 1 and "RNG states" not in done.stderr
    done = _run_line(second, str(tmp_path))  # again: nothing left to do is a note and exit status 0
    assert "nothing to do: out/train_dist.pt is at step 20 and --steps is 20" in done.stdout and not _steps(done.stdout)


def test_the_use_example_runs_on_a_cpu(tmp_path, monkeypatch, capsys):
    # The stand-ins are the ones the README names below the block: one random batch, random images, width 4.
    text = " ".join(_readme().split())
    assert "`loader` is one random batch of 128, `x_val` 8 random images, and `resnet50` has base width 4" in text
    (block, *_) = _blocks("python", after="## Use")
    monkeypatch.setattr(pipedp.models, "resnet50", functools.partial(pipedp.models.resnet50, width=4))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    loader = [(torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,)))]
    scope = {"loader": loader, "x_val": torch.randn(8, 3, 32, 32)}
    exec(compile(block, "README.md (Use)", "exec"), scope)
    assert "pipedp plan" in capsys.readouterr().out
    assert math.isfinite(scope["loss"].item()) and scope["logits"].shape == (8, 10)
    assert (tmp_path / "ckpt.pt").exists() and scope["cuda"] == torch.cuda.is_available()


def test_setup_shows_progress(tmp_path):
    # `make setup` took minutes of silent `pip -q`: pip now shows its downloads, and each phase is announced.
    if shutil.which("make") is None:
        pytest.skip("no make")
    done = subprocess.run(["make", "-n", "-B", "setup", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pips = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert len(pips) == 2 and not any(re.search(r"\s(-q|--quiet)\b", line) for line in pips), pips
    assert done.stdout.count('echo "== setup:') >= 3
