"""Ceiling test: how much more could one GPU train at a batch size if its idle time were filled?

K independent copies of the graphed plain step (each its own model, optimizer
and batch) are replayed side by side, each on its own CUDA stream. If the
plain step left the GPU idle (launch gaps, kernels too small to fill it), K
copies finish K steps in less than K times one step: their images/s over one
copy's is the ceiling of what any single-GPU scheme that overlaps work (a
pipeline over streams, inter-operator concurrency) can gain at that batch.
The windows of K = 1, 2, 4, ... alternate in one process; the copies for the
largest K are built once and the first K of them replay in a window of K.

pipedp's share of the spare capacity is ``(pipedp / baseline - 1) / (ceiling - 1)``
(:func:`captured_fraction`), with pipedp and the baseline measured side by side
by ``experiments.bench_pipeline`` at the same model, batch and numerics.

    python -m experiments.ceiling --device cuda --models resnet18 --batch 32,64,128,256 --out ceiling.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from typing import Callable, Mapping, Sequence

import torch

from pipedp import console

from .baselines import graphed_step, numerics, prepare
from .machine import describe, sync
from .report import write_json
from .workload import Workload, parse_ints, parse_workload

__all__ = ["ceiling_summary", "captured_fraction", "measure_ceiling", "main"]

PROG = "python -m experiments.ceiling"


def ceiling_summary(images_per_s: Mapping[int, float]) -> dict[str, object]:
    """Speedup of each K copies over one copy, and the ceiling (the best of them, at least 1.0)."""
    if 1 not in images_per_s or images_per_s[1] <= 0:
        raise ValueError(f"the ceiling needs a positive images/s for K=1 copy, got {dict(images_per_s)}")
    one = images_per_s[1]
    ratios = {k: v / one for k, v in sorted(images_per_s.items())}
    best = max(ratios, key=lambda k: ratios[k])
    return {"speedup": {str(k): r for k, r in ratios.items()}, "best_copies": best,
            "ceiling": max(1.0, ratios[best])}


def captured_fraction(speedup: float | None, ceiling: float | None, floor: float = 1.02) -> float | None:
    """Of the spare capacity (``ceiling - 1``), the share a scheme with ``speedup`` over the baseline captured.

    None when there is (almost) nothing to capture: a ceiling below ``floor``
    is within timing noise of 1.0, and a fraction of it would be noise too.
    Negative when the scheme is slower than the baseline.
    """
    if speedup is None or ceiling is None or ceiling < floor:
        return None
    return (speedup - 1.0) / (ceiling - 1.0)


def _copies(work: Workload, batch: int, num_name: str, k: int, device: torch.device, width: int) \
        -> list[Callable[[], None]]:
    num = numerics(num_name)
    base = work.build(width).to(device)
    replays = []
    for i in range(k):
        x, y = work.batch(batch, device, seed=i)
        model, x = prepare(copy.deepcopy(base), x, num)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        replays.append(graphed_step(model, opt, num, x, y, stream=torch.cuda.Stream(device))[1])
    return replays


def measure_ceiling(work: Workload, batch: int, num_name: str, copies: Sequence[int], device: torch.device, *,
                    rounds: int, steps: int, width: int = 64) -> dict[str, object]:
    """images/s of K side-by-side graphed copies for each K in ``copies`` (alternating windows), and the summary."""
    t0 = time.perf_counter()
    replays = _copies(work, batch, num_name, max(copies), device, width)
    setup_s = time.perf_counter() - t0
    windows: dict[int, list[float]] = {k: [] for k in copies}
    for _ in range(rounds):
        for k in copies:
            sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                for r in replays[:k]:
                    r()
            sync(device)
            windows[k].append(k * batch * steps / (time.perf_counter() - t))
    ips = {k: statistics.median(w) for k, w in windows.items()}
    out: dict[str, object] = {"images_per_s": {str(k): v for k, v in ips.items()},
                              "images_per_s_windows": {str(k): w for k, w in windows.items()}, "setup_s": setup_s}
    out.update(ceiling_summary(ips))
    del replays
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--models", default="resnet18,resnet34,resnet50", help="comma list of model specs "
                   "name[@size][/classes]")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="a CUDA device")
    p.add_argument("--batch", default="32,64,128,256", help="comma list of batch sizes")
    p.add_argument("--numerics", default="fp32,bf16cl", help="comma list: fp32, bf16cl")
    p.add_argument("--copies", default="1,2,4", help="comma list of K (must include 1)")
    p.add_argument("--rounds", type=int, default=4, help="alternating windows per K")
    p.add_argument("--steps", type=int, default=10, help="steps of every copy per window")
    p.add_argument("--width", type=int, default=64, help="ResNet base width")
    p.add_argument("--out", default=None, help="write results JSON here")
    return p


def run(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    copies = parse_ints(args.copies, "--copies")
    if 1 not in copies:
        raise ValueError(f"--copies must include 1 (the reference), got {args.copies!r}")
    works = [parse_workload(m) for m in args.models.split(",")]
    batches, nums = parse_ints(args.batch, "--batch"), [numerics(n).name for n in args.numerics.split(",")]
    out: dict[str, object] = {"machine": describe(device), "date": time.strftime("%Y-%m-%d"), "copies": copies,
                              "rounds": args.rounds, "steps_per_window": args.steps}
    if device.type != "cuda":
        out["skipped"] = "the ceiling test replays CUDA graphs on CUDA streams: it needs a CUDA device"
        print(f"ceiling: skipped ({out['skipped']})", file=sys.stderr)
    else:
        torch.backends.cudnn.benchmark = True
        results: dict[str, dict] = {}
        out["results"] = results
        for work in works:
            for b in batches:
                for n in nums:
                    key = f"{work.name}/{b}/{n}"
                    try:
                        results.setdefault(work.name, {}).setdefault(str(b), {})[n] = r = measure_ceiling(
                            work, b, n, copies, device, rounds=args.rounds, steps=args.steps, width=args.width)
                        print(f"ceiling {key}: {r['ceiling']:.2f}x with {r['best_copies']} copies "
                              f"({r['speedup']})", file=sys.stderr, flush=True)
                    except Exception as e:  # e.g. out of memory for 4 large copies: record, go on
                        results.setdefault(work.name, {}).setdefault(str(b), {})[n] = {
                            "error": f"{type(e).__name__}: {str(e)[:300]}"}
                        print(f"ceiling {key}: FAILED {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                        gc.collect()
                        torch.cuda.empty_cache()
                    if args.out:
                        write_json(args.out, out)
    if args.out:
        write_json(args.out, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.ceiling: exit status 0 on success (a CPU run records why it skipped)."""
    return console.run_job(run, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
