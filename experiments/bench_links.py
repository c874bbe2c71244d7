"""Benchmark: data parallelism and pipelines across a slow link, against DDP and its compression hooks.

Where the gradient all-reduce waits on the link, a pipeline that sends only
activations may win. For each link rate this makes an emulated cluster of 2
nodes (:mod:`experiments.cluster`: network namespaces, links shaped by
``tc``), runs :mod:`experiments.links_worker` on both under torchrun (gloo,
1 process x ``--threads`` threads per node), and reports per model the step
of every configuration (DDP, DDP with the fp16 hook, DDP with PowerSGD,
pipedp data parallel with and without a 16-bit reduce, the pipeline over 2
ranks at each microbatch count, ``pp="auto"`` and ``pp="auto"`` allowed a bf16
all-reduce) in alternating windows, the fastest exact one, and what each
``pp="auto"`` chose; per rate, each link's drops (a dropped packet stalls
TCP). Needs root (see the cluster module).

    python -m experiments.bench_links --rates none,1000,100 --models resnet18 --out links.json --md links.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Sequence

from pipedp import console

from .cluster import Cluster, ClusterSpec, Link
from .machine import describe
from .paired import paired_ratio
from .report import write_json

PROG = "python -m experiments.bench_links"


def _rate(text: str) -> float | None:
    return None if text in ("none", "unlimited") else float(text)


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--rates", default="none,1000,100", help="comma list of link rates in Mbit/s ('none': unlimited)")
    p.add_argument("--delays", default="0", help="comma list of one-way link delays in ms (each with every rate)")
    p.add_argument("--models", default="resnet18,vgg11_bn", help="comma list: pipedp.models names or vgg11_bn")
    p.add_argument("--batch", type=int, default=64, help="global batch per step")
    p.add_argument("--microbatches", default="2,4,8", help="microbatch counts of the pipeline rows")
    p.add_argument("--schedules", default="1f1b", help="comma list: the schedules of the pipeline rows")
    p.add_argument("--rounds", type=int, default=3, help="alternating windows per configuration")
    p.add_argument("--steps", type=int, default=2, help="steps per window")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--width", type=int, default=None, help="base width of pipedp's zoo models (default theirs)")
    p.add_argument("--powersgd", action="store_true", help="also DDP with PowerSGD (rank 2; lossy; its buckets chained for gloo)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per rate before the run is killed")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--md", default=None, help="markdown table")
    return p


def _ms(ms: dict[str, float], key: str) -> str:
    return f"{ms[key]:.0f}" if key in ms else "-"


def _table(report: dict[str, Any]) -> str:
    lines = [f"Machine: {report['machine']['cpu']}, {report['machine']['cpu_cores']} cores; 2 nodes x 1 process x "
             f"{report['settings']['threads']} thread(s), gloo; global batch {report['settings']['batch']}; "
             f"{report['settings']['rounds']} rounds x {report['settings']['steps']} steps, median window (ms). "
             f"Ratios paired per round, against DDP.", "",
             "| link | model | DDP | DDP fp16 | DDP PowerSGD (lossy) | pipedp DP | pipedp DP fp16 (÷ DDP fp16) "
             "| best pipeline | pp=auto (its choice) | auto ÷ fastest exact | pp=auto, bf16 allowed (its choice) "
             "| ÷ fastest exact or 16-bit |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---:|---|---:|"]
    for run in report["runs"]:
        for r in run["results"]:
            ms, pp, auto, auto16 = r["ms"], r["best_pipeline"], r["auto"]["pp-auto"], r["auto"]["pp-auto-16"]
            fp16 = paired_ratio(r["windows_ms"]["ddp-fp16"], r["windows_ms"]["pipedp-dp-fp16"])
            lines.append(
                f"| {run['link']} | {r['model']} | {ms['ddp']:.0f} | {ms['ddp-fp16']:.0f} "
                f"| {_ms(ms, 'ddp-powersgd')} | {ms['pipedp-dp']:.0f} ({r['vs_ddp']['pipedp-dp']:.2f}x) "
                f"| {ms['pipedp-dp-fp16']:.0f} ({fp16:.2f}x) "
                f"| {pp}: {ms[pp]:.0f} ({r['vs_ddp'][pp]:.2f}x) | {ms['pp-auto']:.0f} ({auto['chosen']}) "
                f"| {auto['vs_bar']:.2f}x ({auto['bar']}) | {ms['pp-auto-16']:.0f} ({auto16['chosen']}) "
                f"| {auto16['vs_bar']:.2f}x ({auto16['bar']}) |")
    lines += ["", "The forecast (pp=auto's prediction) beside the measured median, and its link probes against the "
              "emulated rate:", "",
              "| link | model | configuration | predicted ms | measured ms | error | moves a step (MB) |",
              "|---|---|---|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for r in run["results"]:
            for name, f in r.get("forecast", {}).items():
                moved = (f["allreduce_bytes"] + f["p2p_bytes"]) / 1e6
                lines.append(f"| {run['link']} | {r['model']} | {name} | {f['predicted_ms']:.0f} | "
                             f"{f['measured_ms']:.0f} | {100 * f['error']:+.0f}% | {moved:.0f} |")
    lines += ["", "| link | model | all-reduce probe (GB/s) | point-to-point probe (GB/s) | emulated (GB/s) |",
              "|---|---|---:|---:|---:|"]
    for run in report["runs"]:
        for r in run["results"]:
            probed = r["auto"]["pp-auto"].get("probed_bytes_per_s")
            if probed:
                rate = f"{run['rate_mbit'] / 8e3:.4g}" if run.get("rate_mbit") else "unlimited"
                lines.append(f"| {run['link']} | {r['model']} | {probed['allreduce'] / 1e9:.4g} | "
                             f"{probed['p2p'] / 1e9:.4g} | {rate} |")
    lines += ["", "Planning (wrap() with pp=\"auto\", seconds, and as a share of a 10-minute run), and each node's "
              "link drops:", "", "| link | model | pp=auto | pp=auto, bf16 allowed | share (worst) |", "|---|---|---:|---:|---:|"]
    for run in report["runs"]:
        for r in run["results"]:
            a, b = r["auto"]["pp-auto"]["setup_s"], r["auto"]["pp-auto-16"]["setup_s"]
            lines.append(f"| {run['link']} | {r['model']} | {a:.1f} | {b:.1f} | {100 * max(a, b) / 600:.1f}% |")
    drops = {run["link"]: [n.get("dropped", 0) for n in run.get("link_stats", [])] for run in report["runs"]}
    lines += ["", "Packets dropped by each node's shaped link over the run: " + "; ".join(
        f"{link}: {', '.join(map(str, d)) or 'not read'}" for link, d in drops.items()) + "."]
    lines += ["", "Where a pipeline overtakes data parallelism (the fastest link rate at which the best pipeline "
              "ran, or was predicted, faster than the best data-parallel configuration):", "",
              "| model | measured | forecast |", "|---|---|---|"]
    for model, (measured, predicted) in overtakes(report).items():
        lines.append(f"| {model} | {measured} | {predicted} |")
    schedules = report["settings"].get("schedules", "1f1b").split(",")
    if len(schedules) > 1:
        lines += ["", "The same, measured, with the pipelines of each schedule alone:", "",
                  "| model | " + " | ".join(schedules) + " |", "|---|" + "---|" * len(schedules)]
        per = {s: overtakes(report, s) for s in schedules}
        for model in per[schedules[0]]:
            lines.append(f"| {model} | " + " | ".join(per[s][model][0] for s in schedules) + " |")
    return "\n".join(lines)


def _schedule_of(row: str) -> str:
    """The schedule of a pipeline row: ``pipedp-pp2x4`` is 1F1B, ``pipedp-pp2x4-zb-h1`` ZB-H1."""
    rest = row.split("-", 2)
    return rest[2] if len(rest) > 2 else "1f1b"


def overtakes(report: dict[str, Any], schedule: str | None = None) -> dict[str, tuple[str, str]]:
    """Per model (and link delay): the fastest rate where the best pipeline (of ``schedule`` alone, where
    given) beat data parallelism, measured and forecast."""
    found: dict[str, list[tuple[float, bool, bool]]] = {}
    for run in report["runs"]:
        rate = run.get("rate_mbit") or float("inf")
        for r in run["results"]:
            ms, fc = r["ms"], r.get("forecast", {})
            pipes = [k for k in ms if k.startswith("pipedp-pp2") and schedule in (None, _schedule_of(k))]
            dp = min(ms[k] for k in ("ddp", "pipedp-dp") if k in ms)
            won = bool(pipes) and min(ms[k] for k in pipes) < dp
            pred_pipes = [f["predicted_ms"] for k, f in fc.items()
                          if k.startswith("pipedp-pp2") and schedule in (None, _schedule_of(k))]
            pred_won = bool(pred_pipes) and "pipedp-dp" in fc and min(pred_pipes) < fc["pipedp-dp"]["predicted_ms"]
            delay = run.get("delay_ms") or 0.0
            found.setdefault(r["model"] + (f", {delay:g} ms" if delay else ""), []).append((rate, won, pred_won))
    out = {}
    for model, rows in found.items():
        def first(k: int) -> str:
            rates = [row[0] for row in rows if row[k]]
            if not rates:
                return "not at the rates run"
            top = max(rates)
            return "unlimited" if top == float("inf") else f"{top:g} Mbit/s"
        out[model] = (first(1), first(2))
    return out


def bench(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    report: dict[str, Any] = {"benchmark": "bench_links", "date": time.strftime("%Y-%m-%d"),
                              "machine": describe("cpu"), "settings": {k: v for k, v in vars(args).items()
                                                                       if k not in ("out", "md")}, "runs": []}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for text, delay in ((t, float(d)) for d in args.delays.split(",") for t in args.rates.split(",")):
        link = Link(rate_mbit=_rate(text), delay_ms=delay)
        print(f"{PROG}: link {link.describe()}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp, Cluster(ClusterSpec(2, between=link)) as c:
            out = os.path.join(tmp, "results.json")
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=root)
            codes = c.torchrun(["-m", "experiments.links_worker", "--models", args.models, "--batch", str(args.batch),
                                "--microbatches", args.microbatches, "--schedules", args.schedules,
                                "--rounds", str(args.rounds), "--steps",
                                str(args.steps), "--threads", str(args.threads), "--out", out,
                                *(["--width", str(args.width)] if args.width else []),
                                *(["--powersgd"] if args.powersgd else [])],
                               env=env, cwd=root).wait_all(args.timeout)
            if any(codes) or not os.path.exists(out):
                raise RuntimeError(f"the workers on the {link.describe()} link exited with {codes}")
            with open(out) as f:
                report["runs"].append({"link": link.describe(), "rate_mbit": link.rate_mbit,
                                       "delay_ms": link.delay_ms, "link_stats": c.link_stats(),
                                       "results": json.load(f)})
        if args.out:
            write_json(args.out, report, indent=2)
    table = _table(report)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.bench_links: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(bench, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
