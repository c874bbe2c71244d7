"""Benchmark: pipedp's ``stages="auto"`` against the strongest thing a user would run instead.

A speed-up over plain eager PyTorch says little: a user who cares about speed
also tries channels_last, ``torch.compile``, CUDA graphs and gradient
accumulation. So the bar here is the best of all of those, measured in the
same process on the same batch, and pipedp's ratio is against that bar (its
ratio against plain eager NCHW is reported too).

A group is a (model, batch, precision); ``bf16`` is bf16 autocast with fp32
parameters. Every configuration of a group trains its own copy of one seeded
model with SGD(lr=0.01, momentum=0.9) and cross entropy on one synthetic batch:

* ``eager-nchw``, ``eager-cl``: the plain step, NCHW or channels_last (model
  and batch; the batch is converted once, as a data loader would deliver it);
* ``compile-nchw``, ``compile-cl``: ``torch.compile(model)``, default mode;
* ``graph-nchw``, ``graph-cl``, ``graph+compile-nchw``, ``graph+compile-cl``:
  the whole step (update included) captured as one CUDA graph, of the eager or
  the compiled model (CUDA only; see :mod:`experiments.baselines`);
* ``accum2``, ``accum4``: gradient accumulation over 2 or 4 equal chunks, in
  the eager layout that was faster in a first short round; with
  ``--compile-accum`` also ``compile-accum2``, ``compile-accum4``: the same
  over ``torch.compile(model)`` (a user who stacks both levers);
* ``pipedp``: ``pipedp.wrap(..., stages="auto", microbatches="auto",
  channels_last="auto", compile="auto")`` (with ``cuda_graph=True`` on a GPU,
  as the graphed alternatives are), which plans on its first batch: wrap
  plus that first step, less one step at the row's median (the first step
  trains like any other), is its planning time, reported apart and as a
  share of a 10-minute run. ``pipedp-threads`` (CPU, ``--threads``) adds
  ``threads="auto"``. pipedp runs ``kernels="torch"`` unless ``--kernel-db``
  names a ``tune-kernels`` database: then ``kernels="auto"`` takes each tuned
  depthwise kernel its tuning measured faster than torch (never the per-user
  cache, which would make the figures depend on what this machine tuned before).
* ``pipedp-defaults``: ``pipedp`` with the default ``microbatches=None``
  (your step's math: one microbatch for a model with BatchNorm); its bar is
  the best alternative with the same math (eager, channels_last, compile).
* ``pipedp-streams`` (CUDA, ``--streams``): ``pipedp`` with ``branches=True,
  split_grads=True`` (side streams inside the captured step).

Timing: each configuration is built and warmed up (2 steps; that time is its
setup, reported apart), then windows of ``--steps`` steps go round robin over
the configurations for ``--rounds`` rounds (synchronized on CUDA), and the
median window is the figure; ``vs_best`` is the best alternative's ms over a
row's ms (above 1: faster than the bar), ``vs_eager`` the same against
``eager-nchw``. What cannot run here is skipped with the reason
in the JSON; what fails is reported and the rest goes on.

    python -m experiments.bench_best --quick
    python -m experiments.bench_best --device cpu --no-compile --out best_cpu.json --md best_cpu.md
    python -m experiments.bench_best --device cuda --out best_h100.json --md best_h100.md
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

import pipedp
from pipedp import console

from .baselines import Numerics, Step, accum_step, make_baseline, prepare, skip_reason
from .machine import describe, sync
from .paired import paired_ratio
from .report import write_json, write_text
from .workload import Workload, parse_ints, parse_workload

__all__ = ["Runner", "PLAN_FIELDS", "groups", "layout_numerics", "time_window", "alternate", "summarize", "plan_fields",
           "bench_group", "markdown", "bench", "main"]

PROG = "python -m experiments.bench_best"
LR, MOMENTUM = 0.01, 0.9
WARMUP = 2  # untimed steps per configuration before its first window
RUN_S = 600.0  # planning is reported as a share of a run this long (10 minutes)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
LAYOUTS = {"nchw": False, "cl": True}
DEFAULT_MODELS = "resnet18,resnet50,mobilenet_v2"
DEFAULT_BATCHES = {"resnet18": [64, 128]}  # other models: 128
# Each in both layouts; then accum2, accum4 (and compile-accum2/4).
ALTERNATIVES = ("eager", "compile", "graph", "graph+compile")
ACCUM = (2, 4)
PLAN_FIELDS = ("label", "channels_last", "compiled", "kernels", "microbatches", "counts", "planning_s", "bar",
               "trial_baseline_ms", "hint")


Make = Callable[[], "tuple[Step, torch.Tensor, object]"]  # builds a configuration: (step, its batch, engine)


@dataclass
class Runner:
    """One timed configuration: its step, the batch in its format, setup seconds and window times (ms per step)."""

    name: str
    step: Step
    x: torch.Tensor
    setup_s: float
    engine: object = None  # pipedp's engine (its plan), None for an alternative
    windows_ms: list[float] = field(default_factory=list)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def layout_numerics(precision: str, channels_last: bool) -> Numerics:
    """The baselines' numerics for a precision (``fp32``, ``bf16``) in one memory format."""
    return Numerics(f"{precision}-{'cl' if channels_last else 'nchw'}", PRECISIONS[precision], channels_last)


