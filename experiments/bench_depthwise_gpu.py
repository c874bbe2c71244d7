"""GPU benchmark: depthwise kernels vs torch's best layout per shape, and the memory bound at each size.

The depthwise convolutions of MobileNetV2 and EfficientNet-B0 at 32x32
(CIFAR stems) and 224x224 inputs, at batch 64 and 128, in fp32 and bf16:
forward, grad-input and grad-weight each. Per problem and operator the
contenders are torch's NCHW kernel (its native depthwise kernel), torch's
channels_last (cuDNN), and our NCHW and NHWC kernels from a prebuilt
library (``experiments/build_gpu_kernels.py``: compiled here, carried to
the GPU host, which needs only torch and the TVM runtime). Every kernel is
checked against torch on the same data before it is timed; all contenders
are timed in turn, round after round (CUDA events, medians), so a ratio
compares timings taken under the same conditions. The baseline of each row
is torch's faster layout for that row.

- Each row runs in a worker process with a time limit (``--row-timeout``):
  a generated kernel that faults takes its CUDA context down with it (the
  error is sticky: every later CUDA call of that process fails too), so its
  row is recorded as failed and the next row gets a fresh process. A fresh
  one too after a row whose kernel was wrong (it may have written where it
  should not) and after any other failure. This process itself never
  touches the GPU (the HBM copy is timed in the worker too), so nothing of a
  faulted row outlives its worker.
- ``kernels="auto"`` per layer: in each layout, ours is taken where the
  timing rounds measured it faster than torch in that layout by
  ``AUTO_MARGIN`` and fresh rounds confirmed it at least as fast; the
  choice is then timed against torch in rounds of its own, so the ratio
  reported (``auto``) is not one that made the choice (a choice made on
  noise shows up there). At these kernels' 20-50 µs a ratio measured twice
  differs by up to 20% (the 95th percentile of 418 rows on the H100,
  2026-11-25), and a choice on one measurement with no margin was below
  0.95x of torch for 12 layers there.
- The database (``--db``) gives ``kernels="auto"`` the same decision: a
  layer's kernel is marked faster only where auto took it at every batch
  size measured, and a kernel that was wrong, or whose row failed (a
  crash, a CUDA error, a timeout), at any batch size is left out of it.
- The memory bound is the time to move the operator's bytes once (inputs
  and outputs at the problem's dtype) at the speed of a device copy of the
  same number of bytes: at the problem's own size, since an H100's 50 MB L2
  holds many of these tensors (``bound_us``), and at HBM's speed
  (``hbm_bound_us``, a 1 GiB copy); ``fits_l2`` says which applies.

Writes ``depthwise_gpu.json`` (rows, summary, goals, machine) and
``depthwise_gpu.md`` (summary and every row) to ``--out``; ``--db`` also
writes a kernel database whose export holds the library with each layer's
timings, which ``kernels="auto"`` reads (``bench_kernels_train --db``).

    python -m experiments.bench_depthwise_gpu --kernels .gpu/kernels --out OUT --db OUT/db   # on the GPU host
    python -m experiments.bench_depthwise_gpu --dry-run                                        # the plan, anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from pipedp.kernels.tvm.cli import find_depthwise

from pipedp.atomic import write_text
from pipedp.models import get_model
from pipedp.ops import harness, parallel
from pipedp.ops import records as rec
from pipedp.ops.artifact import sha256
from pipedp.ops.layout import arrange
from pipedp.ops.measure import read_manifest
from pipedp.ops.problem import OPS, DepthwiseConv
from pipedp.ops.runtime import _load_runtime, target_for
from pipedp.ops.worker import CandidateFailed, Worker

from .machine import describe
from .report import write_json

__all__ = ["MODELS", "SIZES", "BATCHES", "DTYPES", "BUILD_BATCH", "layers", "Library", "compare", "bench_row",
           "summarize",
           "markdown", "write_db", "main"]

MODELS = ("mobilenet_v2", "efficientnet_b0")
SIZES = (32, 224)
BATCHES = (64, 128)
DTYPES = ("float32", "bfloat16")
BUILD_BATCH = 64  # the batch the library's configs are validated at (kernels take any batch size)
L2_DEFAULT = 50 * 2**20  # an H100's L2, where torch does not report it
HBM_COPY = 1 << 30
GOALS = {"geomean_speedup": 1.2, "auto_min": 0.95, "hbm_fraction_beyond_l2": 0.6}
AUTO_MARGIN = 0.05  # ours must beat torch by this fraction in the timing rounds before auto considers it
_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def layers(models: Iterable[str], sizes: Iterable[int], dtypes: Iterable[str],
           batch: int = BUILD_BATCH) -> list[tuple[str, DepthwiseConv]]:
    """Every distinct depthwise convolution of each model at each input size (32: its CIFAR stem), at ``batch``
    and each dtype, with the set it comes from (``mobilenet_v2@32``); one entry per distinct problem."""
    out: dict[str, tuple[str, DepthwiseConv]] = {}
    for name in models:
        for size in sizes:
            model = get_model(name, cifar=size <= 64)
            for conv in find_depthwise(model, (batch, 3, size, size)):
                for dtype in dtypes:
                    p = dataclasses.replace(conv, dtype=dtype)
                    out.setdefault(json.dumps(p.key(), sort_keys=True), (f"{name}@{size}", p))
    return list(out.values())


def _layer(problem: DepthwiseConv, op: str, layout: str) -> str:
    """A library entry's name: operator, problem without its batch size, layout."""
    key = dict(problem.key())
    key.pop("n", None)
    return json.dumps([op, key, layout], sort_keys=True)


