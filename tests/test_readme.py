"""The torchrun lines of the distributed guide run in order as written, and the set-up the README's commands
start with shows its progress (every page's examples and commands: tests/test_docs.py)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PROGRAMS = ("torchrun", "tune-kernels", "reproduce-paper")  # console scripts only the venv has


PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "docs")) if "_build" not in d
    for f in fs if f.endswith(".md"))


def _read(page: str) -> str:
    with open(page, encoding="utf-8") as f:
        return f.read()


def _commands(program: str, page: str) -> list[str]:
    """The command lines of ``page``'s shell blocks that start ``program``."""
    blocks = [body for kind, body in re.findall(r"^```(\w*)\n(.*?)^```", _read(page), re.M | re.S)
              if kind in ("bash", "")]
    return [line for block in blocks for line in block.splitlines()
            if line.split() and os.path.basename(line.split()[0]) == program]


def test_the_venvs_programs_are_reachable_as_documented():
    # After `make setup` nothing is on PATH: every such command is written .venv/bin/..., or the page says before
    # it to activate the venv.
    for page in PAGES:
        text = _read(page)
        activate = text.find("source .venv/bin/activate")
        for program in VENV_PROGRAMS:
            for line in _commands(program, page):
                assert line.startswith(".venv/bin/") or -1 < activate < text.index(line), (page, line)


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
    first, second, *_ = _commands("torchrun", os.path.join(ROOT, "docs", "guides", "distributed.md"))
    done = _run_line(first, str(tmp_path))
    assert _steps(done.stdout) == list(range(1, 11))
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == ["train_dist.pt"]  # ignored by git
    done = _run_line(second, str(tmp_path))
    assert "resumed at step 10 from out/train_dist.pt" in done.stdout and _steps(done.stdout) == list(range(11, 21))
    assert done.stdout.count("written by 2 rank(s), this run has 4") == 1 and "RNG states" not in done.stderr
    done = _run_line(second, str(tmp_path))  # again: nothing left to do is a note and exit status 0
    assert "nothing to do: out/train_dist.pt is at step 20 and --steps is 20" in done.stdout and not _steps(done.stdout)


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