def time_window(step: Step, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> float:
    """Milliseconds per step over one window of ``steps`` steps (synchronized before and after on CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def alternate(runners: list[Runner], y: torch.Tensor, rounds: int, steps: int, device: torch.device,
              errors: dict[str, str], where: str = "") -> list[Runner]:
    """Round robin of timing windows: drift of the machine hits every configuration alike. The ones that ran."""
    live = list(runners)
    for r in range(rounds):
        for run in list(live):
            try:
                run.windows_ms.append(time_window(run.step, run.x, y, steps, device))
            except Exception as e:  # report it and time the others
                errors[run.name] = f"{type(e).__name__}: {e}"
                live.remove(run)
                _log(f"  {where} {run.name}: FAILED in round {r + 1}: {errors[run.name][:300]}")
        _log(f"  {where} round {r + 1}/{rounds}: "
             + ", ".join(f"{run.name} {run.windows_ms[-1]:.1f}" for run in live) + " ms/step")
    return live


def _jsonable(v: object) -> object:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(i) for i in v]
    return str(v)


def plan_fields(plan: object) -> dict[str, object]:
    """What pipedp chose and how long it took: :data:`PLAN_FIELDS` of ``plan`` (None where this tree lacks one)."""
    out = {name: _jsonable(getattr(plan, name, None)) for name in PLAN_FIELDS}
    out["text"] = str(plan)
    return out


def summarize(runners: list[Runner], batch: int) -> dict:
    """Medians, spreads and ratios; the best alternative (the bar) is the fastest row that is not pipedp's.

    A ratio is the other row's ms over this row's (images/s over images/s): above 1, this row is faster.
    ``vs_best_paired`` is the median of that ratio per round (the two windows timed in the same round), which
    drift of the machine over the run moves less than the ratio of the two medians.
    """
    ms = {r.name: statistics.median(r.windows_ms) for r in runners}
    alternatives = [n for n in ms if not n.startswith("pipedp")]
    best = min(alternatives, key=lambda n: ms[n]) if alternatives else None
    # The bar of the defaults (microbatches=None keeps the step's math): the alternatives without accumulation.
    same = [n for n in alternatives if "accum" not in n]
    same_best = min(same, key=lambda n: ms[n]) if same else None
    eager = ms.get("eager-nchw")
    by_name = {r.name: r for r in runners}
    rows: dict[str, dict] = {}
    for r in runners:
        rows[r.name] = {
            "kind": "pipedp" if r.name.startswith("pipedp") else "alternative",
            "ms_per_step": ms[r.name], "windows_ms": r.windows_ms, "images_per_s": batch * 1e3 / ms[r.name],
            "spread_ms": [min(r.windows_ms), max(r.windows_ms)], "setup_s": r.setup_s,
            "vs_best": ms[best] / ms[r.name] if best else None,
            "vs_best_paired": paired_ratio(by_name[best].windows_ms, r.windows_ms) if best else None,
            "vs_eager": eager / ms[r.name] if eager else None,
            "vs_same_math": ms[same_best] / ms[r.name] if same_best else None,
            "vs_same_math_paired": paired_ratio(by_name[same_best].windows_ms, r.windows_ms) if same_best else None,
        }
    return {"rows": rows, "best_alternative": best, "best_alternative_ms": ms[best] if best else None,
            "best_same_math": same_best}


def bench_group(work: Workload, batch: int, precision: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Every configuration of one (model, batch, precision), set up, then timed in alternating windows."""
    where = f"{work.name} b{batch} {precision}"
    torch.manual_seed(args.seed)
    base = work.build(args.width, seed=args.seed).to(device)
    x, y = work.batch(batch, device, seed=args.seed)
    runners: list[Runner] = []
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    planning: dict[str, float] = {}  # pipedp rows: wrap + first (planning) step, seconds

    def setup(name: str, make: Make) -> Runner | None:
        """Build ``name`` with ``make() -> (step, batch, engine)`` and warm it up; None (error kept) on failure."""
        t0 = time.perf_counter()
        try:
            step, xi, engine = make()
            for _ in range(WARMUP):
                step(xi, y)
            sync(device)
        except Exception as e:  # report it and go on with the others
            errors[name] = f"{type(e).__name__}: {e}"
            _log(f"  {where} {name}: FAILED {errors[name][:300]}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        run = Runner(name, step, xi, time.perf_counter() - t0, engine)
        runners.append(run)
        _log(f"  {where} {name}: ready in {run.setup_s:.1f} s")
        return run

    def alternative(kind: str, num: Numerics) -> Make:
        def make() -> tuple[Step, torch.Tensor, None]:
            model, xi = prepare(copy.deepcopy(base), x, num)
            return make_baseline(kind, num, model, xi, y, lr=LR), xi, None
        return make

    def accumulation(chunks: int, num: Numerics, compiled: bool = False) -> Make:
        def make() -> tuple[Step, torch.Tensor, None]:
            model, xi = prepare(copy.deepcopy(base), x, num)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            # Static shapes, as a user compiling for one chunk size gets (dynamo would otherwise mark the batch
            # dynamic: the group's compile rows already compiled this forward at the whole batch).
            run = torch.compile(model, dynamic=False) if compiled else model
            return accum_step(run, opt, num, chunks), xi, None  # type: ignore[arg-type]
        return make

    def wrapped(name: str, threads: bool, streams: bool = False, defaults: bool = False) -> Make:
        def make() -> tuple[Step, torch.Tensor, object]:
            model = copy.deepcopy(base)
            kw: dict[str, object] = dict(
                optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                loss_fn=nn.CrossEntropyLoss(), precision=precision, stages="auto",
                microbatches=None if defaults else "auto",
                channels_last="auto", compile="auto" if args.compile else False, plan_budget_s=args.plan_budget,
                devices=x.device, progress=False, cuda_graph=device.type == "cuda", plan_cache=False,
                kernels="auto" if args.kernel_db else "torch", kernel_db=args.kernel_db)
            if threads:
                kw["threads"] = "auto"
            if streams:
                kw.update(branches=True, split_grads=True)
            t0 = time.perf_counter()
            engine = pipedp.wrap(model, **kw)  # type: ignore[arg-type]
            engine.train_step(x, y)  # plans on this first batch
            sync(device)
            planning[name] = time.perf_counter() - t0
            return engine.train_step, x, engine
        return make

    # 1. Plain eager in both layouts, and a first short round to pick the layout of the accumulation rows.
    eager = {lay: setup(f"eager-{lay}", alternative("eager", layout_numerics(precision, cl)))
             for lay, cl in LAYOUTS.items()}
    probe = {r.name: time_window(r.step, r.x, y, args.steps, device) for r in eager.values() if r is not None}
    accum_layout = min(LAYOUTS, key=lambda lay: probe.get(f"eager-{lay}", float("inf"))) if probe else None
    _log(f"  {where} first round: " + ", ".join(f"{n} {ms:.1f}" for n, ms in probe.items())
         + f" ms/step; accumulation in {accum_layout}")
    # 2. The compiled and CUDA-graphed alternatives in both layouts.
    for kind in ALTERNATIVES[1:]:
        for lay, cl in LAYOUTS.items():
            name = f"{kind}-{lay}"
            why = skip_reason(kind, device, compile_on_cpu=True)
            why = why or (args.compile_skip if "compile" in kind else None)
            if why is not None:
                skipped[name] = why
            else:
                setup(name, alternative(kind, layout_numerics(precision, cl)))
    # 3. Gradient accumulation in the faster eager layout (and over the compiled model, where asked).
    for compiled in (False, True) if args.compile_accum else (False,):
        for chunks in ACCUM:
            name = f"{'compile-' if compiled else ''}accum{chunks}"
            if compiled and args.compile_skip:
                skipped[name] = args.compile_skip
            elif accum_layout is None:
                skipped[name] = "no eager layout ran to choose from"
            else:
                setup(name, accumulation(chunks, layout_numerics(precision, LAYOUTS[accum_layout]), compiled))
    # 4. pipedp, planning on its first batch.
    setup("pipedp", wrapped("pipedp", threads=False))
    setup("pipedp-defaults", wrapped("pipedp-defaults", threads=False, defaults=True))
    if not args.threads:
        skipped["pipedp-threads"] = "off by default: pass --threads"
    elif device.type != "cpu":
        skipped["pipedp-threads"] = "threads= schedules CPU stages: CPU only"
    else:
        setup("pipedp-threads", wrapped("pipedp-threads", threads=True))

    if not args.streams:
        skipped["pipedp-streams"] = "off by default: pass --streams"
    elif device.type != "cuda":
        skipped["pipedp-streams"] = "branches and split_grads run on CUDA streams: CUDA only"
    else:
        setup("pipedp-streams", wrapped("pipedp-streams", threads=False, streams=True))

    ran = alternate(runners, y, args.rounds, args.steps, device, errors, where)
    res = summarize(ran, batch)
    for run in ran:
        if run.engine is not None:
            spent = planning[run.name] - res["rows"][run.name]["ms_per_step"] / 1e3  # the first step trained
            res["rows"][run.name].update(
                planning_s=spent, planning_share_10min=spent / RUN_S,
                kernel_layers=run.engine.kernel_layers,  # type: ignore[attr-defined]
                plan=plan_fields(run.engine.plan))  # type: ignore[attr-defined]
    res.update(model=work.name, batch=batch, precision=precision, accum_layout=accum_layout,
               eager_probe_ms=probe, skipped=skipped, errors=errors)
    for run in runners:  # an engine may hold threads or graphs: let it go before the next group
        close = getattr(run.engine, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:  # the figures are taken: say so and go on
                _log(f"  {where} {run.name}: close() failed: {type(e).__name__}: {e}")
    del runners, ran, eager, base
    return res


def _free(device: torch.device) -> None:
    """Drop the last group's models, compiled code and cached memory before the next group."""
    gc.collect()
    torch._dynamo.reset()  # compiled code of the last group's models; also keeps recompiles under dynamo's limit
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fmt(v: object, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def markdown(out: dict) -> str:
    """One line per group: the bar (best alternative), pipedp against it, and what pipedp chose and paid for it."""
    lines = [f"Machine: {out['machine']}; torch {out['torch']}; {out['rounds']} rounds x {out['steps_per_window']} "
             "steps, median window. Ratio = best alternative's ms / pipedp's ms (>1: pipedp is faster); paired: the "
             "median of that ratio per round, the two windows of one round side by side.", "",
             "| model | batch | precision | best alternative | best ms | pipedp ms | pipedp vs best | paired "
             "| pipedp plan | planning s | planning % of 10 min | hint |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in out["groups"]:
        p = g["rows"].get("pipedp")
        plan = (p or {}).get("plan") or {}
        if p is None:
            chosen = "failed: " + g["errors"].get("pipedp", "")[:80] if "pipedp" in g["errors"] else "-"
        else:
            counts, mb = plan.get("counts"), plan.get("microbatches")
            sxm = f"{len(counts)}x{mb}" if counts is not None and mb is not None else str(plan.get("label") or "?")
            layout = {True: "channels_last", False: "NCHW"}.get(plan.get("channels_last"), "layout ?")
            compiled = {True: "compiled", False: "eager"}.get(plan.get("compiled"), "compiled ?")
            chosen = f"{sxm}, {layout}, {compiled}"
            if p.get("kernel_layers"):
                chosen += f", tuned kernels on {p['kernel_layers']} depthwise layers"
        share = (p or {}).get("planning_share_10min")
        cells = [g["model"], str(g["batch"]), g["precision"], g["best_alternative"] or "-",
                 _fmt(g["best_alternative_ms"], ".1f"), _fmt((p or {}).get("ms_per_step"), ".1f"),
                 _fmt((p or {}).get("vs_best"), ".2f"), _fmt((p or {}).get("vs_best_paired"), ".2f"), chosen,
                 _fmt((p or {}).get("planning_s"), ".1f"),
                 _fmt(share * 100 if share is not None else None, ".1f"), str(plan.get("hint") or "")]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--models", default=None, help=f"comma list of model specs name[@size][/classes] "
                   f"(default {DEFAULT_MODELS}; resnet18 at 32x32 is CIFAR ResNet-18)")
    p.add_argument("--batch", default=None, help="comma list of batch sizes (default: 64,128 for resnet18, 128 "
                   "for the others)")
    p.add_argument("--precision", default=None, help="comma list of fp32, bf16 (bf16 autocast, fp32 parameters); "
                   "default fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--rounds", type=int, default=None, help="alternating windows per configuration (default 5 on "
                   "CUDA, 3 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="steps per timing window (default 20 on CUDA, 2 on CPU)")
    p.add_argument("--width", type=int, default=None, help="base width of the models (default 64; 8 with --quick)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="time the torch.compile alternatives and let pipedp compile (default on, off with --quick; "
                        "on 2 CPU cores a compile takes minutes)")
    p.add_argument("--compile-accum", action="store_true", help="also time gradient accumulation over the "
                   "compiled model (compile-accum2, compile-accum4; skipped without --compile)")
    p.add_argument("--streams", action="store_true", help="also time pipedp with branches=True and split_grads=True "
                   "(CUDA side streams; stages='auto' then weighs them against the compiled step)")
    p.add_argument("--threads", action="store_true", help="also time pipedp with threads='auto' (CPU)")
    p.add_argument("--plan-budget", type=float, default=30.0, help="pipedp's plan_budget_s: seconds its planner may "
                   "spend on trials")
    p.add_argument("--kernel-db", default=None, help="a tune-kernels database: pipedp runs kernels='auto' from it "
                   "(default: none, kernels='torch')")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the synthetic batch")
    p.add_argument("--quick", action="store_true", help="a smoke run: resnet18 of width 8, batch 16, fp32, "
                   "2 rounds x 1 step, no compile unless --compile")
    p.add_argument("--out", default=None, help="write results JSON here (after every group)")
    p.add_argument("--md", default=None, help="write the markdown table here (after every group)")
    return p


def _defaults(args: argparse.Namespace, device: torch.device) -> None:
    cuda = device.type == "cuda"
    if args.quick:
        args.models = args.models or "resnet18"
        args.batch = args.batch or "16"
        args.precision = args.precision or "fp32"
        args.width = args.width or 8
        args.rounds, args.steps = args.rounds or 2, args.steps or 1
    args.models = args.models or DEFAULT_MODELS
    args.precision = args.precision or "fp32,bf16"
    args.width = args.width or 64
    args.rounds = args.rounds or (5 if cuda else 3)
    args.steps = args.steps or (20 if cuda else 2)
    if args.compile is None:
        args.compile, args.compile_skip = not args.quick, "--quick skips torch.compile (pass --compile)"
    else:
        args.compile_skip = "skipped under --no-compile"
    args.compile_skip = None if args.compile else args.compile_skip  # why the compiled alternatives do not run
    if args.rounds < 1 or args.steps < 1 or args.width < 1:
        raise ValueError("--rounds, --steps and --width must be positive")
    if args.plan_budget <= 0:
        raise ValueError(f"--plan-budget must be positive seconds, got {args.plan_budget}")


def groups(args: argparse.Namespace) -> list[tuple[Workload, int, str]]:
    """(workload, batch, precision) of every row: --batch for every model, or each model's default batches."""
    precisions = [s.strip() for s in args.precision.split(",") if s.strip()]
    for prec in precisions:
        if prec not in PRECISIONS:
            raise ValueError(f"unknown precision {prec!r}: choose from {', '.join(PRECISIONS)}")
    given = parse_ints(args.batch, "--batch") if args.batch else None
    out = []
    for spec in args.models.split(","):
        work = parse_workload(spec)
        for b in given or DEFAULT_BATCHES.get(work.name, [128]):
            out.extend((work, b, prec) for prec in precisions)
    return out


def bench(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark for ``argv``; the results (also written to --out and --md when given)."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    _defaults(args, device)
    rows = groups(args)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # what a user after speed turns on
    out: dict = {"benchmark": "bench_best", "machine": describe(device), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "device": str(device), "rounds": args.rounds,
                 "steps_per_window": args.steps, "warmup": WARMUP, "width": args.width, "compile": args.compile,
                 "threads": args.threads, "compile_accum": args.compile_accum, "plan_budget_s": args.plan_budget,
                 "seed": args.seed, "kernel_db": args.kernel_db,
                 "cudnn_benchmark": device.type == "cuda", "lr": LR, "momentum": MOMENTUM, "groups": []}
    for i, (work, batch, precision) in enumerate(rows, 1):
        _log(f"[{i}/{len(rows)}] {work.name}, batch {batch}, {precision} on {device}")
        t0 = time.perf_counter()
        out["groups"].append(bench_group(work, batch, precision, args, device))
        _free(device)
        g = out["groups"][-1]
        _log(f"[{i}/{len(rows)}] done in {time.perf_counter() - t0:.0f} s: best alternative {g['best_alternative']}"
             f" {_fmt(g['best_alternative_ms'], '.1f')} ms, pipedp "
             f"{_fmt(g['rows'].get('pipedp', {}).get('ms_per_step'), '.1f')} ms")
        if args.out:  # after every group, so that a cut-off run keeps what it measured
            write_json(args.out, out)
        if args.md:
            write_text(args.md, markdown(out))
    print(markdown(out))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.bench_best: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(bench, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
