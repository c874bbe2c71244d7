"""Benchmark: each concurrent piece of a step (branches, split_grads, early_update) on and off, side by side.

For one model, each batch size and numerics, every row trains its own copy of
the same model on the same synthetic batch: the baselines ``eager`` and (on
CUDA) ``graph`` (the CUDA-graphed eager step, the strongest thing a user
would do instead at small batches), pipedp with the pieces off, with each
piece alone and with all of them, at the same stages, microbatches and
``cuda_graph``. Timing windows alternate between the rows (round robin) in
this one process; the median window gives images/s. Each pipedp row's
``vs_off`` is its speed over the same pipeline with the pieces off (the
effect of the piece), ``vs_best_baseline`` over the faster baseline. The JSON
names the machine.

    python -m experiments.bench_concurrency --device cpu --quick
    python -m experiments.bench_concurrency --device cuda --model resnet18 --batch 16,32,64 --graph --out c.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

import pipedp
from pipedp.models import get_model

from .baselines import Numerics, Step, in_format, make_baseline, numerics, prepare
from .machine import describe, sync
from .report import write_json
from .workload import parse_ints

PROG = "python -m experiments.bench_concurrency"
PIECES = ("branches", "split_grads", "early_update")


@dataclass(frozen=True)
class Row:
    """One way to train: a baseline, or pipedp with the pieces in ``pieces`` on."""

    name: str
    baseline: str | None = None
    pieces: tuple[str, ...] = ()


def rows_for(device: torch.device) -> list[Row]:
    out = [Row("eager", baseline="eager")]
    if device.type == "cuda":
        out.append(Row("graph", baseline="graph"))
    out.append(Row("pipedp"))
    out += [Row(f"pipedp+{p}", pieces=(p,)) for p in PIECES]
    out.append(Row("pipedp+all", pieces=PIECES))
    return out


def make_step(row: Row, num: Numerics, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
              args: argparse.Namespace) -> tuple[Step, str | None]:
    """The training step of ``row`` and, for pipedp, its plan's notes."""
    if row.baseline is not None:
        model, x = prepare(model, x, num)
        return make_baseline(row.baseline, num, model, x, y), None
    engine = pipedp.wrap(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
        microbatches=args.microbatches, stages=args.stages, devices=x.device, profile=False, sample=x,
        cuda_graph=args.graph, progress=False, precision=num.precision, channels_last=num.channels_last,
        **{p: True for p in row.pieces},
    )
    return engine.train_step, "; ".join(engine.plan.notes)


def bench_group(batch: int, num: Numerics, args: argparse.Namespace, device: torch.device) -> dict:
    """All rows at one batch size and numerics, timed in alternating windows."""
    torch.manual_seed(0)
    base = get_model(args.model, width=args.width).to(device)
    x = torch.randn(batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    xi = in_format(x, num)
    steps: dict[str, Step] = {}
    notes: dict[str, str | None] = {}
    errors: dict[str, str] = {}
    for row in rows_for(device):
        try:
            steps[row.name], notes[row.name] = make_step(row, num, copy.deepcopy(base), x, y, args)
            for _ in range(args.warmup):
                steps[row.name](xi, y)
            sync(device)
        except Exception as e:  # report and go on with the other rows
            errors[row.name] = f"{type(e).__name__}: {e}"
            steps.pop(row.name, None)
            print(f"  b{batch} {num.name} {row.name}: FAILED {errors[row.name][:300]}", file=sys.stderr)
    windows: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(xi, y)
            sync(device)
            windows[name].append(args.steps * batch / (time.perf_counter() - t0))
    ips = {n: statistics.median(w) for n, w in windows.items()}
    baselines = [r.name for r in rows_for(device) if r.baseline is not None and r.name in ips]
    best = max(baselines, key=lambda n: ips[n]) if baselines else None
    off = ips.get("pipedp")
    rows = {n: {"images_per_s": ips[n], "images_per_s_windows": windows[n], "notes": notes[n],
                "vs_off": ips[n] / off if off and n.startswith("pipedp") else None,
                "vs_best_baseline": ips[n] / ips[best] if best else None} for n in ips}
    return {"rows": rows, "best_baseline": best, "errors": errors}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", help="a pipedp.models name (resnet18, resnet34, resnet50, ...)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", default="16,32,64", help="comma list of batch sizes")
    p.add_argument("--numerics", default="fp32,bf16cl", help="comma list: fp32, bf16cl")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages of every pipedp row")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches of every pipedp row")
    p.add_argument("--graph", action="store_true", help="pipedp rows with cuda_graph=True (CUDA only)")
    p.add_argument("--size", type=int, default=32, help="image side")
    p.add_argument("--width", type=int, default=64, help="ResNet base width")
    p.add_argument("--steps", type=int, default=10, help="steps per timing window")
    p.add_argument("--rounds", type=int, default=5, help="alternating windows per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row first (a graph is captured here)")
    p.add_argument("--quick", action="store_true", help="smoke run: width 4, size 8, batch 4, fp32, 1 step x 2 rounds")
    p.add_argument("--out", default=None, help="write results JSON here")
    return p


def bench(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if args.graph and device.type != "cuda":
        raise SystemExit(f"{PROG}: --graph needs a CUDA device")
    if args.quick:
        args.width, args.size, args.batch, args.numerics = 4, 8, "4", "fp32"
        args.steps, args.rounds, args.warmup = 1, 2, 1
    results: dict[str, dict] = {}
    for batch in parse_ints(args.batch, "--batch"):
        for name in args.numerics.split(","):
            num = numerics(name)
            res = results.setdefault(str(batch), {})[name] = bench_group(batch, num, args, device)
            for row, r in res["rows"].items():
                vs = f"  x{r['vs_off']:.3f} vs off" if r["vs_off"] is not None else ""
                print(f"{args.model} b{batch} {name} {row:20s} {r['images_per_s']:10.1f} img/s{vs}")
    out = {"machine": describe(device), "model": args.model, "width": args.width, "size": args.size,
           "stages": args.stages, "microbatches": args.microbatches, "graph": args.graph, "results": results}
    if args.out:
        write_json(args.out, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    bench(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
