"""Benchmark: pipeline schedules over pipeline ranks, step against 1F1B's, in alternating windows.

Every rank of a ``torchrun`` world is a pipeline rank (``pp`` = world size,
gloo on a CPU): one stage per rank, or ``--per-rank`` stages spread round the
ranks for ``interleaved``. Every schedule trains its own copy of one seeded
model on the same global batch, and the windows alternate between them; the
row ``dp`` is data parallelism over the same ranks, each taking its share of
the batch, for the pipeline's other alternative. Beside each measured step:
the simulator's idle fraction on the plan's own stage times (forward 1 :
backward 2 of each), and the measured one, from the stages' busy time in the
steps the engine times.

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
from pipedp.pipeline.orders import PER_RANK, simulate_schedule
from pipedp.pipeline.simulate import Simulation
from pipedp.decide.world import window_ms

from .machine import describe
from .paired import paired_ratio
from .report import write_json

CPU = torch.device("cpu")


def row(name: str) -> tuple[str, list[int] | None]:
    """A row's schedule and its given cut: ``interleaved@7-4-5-7`` runs that cut, ``interleaved`` the plan's."""
    schedule, _, cut = name.partition("@")
    return schedule, [int(k) for k in cut.split("-")] if cut else None


def _engine(model: nn.Module, name: str, args: argparse.Namespace, sample: torch.Tensor) -> pipedp.Engine:
    ranks = dist.get_world_size()
    schedule, cut = row(name)
    if schedule == "dp":
        layout = dict(pp=1, stages=1, microbatches=1)
    else:
        per_rank = args.per_rank if schedule in PER_RANK else 1
        layout = dict(pp=ranks, stages=cut if cut is not None else per_rank * ranks, microbatches=args.microbatches,
                      schedule=schedule)
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), sample=sample, progress=False, plan_cache=False,
                       measure_steps=args.rounds * args.steps, **layout)


def _predicted(engine: pipedp.Engine, schedule: str, microbatches: int) -> Simulation:
    """The simulated step on the plan's stage times: each stage's planned ms of a microbatch, split forward 1 :
    backward 2 (the plan keeps only the sum)."""
    plan = engine.plan
    fwd = [st.predicted_ms / 3 for st in plan.stages]
    bwd = [2 * st.predicted_ms / 3 for st in plan.stages]
    return simulate_schedule(schedule, len(fwd), microbatches, dist.get_world_size(),
                             duration=action_durations(fwd, bwd))


def _measured_idle(engine: pipedp.Engine, microbatches: int, step_ms: float) -> float:
    """1 - the ranks' mean busy time over the step: each rank's stages' measured ms of a microbatch, summed."""
    busy = sum(st.measured_ms or 0.0 for st in engine.plan.stages) * microbatches
    every: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, busy)
    return 1.0 - statistics.mean(every) / step_ms


def measure(name: str, args: argparse.Namespace) -> dict:
    from pipedp.models import get_model

    torch.manual_seed(0)
    base = get_model(name, num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    share = slice(dist.get_rank() * args.batch // dist.get_world_size(),
                  (dist.get_rank() + 1) * args.batch // dist.get_world_size())
    batches = {k: (x[share], y[share]) if k == "dp" else (x, y) for k in args.schedules.split(",")}
    engines = {k: _engine(copy.deepcopy(base), k, args, xb) for k, (xb, _) in batches.items()}
    for k, e in engines.items():
        e.train_step(*batches[k])
    windows: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            windows[k].append(window_ms(functools.partial(engines[k].train_step, *batches[k]), CPU, args.steps))
    first = next(iter(engines))
    ms = {k: statistics.median(v) for k, v in windows.items()}
    pipes = [k for k in engines if k != "dp"]
    predicted = {k: _predicted(engines[k], row(k)[0], args.microbatches) for k in pipes}
    return {"model": name, "global_batch": args.batch, "microbatches": args.microbatches,
            "counts": {k: list(engines[k].plan.counts) for k in engines},
            "ms": ms, "windows_ms": windows,
            "vs_first": {k: paired_ratio(windows[first], v) for k, v in windows.items()},
            "predicted_idle": {k: p.bubble for k, p in predicted.items()},
            "measured_idle": {k: _measured_idle(engines[k], args.microbatches, ms[k]) for k in pipes},
            "predicted_ms": {k: p.makespan for k, p in predicted.items()},
            "program": {k: engines[k].program for k in pipes}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18")
    p.add_argument("--schedules", default="1f1b,zb-h1,interleaved,gpipe,dp",
                   help="comma list; ratios against the first (dp: data parallelism over the same ranks; "
                        "schedule@7-4-5-7: that schedule on that cut of blocks)")
    p.add_argument("--per-rank", type=int, default=2, help="stages per rank of an interleaved pipeline")
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
