"""Benchmark: one tuned kernel for every batch size - a symbolic batch against a kernel compiled per size.

A kernel serves every batch size of its layer because its batch extent is
symbolic (read from the tensors at each call; see ``kernels/tvm/ops.py``).
This measures what that costs. For a few of MobileNetV2's depthwise
convolutions (the CIFAR-style net, 32x32 input), each operator and layout is
tuned at ``--batch`` as ``tune-kernels`` does, and the best config is
compiled three ways: with a symbolic batch (what is exported and run), for
exactly ``--batch``, and for exactly ``--small`` (a per-size compile of the
same config: the best a fixed-batch kernel could do at that size, and the
alternative design). All of them and torch in the same layout are timed
side by side at both sizes (``--rounds`` rounds, each timing every contender
at both sizes once in turn): times are medians over the rounds, ratios are
medians of the rounds' ratios (each pair timed back to back), and the load
average before and after each kernel's timing is kept with it, since this
machine is shared. With ``--retune`` the operator is also tuned at
``--small``, to show how much a config tuned at the small batch itself would
gain over the one tuned at the large batch (timed at both sizes: a config
that is faster at both came from a luckier search, not from its batch size).

    python -m experiments.bench_batch --trials 8 --rounds 9 --retune --threads 1 --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from typing import Any, Callable

import torch

from pipedp.kernels.tvm import allocator
from pipedp.kernels.tvm import builder as B
from pipedp.kernels.tvm import runner as R
from pipedp.kernels.tvm.ops import OPS, DepthwiseConv
from pipedp.kernels.tvm.target import Target, make_target
from pipedp.kernels.tvm.template import layouts_for
from pipedp.kernels.tvm.tuner import History, tune

from .bench_depthwise import problems
from .machine import describe
from .paired import paired_ratio
from .report import write_json

DEFAULT_PROBLEMS = "0,3,6,9"  # of the 32x32 set: C=32 at 32x32, C=144 at 32x32 stride 2, C=384 at 8x8, C=960 at 4x4


def _timer(kernel: Any, conv: DepthwiseConv, op: str, layout: str, device: torch.device) -> Callable[[], float]:
    return lambda: R.measure_us(kernel, conv, op, device, layout=layout)


Times = dict[str, dict[str, list[float]]]  # size -> contender -> µs of each round


def _alternating(contenders: dict[str, dict[str, Callable[[], float]]], rounds: int) -> Times:
    """µs of every contender at every size in each of ``rounds`` rounds, each timing all of them once in turn.

    Both sizes in every round, so a load that comes and goes on a shared
    machine meets every contender, not the rounds of one size only; the
    order within a size rotates from round to round, so the first call after
    a change of size (whose output may need fresh pages) is not always the
    same contender's.
    """
    times: Times = {size: {k: [] for k in c} for size, c in contenders.items()}
    for i in range(rounds):
        for size, timers in contenders.items():
            names = list(timers)
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[size][name].append(timers[name]())
    return times


def bench_one(prob: DepthwiseConv, op: str, layout: str, small: int, target: Target, device: torch.device,
              trials: int, rounds: int, retune: bool, histories: dict[str, History]) -> dict[str, Any]:
    """Tune ``op`` at ``prob.n``, then time the best config compiled symbolic and per size, at both sizes.

    ``histories`` carries each size's tuning model over between problems, as tune-kernels does within a run.
    """
    at = {"large": prob, "small": dataclasses.replace(prob, n=small)}
    best = tune(prob, op, target, device, trials=trials, layout=layout, history=histories["large"]).best
    if best is None:
        raise RuntimeError(f"no {layout} {op} config for {prob} compiled and matched torch in {trials} trials")
    config = best.config
    symbolic = B.build(prob, op, config, target)
    # (validated for the tuned problem, as the symbolic kernel is: a knob such as streaming stores exists only for
    # outputs as large as the tuned batch's)
    fixed = {name: B.build(prob, op, config, target, batch=conv.n) for name, conv in at.items()}
    retuned = None
    if retune:
        found = tune(at["small"], op, target, device, trials=trials, layout=layout, history=histories["small"]).best
        retuned = found.config if found else None
    cl = layout == "NHWC"
    contenders: dict[str, dict[str, Callable[[], float]]] = {}
    for name, conv in at.items():
        contenders[name] = {
            "symbolic": _timer(symbolic, conv, op, layout, device),
            "fixed": _timer(fixed[name], conv, op, layout, device),
            "torch": lambda conv=conv: R.torch_us(conv, op, device, channels_last=cl),
        }
        if retuned is not None:  # at the large size too: is it better at its own size only, or a luckier search?
            contenders[name]["retuned"] = _timer(B.build(at["small"], op, retuned, target), conv, op, layout, device)
        for kernel in (symbolic, fixed[name]):
            R.check(kernel, conv, op, device, layout)
    load = os.getloadavg()[0]
    rounds_us = _alternating(contenders, rounds)
    return {
        "problem": prob.key(), "op": op, "layout": layout, "batch": prob.n, "small": small, "config": config,
        "retuned_config": retuned, "load_average": [load, os.getloadavg()[0]], "rounds_us": rounds_us,
        "us": {size: {k: statistics.median(v) for k, v in t.items()} for size, t in rounds_us.items()},
        "symbolic_over_fixed": {k: paired_ratio(t["symbolic"], t["fixed"]) for k, t in rounds_us.items()},
        "retuned_over_symbolic": {k: paired_ratio(t["retuned"], t["symbolic"]) for k, t in rounds_us.items()} if retuned
        else None,
        "torch_over_symbolic": {k: paired_ratio(t["torch"], t["symbolic"]) for k, t in rounds_us.items()},
    }


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"kernels": len(rows)}
    for size in ("large", "small"):
        ratios = [r["symbolic_over_fixed"][size] for r in rows]
        out[f"symbolic_over_fixed_{size}"] = {"geomean": _geomean(ratios), "min": min(ratios), "max": max(ratios)}
        out[f"torch_over_symbolic_{size}_geomean"] = _geomean([r["torch_over_symbolic"][size] for r in rows])
    for size in ("large", "small"):
        retuned = [r["retuned_over_symbolic"][size] for r in rows if r["retuned_over_symbolic"]]
        if retuned:
            out[f"retuned_over_symbolic_{size}"] = {"geomean": _geomean(retuned), "min": min(retuned),
                                                    "max": max(retuned)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problems", default=DEFAULT_PROBLEMS, help="indexes into MobileNetV2's 32x32 depthwise set")
    p.add_argument("--batch", type=int, default=128, help="the batch size kernels are tuned at")
    p.add_argument("--small", type=int, default=32, help="the smaller batch size they also run at")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--layouts", default="auto", help="nchw,nhwc (auto: both)")
    p.add_argument("--trials", type=int, default=8, help="tuning trials per kernel")
    p.add_argument("--rounds", type=int, default=5, help="side-by-side timing rounds")
    p.add_argument("--retune", action="store_true", help="also tune at --small and time that config at both sizes")
    p.add_argument("--threads", type=int, default=None, help="torch's (and the kernels') threads (default: torch's)")
    allocator.add_argument(p)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    target = make_target("cpu")
    layouts = list(layouts_for(target)) if args.layouts == "auto" else [v.upper() for v in args.layouts.split(",")]
    if not allocator.measure_with(args.allocator):
        raise SystemExit("--allocator reuse needs glibc (mallopt); use --allocator default here")
    every = [prob for _, prob in problems(["32x32"], None, args.batch)]
    chosen = [every[int(i)] for i in args.problems.split(",")]
    report: dict[str, Any] = {"benchmark": "bench_batch", "date": time.strftime("%Y-%m-%d"),
                              "machine": describe(device), "settings": vars(args), "rows": []}
    histories = {"large": History(), "small": History()}
    print(f"{'problem':24s} {'op':5s} {'layout':6s} {'n':>4s} {'symbolic us':>12s} {'fixed us':>10s} {'sym/fixed':>9s} "
          f"{'torch us':>10s} {'retuned us':>10s}")
    for prob in chosen:
        for op in args.ops.split(","):
            for layout in layouts:
                row = bench_one(prob, op, layout, args.small, target, device, args.trials, args.rounds, args.retune,
                                histories)
                report["rows"].append(row)
                for size, n in (("large", args.batch), ("small", args.small)):
                    t = row["us"][size]
                    name = f"C={prob.c} {prob.h}x{prob.w} s{prob.stride[0]}"
                    retuned = f"{t['retuned']:10.1f}" if "retuned" in t else f"{'-':>10s}"
                    print(f"{name:24s} {op:5s} {layout:6s} {n:4d} {t['symbolic']:12.1f} {t['fixed']:10.1f} "
                          f"{row['symbolic_over_fixed'][size]:9.3f} {t['torch']:10.1f} {retuned}", flush=True)
                if args.out:  # after every kernel, so a cut-off run keeps what it measured
                    write_json(args.out, report)
    report["summary"] = _summary(report["rows"])
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
