"""Errors that name the actual problem and its fix (issue 25 items 11-14).

Item 11: a folder that exists but cannot be entered or written is not called
missing. Item 12: a CPU export that needs vector extensions this CPU lacks is
named as such, with the flags and the command that re-exports it here. Item
13: an empty batch is called empty. Item 14: a model whose forward needs two
inputs gets the same clear error with ``stages=1`` as with a cut.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import pipedp
from pipedp.ops import records as R

from ..model_files import DEPTHWISE_NET
from ..reference import sequential_cnn

OPTS = dict(microbatches=2, profile=False, progress=False)


def _engine(model: nn.Module | None = None, **kw) -> pipedp.Engine:
    model = model if model is not None else sequential_cnn()
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.CrossEntropyLoss(),
                       **{**OPTS, **kw})


# -- item 11: a folder that cannot be entered -----------------------------------------------------------------


@contextlib.contextmanager
def _locked(folder: Path, monkeypatch) -> Iterator[None]:
    """``folder`` exists but this user may neither enter nor write it (mode 0600).

    root ignores modes, so there the kernel's answers for an ordinary user are
    played: stat of anything below the folder is refused, and access() says no.
    """
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o600)
    if os.geteuid() == 0:
        inside = str(folder) + os.sep
        real_stat, real_access = os.stat, os.access

        def stat(path, *args, **kw):
            if os.fspath(path).startswith(inside):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real_stat(path, *args, **kw)

        def access(path, mode, *args, **kw):
            p = os.fspath(path)
            if p.startswith(inside) or (p == str(folder) and mode & (os.W_OK | os.X_OK)):
                return False
            return real_access(path, mode, *args, **kw)

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(os, "access", access)
    try:
        yield
    finally:
        monkeypatch.undo()
        os.chmod(folder, 0o700)


@pytest.mark.parametrize("where", ["in it", "below it"])
@pytest.mark.parametrize("action", ["save", "trace"])
def test_a_folder_that_cannot_be_entered_is_not_called_missing(action, where, tmp_path, monkeypatch):
    """Item 11: save/trace into (or below) an existing folder this user may not enter says so, and the fix."""
    engine = _engine(stages=1)
    locked = tmp_path / "locked"
    (locked / "sub").mkdir(parents=True)
    path = locked / "ck.pt" if where == "in it" else locked / "sub" / "ck.pt"
    with _locked(locked, monkeypatch):
        with pytest.raises(PermissionError) as err:
            engine.save(path) if action == "save" else engine.trace(path)
    msg = str(err.value)
    assert "does not exist" not in msg and str(locked) in msg and "permission" in msg.lower(), msg
    assert "chmod" in msg or "another folder" in msg, msg


def test_a_missing_folder_is_still_called_missing(tmp_path):
    engine = _engine(stages=1)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        engine.save(tmp_path / "nope" / "ck.pt")


# -- item 12: an export for another CPU ------------------------------------------------------------------------


BODY = b"\x7fELF a stand-in for an exported kernel library"
FLAG = "avx512_pipedp_test"


def _foreign_cpu_db(db: Path) -> None:
    """A database holding one CPU export that needs a vector extension no CPU has."""
    db.mkdir(parents=True)
    (db / "kernels-cpu-test.so").write_bytes(BODY)
    R.append(db / R.RECORDS_FILE, {"kind": "export", "target": "cpu:test", "library": "kernels-cpu-test.so",
                                   "sha256": hashlib.sha256(BODY).hexdigest(), "kernels": {}, "timings": {},
                                   "cpu_flags": ["avx2", FLAG]})


def _depthwise_net() -> nn.Module:
    scope: dict = {}
    exec(DEPTHWISE_NET, scope)
    return scope["build"]()


def test_tvm_names_the_cpu_features_an_export_needs(tmp_path):
    """Item 12: kernels='tvm' says the export exists but needs FLAG, which this CPU lacks, and to re-export here."""
    db = tmp_path / "db"
    _foreign_cpu_db(db)
    net = _depthwise_net()
    with pytest.raises(RuntimeError) as err:
        pipedp.wrap(net, kernels="tvm", kernel_db=str(db), **OPTS)
    msg = str(err.value)
    assert "holds no exported kernels" not in msg, msg
    assert FLAG in msg and "lacks" in msg and "tune-kernels" in msg and "--target cpu" in msg, msg
    assert all(type(m) is nn.Conv2d for m in net.modules() if isinstance(m, nn.Conv2d))


def test_auto_keeps_torch_on_an_export_for_another_cpu_and_says_why(tmp_path, caplog):
    """Item 12: kernels='auto' trains with torch and logs the missing CPU features once."""
    db = tmp_path / "db"
    _foreign_cpu_db(db)
    with caplog.at_level(logging.INFO, logger="pipedp"):
        engine = pipedp.wrap(_depthwise_net(), kernels="auto", kernel_db=str(db), **OPTS)
    assert engine.kernel_layers == 0
    assert any(FLAG in r.getMessage() for r in caplog.records)


# -- item 13: an empty batch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("microbatches, stages", [(2, 1), (1, 1), (2, 2), ("auto", "auto")])
def test_an_empty_batch_is_called_empty(microbatches, stages):
    """Item 13: a batch of 0 samples is named empty, not 'use microbatches <= 0'."""
    engine = _engine(microbatches=microbatches, stages=stages)
    with pytest.raises(ValueError) as err:
        engine.train_step(torch.zeros(0, 3, 16, 16), torch.zeros(0, dtype=torch.long))
    msg = str(err.value)
    assert "empty" in msg and "<= 0" not in msg, msg


# -- item 14: a model with two inputs ---------------------------------------------------------------------------


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


class _OptionalMask(nn.Module):
    """A second input with a default: plain PyTorch trains it on one tensor, and so does pipedp."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.a(x) if mask is None else self.a(x * mask)


@pytest.mark.parametrize("stages", [1, 2, "auto"])
def test_a_model_with_two_inputs_is_one_clear_error_at_every_stage_count(stages):
    """Item 14: stages=1 refuses a two-input forward as clearly as a cut does, and no message advises stages=1."""
    with pytest.raises(ValueError) as err:
        _engine(_TwoInputs(), stages=stages).train_step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
    msg = str(err.value)
    assert "2 inputs (x, z)" in msg and "one tensor" in msg and "stages=1" not in msg, msg


def test_a_second_input_with_a_default_trains_on_one_stage():
    """Item 14: only inputs without defaults count; forward(x, mask=None) trains with stages=1."""
    engine = _engine(_OptionalMask(), stages=1)
    assert torch.isfinite(engine.train_step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long)))
