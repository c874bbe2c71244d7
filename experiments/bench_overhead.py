"""Benchmark: what pipedp's engine adds to a step when its plan is the plain step itself.

Where ``stages="auto"`` finds no plan faster than the user's own step, the
plan is that step (one stage, one microbatch) run by the engine, and the
engine must cost next to nothing on top (the goal: at most 1% more). On a
2-core CPU, windows of one multi-second step spread by 5-20%, so a 1%
difference cannot be resolved at the sizes users train; the engine's cost
is a fixed amount per step (its schedule, hooks and update), not a
share of the compute. So this measures it where it is largest, on fast steps
(narrow models, small batches), as milliseconds per step: the plain PyTorch
step (zero_grad, forward, loss, backward, SGD update) and ``pipedp.wrap(...,
stages=1, microbatches=1)`` train copies of one model on one batch, in
alternating windows; per round the engine's window is divided by the plain
window beside it, and the median of those ratios is the figure (with the
median difference in ms, which bounds the share at any larger step). A
third step, the engine with ``rollback=False``, shows what the copy of
parameters and optimizer state that undoes a failing ``optimizer.step()``
costs apart from the rest of the engine. ``--precision bf16`` runs all three
in bf16 autocast and channels_last.

    python -m experiments.bench_overhead --out experiments/results/overhead_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any, Sequence

import torch
from torch import nn

import pipedp
from pipedp.models import get_model

from .baselines import in_format, numerics, plain_step
from .bench_best import time_window
from .machine import describe
from .report import write_json, write_text
from .workload import parse_ints

# The user's plain step in each precision: fp32 in the model's own memory format, or bf16 autocast in channels_last.
NUMERICS = {"fp32": numerics("fp32"), "bf16": numerics("bf16cl")}


def plain_plan(model: nn.Module, device: torch.device, precision: str = "fp32", rollback: bool = True
               ) -> pipedp.Engine:
    """The engine whose plan is the plain step: one stage, one microbatch, in ``precision``'s numerics."""
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), stages=1, microbatches=1, devices=device, profile=False,
                       progress=False, channels_last=NUMERICS[precision].channels_last, kernels="torch",
                       precision=precision, rollback=rollback)


def measure_row(name: str, width: int, batch: int, device: torch.device, rounds: int, steps: int,
                precision: str = "fp32") -> dict[str, Any]:
    """One model size: every step's windows, the median per-round ratio and the median ms difference to plain.

    ``steps`` per window; 0: about a second of steps, from the plain step's warm-up.
    """
    torch.manual_seed(0)
    num = NUMERICS[precision]
    base = get_model(name, num_classes=10, width=width).to(device)
    x, y = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)
    x = in_format(x, num)  # as a loader would deliver it
    plain = copy.deepcopy(base).to(memory_format=torch.channels_last) if num.channels_last else copy.deepcopy(base)
    steps_by = {"plain": plain_step(plain, torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9), num),
                "pipedp": plain_plan(copy.deepcopy(base), device, precision).train_step,
                "pipedp-no-rollback": plain_plan(copy.deepcopy(base), device, precision, rollback=False).train_step}
    warm_ms = {k: time_window(step, x, y, 3, device) for k, step in steps_by.items()}
    steps = steps or max(1, int(1000 / max(warm_ms["plain"], 1e-3)))
    windows: dict[str, list[float]] = {k: [] for k in steps_by}
    for r in range(rounds):
        order = list(steps_by) if r % 2 == 0 else list(reversed(steps_by))  # none always goes first
        for k in order:
            windows[k].append(time_window(steps_by[k], x, y, steps, device))
    ratios = [e / p for e, p in zip(windows["pipedp"], windows["plain"])]
    diffs = [e - p for e, p in zip(windows["pipedp"], windows["plain"])]
    bare = [e / p for e, p in zip(windows["pipedp-no-rollback"], windows["plain"])]
    return {"model": name, "width": width, "batch": batch, "precision": precision, "windows_ms": windows,
            "plain_ms": statistics.median(windows["plain"]), "pipedp_ms": statistics.median(windows["pipedp"]),
            "ratio": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
            "extra_ms": statistics.median(diffs), "ratio_no_rollback": statistics.median(bare),
            "steps_per_window": steps}


def _table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | width | batch | precision | plain ms | pipedp ms | pipedp / plain (median of rounds) | range | "
             "extra ms per step | without rollback / plain |", "|---|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lo, hi = r["ratio_spread"]
        lines.append(f"| {r['model']} | {r['width']} | {r['batch']} | {r['precision']} | {r['plain_ms']:.2f} | "
                     f"{r['pipedp_ms']:.2f} | {r['ratio']:.3f} | {lo:.3f}-{hi:.3f} | {r['extra_ms']:+.2f} | "
                     f"{r['ratio_no_rollback']:.3f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", help="a pipedp.models name (CIFAR shapes)")
    p.add_argument("--widths", default="8,16,64", help="comma list of base widths")
    p.add_argument("--batch", default="16,32", help="comma list of batch sizes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=sorted(NUMERICS), default="fp32",
                   help="fp32 (the model's memory format) or bf16 (autocast, channels_last)")
    p.add_argument("--rounds", type=int, default=15, help="alternating window pairs per row")
    p.add_argument("--steps", type=int, default=0, help="steps per window (0: about 1 s of steps)")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--md", default=None, help="markdown table")
    return p


def bench(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for width in parse_ints(args.widths, "--widths"):
        for batch in parse_ints(args.batch, "--batch"):
            rows.append(measure_row(args.model, width, batch, device, args.rounds, args.steps, args.precision))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    out = {"benchmark": "bench_overhead", "machine": describe(device), "rounds": args.rounds, "rows": rows}
    if args.out:
        write_json(args.out, out)
    if args.md:
        write_text(args.md, f"Machine: {out['machine']}\n\n{_table(rows)}\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    print(_table(bench(argv)["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
