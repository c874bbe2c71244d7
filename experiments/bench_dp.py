"""Benchmark: pipedp data parallel vs PyTorch DDP, and the cost of the sync machinery.

Each of ``--procs`` processes (gloo on CPU, NCCL on CUDA; loopback) trains
three copies of the same model on its own synthetic batch, alternating timing
windows so all see the same machine state:

- ``ddp``: ``DistributedDataParallel`` with its defaults (25 MiB buckets),
- ``pipedp``: ``pipedp.wrap`` over the data-parallel group (bucketed async
  all-reduce launched from gradient hooks, on side streams on CUDA),
- ``nosync``: the same pipedp engine with ``distributed=False`` (no sync at all).

Reported: images/s (global batch / median window), the pipedp/ddp and
pipedp/nosync ratios (median over rounds of side-by-side ratios), and how much
of pipedp's gradient sync ran hidden behind backward.

    python -m experiments.bench_dp --device cpu --procs 2 --models resnet18,resnet50
    python -m experiments.bench_dp --device cuda --procs 1 --stages 2 --microbatches 4
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import pipedp
from pipedp import console
from pipedp.models import get_model

from .machine import sync
from .paired import paired_ratio
from .world import run_world, world_report

PROG = "python -m experiments.bench_dp"
CONFIGS = ("ddp", "pipedp", "nosync")


def _steppers(model: nn.Module, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    loss_fn = nn.CrossEntropyLoss()
    out: dict[str, Any] = {}
    twin = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(twin, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()

    out["ddp"] = ddp_step
    for name, distributed in (("pipedp", True), ("nosync", False)):
        m = copy.deepcopy(model)
        engine = pipedp.wrap(
            m, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), loss_fn=loss_fn,
            stages=args.stages, microbatches=args.microbatches, profile=False, progress=False,
            distributed=distributed, bucket_mb=args.bucket_mb,
        )
        out[name] = engine
    return out


def _window(step: Callable, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> float:
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(device)
    return time.perf_counter() - t0


class _Recording:
    """A pipedp engine's train_step that also keeps each step's sync timing."""

    def __init__(self, engine: pipedp.Engine, per_step: bool) -> None:
        self.engine, self.per_step = engine, per_step
        self.stats: list[Any] = []

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.engine.train_step(x, y)
        if self.per_step:  # on CUDA reading stats syncs: read them outside the timed windows
            self.stats.append(self.engine.sync_stats())


def _measure(name: str, args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = get_model(name, num_classes=10).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    steppers = _steppers(model, args, device)
    rec = _Recording(steppers["pipedp"], per_step=device.type == "cpu")
    step = {"ddp": steppers["ddp"], "pipedp": rec, "nosync": steppers["nosync"].train_step}
    for k in CONFIGS:  # warm-up (and the engines' planning)
        for _ in range(args.warmup):
            step[k](x, y)
    rec.stats.clear()
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    for r in range(args.rounds):
        for k in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            times[k].append(_window(step[k], x, y, args.steps, device))
    if not rec.per_step:
        for _ in range(3):
            rec.engine.train_step(x, y)
            rec.stats.append(rec.engine.sync_stats())
    imgs = args.batch * world * args.steps
    sync_ms = sum(st.sync_ms for st in rec.stats)
    return {
        "model": name,
        "images_per_s": {k: imgs / statistics.median(v) for k, v in times.items()},
        "pipedp_vs_ddp": paired_ratio(times["ddp"], times["pipedp"]),
        "pipedp_vs_nosync": paired_ratio(times["nosync"], times["pipedp"]),
        "sync_ms_per_step": sync_ms / len(rec.stats),
        "sync_hidden_fraction": sum(st.hidden_ms for st in rec.stats) / sync_ms if sync_ms > 0 else 1.0,
        "optimizer_wait_ms_per_step": statistics.fmean(st.exposed_ms for st in rec.stats),
        "buckets": rec.stats[-1].buckets,
        "plan": str(rec.engine.plan),
    }


def _row(r: dict[str, Any]) -> str:
    ips = r["images_per_s"]
    return (
        f"{r['model']:<9} ddp {ips['ddp']:8.1f} img/s  pipedp {ips['pipedp']:8.1f}  nosync {ips['nosync']:8.1f}  "
        f"pipedp/ddp {r['pipedp_vs_ddp']:.3f}  pipedp/nosync {r['pipedp_vs_nosync']:.3f}  "
        f"sync {r['sync_ms_per_step']:.1f} ms/step, {100 * r['sync_hidden_fraction']:.0f}% hidden, "
        f"optimizer waited {r['optimizer_wait_ms_per_step']:.1f} ms"
    )


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="gloo on CPU, NCCL on CUDA")
    p.add_argument("--procs", type=int, default=2, help="processes (data-parallel replicas)")
    p.add_argument("--models", default="resnet18,resnet50", help="comma list of models")
    p.add_argument("--batch", type=int, default=32, help="per process")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages of pipedp's engine")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per pipedp step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="pipedp's gradient bucket size (MiB)")
    p.add_argument("--rounds", type=int, default=3, help="alternating windows per configuration")
    p.add_argument("--steps", type=int, default=3, help="steps per timing window")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per process")
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p


def bench(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark for ``argv``; the report (also written to --out when given)."""
    args = _parser().parse_args(argv)
    rows = run_world(_measure, _row, args)
    return world_report("bench_dp", args, rows)


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.bench_dp: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(bench, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
