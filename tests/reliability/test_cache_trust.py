"""Libraries pipedp loads from disk are the ones it checked, under names that stay the same.

Issue 25 item 6: the OpenMP launcher compiled into the per-user cache is
loaded only if it is the library pipedp built there (its sha256 recorded at
build, owned by this user, writable by nobody else); a foreign or damaged
file is never loaded (its constructor never runs) but rebuilt. Item 9: a
layer's library key names the library by its place in the kernel database,
so a library replaced by a symlink to a byte-identical copy still loads in a
new process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipedp
from pipedp.ops import parallel
from pipedp.ops.swap import TunedDepthwiseConv2d

from ..ops.test_swap import exported  # noqa: F401  (a real exported library, built once for this module)

_FOREIGN = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(getenv("PIPEDP_TEST_MARKER"), "w");
  if (f) { fputs("ran", f); fclose(f); }
}
int pipedp_parallel_launch(void* f, void* cdata, int num_task) { return 0; }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty per-user cache, a fresh launcher lookup, and the marker a planted constructor would write."""
    if parallel._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(parallel, "cache_folder", lambda: str(tmp_path / "cache"))
    marker = tmp_path / "constructor-ran"
    monkeypatch.setenv("PIPEDP_TEST_MARKER", str(marker))
    parallel.launcher_address.cache_clear()
    yield tmp_path / "cache", marker
    parallel.launcher_address.cache_clear()


def _plant(path: Path, work: Path) -> None:
    """A foreign library with the launcher's name and symbol, whose constructor leaves a marker when loaded."""
    src = work / "foreign.c"
    src.write_text(_FOREIGN)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([parallel._compiler(), "-shared", "-fPIC", str(src), "-o", str(path)], check=True)


def _launcher_path(folder: Path) -> Path:
    return Path(parallel._build(str(folder)))


def test_a_foreign_library_in_the_cache_is_never_loaded(cache, tmp_path):
    """Item 6: a library planted under the launcher's name is rebuilt, never loaded."""
    folder, marker = cache
    path = _launcher_path(tmp_path / "probe")  # where the launcher goes: its name in any cache folder
    target = folder / path.name
    _plant(target, tmp_path)
    assert parallel.launcher_address() is not None
    assert not marker.exists(), "the planted library's constructor ran inside pipedp"
    assert target.read_bytes() == path.read_bytes()  # rebuilt in place


def test_a_planted_library_beside_a_genuine_checksum_is_rebuilt(cache, tmp_path):
    """Item 6: a checksum file from a genuine build does not vouch for different bytes."""
    folder, marker = cache
    genuine = _launcher_path(folder)
    _plant(genuine, tmp_path)  # same name, the genuine build's checksum kept beside it
    assert parallel.launcher_address() is not None
    assert not marker.exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a file away")
def test_a_launcher_another_user_owns_or_may_write_is_rebuilt(cache, tmp_path):
    """Item 6: bytes and checksum are only trusted in a file only this user could have written."""
    folder, marker = cache
    path = _launcher_path(folder)
    os.chmod(path, 0o777)  # anyone may have written it
    parallel.launcher_address()
    assert os.stat(path).st_mode & 0o022 == 0
    os.chown(path, 65534, 65534)  # another user's file
    parallel.launcher_address.cache_clear()
    assert parallel.launcher_address() is not None
    assert os.stat(path).st_uid == os.geteuid()


def test_the_launcher_is_still_built_once(cache, monkeypatch):
    """Item 6: a genuine cached launcher is loaded as before, without compiling again."""
    folder, _ = cache
    path = _launcher_path(folder)
    calls = []
    monkeypatch.setattr(parallel.subprocess, "run", lambda *a, **k: calls.append(a))
    assert parallel._build(str(folder)) == str(path) and not calls


# -- item 9: a library's key survives a symlink ------------------------------------------------------------------


_LOAD_AND_RUN = r"""
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)
model(torch.randn(8, 3, 16, 16)).sum().backward()
print("ok")
"""


def test_a_library_replaced_by_a_symlink_keeps_its_key_across_processes(exported, tmp_path):  # noqa: F811
    """Item 9: a model saved after its library became a link to a byte-identical copy loads in a new process."""
    root, db_src = exported
    db = tmp_path / "db"
    shutil.copytree(db_src, db)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for lib in db.glob("*.so"):
        shutil.copy(lib, elsewhere / lib.name)
        lib.unlink()
        lib.symlink_to(elsewhere / lib.name)
    sys.path.insert(0, str(root))
    try:
        import net  # the model file the fixture was tuned with
    finally:
        sys.path.remove(str(root))
    model = net.build()
    engine = pipedp.wrap(model, kernels="tvm", kernel_db=str(db), microbatches=2, profile=False, progress=False,
                         sample=(8, 3, 16, 16))
    assert engine.kernel_layers == 2
    saved = tmp_path / "model.pt"
    torch.save(model, saved)
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(saved)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.getcwd()}"})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    keys = {m.kernels.library for m in model.modules() if isinstance(m, TunedDepthwiseConv2d)}
    assert all(k.startswith(str(db.resolve()) + os.sep) for k in keys), keys  # the database's name, not the link's


def test_two_spellings_of_one_database_share_one_key(exported, tmp_path):  # noqa: F811
    """Item 9: the key does not depend on how the database folder was named (a link to it, a relative path)."""
    from pipedp.ops.runtime import load_library

    _, db = exported
    link = tmp_path / "db-link"
    link.symlink_to(db)
    a, b = load_library(str(db), torch.device("cpu")), load_library(str(link), torch.device("cpu"))
    assert a is not None and a.key == b.key
