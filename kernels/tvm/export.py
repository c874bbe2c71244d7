"""One shared library per target holding the best kernel of every tuned layer.

Rules, and why:

- A kernel takes any batch size (:func:`.builder.schedule` compiles the batch
  as a symbol), so the export has one kernel per layer: operator, problem
  without its batch size, layout, target (:func:`~pipedp.ops.records.layer_key`).
- Where a layer was tuned at several batch sizes, the record tuned at the
  largest one is exported (the fastest there): full batches and microbatches
  are the largest a layer sees, and the rest (a last partial batch) are
  rarer; a timing at a larger batch is also less overhead and more kernel.
  Timings at different sizes are not comparable, so "fastest" never crosses
  sizes.
- A record whose config the template no longer accepts (the template changed
  since) is passed over with a warning, for the layer's record at the next
  smaller batch size if there is one: an old record never stops an export.
- The library is written to a temp file and renamed into place, then its
  sha256 goes into an export record that also maps each layer to its symbol.
  A shared library is code: the runtime loads only a file whose hash matches.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import warnings
from typing import Any, Iterable

import tvm

from pipedp.ops import records as rec
from pipedp.ops.artifact import cpu_flags, sha256
from .builder import compile_module, schedule, streamed
from .ops import DepthwiseConv
from .space import InvalidConfig
from .target import Target, target_key

__all__ = ["export", "choose", "library_name", "versions", "write_library"]


def library_name(key: str) -> str:
    return "kernels-" + key.replace(":", "-").replace("/", "-") + ".so"


def versions() -> dict[str, str]:
    import torch

    import pipedp

    return {"tvm": tvm.__version__, "torch": torch.__version__, "pipedp": pipedp.__version__}


def choose(records: Iterable[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """Per layer key (:func:`~pipedp.ops.records.layer_key`) of target ``key``: its best record at each tuned batch
    size, the one to export first (the largest batch size first)."""
    layers: dict[str, list[dict[str, Any]]] = {}
    for r in rec.best(records).values():
        if r["target"] == key:
            layers.setdefault(rec.layer_key(r["op"], r["problem"], key, r.get("layout", "NCHW")), []).append(r)
    return {lk: sorted(rs, key=lambda r: (-int(r["problem"]["n"]), r["us"])) for lk, rs in sorted(layers.items())}


def _first_that_fits(candidates: list[dict[str, Any]], target: Target, symbol: str,
                     path: str) -> tuple[dict[str, Any], tvm.tirx.PrimFunc] | None:
    """The first record whose config the template still accepts, with its scheduled function (any batch size)."""
    for r in candidates:
        try:
            sch = schedule(DepthwiseConv.from_key(r["problem"]), r["op"], r["config"], target, symbol=symbol)
            return r, sch.mod[symbol]
        except InvalidConfig as e:
            warnings.warn(f"{path}: not exporting the {r.get('layout', 'NCHW')} {r['op']} kernel tuned for "
                          f"{r['problem']}: its config {r['config']} no longer fits the template ({e}); run "
                          f"tune-kernels for this model again to tune it anew", stacklevel=3)
    return None


def write_library(lib: Any, folder: str, name: str) -> str:
    """Export compiled ``lib`` as ``folder/name``, whole or not at all; returns its sha256.

    The library is written beside its final name and renamed over it, so a
    loader never sees half a library (and a crash leaves the previous one).
    """
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + name + ".", suffix=".tmp.so")
    os.close(fd)
    try:
        lib.export_library(tmp)
        digest = sha256(tmp)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return digest


def export(db: str, target: Target) -> dict[str, Any] | None:
    """Build the chosen record of every layer for ``target`` into one library; returns the export record."""
    path = os.path.join(db, rec.RECORDS_FILE)
    key = target_key(target)
    mod = tvm.IRModule()
    symbols: dict[str, str] = {}
    streams: dict[str, str] = {}
    timings: dict[str, dict[str, Any]] = {}
    for lk, candidates in choose(rec.read(path), key).items():
        sym = "pipedp_dw_" + hashlib.sha1(lk.encode()).hexdigest()[:16]
        found = _first_that_fits(candidates, target, sym, path)
        if found is None:
            continue
        r, func = found
        mod[sym] = func
        symbols[lk] = sym
        layout = r.get("layout", "NCHW")
        # torch in the same layout is what the layer runs without this kernel; both timed at the batch size n
        timings[lk] = {"us": r["us"], "torch_us": (r.get("torch_us") or {}).get(layout.lower()),
                       "n": r["problem"]["n"]}
        if out := streamed(r["op"], r["config"]):
            streams[sym] = out
    if not symbols:
        return None
    lib = compile_module(mod, target, streams)
    name = library_name(key)
    digest = write_library(lib, db, name)
    record = {
        "kind": "export", "target": key, "library": name, "sha256": digest, "kernels": symbols, "timings": timings,
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "sse4")))
        if target.kind.name != "cuda" else [], "versions": versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    rec.append(path, record)
    return record
