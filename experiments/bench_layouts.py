"""Benchmark: the layouts of a world (data parallel x pipeline) measured side by side, and the forecast of each.

``--procs`` processes on loopback (gloo on CPU, one core each by default;
NCCL on CUDA, one GPU each) are the world. In one launch, every rank:

1. profiles the model's blocks on its share of the batch (all ranks at once,
   as they will train: on a shared host that is the contention they see);
2. measures the world's links: ring all-reduce over all ranks and
   point-to-point between neighbours (:mod:`pipedp.decide.probe`);
3. builds one engine per layout of :func:`pipedp.decide.layout.layouts`
   (``pipedp.wrap(..., pp=P, stages=<the balanced cut>, microbatches=M)``,
   each on its own copy of the model), then times them in alternating
   windows (``--rounds`` x ``--steps``, after ``--warmup`` steps each), the
   slowest rank's median window per layout.

``pipedp.wrap(..., pp="auto")`` is timed in the same windows (its planning,
on the global batch, reported apart). Rank 0 then predicts each layout with the profile and the measured links and
reports measured and predicted step, the forecast's error, and which layout
each would choose.

    python -m experiments.bench_layouts --procs 2 --models resnet18,resnet50 --batch 64
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

import pipedp
from pipedp import console
from pipedp.decide.layout import ASSUMPTIONS, Layout, layouts, predict
from pipedp.decide.probe import probe_allreduce, probe_p2p
from pipedp.forecast import profile_model
from pipedp.models import get_model
from pipedp.decide.world import window_ms

from .world import run_world, world_report

PROG = "python -m experiments.bench_layouts"
AUTO = "pp=auto"


def _engine(model: nn.Module, layout: Layout, x: torch.Tensor, device: torch.device, args: argparse.Namespace):
    rank_stages = list(layout.counts)
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=layout.microbatches, stages=rank_stages,
                       schedule=layout.schedule, pp=layout.pp, devices=device, profile=False, progress=False,
                       sample=x, bucket_mb=args.bucket_mb)


def _measure(name: str, args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = get_model(name, num_classes=10, **({"width": args.width} if args.width else {})).to(device)
    g = torch.Generator().manual_seed(0)  # one global batch on every rank: a pipeline's ranks must be fed alike
    full = torch.randn(args.batch, 3, 32, 32, generator=g).to(device)
    labels = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    prof_batch = args.batch // world
    t0 = time.perf_counter()
    prof = profile_model(copy.deepcopy(base), full[:prof_batch])
    profile_s = time.perf_counter() - t0
    shared = [prof]
    dist.broadcast_object_list(shared, src=0)  # one profile, one cut per layout: rank 0's, as pipedp's plans are
    prof = shared[0]
    ar = probe_allreduce(device=device)
    peer = rank ^ 1 if (rank ^ 1) < world else rank - 1
    p2p = probe_p2p(peer, device=device)
    cands = layouts(prof.blocks, world, args.batch, microbatches=[int(m) for m in args.microbatches.split(",")])
    engines = []
    for lay in cands:
        b = args.batch // lay.dp
        x, y = full[:b], labels[:b]
        engines.append((lay, _engine(copy.deepcopy(base), lay, x, device, args), x, y))
    # pp="auto" beside them: it plans on the global batch (profile, probes, timed finalists), then trains its pick.
    t0 = time.perf_counter()
    mine = copy.deepcopy(base)
    auto = pipedp.wrap(mine, optimizer=torch.optim.SGD(mine.parameters(), lr=0.01, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), pp="auto", microbatches="auto", sample=full, devices=device,
                       profile=False, progress=False, bucket_mb=args.bucket_mb)
    auto_setup_s = time.perf_counter() - t0
    assert auto.world is not None
    b = args.batch // auto.world.layout.dp
    runs = [(lay.label, eng, x, y) for lay, eng, x, y in engines] + [(AUTO, auto, full[:b], labels[:b])]
    for _, eng, x, y in runs:
        for _ in range(args.warmup):
            eng.train_step(x, y)
    windows: dict[str, list[float]] = {label: [] for label, *_ in runs}
    for _ in range(args.rounds):
        for label, eng, x, y in runs:  # a step ends for the world when it ends for its last rank
            windows[label].append(window_ms(functools.partial(eng.train_step, x, y), device, args.steps))
    for _, eng, _, _ in runs:
        eng.close()
    rows = []
    for lay in cands:
        measured = statistics.median(windows[lay.label])
        pred = predict(prof.costs(), lay, args.batch, ar, p2p=p2p, update_ms=prof.update_ms,
                       bucket_bytes=args.bucket_mb * 2**20)
        rows.append({"layout": lay.label, "dp": lay.dp, "pp": lay.pp, "counts": list(lay.counts),
                     "microbatches": lay.microbatches, "measured_ms": measured, "windows_ms": windows[lay.label],
                     "predicted_ms": pred.step_ms, "error": pred.step_ms / measured - 1,
                     "predicted_sync_ms": pred.allreduce_ms, "predicted_exposed_ms": pred.exposed_ms,
                     "predicted_bubble": pred.bubble})
    best_measured = min(rows, key=lambda r: r["measured_ms"])
    best_predicted = min(rows, key=lambda r: r["predicted_ms"])
    return {"model": name, "global_batch": args.batch, "world": world, "profile_s": profile_s,
            "profile_device": prof.device, "update_ms": prof.update_ms, "allreduce_link": asdict(ar),
            "p2p_link": asdict(p2p), "profile": {"batch": prof.batch, "update_ms": prof.update_ms,
                                                  "blocks": [asdict(b) for b in prof.blocks],
                                                  "small_batch": prof.small_batch,
                                                  "small": [asdict(b) for b in prof.small]},
            "bucket_mb": args.bucket_mb, "rows": rows,
            "best_measured": best_measured["layout"], "best_predicted": best_predicted["layout"],
            "forecast_choice_vs_best": best_measured["measured_ms"] / best_predicted["measured_ms"],
            "auto": {"chosen": auto.world.layout.label, "measured_ms": statistics.median(windows[AUTO]),
                     "windows_ms": windows[AUTO], "vs_best": best_measured["measured_ms"]
                     / statistics.median(windows[AUTO]), "planning_s": auto.world.planning_s,
                     "setup_s": auto_setup_s, "planning_share_10min": auto_setup_s / 600,
                     "table": auto.world.table()}}


def _table(r: dict[str, Any]) -> str:
    lines = [f"{r['model']}, global batch {r['global_batch']}, {r['world']} ranks ({r['profile_device']}); links: "
             f"all-reduce {r['allreduce_link']['bytes_per_s'] / 1e9:.2f} GB/s + "
             f"{r['allreduce_link']['alpha_s'] * 1e6:.0f} us, p2p {r['p2p_link']['bytes_per_s'] / 1e9:.2f} GB/s + "
             f"{r['p2p_link']['alpha_s'] * 1e6:.0f} us",
             f"  {'layout':<24} {'measured ms':>12} {'predicted ms':>13} {'error':>7}"]
    for row in r["rows"]:
        lines.append(f"  {row['layout']:<24} {row['measured_ms']:12.1f} {row['predicted_ms']:13.1f} "
                     f"{row['error']:+7.1%}")
    lines.append(f"  fastest measured: {r['best_measured']}; forecast's choice: {r['best_predicted']} "
                 f"({r['forecast_choice_vs_best']:.3f}x of the fastest)")
    a = r["auto"]
    lines.append(f"  pp=auto chose {a['chosen']}: {a['measured_ms']:.1f} ms, {a['vs_best']:.3f}x of the fastest; "
                 f"planning {a['setup_s']:.1f} s ({a['planning_share_10min']:.1%} of a 10-minute run)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="gloo on CPU, NCCL on CUDA")
    p.add_argument("--procs", type=int, default=2, help="processes: the world's ranks")
    p.add_argument("--models", default="resnet18,resnet50", help="comma list of pipedp.models names (CIFAR shapes)")
    p.add_argument("--batch", type=int, default=64, help="global batch per step")
    p.add_argument("--width", type=int, default=None, help="base width of the ResNets (default: the model's, 64)")
    p.add_argument("--microbatches", default="2,4,8", help="microbatch counts of the pipeline layouts")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (MiB)")
    p.add_argument("--rounds", type=int, default=3, help="alternating windows per layout")
    p.add_argument("--steps", type=int, default=2, help="steps per timing window")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per layout first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p


def bench(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark for ``argv``; the report (also written to --out when given)."""
    args = _parser().parse_args(argv)
    if args.procs < 2 or args.procs % 2:
        raise SystemExit(f"--procs {args.procs}: the layouts of a world need an even number of ranks, at least 2 "
                         f"(the point-to-point probe pairs neighbours)")
    rows = run_world(_measure, _table, args)
    return world_report("bench_layouts", args, rows, assumptions=list(ASSUMPTIONS))


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.bench_layouts: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(bench, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