class Library:
    """A prebuilt kernel library and its manifest (round format), its sha256 checked before it is loaded.

    ``load=False`` checks it without loading it (no kernel can be called): what the benchmark's own process
    needs, which leaves the GPU to its workers."""

    def __init__(self, folder: str, device: torch.device, load: bool = True) -> None:
        self.manifest = read_manifest(folder)
        self.path = os.path.join(folder, self.manifest["library"])
        if not os.path.isfile(self.path):
            raise ValueError(f"the library {self.path} is missing: carry the whole folder {folder}")
        if sha256(self.path) != self.manifest["sha256"]:
            raise ValueError(f"refusing to load {self.path}: its sha256 is not its manifest's (changed or "
                             f"half-copied): copy {folder} again")
        self.target = self.manifest["target"]
        cuda = self.target.startswith("cuda")
        here = target_for(device)
        if cuda and self.target != here:
            raise ValueError(f"{folder} is built for {self.target}, this device is {here}: build it with "
                             f"--arch {(here or 'cuda:sm_XX').split(':')[1]}")
        if not cuda and device.type != "cpu":
            raise ValueError(f"{folder} holds CPU kernels ({self.target}): run with --device cpu")
        self.module = _load_runtime(cuda).load_module(self.path) if load else None
        if load and not cuda:
            parallel.route(self.path)
        self.entries = {_layer(DepthwiseConv.from_key(c["problem"]), c["op"], c["layout"]): c
                        for c in self.manifest["candidates"]}

    def entry(self, problem: DepthwiseConv, op: str, layout: str) -> dict | None:
        """The manifest entry of the kernel for ``op`` on ``problem`` (any batch size) in ``layout``, if built."""
        return self.entries.get(_layer(problem, op, layout))

    def kernel(self, problem: DepthwiseConv, op: str, layout: str) -> tuple[Callable[..., object], dict] | None:
        """The kernel for ``op`` on ``problem`` (any batch size) in ``layout`` and its manifest entry, if built."""
        entry = self.entry(problem, op, layout)
        if entry is None:
            return None
        if self.module is None:
            raise RuntimeError(f"{self.path} was checked, not loaded (load=False): its kernels cannot be called")
        return self.module[entry["symbol"]], entry


def _operands(conv: DepthwiseConv, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """x, w, dy drawn on the device (large problems would take seconds to draw on the host)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = _TORCH_DTYPE[conv.dtype]
    return tuple(torch.randn(conv.shapes()[k], generator=g, device=device, dtype=torch.float32).to(dt)
                 for k in "xwy")


def _torch_fn(conv: DepthwiseConv, op: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
              layout: str) -> Callable[[], Any]:
    """torch's own kernel for ``op``, activations in ``layout`` (NCHW: native; NHWC: channels_last, cuDNN)."""
    if layout == "NHWC":
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    if op == "fwd":
        return lambda: F.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.c)
    args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0, 0], conv.c)
    mask = [op == "dgrad", op == "wgrad", False]
    return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, mask)[0 if op == "dgrad" else 1]


