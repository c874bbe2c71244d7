"""Atomic checkpoint files and data-only loading."""

import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pipedp import checkpoint


def test_round_trip(tmp_path):
    obj = {"model": {"w": torch.arange(6.0).view(2, 3)}, "engine": {"steps": 3, "name": "x", "f": 0.5}}
    checkpoint.save(obj, tmp_path / "c.pt")
    back = checkpoint.load(tmp_path / "c.pt")
    assert torch.equal(back["model"]["w"], obj["model"]["w"]) and back["engine"] == obj["engine"]
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_save_killed_midway_leaves_the_old_file(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save({"v": torch.zeros(4)}, path)
    script = textwrap.dedent(f"""
        import os, time, torch
        from pipedp import checkpoint
        os.fsync = lambda fd: time.sleep(600)  # written, not yet renamed: killed here
        checkpoint.save({{"v": torch.ones(5_000_000)}}, {str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 60
        while not any(n.endswith(".tmp") for n in os.listdir(tmp_path)):
            assert time.monotonic() < deadline and proc.poll() is None, "the save never started"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait(30)
    assert torch.equal(checkpoint.load(path)["v"], torch.zeros(4))
    assert sorted(n.endswith(".tmp") for n in os.listdir(tmp_path)) == [False, True]


def test_a_save_that_fails_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save({"v": torch.zeros(2)}, path)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        checkpoint.save({"v": torch.ones(2), "f": lambda: 0}, path)  # a lambda cannot be pickled
    assert torch.equal(checkpoint.load(path)["v"], torch.zeros(2))
    assert os.listdir(tmp_path) == ["c.pt"]


class _Code:
    pass


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt"):
        checkpoint.load(tmp_path / "junk.pt")
    full = tmp_path / "full.pt"
    checkpoint.save({"v": torch.ones(1000)}, full)
    (tmp_path / "cut.pt").write_bytes(full.read_bytes()[:500])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        checkpoint.load(tmp_path / "cut.pt")
    torch.save({"obj": _Code()}, tmp_path / "code.pt")  # arbitrary objects: refused, never unpickled
    with pytest.raises(ValueError, match="plain containers"):
        checkpoint.load(tmp_path / "code.pt")
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint.save({}, tmp_path / "nodir" / "c.pt")
