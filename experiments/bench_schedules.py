"""Benchmark: pipeline schedules over pipeline ranks, step against 1F1B's, in alternating windows.

Each rank of a ``torchrun`` world holds one stage (``pp`` = world size, gloo
on a CPU); every schedule trains its own copy of one seeded model on the same
global batch, and the windows alternate between them. Also the simulator's
idle fraction of each schedule on the plan's own stage times (forward 1 :
backward 2 of each), beside the measured step.

    torchrun --nproc-per-node 2 -m experiments.bench_schedules --models resnet18 --out schedules.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pipedp
from pipedp.decide.cut import action_durations
from pipedp.pipeline.schedule import get_schedule
from pipedp.pipeline.simulate import simulate
from pipedp.world import window_ms

from .machine import describe
from .paired import paired_ratio
from .report import write_json

CPU = torch.device("cpu")


def _engine(model: nn.Module, schedule: str, microbatches: int, sample: torch.Tensor) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), pp=dist.get_world_size(), stages=dist.get_world_size(),
                       microbatches=microbatches, schedule=schedule, sample=sample, progress=False,
                       plan_cache=False)


def measure(name: str, args: argparse.Namespace) -> dict:
    from pipedp.models import get_model

    torch.manual_seed(0)
    base = get_model(name, num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    engines = {s: _engine(copy.deepcopy(base), s, args.microbatches, x) for s in args.schedules.split(",")}
    for e in engines.values():
        e.train_step(x, y)
    windows: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            windows[k].append(window_ms(functools.partial(engines[k].train_step, x, y), CPU, args.steps))
    first = next(iter(engines))
    plan = engines[first].plan
    # Each stage's planned ms of a microbatch, split forward 1 : backward 2 (the plan keeps only the sum).
    fwd = [st.predicted_ms / 3 for st in plan.stages]
    bwd = [2 * st.predicted_ms / 3 for st in plan.stages]
    predicted = {k: simulate(get_schedule(k)(len(fwd), args.microbatches), duration=action_durations(fwd, bwd))
                 for k in engines}
    return {"model": name, "global_batch": args.batch, "microbatches": args.microbatches, "counts": plan.counts,
            "ms": {k: statistics.median(v) for k, v in windows.items()}, "windows_ms": windows,
            "vs_first": {k: paired_ratio(windows[first], v) for k, v in windows.items()},
            "predicted_idle": {k: p.bubble for k, p in predicted.items()},
            "predicted_ms": {k: p.makespan for k, p in predicted.items()},
            "program": {k: e.program for k, e in engines.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18")
    p.add_argument("--schedules", default="1f1b,zb-h1,gpipe", help="comma list; ratios against the first")
    p.add_argument("--batch", type=int, default=64, help="global batch per step")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        t0 = time.perf_counter()
        results = [measure(m, args) for m in args.models.split(",")]
        if dist.get_rank() == 0:
            report = {"benchmark": "bench_schedules", "date": time.strftime("%Y-%m-%d"), "machine": describe("cpu"),
                      "world": dist.get_world_size(), "settings": vars(args), "seconds": time.perf_counter() - t0,
                      "results": results}
            print(json.dumps(report, indent=1))
            if args.out:
                write_json(args.out, report)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