def _ours_fn(kernel: Callable[..., object], conv: DepthwiseConv, op: str, x: torch.Tensor, w: torch.Tensor,
             dy: torch.Tensor, layout: str, out_shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    """Our kernel called as the runtime op calls it: tensors arranged for its layout, a fresh output per call."""
    inputs = {"fwd": [arrange(x, layout), w], "dgrad": [arrange(dy, layout), w],
              "wgrad": [arrange(x, layout), arrange(dy, layout)]}[op]
    return lambda: harness.call(kernel, op, layout, inputs, out_shape)


def _copy_fn(nbytes: int, device: torch.device) -> Callable[[], Any]:
    """A copy that reads ``nbytes / 2`` and writes as many: moves ``nbytes``."""
    src = torch.empty(max(nbytes // 2, 64), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _l2_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_DEFAULT)


def _short(conv: DepthwiseConv) -> str:
    return f"C={conv.c} {conv.h}x{conv.w} k{conv.kernel[0]} s{conv.stride[0]}"


def _error(fn: Callable[[], torch.Tensor], ref: torch.Tensor, conv: DepthwiseConv, op: str) -> tuple[float, float]:
    """Max abs error of ``fn``'s result against torch's, and the most that summation order explains."""
    err = (fn().float() - ref.float()).abs().max().item()
    return err, harness.tolerance(conv, op) * max(1.0, ref.float().abs().max().item())


def compare(kernel: Callable[..., object], conv: DepthwiseConv, op: str, layout: str, device: torch.device,
            seed: int = 0) -> tuple[float, float]:
    """:func:`_error` of ``kernel`` on fresh random operands of ``conv`` (what the CUDA tests check)."""
    x, w, dy = _operands(conv, device, seed)
    ref = _torch_fn(conv, op, x, w, dy, "NCHW")()
    return _error(_ours_fn(kernel, conv, op, x, w, dy, layout, tuple(ref.shape)), ref, conv, op)


def bench_row(lib: Library | None, set_name: str, conv: DepthwiseConv, op: str, device: torch.device, rounds: int,
              min_ms: float, hbm_us_per_byte: float | None, seed: int = 0) -> dict[str, Any]:
    """Check and time every contender of ``op`` on ``conv`` side by side; ratios, bound and auto's choice."""
    x, w, dy = _operands(conv, device, seed)
    fns: dict[str, Callable[[], Any]] = {f"torch {v}": _torch_fn(conv, op, x, w, dy, v) for v in ("NCHW", "NHWC")}
    ref = fns["torch NCHW"]()
    row: dict[str, Any] = {"set": set_name, "layer": _short(conv), "problem": conv.key(), "op": op,
                           "dtype": conv.dtype, "n": conv.n, "kernels": {}, "max_err": {}, "wrong": {}}
    for layout in ("NCHW", "NHWC"):
        found = lib.kernel(conv, op, layout) if lib else None
        if found is None:
            continue
        kernel, entry = found
        row["kernels"][layout] = entry["config"]
        fn = _ours_fn(kernel, conv, op, x, w, dy, layout, tuple(ref.shape))
        err, limit = _error(fn, ref, conv, op)
        if err <= limit:
            row["max_err"][layout] = err
            fns[f"ours {layout}"] = fn
        else:  # a wrong kernel is a finding, never a time
            row["wrong"][layout] = f"differs from torch by {err:.3g} (tolerance {limit:.3g})"
    del ref
    us = harness.alternate(fns, device, rounds, min_ms)
    row["us"] = us
    torch_layout = min(("NCHW", "NHWC"), key=lambda v: us[f"torch {v}"])
    row["torch_best_us"], row["torch_layout"] = us[f"torch {torch_layout}"], torch_layout
    ours = {v: us[f"ours {v}"] for v in ("NCHW", "NHWC") if f"ours {v}" in us}
    row["ours_us"] = min(ours.values()) if ours else None
    row["ours_layout"] = min(ours, key=ours.get) if ours else None
    row["speedup"] = row["torch_best_us"] / row["ours_us"] if ours else None
    row["speedup_same_layout"] = {v: us[f"torch {v}"] / t for v, t in ours.items()}
    auto, choice, confirmed = {}, {}, {}
    for v, t in ours.items():  # see the module docstring: a margin, a confirmation, then a timing of its own
        choice[v] = "torch"
        if t * (1 + AUTO_MARGIN) <= us[f"torch {v}"]:
            pair = {"ours": fns[f"ours {v}"], "torch": fns[f"torch {v}"]}
            again = harness.alternate(pair, device, max(rounds, 2), min_ms)
            confirmed[v] = again["torch"] / again["ours"]
            if confirmed[v] >= 1.0:
                choice[v] = "ours"
                final = harness.alternate(pair, device, max(rounds, 2), min_ms)
                auto[v] = final["torch"] / final["ours"]
        if choice[v] == "torch":
            auto[v] = 1.0  # torch's own kernel: the same call as the baseline
    row["auto"], row["auto_min"] = auto, (min(auto.values()) if auto else None)
    row["auto_choice"], row["auto_confirmed"] = choice, confirmed
    nbytes = conv.min_bytes(op)
    l2 = _l2_bytes(device)
    row["bytes"], row["fits_l2"] = nbytes, (nbytes <= l2 if l2 else None)
    row["bound_us"] = harness.alternate({"copy": _copy_fn(nbytes, device)}, device, rounds, min_ms)["copy"]
    row["hbm_bound_us"] = nbytes * hbm_us_per_byte if hbm_us_per_byte else None
    best, hbm_us = row["ours_us"], row["hbm_bound_us"]
    row["bound_fraction"] = row["bound_us"] / best if best else None
    row["hbm_fraction"] = hbm_us / best if best and hbm_us else None
    row["torch_hbm_fraction"] = hbm_us / row["torch_best_us"] if hbm_us else None
    return row


@functools.lru_cache(maxsize=1)  # one library per worker process, loaded when it starts
def _library(folder: str | None, device: str) -> Library | None:
    return Library(folder, torch.device(device)) if folder else None


def _start(folder: str | None, device: str) -> None:
    """A worker's setup: the library loaded (not a row's time)."""
    _library(folder, device)


def _row_job(folder: str | None, device: str, set_name: str, problem: dict[str, Any], op: str, rounds: int,
             min_ms: float, hbm_us_per_byte: float | None) -> dict[str, Any]:
    """:func:`bench_row` in a worker process (module-level, picklable arguments)."""
    row = bench_row(_library(folder, device), set_name, DepthwiseConv.from_key(problem), op, torch.device(device),
                    rounds, min_ms, hbm_us_per_byte)
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # a fault of this row's kernels is this row's (CUDA reports it at the next sync)
        torch.cuda.empty_cache()  # rows of many sizes: give the next one the memory back
    return row


def _hbm_job(device: str, nbytes: int, min_ms: float) -> float:
    """µs per byte of a device copy of ``nbytes`` (in a worker: the benchmark's own process keeps off the GPU)."""
    dev = torch.device(device)
    us = harness.alternate({"copy": _copy_fn(nbytes, dev)}, dev, 3, min_ms)["copy"] / nbytes
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return us


def _geomean(values: Iterable[float | None]) -> float | None:
    vs = [v for v in values if v]
    return math.exp(statistics.fmean(math.log(v) for v in vs)) if vs else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geo-mean speedups (per operator, dtype, input size), auto's worst layer, bandwidth beyond L2, the goals."""
    timed = [r for r in rows if r.get("speedup")]
    s: dict[str, Any] = {"rows": len(rows), "rows_with_kernels": len(timed),
                         "rows_wrong": sum(bool(r.get("wrong")) for r in rows),
                         "rows_failed": sum(_failed(r) for r in rows),
                         "geomean_speedup": _geomean(r["speedup"] for r in timed)}
    for op in OPS:
        s[f"geomean_speedup_{op}"] = _geomean(r["speedup"] for r in timed if r["op"] == op)
        for dtype in DTYPES:
            s[f"geomean_speedup_{op}_{dtype}"] = _geomean(r["speedup"] for r in timed
                                                          if r["op"] == op and r["dtype"] == dtype)
    for size in SIZES:
        s[f"geomean_speedup_{size}"] = _geomean(r["speedup"] for r in timed if r["set"].endswith(f"@{size}"))
    autos = [r["auto_min"] for r in rows if r.get("auto_min")]
    s["auto_min"] = min(autos) if autos else None
    s["auto_below_095"] = sum(a < 0.95 for a in autos)
    big = [r for r in timed if r["op"] in ("fwd", "dgrad") and r.get("fits_l2") is False and r.get("hbm_fraction")]
    s["hbm_fraction_beyond_l2_min"] = min((r["hbm_fraction"] for r in big), default=None)
    s["hbm_fraction_beyond_l2_geomean"] = _geomean(r["hbm_fraction"] for r in big)
    s["torch_hbm_fraction_beyond_l2_geomean"] = _geomean(r["torch_hbm_fraction"] for r in big)
    goals = {f"geomean_speedup_{op} >= {GOALS['geomean_speedup']}": _at_least(s[f"geomean_speedup_{op}"],
                                                                          GOALS["geomean_speedup"]) for op in OPS}
    goals[f"auto never below {GOALS['auto_min']}x of torch"] = _at_least(s["auto_min"], GOALS["auto_min"])
    goals[f"fwd/dgrad beyond L2 >= {GOALS['hbm_fraction_beyond_l2']:.0%} of the HBM bound"] = _at_least(
        s["hbm_fraction_beyond_l2_min"], GOALS["hbm_fraction_beyond_l2"])
    s["goals"] = goals
    return s


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(report: dict[str, Any]) -> str:
    """The summary (geo-means by operator and dtype, goals) and one line per row."""
    m, s = report["machine"], report["summary"]
    lines = [f"# Depthwise kernels on {m.get('gpu', m['device'])}", "",
             f"torch {m['torch']}, CUDA {m.get('cuda', '-')}, {report['date']}; {s['rows_with_kernels']} of "
             f"{s['rows']} rows with our kernels, {s['rows_wrong']} with a wrong kernel, "
             f"{s.get('rows_failed', 0)} failed (crash, CUDA error, timeout)", "",
             "| geo-mean speedup over torch's best layout | " + " | ".join(OPS) + " |",
             "|---|" + "---:|" * len(OPS)]
    for dtype in DTYPES:
        lines.append(f"| {dtype} | " + " | ".join(_f(s.get(f"geomean_speedup_{op}_{dtype}"), "{:.2f}x")
                                                   for op in OPS) + " |")
    lines.append("| all | " + " | ".join(_f(s.get(f"geomean_speedup_{op}"), "{:.2f}x") for op in OPS) + " |")
    lines += ["", f"kernels=\"auto\": worst layer {_f(s['auto_min'], '{:.2f}x')} of torch "
              f"({s['auto_below_095']} below 0.95x); fwd/dgrad beyond L2: "
              f"{_f(s['hbm_fraction_beyond_l2_geomean'], '{:.0%}')} of the HBM bound (geo-mean; worst "
              f"{_f(s['hbm_fraction_beyond_l2_min'], '{:.0%}')}, torch "
              f"{_f(s['torch_hbm_fraction_beyond_l2_geomean'], '{:.0%}')})",
              "", "| goal | met |", "|---|---|"]
    lines += [f"| {g} | {'-' if ok is None else ('yes' if ok else 'no')} |" for g, ok in s["goals"].items()]
    lines += ["", "| set | layer | op | dtype | N | ours µs | torch NCHW µs | torch NHWC µs | speedup | auto | "
              "% HBM bound | in L2 |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        us = r.get("us") or {}
        ours = f"{_f(r.get('ours_us'))} ({r['ours_layout']})" if r.get("ours_layout") else (
            r.get("status") or ("wrong" if r.get("wrong") else "no kernel"))
        lines.append(f"| {r['set']} | {r['layer']} | {r['op']} | {r['dtype']} | {r['n']} | {ours} | "
                     f"{_f(us.get('torch NCHW'))} | {_f(us.get('torch NHWC'))} | {_f(r.get('speedup'), '{:.2f}x')} | "
                     f"{_f(r.get('auto_min'), '{:.2f}x')} | {_f(r.get('hbm_fraction'), '{:.0%}')} | "
                     f"{'-' if r.get('fits_l2') is None else ('yes' if r['fits_l2'] else 'no')} |")
    return "\n".join(lines) + "\n"


def _failed(row: dict[str, Any]) -> bool:
    """Whether a row's worker failed (a crash, a CUDA error, a timeout), rather than the row not being run."""
    status = row.get("status")
    return bool(status) and not status.startswith("not measured")


def write_db(db: str, lib: Library, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A kernel database for ``kernels=``: the library, and an export record with each layer's timings (at the
    largest batch measured) against torch in the same layout, and auto's decision (``faster``: taken at every
    batch size measured), which ``kernels="auto"`` decides by. A kernel that was wrong at any batch size, and
    both kernels of a layer whose row failed at any (which of them faulted is not known), are left out."""
    os.makedirs(db, exist_ok=True)
    name = os.path.basename(lib.path)
    tmp = os.path.join(db, f".{name}.{os.getpid()}.tmp")
    shutil.copyfile(lib.path, tmp)
    os.replace(tmp, os.path.join(db, name))
    bad: set[tuple[str, str]] = set()  # (layer, layout) never to run
    for r in rows:
        conv = DepthwiseConv.from_key(r["problem"])
        for layout in ("NCHW", "NHWC"):
            if _failed(r) or layout in (r.get("wrong") or {}):
                bad.add((_layer(conv, r["op"], layout), layout))
    kernels, timings = {}, {}
    for r in sorted((r for r in rows if r.get("us")), key=lambda r: r["n"]):  # the largest batch last: it wins
        conv = DepthwiseConv.from_key(r["problem"])
        for layout in ("NCHW", "NHWC"):
            if f"ours {layout}" not in r["us"] or (_layer(conv, r["op"], layout), layout) in bad:
                continue
            lk = rec.layer_key(r["op"], conv.key(), lib.target, layout)
            kernels[lk] = lib.entry(conv, r["op"], layout)["symbol"]
            taken = (r.get("auto_choice") or {}).get(layout) == "ours" and timings.get(lk, {}).get("faster", True)
            timings[lk] = {"us": r["us"][f"ours {layout}"], "torch_us": r["us"][f"torch {layout}"], "n": r["n"],
                           "faster": taken}
    record = {"kind": "export", "target": lib.target, "library": name, "sha256": lib.manifest["sha256"],
              "kernels": kernels, "timings": timings, "cpu_flags": lib.manifest.get("cpu_flags", []),
              "versions": lib.manifest.get("versions", {}), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "source": "bench_depthwise_gpu", "left_out": len(bad)}
    rec.append(os.path.join(db, rec.RECORDS_FILE), record)
    return record


def _plan(args: argparse.Namespace) -> list[tuple[str, DepthwiseConv, str]]:
    """(set, problem at its batch, op) of every row, in order: size, batch, dtype, then the models' layers."""
    base = layers(args.models, args.sizes, args.dtypes, batch=1)
    plan = []
    for size in args.sizes:
        for n in args.batches:
            for set_name, conv in base:
                if set_name.endswith(f"@{size}"):
                    plan += [(set_name, dataclasses.replace(conv, n=n), op) for op in args.ops]
    return plan[: args.limit] if args.limit else plan


def _csv(kind: Callable[[str], Any], allowed: Iterable[Any] | None = None) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        if not values or (allowed is not None and any(v not in allowed for v in values)):
            raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(map(str, allowed or ['values']))}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default=".gpu/kernels", help="the library folder build_gpu_kernels wrote "
                   "(round.json and its library); rows without a kernel are timed for torch alone")
    p.add_argument("--models", type=_csv(str, MODELS), default=list(MODELS))
    p.add_argument("--sizes", type=_csv(int), default=list(SIZES), help="input sides (32: the CIFAR stems)")
    p.add_argument("--batches", type=_csv(int), default=list(BATCHES))
    p.add_argument("--dtypes", type=_csv(str, DTYPES + ("float16",)), default=list(DTYPES))
    p.add_argument("--ops", type=_csv(str, OPS), default=list(OPS))
    p.add_argument("--limit", type=int, default=None, help="the first N rows only")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    p.add_argument("--min-ms", type=float, default=10.0, help="milliseconds of calls in each timing")
    p.add_argument("--time-limit", type=float, default=360.0, help="seconds after which no row is started")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to try the script")
    p.add_argument("--row-timeout", type=float, default=60.0, help="seconds a row may take before its worker is "
                   "killed (the row is then recorded as a timeout)")
    p.add_argument("--in-process", action="store_true", help="run the rows in this process (no isolation)")
    p.add_argument("--hbm-copy-mib", type=int, default=HBM_COPY >> 20, help="size of the copy that times HBM")
    p.add_argument("--db", default=None, help="also write a kernel database for kernels= here")
    p.add_argument("--dry-run", action="store_true", help="print the rows and their bytes, time nothing")
    p.add_argument("--out", default=None, help="folder for depthwise_gpu.json and depthwise_gpu.md")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or not args.min_ms > 0:
        raise SystemExit("bench_depthwise_gpu: --rounds must be at least 1 and --min-ms positive")
    plan = _plan(args)
    if args.dry_run:
        for set_name, conv, op in plan:
            print(f"{set_name:20s} {_short(conv):22s} {op:5s} {conv.dtype:8s} N={conv.n:<4d} "
                  f"{conv.min_bytes(op) / 2**20:8.1f} MiB")
        print(f"{len(plan)} rows")
        return {"rows": [], "plan": len(plan)}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_depthwise_gpu: no CUDA device here (--device cpu only tries the script)")
    folder = args.kernels if os.path.exists(os.path.join(args.kernels, "round.json")) else None
    lib = Library(folder, device, load=False) if folder else None  # (checked here; loaded by the workers)
    if lib is None:
        print(f"no kernel library in {args.kernels}: timing torch alone (build one with "
              f"python -m experiments.build_gpu_kernels)")
    big = args.hbm_copy_mib << 20
    deadline = time.monotonic() + args.time_limit
    # A fresh worker after any failed row: a CUDA error leaves its process's context broken for good
    with Worker(_start, (folder, str(device)), restart_after_error=True) as worker:
        hbm_job = (str(device), big, args.min_ms)
        try:
            hbm = _hbm_job(*hbm_job) if args.in_process else worker.call(_hbm_job, hbm_job,
                                                                          max(args.row_timeout, 120.0))
        except CandidateFailed as e:  # no HBM bound then; the rows are still worth timing
            print(f"the HBM copy failed ({e.status}: {e}): rows without the HBM bound")
            hbm = None
        report: dict[str, Any] = {"benchmark": "bench_depthwise_gpu", "date": time.strftime("%Y-%m-%d"),
                                  "machine": describe(device), "settings": vars(args),
                                  "library": lib.manifest["sha256"] if lib else None,
                                  "hbm_copy_gb_per_s": 1e-3 / hbm if hbm else None, "l2_bytes": _l2_bytes(device),
                                  "rows": []}
        for i, (set_name, conv, op) in enumerate(plan, 1):
            if time.monotonic() > deadline:
                report["rows"] += [_unmeasured(s, c, o, "not measured (time limit)") for s, c, o in plan[i - 1:]]
                print(f"time limit of {args.time_limit:g} s: {len(plan) - i + 1} row(s) not measured")
                break
            job = (folder, str(device), set_name, conv.key(), op, args.rounds, args.min_ms, hbm)
            try:
                row = _row_job(*job) if args.in_process else worker.call(_row_job, job, args.row_timeout)
            except CandidateFailed as e:  # a kernel that faulted or hung: the row says so, the run goes on
                report["rows"].append(_unmeasured(set_name, conv, op, f"{e.status}: {e}"))
                print(f"[{i}/{len(plan)}] {set_name} {_short(conv)} {op} {conv.dtype} N={conv.n}: {e.status} ({e})")
                continue
            report["rows"].append(row)
            if row["wrong"] and not args.in_process:
                worker.restart()  # a wrong kernel may have written where it should not: the next row starts clean
            print(f"[{i}/{len(plan)}] {set_name} {row['layer']} {op} {conv.dtype} N={conv.n}: ours "
                  f"{_f(row['ours_us'])} us ({row['ours_layout'] or 'none'}), torch {row['torch_best_us']:.1f} us "
                  f"({row['torch_layout']}), speedup {_f(row['speedup'], '{:.2f}x')}"
                  + (f"; WRONG {row['wrong']}" if row["wrong"] else ""), flush=True)
            if args.out and i % 20 == 0:  # a run cut short keeps what it measured
                _write(args.out, report)
    report["summary"] = summarize(report["rows"])
    if args.db and lib is not None:
        report["db"] = {"path": args.db, "kernels": len(write_db(args.db, lib, report["rows"])["kernels"])}
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        _write(args.out, report)
    return report


def _unmeasured(set_name: str, conv: DepthwiseConv, op: str, status: str) -> dict[str, Any]:
    return {"set": set_name, "layer": _short(conv), "problem": conv.key(), "op": op, "dtype": conv.dtype, "n": conv.n,
            "status": status}


def _write(out: str, report: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    if "summary" not in report:
        report = {**report, "summary": summarize(report["rows"])}
    write_json(os.path.join(out, "depthwise_gpu.json"), report)
    write_text(os.path.join(out, "depthwise_gpu.md"), markdown(report))


if __name__ == "__main__":
    main()
