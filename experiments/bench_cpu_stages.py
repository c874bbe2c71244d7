"""Benchmark: concurrent CPU stages with planned thread counts, against plain training and one-stage microbatching.

Per model (CIFAR-shaped ResNets), every configuration trains its own copy of
the same model on the same synthetic batch, in this one process, timed in
windows that alternate between configurations (round robin) so that drift and
other load hit all of them alike; the fastest window gives ms per step (load
from elsewhere only slows a window down; every window is in the JSON).

- ``plain``: the unmodified model, one forward+backward+SGD step on the whole
  batch, torch's default thread count (what a user runs without pipedp);
- ``1stage:M=m``: pipedp with one stage and m microbatches, for every m of
  ``--microbatches`` (the best of them is the best single-stage plan);
- ``auto``: ``stages="auto", threads="auto"`` at ``--auto-microbatches`` (a
  number, or ``auto`` to let it choose among 1, 2, 4, 8 too): the planner
  measures one stage on all cores against concurrent stages with modelled,
  then hill-climbed thread counts, and keeps the faster;
- ``S=2,even``: two concurrent stages with the cores split evenly (the fixed
  concurrent plan a user might write by hand), at auto's microbatches (4 for ``auto``).

Setup (build, profiling, the planner's trial steps, the first step) is
reported apart from the step times. Ratios: auto against plain, against the
best single-stage plan, against the best fixed configuration (every row but
auto and plain) and against the best fixed configuration auto could have
chosen (those at its microbatch count; all of them for ``auto``).

    python -m experiments.bench_cpu_stages --quick --out /tmp/cpu_stages.json
    python -m experiments.bench_cpu_stages --out experiments/results/cpu_stages_2core.json
    python3 -m experiments.bench_cpu_stages --rounds 3 --steps 2 --auto-microbatches auto \
        --out $OUT/cpu_stages_16core.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

import pipedp
from pipedp.pipeline.cpu_lane import available_cores

from .machine import describe
from .models import paper_model
from .report import write_json

PROG = "python -m experiments.bench_cpu_stages"
Step = Callable[[torch.Tensor, torch.Tensor], object]


def _plain(model: nn.Module, lr: float) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> object:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _engine(model: nn.Module, lr: float, **pipeline: Any) -> pipedp.Engine:
    opts = pipedp.PipelineOptions(progress=False, **pipeline)
    return pipedp.Engine(model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), pipeline=opts)


def configs(cores: int, microbatches: Sequence[int], auto_m: int | str) -> dict[str, dict[str, Any] | None]:
    """Name -> the engine's pipeline options (None: plain training)."""
    out: dict[str, dict[str, Any] | None] = {"plain": None}
    for m in microbatches:
        out[f"1stage:M={m}"] = dict(stages=1, microbatches=m, profile=False)
    out["auto"] = dict(stages="auto", threads="auto", microbatches=auto_m)
    if cores >= 2:
        even_m = auto_m if isinstance(auto_m, int) else 4
        out["S=2,even"] = dict(stages=2, threads=[cores // 2, cores // 2], microbatches=even_m, profile=False)
    return out


def choosable(cfgs: dict[str, dict[str, Any] | None]) -> list[str]:
    """The fixed rows auto could have chosen: those at its microbatch count (all, when it chooses that too)."""
    auto_m = cfgs["auto"]["microbatches"]  # type: ignore[index]
    return [k for k, c in cfgs.items() if c is not None and k != "auto"
            and (auto_m == "auto" or c["microbatches"] == auto_m)]


def bench_model(name: str, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = paper_model(name, 10, image_size=args.image_size, width=args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    steps: dict[str, Step] = {}
    rows: dict[str, dict[str, Any]] = {}
    cfgs = configs(cores, args.microbatches, args.auto_microbatches)
    for cname, opts in cfgs.items():
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        if opts is None:
            step: Step = _plain(model, args.lr)
            engine = None
        else:
            engine = _engine(model, args.lr, **opts)
            step = engine.train_step
        step(x, y)  # builds (profiling, trials) and warms up
        rows[cname] = {"setup_s": round(time.perf_counter() - t0, 2), "windows_ms": []}
        if engine is not None:
            plan = engine.plan
            rows[cname].update(plan=str(plan), stages=len(plan.stages), microbatches=plan.microbatches,
                               threads=[s.threads for s in plan.stages], counts=plan.counts)
        steps[cname] = step
        print(f"{name}: {cname} ready in {rows[cname]['setup_s']:.1f} s", file=sys.stderr, flush=True)
    for _ in range(args.rounds):
        for cname, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            rows[cname]["windows_ms"].append((time.perf_counter() - t0) * 1e3 / args.steps)
    for row in rows.values():
        row["ms_per_step"] = min(row["windows_ms"])
        row["median_ms_per_step"] = statistics.median(row["windows_ms"])
        row["images_per_s"] = args.batch / row["ms_per_step"] * 1e3
    return {"rows": rows, **ratios(rows, choosable(cfgs))}


def ratios(rows: dict[str, dict[str, Any]], could: Sequence[str]) -> dict[str, Any]:
    """Speed ratios (>1: the first is faster) of auto against plain, the best single stage and the best fixed rows.

    ``could``: the fixed rows auto could have chosen.
    """
    ms = {k: r["ms_per_step"] for k, r in rows.items()}
    single = min((k for k in ms if k.startswith("1stage")), key=ms.__getitem__)
    fixed = min((k for k in ms if k not in ("auto", "plain")), key=ms.__getitem__)
    best_could = min(could, key=ms.__getitem__)
    out: dict[str, Any] = {
        "best_single_stage": single,
        "best_fixed": fixed,
        "best_choosable": best_could,
        "auto_vs_plain": ms["plain"] / ms["auto"],
        "auto_vs_best_single_stage": ms[single] / ms["auto"],
        "auto_vs_best_fixed": ms[fixed] / ms["auto"],
        "auto_vs_best_choosable": ms[best_could] / ms["auto"],
        "best_single_stage_vs_plain": ms["plain"] / ms[single],
    }
    if "S=2,even" in ms:
        out["even_vs_plain"] = ms["plain"] / ms["S=2,even"]
    return out


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return vals


def _count(text: str) -> int | str:
    if text == "auto":
        return text
    (value,) = _ints(text)
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,resnet34,resnet50", help="comma list of models")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64, help="the ResNets' base width")
    p.add_argument("--microbatches", type=_ints, default=[1, 2, 4, 8], help="single-stage microbatch counts")
    p.add_argument("--auto-microbatches", type=_count, default=4,
                   help="microbatches of the concurrent plans: a number, or 'auto' to let the planner choose")
    p.add_argument("--rounds", type=int, default=2, help="alternating windows per configuration")
    p.add_argument("--steps", type=int, default=1, help="steps per window")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--quick", action="store_true", help="a tiny run to check the script (ResNet-18 of width 8)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.models, args.batch, args.image_size, args.width = "resnet18", 8, 16, 8
        args.microbatches, args.auto_microbatches, args.rounds, args.steps = [1, 2], 2, 2, 1
    cores = len(available_cores())
    t0 = time.perf_counter()
    results = {m: bench_model(m, args, cores) for m in args.models.split(",") if m}
    out = {
        "benchmark": "cpu_stages",
        "machine": describe("cpu"),
        "cores": cores,
        "batch": args.batch,
        "image_size": args.image_size,
        "width": args.width,
        "microbatches": args.microbatches,
        "auto_microbatches": args.auto_microbatches,
        "rounds": args.rounds,
        "steps": args.steps,
        "results": results,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    for m, r in results.items():
        print(f"{m}: auto {r['auto_vs_plain']:.2f}x plain, {r['auto_vs_best_single_stage']:.2f}x best single stage "
              f"({r['best_single_stage']}), {r['auto_vs_best_fixed']:.2f}x best fixed ({r['best_fixed']}), "
              f"{r['auto_vs_best_choosable']:.2f}x best it could choose ({r['best_choosable']}); "
              f"auto ran {r['rows']['auto']['stages']} stage(s), threads {r['rows']['auto']['threads']}")
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
