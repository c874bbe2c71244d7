"""Kernel database faults: a damaged database never stops kernels="auto", is a clear error under kernels="tvm",
never gets a tampered library loaded, and a wrap that fails leaves the model's depthwise layers as they were.

The databases here are written by hand (an export record and a stand-in library file) wherever the fault is
found before any library is loaded; only the tests that need a real library use the exported one from
tests/ops/test_swap.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import pipedp
from pipedp.ops import records as R
from pipedp.ops.runtime import KernelChoice
from pipedp.ops.swap import TunedDepthwiseConv2d

from ..model_files import DEPTHWISE_NET
from ..ops.test_swap import exported  # noqa: F401  (a real exported library, built once for this module)

OPTS = dict(microbatches=2, profile=False, progress=False)
LIBRARY = "kernels-cpu-test.so"
BODY = b"\x7fELF a stand-in for an exported kernel library"


def _net() -> nn.Module:
    """tests.model_files.DEPTHWISE_NET: two depthwise layers, the shapes the exported fixture was tuned for."""
    torch.manual_seed(0)
    scope: dict = {}
    exec(DEPTHWISE_NET, scope)
    return scope["build"]()


def _depthwise(net: nn.Module) -> list[nn.Module]:
    return [m for m in net.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]


def _untouched(net: nn.Module) -> bool:
    """Every depthwise layer is the plain nn.Conv2d it was built as."""
    return all(type(m) is nn.Conv2d and "kernels" not in vars(m) for m in _depthwise(net))


def _export(**fields) -> dict:
    record = {"kind": "export", "target": "cpu:test", "library": LIBRARY, "sha256": hashlib.sha256(BODY).hexdigest(),
              "kernels": {}, "timings": {}, "cpu_flags": []}
    record.update(fields)
    return {k: v for k, v in record.items() if v is not None}


def _write(db: Path, **fields) -> None:
    R.append(db / R.RECORDS_FILE, _export(**fields))


def _records_folder(db: Path, monkeypatch) -> None:
    (db / R.RECORDS_FILE).mkdir()


def _unreadable_records(db: Path, monkeypatch) -> None:
    _write(db)

    def refuse(path, *args, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(R, "open", refuse, raising=False)  # as a records file this user may not read


def _no_library(db: Path, monkeypatch) -> None:
    _write(db, library=None)


def _kernels_string(db: Path, monkeypatch) -> None:
    _write(db, kernels="fwd")


def _tampered(db: Path, monkeypatch) -> None:
    _write(db)
    (db / LIBRARY).write_bytes(BODY + b"\0")


def _truncated(db: Path, monkeypatch) -> None:
    _write(db)
    (db / LIBRARY).write_bytes(BODY[:8])


def _missing(db: Path, monkeypatch) -> None:
    _write(db)
    (db / LIBRARY).unlink()


# Each damage: how to make it, and what the error names. All of them are found before any library is loaded.
DAMAGES = {
    "records file is a folder": (_records_folder, "is a folder"),
    "records file unreadable": (_unreadable_records, "cannot read the tuning records"),
    "export without library": (_no_library, "'library'"),
    "kernels as a string": (_kernels_string, "'kernels'"),
    "tampered library": (_tampered, "refusing to load"),
    "truncated library": (_truncated, "refusing to load"),
    "missing library": (_missing, "is missing"),
}
# kernels="tvm" refused the rest with a clear message before (tests/kernels/test_cli.py covers a tampered one)
UNCLEAR_BEFORE = ["records file is a folder", "records file unreadable", "export without library",
                  "kernels as a string"]


def _damaged(db: Path, damage: str, monkeypatch) -> str:
    """A hand-written database at ``db`` (a stand-in library and its export record), damaged as named."""
    db.mkdir(parents=True)
    (db / LIBRARY).write_bytes(BODY)
    make, names = DAMAGES[damage]
    make(db, monkeypatch)
    return names


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_auto_keeps_torch_on_a_damaged_default_cache(damage, tmp_path, monkeypatch, caplog):
    """Item 7b: a damaged default kernel cache makes kernels="auto" warn (problem and fix) and run torch."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the default kernel database is under it
    db = tmp_path / "pipedp" / "kernels"
    names = _damaged(db, damage, monkeypatch)
    net = _net()
    ref = copy.deepcopy(net)
    with caplog.at_level(logging.WARNING, logger="pipedp.ops.swap"):
        engine = pipedp.wrap(net, **OPTS)  # kernels="auto", kernel_db=None: the defaults
    assert engine.kernel_layers == 0 and _untouched(net)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert names in warned and str(db) in warned and "tune-kernels" in warned, warned
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), ref(x))


