"""One shared library per target holding the best kernel of every tuned problem.

The library is written to a temp file and renamed into place, then its
sha256 goes into an export record that also maps each problem to its symbol.
A shared library is code: the runtime loads only a file whose hash matches.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

import tvm

from pipedp.ops import records as rec
from pipedp.ops.artifact import cpu_flags, sha256
from .builder import compile_module, schedule, streamed
from .ops import DepthwiseConv
from .target import Target, target_key

__all__ = ["export", "library_name", "versions"]


def library_name(key: str) -> str:
    return "kernels-" + key.replace(":", "-").replace("/", "-") + ".so"


def versions() -> dict[str, str]:
    import torch

    import pipedp

    return {"tvm": tvm.__version__, "torch": torch.__version__, "pipedp": pipedp.__version__}


def export(db: str, target: Target) -> dict[str, Any] | None:
    """Build the best record of every problem for ``target`` into one library; returns the export record."""
    path = os.path.join(db, rec.RECORDS_FILE)
    key = target_key(target)
    chosen = [r for r in rec.best(rec.read(path)).values() if r["target"] == key]
    if not chosen:
        return None
    mod = tvm.IRModule()
    symbols: dict[str, str] = {}
    streams: dict[str, str] = {}
    timings: dict[str, dict[str, float | None]] = {}
    for r in sorted(chosen, key=lambda r: rec.problem_key(r["op"], r["problem"], key, r.get("layout", "NCHW"))):
        layout = r.get("layout", "NCHW")
        pk = rec.problem_key(r["op"], r["problem"], key, layout)
        # torch in the same layout is what the layer runs without this kernel
        timings[pk] = {"us": r["us"], "torch_us": (r.get("torch_us") or {}).get(layout.lower())}
        sym = "pipedp_dw_" + hashlib.sha1(pk.encode()).hexdigest()[:16]
        conv = DepthwiseConv.from_key(r["problem"])
        mod[sym] = schedule(conv, r["op"], r["config"], target, symbol=sym).mod[sym]
        symbols[pk] = sym
        if out := streamed(r["op"], r["config"]):
            streams[sym] = out
    lib = compile_module(mod, target, streams)
    name = library_name(key)
    fd, tmp = tempfile.mkstemp(dir=db, prefix="." + name + ".", suffix=".tmp.so")
    os.close(fd)
    try:
        lib.export_library(tmp)
        digest = sha256(tmp)
        os.replace(tmp, os.path.join(db, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    record = {
        "kind": "export", "target": key, "library": name, "sha256": digest, "kernels": symbols, "timings": timings,
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "sse4")))
        if target.kind.name != "cuda" else [], "versions": versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    rec.append(path, record)
    return record
