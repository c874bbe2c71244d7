"""Benchmark: tuned depthwise kernels vs torch's best layout, and our tuner vs MetaSchedule.

The problems are MobileNetV2's depthwise convolutions at 32x32 (batch 128,
the CIFAR-style net) and 224x224 (batch 32, the ImageNet net). For each
problem and operator (forward, grad-input, grad-weight) our tuner searches
``--trials`` candidates per layout; torch runs the same problem in NCHW and in
channels_last, and the better of the two is the baseline. The tuned kernels
and torch are then timed side by side (``--rounds`` rounds, each timing
every contender once in turn; medians), so a ratio never compares a tuner's
luckiest timing with a baseline taken under another load. Reported per
kernel: µs of each, speedup over torch's best layout, and the fraction of the
memory-bandwidth bound reached (a copy of the bytes the operator must move,
see ``kernels/tvm/roofline.py``). Outputs are fresh tensors on every call on
both sides, as in training; ``--allocator reuse`` (the default) keeps freed
memory for reuse, as jemalloc/tcmalloc do, so a 50 MB output is not a fresh
mapping faulted in page by page on every call (glibc's default above 32 MiB).
``--metaschedule K`` also tunes the first K forward problems with TVM's
MetaSchedule at the same trial budget and records both tuners' best-so-far
curves, MetaSchedule's candidates re-timed with our harness.

    python -m experiments.bench_depthwise --target cpu --trials 32 --out experiments/results/depthwise_cpu.json
    python -m experiments.bench_depthwise --target cuda --trials 64 --metaschedule 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any
from unittest import mock

import torch
from pipedp.kernels.tvm import allocator
from pipedp.kernels.tvm import builder as B
from pipedp.kernels.tvm import runner as R
from pipedp.kernels.tvm.cli import find_depthwise
from pipedp.kernels.tvm.ops import OPS, DepthwiseConv, compute
from pipedp.kernels.tvm.roofline import bound_us
from pipedp.kernels.tvm.target import Target, make_target
from pipedp.kernels.tvm.template import layouts_for
from pipedp.kernels.tvm.tuner import History, tune

from pipedp.models import mobilenet_v2

from .machine import describe
from .report import write_json

SETS = {
    "32x32": (lambda: mobilenet_v2(cifar=True), (128, 3, 32, 32)),
    "224x224": (lambda: mobilenet_v2(cifar=False), (32, 3, 224, 224)),
}


def problems(which: list[str], limit: int | None, batch: int | None = None) -> list[tuple[str, DepthwiseConv]]:
    out = []
    for name in which:
        if name not in SETS:
            raise SystemExit(f"--sets: unknown set {name!r}; choose from {','.join(SETS)}")
        make, shape = SETS[name]
        found = find_depthwise(make(), (batch or shape[0], *shape[1:]))
        out += [(name, p) for p in found[:limit]]
    return out


def _ms_build(mod: Any, target: Any, _params: Any = None) -> Any:
    import tvm

    return tvm.compile(mod, target=target).mod


def metaschedule_curve(conv: DepthwiseConv, op: str, layout: str, target: Target, trials: int,
                       device: torch.device) -> dict[str, list[float]]:
    """MetaSchedule's best µs after each trial on the same compute, at the same budget (its own space and model).

    ``own`` is what its runner measured (arguments allocated once); ``ours``
    re-times every candidate it measured with our harness (a fresh output per
    call, as torch's op and ours are timed), so the two tuners are compared
    on one clock. Its runner processes get torch's thread count, as ours do.
    """
    import tvm
    from tvm import s_tir, te
    from tvm.s_tir import meta_schedule as ms

    func = te.create_prim_func(compute(conv, op, layout)).with_attr("global_symbol", "main")
    if target.kind.name == "llvm":  # MetaSchedule's CPU rules need the core count in the target
        target = tvm.target.Target({**dict(target.export()), "num-cores": len(os.sched_getaffinity(0))})
    runner_env = {"TVM_NUM_THREADS": str(torch.get_num_threads())}  # its runner processes inherit it
    with mock.patch.dict(os.environ, runner_env), tempfile.TemporaryDirectory() as work:
        db = ms.tune_tir(
            mod=tvm.IRModule({"main": func}), target=target, work_dir=work, max_trials_global=trials,
            num_trials_per_iter=8, builder=ms.builder.LocalBuilder(f_build=_ms_build, timeout_sec=120),
            runner=ms.runner.LocalRunner(timeout_sec=120), seed=0,
        )
        records = list(db.get_all_tuning_records())
    own, ours, best_own, best_ours = [], [], math.inf, math.inf
    for rec in records:
        vals = [float(s) for s in rec.run_secs or []]
        if vals and all(v < 1e9 for v in vals):
            best_own = min(best_own, statistics.fmean(vals) * 1e6)
            sch = s_tir.Schedule(rec.workload.mod)
            rec.trace.apply_to_schedule(sch, remove_postproc=False)
            kernel = B.runnable(B.compile_module(sch.mod, target), "main", target)
            R.check(kernel, conv, op, device, layout)
            best_ours = min(best_ours, R.measure_us(kernel, conv, op, device, layout=layout))
        own.append(best_own)
        ours.append(best_ours)
    return {"own": own, "ours": ours}


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def side_by_side(contenders: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median µs of each contender over ``rounds`` rounds in which each is timed once, in turn.

    A tuner's best-so-far is the minimum of many noisy timings (biased low),
    and on a shared machine a baseline timed minutes later may meet another
    load; timing the chosen kernels and torch alternately gives a ratio both
    sides of which saw the same machine.
    """
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, timer in contenders.items():
            times[name].append(timer())
    return {k: statistics.median(v) for k, v in times.items()}


def bench_kernel(set_name: str, prob: DepthwiseConv, op: str, layouts: list[str], target: Target,
                 device: torch.device, trials: int, rounds: int = 3, history: History | None = None) -> dict[str, Any]:
    """Tune ``op`` on ``prob`` in every layout, then time the best of each and torch in both layouts side by side."""
    t0 = time.time()
    tuned = {layout: tune(prob, op, target, device, trials=trials, layout=layout, history=history)
             for layout in layouts}
    best_cfg = {layout: r.best.config for layout, r in tuned.items() if r.best}

    def timer(layout: str) -> Any:
        kernel = B.build(prob, op, best_cfg[layout], target)
        return lambda: R.measure_us(kernel, prob, op, device, layout=layout)

    contenders: dict[str, Any] = {layout: timer(layout) for layout in best_cfg}
    contenders["torch nchw"] = lambda: R.torch_us(prob, op, device, False)
    contenders["torch nhwc"] = lambda: R.torch_us(prob, op, device, True)
    timed = side_by_side(contenders, rounds)
    base = {"nchw": timed["torch nchw"], "nhwc": timed["torch nhwc"]}
    ours = {layout: timed[layout] for layout in best_cfg}
    best_layout = min(ours, key=ours.get) if ours else None
    best = ours.get(best_layout, math.nan) if best_layout else math.nan
    torch_best = min(base.values())
    bound = bound_us(prob, op, device)
    return {
        "set": set_name, "problem": prob.key(), "op": op, "us": ours.get(best_layout), "layout": best_layout,
        "us_by_layout": ours, "config": best_cfg.get(best_layout),
        "tuned_us_by_layout": {layout: r.best.us for layout, r in tuned.items() if r.best},
        "torch_us": base, "speedup": torch_best / best if ours else None,
        # Same layout on both sides: what a model that keeps its memory format gains.
        "speedup_same_layout": {k: base[k.lower()] / v for k, v in ours.items()},
        "bound_us": bound, "bandwidth_fraction": bound / best if ours else None,
        "torch_bandwidth_fraction": bound / torch_best,
        "curves": {layout: r.best_so_far() for layout, r in tuned.items()}, "tune_s": time.time() - t0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sets", default="32x32,224x224")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each set")
    p.add_argument("--batch", type=int, default=None, help="batch size instead of the set's (128 / 32)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--layouts", default="auto", help="nchw,nhwc (auto: every layout the target has)")
    p.add_argument("--trials", type=int, default=32, help="per kernel and layout")
    p.add_argument("--rounds", type=int, default=3, help="side-by-side timing rounds of the tuned kernels and torch")
    p.add_argument("--no-transfer", dest="transfer", action="store_false",
                   help="tune every problem from scratch (default: the model carries over within a set, as in "
                        "tune-kernels)")
    p.add_argument("--metaschedule", type=int, default=0, help="also tune the first K fwd problems with MetaSchedule")
    allocator.add_argument(p)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.target == "cuda" else "cpu")
    arch = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    target = make_target(args.target, arch)
    layouts = list(layouts_for(target)) if args.layouts == "auto" else [v.upper() for v in args.layouts.split(",")]
    if not allocator.measure_with(args.allocator):
        raise SystemExit("--allocator reuse needs glibc (mallopt); use --allocator default here")
    report: dict[str, Any] = {"benchmark": "bench_depthwise", "date": time.strftime("%Y-%m-%d"),
                              "machine": describe(device), "settings": vars(args),
                              "rows": [], "metaschedule": []}
    rows = report["rows"]
    probs = problems(args.sets.split(","), args.limit, args.batch)
    histories: dict[str, History] = {}  # per set, as tune-kernels tunes one model
    for set_name, prob in probs:
        for op in args.ops.split(","):
            history = histories.setdefault(set_name, History()) if args.transfer else None
            row = bench_kernel(set_name, prob, op, layouts, target, device, args.trials, args.rounds, history)
            rows.append(row)
            base = row["torch_us"]
            mine = "  ".join(f"{k} {v:9.1f}" for k, v in row["us_by_layout"].items())
            print(f"{set_name:8s} C={prob.c:4d} {prob.h}x{prob.w} s{prob.stride[0]} {op:5s} ours {mine}  "
                  f"torch NCHW {base['nchw']:9.1f} NHWC {base['nhwc']:9.1f}  speedup {row['speedup'] or math.nan:5.2f}x  "
                  f"{100 * (row['bandwidth_fraction'] or 0):4.0f}% of bw bound", flush=True)
            if args.out:  # after every kernel, so a cut-off run keeps what it measured
                write_json(args.out, report)
    ms_layout = layouts[-1]  # the layout our template is strongest in (NHWC on CPU)
    for set_name, prob in probs[: args.metaschedule]:
        ours = next(r for r in rows if r["problem"] == prob.key() and r["op"] == "fwd" and r["set"] == set_name)
        ours_curve = ours["curves"][ms_layout]
        curves = metaschedule_curve(prob, "fwd", ms_layout, target, args.trials, device)
        curve = curves["ours"]
        ms_best = min(curve) if curve else math.inf
        reach = next((i + 1 for i, v in enumerate(ours_curve) if v <= ms_best), None)
        report["metaschedule"].append({
            "set": set_name, "problem": prob.key(), "layout": ms_layout, "metaschedule_curve": curve,
            "metaschedule_curve_own_runner": curves["own"], "ours_curve": ours_curve,
            "metaschedule_best_us": ms_best, "ours_best_us": min(ours_curve), "ours_trials_to_reach_it": reach})
        print(f"MetaSchedule {set_name} C={prob.c} fwd {ms_layout}: best {ms_best:.1f} us in {len(curve)} trials "
              f"(its runner: {min(curves['own'], default=math.inf):.1f} us); ours {min(ours_curve):.1f} us, "
              f"reached MetaSchedule's best after {reach} trials", flush=True)
    summary: dict[str, Any] = {
        "kernels": len(rows),
        "geomean_speedup": _geomean([r["speedup"] for r in rows if r["speedup"]]),
        "geomean_bandwidth_fraction": _geomean([r["bandwidth_fraction"] for r in rows if r["bandwidth_fraction"]]),
        "geomean_torch_bandwidth_fraction": _geomean([r["torch_bandwidth_fraction"] for r in rows]),
    }
    for op in OPS:
        summary[f"geomean_speedup_{op}"] = _geomean([r["speedup"] for r in rows if r["op"] == op and r["speedup"]])
    for name in SETS:
        summary[f"geomean_speedup_{name}"] = _geomean([r["speedup"] for r in rows if r["set"] == name and r["speedup"]])
    for layout in layouts:
        summary[f"geomean_speedup_same_layout_{layout}"] = _geomean(
            [r["speedup_same_layout"][layout] for r in rows if layout in r["speedup_same_layout"]])
    report["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