@pytest.mark.parametrize("damage", UNCLEAR_BEFORE)
def test_tvm_on_a_damaged_database_names_the_file_the_problem_and_the_fix(damage, tmp_path, monkeypatch):
    """Items 7b and 9: kernels="tvm" on a damaged database raises a RuntimeError naming file, problem and fix."""
    db = tmp_path / "db"
    names = _damaged(db, damage, monkeypatch)
    net = _net()
    with pytest.raises(RuntimeError) as err:
        pipedp.wrap(net, kernels="tvm", kernel_db=str(db), **OPTS)
    msg = str(err.value)
    assert names in msg and str(db / R.RECORDS_FILE) in msg and "tune-kernels" in msg, msg
    assert _untouched(net)


def test_auto_never_loads_a_tampered_library(tmp_path, monkeypatch):
    """Item 7b: kernels="auto" falls back to torch on a tampered library and still never loads it."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    loaded = []
    monkeypatch.setattr(tvm_ffi, "load_module", lambda path, *a, **kw: loaded.append(path))
    db = tmp_path / "db"
    _damaged(db, "tampered library", monkeypatch)
    net = _net()
    assert pipedp.wrap(net, kernels="auto", kernel_db=str(db), **OPTS).kernel_layers == 0
    assert loaded == [] and _untouched(net)


def test_an_export_naming_a_function_the_library_lacks_fails_at_load(exported, tmp_path, caplog):  # noqa: F811
    """Item 9: an export record naming a missing function fails when the library loads, not at the first step."""
    _, good = exported
    db = tmp_path / "db"
    shutil.copytree(good, db)
    path = db / R.RECORDS_FILE
    records = R.read(path)
    export = [r for r in records if r["kind"] == "export"][-1]
    export["kernels"][next(iter(export["kernels"]))] = "pipedp_dw_missing"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    net = _net()
    with pytest.raises(RuntimeError, match="lacks 1 function.*pipedp_dw_missing.*tune-kernels"):
        pipedp.wrap(net, kernels="tvm", kernel_db=str(db), **OPTS)
    assert _untouched(net)  # refused before any layer was swapped
    with caplog.at_level(logging.WARNING, logger="pipedp.ops.swap"):
        assert pipedp.wrap(net, kernels="auto", kernel_db=str(db), **OPTS).kernel_layers == 0
    assert _untouched(net) and "pipedp_dw_missing" in caplog.text


def test_a_failed_wrap_puts_the_swapped_layers_back(exported):  # noqa: F811
    """Item 7a: a wrap(kernels="tvm") that fails after swapping leaves the model's layers plain nn.Conv2d."""
    _, db = exported
    net = _net()
    assert pipedp.wrap(copy.deepcopy(net), kernels="tvm", kernel_db=str(db), **OPTS).kernel_layers == 2  # it swaps
    with pytest.raises(RuntimeError, match="to have 3 channels, but got 5"):  # fails in planning, after the swap
        pipedp.wrap(net, kernels="tvm", kernel_db=str(db), sample=(4, 5, 16, 16), **OPTS)
    assert _untouched(net)


def test_a_failed_wrap_restores_an_earlier_engines_kernel_choice():
    """Item 7a: undoing a failed wrap gives a layer swapped by an earlier engine that engine's choice back."""
    net = _net()
    earlier = KernelChoice("earlier.so@0", strict=True)
    for m in _depthwise(net):
        m.__class__ = TunedDepthwiseConv2d  # what an earlier wrap(kernels="tvm") left
        m.kernels = earlier
    with pytest.raises(RuntimeError, match="to have 3 channels, but got 5"):
        pipedp.wrap(net, kernels="torch", sample=(4, 5, 16, 16), **OPTS)
    assert all(type(m) is TunedDepthwiseConv2d and m.kernels is earlier for m in _depthwise(net))


def test_an_auto_layer_whose_database_was_damaged_since_falls_back_to_torch(exported, tmp_path, monkeypatch,  # noqa: F811
                                                                             caplog):
    """Item 7b at run time: an "auto" model used where its library cannot load any more (another process, the
    database damaged since) computes with torch, warned once, instead of failing its forward."""
    from pipedp.ops import runtime

    _, good = exported
    db = tmp_path / "db"
    shutil.copytree(good, db)
    net = _net()
    plain = copy.deepcopy(net)
    engine = pipedp.wrap(net, kernels="auto", kernel_db=str(db), **OPTS)
    swapped = [m for m in _depthwise(net) if isinstance(m, TunedDepthwiseConv2d) and m.kernels is not None]
    if not swapped:
        pytest.skip("no tuned kernel beat torch here, so 'auto' swapped no layer")
    x = torch.randn(4, 3, 16, 16)
    monkeypatch.setattr(runtime, "_loaded", {})  # as in a fresh process
    monkeypatch.setattr(runtime, "_unusable", {})
    (db / R.RECORDS_FILE).write_text("")  # and the database damaged since: no export record any more
    with caplog.at_level(logging.WARNING, logger="pipedp.ops.runtime"):
        out = engine(x)
        engine(x)
    assert torch.allclose(out, plain(x), atol=1e-5)
    assert caplog.text.count("torch computes the depthwise layers") == 1
