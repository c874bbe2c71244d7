"""Build the kernel library the GPU benchmark measures: every benchmark problem, compiled here for a CUDA arch.

The GPU host has torch and the TVM runtime but no compiler, so the kernels
of ``experiments/bench_depthwise_gpu.py`` are compiled here (nvcc, no GPU
needed) into one library with a manifest in the tuning rounds' format
(``round.json``: target, library and its sha256, and per kernel its symbol,
operator, problem, layout and config; see :mod:`pipedp.kernels.tvm.remote`).
Every distinct depthwise problem of the benchmark's models and input sizes,
each dtype, each operator and each layout gets one kernel (any batch size)
with a config from :func:`pipedp.kernels.tvm.defaults.default_config` or,
with ``--records``, the best measured config in those tuning records.

Because the folder is a round, ``python -m pipedp.ops.measure FOLDER`` on
the GPU host measures it as a tuning round too, and ``tune-kernels
--remote-round`` can take those measurements in; a kernel that does not
compile is left out (its row then says so) rather than sinking the library.

    python -m experiments.build_gpu_kernels --arch sm_90 --out .gpu/kernels        # about 5-10 minutes on 2 cores
    python -m experiments.build_gpu_kernels --models mobilenet_v2 --sizes 32 --dtypes float32 --out /tmp/k
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from pipedp.kernels.tvm import remote
from pipedp.kernels.tvm.builder import schedule
from pipedp.kernels.tvm.defaults import default_config
from pipedp.kernels.tvm.space import InvalidConfig
from pipedp.kernels.tvm.target import Target, make_target, target_key

from pipedp.ops import records as rec
from pipedp.ops.problem import OPS, DepthwiseConv

from .bench_depthwise_gpu import BUILD_BATCH, DTYPES, MODELS, SIZES, _csv, layers

__all__ = ["main", "build"]

LAYOUTS = ("NCHW", "NHWC")


def _tuned(records: str | None, key: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The best measured config per (problem without batch, op, layout) in ``records`` (none: no records)."""
    best: dict[tuple[str, str, str], tuple[float, dict[str, Any]]] = {}
    for r in (rec.best(rec.read(records)).values() if records else ()):
        if r.get("target") == key:
            k = _name(r["problem"], r["op"], r.get("layout", "NCHW"))
            if k not in best or r["us"] < best[k][0]:
                best[k] = (r["us"], r["config"])
    return {k: v[1] for k, v in best.items()}


def _name(problem: dict[str, Any], op: str, layout: str) -> tuple[str, str, str]:
    return (repr(sorted((k, v) for k, v in problem.items() if k != "n")), op, layout)


def _config(tuned: dict[tuple[str, str, str], dict[str, Any]], conv: DepthwiseConv, op: str, layout: str,
            target: Target, symbol: str) -> tuple[dict[str, Any], Any]:
    """The tuned config where there is one that fits the template (at the build batch), else the default; and
    the scheduled function."""
    config = tuned.get(_name(conv.key(), op, layout))
    if config is not None:
        try:
            return config, schedule(conv, op, config, target, symbol=symbol).mod[symbol]
        except InvalidConfig:
            pass
    config = default_config(conv, op, layout)
    return config, schedule(conv, op, config, target, symbol=symbol).mod[symbol]


def build(out: str, arch: str, models: list[str], sizes: list[int], dtypes: list[str], ops: list[str],
          layouts: list[str], records: str | None = None, limit: int | None = None,
          log: Any = print) -> dict[str, Any]:
    """Schedule one kernel per (problem, dtype, op, layout), compile them as one library, write it and its
    manifest to ``out``; returns the manifest."""
    target = make_target("cuda", arch)
    key = target_key(target)
    tuned = _tuned(records, key)
    funcs: dict[str, Any] = {}
    origin: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    for _, conv in layers(models, sizes, dtypes, BUILD_BATCH)[:limit]:
        for op in ops:
            for layout in layouts:
                sym = f"pipedp_bench_{len(funcs)}"
                config, funcs[sym] = _config(tuned, conv, op, layout, target, sym)
                origin[sym] = {"symbol": sym, "op": op, "problem": conv.key(), "layout": layout, "config": config}
    log(f"{len(funcs)} kernels scheduled in {time.time() - t0:.0f} s; compiling for {arch} (one nvcc run)")
    lib, bad = remote.compile_candidates(funcs, {}, target)
    for sym in sorted(bad):
        c = origin[sym]
        log(f"left out (does not compile): {c['layout']} {c['op']} {c['problem']} {c['config']}")
    entries = [{"id": i, **c} for i, c in enumerate(c for s, c in origin.items() if s not in bad)]
    manifest = remote.write_round(out, lib, 0, key, target, entries)
    size = os.path.getsize(os.path.join(out, manifest["library"])) / 2**20
    log(f"{len(entries)} kernels in {os.path.join(out, manifest['library'])} ({size:.1f} MiB), "
        f"{time.time() - t0:.0f} s in all")
    return manifest


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="sm_90", help="the GPU's arch (sm_90: H100/H200)")
    p.add_argument("--models", type=_csv(str, MODELS), default=list(MODELS))
    p.add_argument("--sizes", type=_csv(int), default=list(SIZES))
    p.add_argument("--dtypes", type=_csv(str, DTYPES + ("float16",)), default=list(DTYPES))
    p.add_argument("--ops", type=_csv(str, OPS), default=list(OPS))
    p.add_argument("--layouts", type=_csv(str.upper, LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--records", default=None, help="tuning records (records.jsonl) whose best configs to take "
                   "where they have one")
    p.add_argument("--limit", type=int, default=None, help="the first N problems only")
    p.add_argument("--out", default=".gpu/kernels")
    args = p.parse_args(argv)
    return build(args.out, args.arch, args.models, args.sizes, args.dtypes, args.ops, args.layouts, args.records,
                 args.limit)


if __name__ == "__main__":
    main()
