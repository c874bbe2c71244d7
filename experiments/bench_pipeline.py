"""Benchmark: pipedp against the strongest single-device baselines, model by batch size by numerics.

For each model, batch size and numerics (fp32; bf16 autocast + channels_last)
every configuration trains its own copy of the same model on the same
synthetic batch: the baselines of :mod:`experiments.baselines` (eager,
CUDA-graphed eager, ``torch.compile`` default and max-autotune) and pipedp
rows (``stages="auto"`` with ``microbatches="auto"``; fixed S x M; with and
without ``cuda_graph`` and ``compile``). Timing windows alternate between the
configurations of a group (round robin, several rounds) in this one process,
and the median window gives images/s. Ratios are against the best baseline of
the same group (and against eager). Setup time (build, compile, capture,
stages="auto" trials, warm-up) is reported apart. On CUDA each configuration
also gets its peak memory (rebuilt alone with the plan it chose) and, from a
profiler trace, the GPU busy fraction and the share of busy time with two or
more streams active (:mod:`pipedp.pipeline.busy`). What cannot run on this
device (CUDA graphs on a CPU; torch.compile on a CPU unless asked) is skipped
with the reason in the JSON.

    python -m experiments.bench_pipeline --device cpu --quick
    python -m experiments.bench_pipeline --device cuda --models resnet18 --batch 32,64,128,256 --out r18.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import torch
from torch import nn

import pipedp
from pipedp import console
from pipedp.pipeline.busy import busy_time, kernel_intervals

from .baselines import BASELINES, Numerics, Step, in_format, make_baseline, numerics, prepare, skip_reason
from .machine import describe, sync
from .report import write_json
from .workload import Workload, parse_ints, parse_workload

PROG = "python -m experiments.bench_pipeline"


@dataclass(frozen=True)
class Config:
    """One way to train: a baseline (see :mod:`experiments.baselines`) or pipedp with some options."""

    name: str
    kind: str = "baseline"  # "baseline" or "pipedp"
    baseline: str = "eager"
    stages: object = "auto"
    microbatches: object = "auto"
    schedule: str = "1f1b"
    graph: bool = False
    compile: bool = False
    recompute: bool = False
    branches: bool = False  # pipedp's concurrency pieces (stages="auto" keeps them only where trials find them faster)
    split_grads: bool = False


def parse_config(text: str) -> Config:
    """A baseline name (``eager``, ``graph``, ``compile``, ``max-autotune``, ``graph+compile``,
    ``graph+max-autotune``) or
    ``pipedp[:S=auto|N,M=auto|N][,gpipe][,graph][,compile][,recompute][,branches][,split_grads]``
    (S and M default to auto)."""
    text = text.strip()
    if text in BASELINES:
        return Config(text, baseline=text)
    if text != "pipedp" and not text.startswith("pipedp:"):
        raise ValueError(f"unknown config {text!r}: {', '.join(BASELINES)} or "
                         f"pipedp[:S=..,M=..][,gpipe][,graph][,compile][,recompute][,branches][,split_grads]")
    kw: dict[str, object] = {}
    for part in text.partition(":")[2].split(","):
        if not part:
            continue
        if part in ("gpipe", "1f1b"):
            kw["schedule"] = part
        elif part in ("graph", "compile", "recompute", "branches", "split_grads"):
            kw[part] = True
        elif part[:2] in ("S=", "M=") and (part[2:] == "auto" or part[2:].isdigit()):
            kw["stages" if part[0] == "S" else "microbatches"] = part[2:] if part[2:] == "auto" else int(part[2:])
        else:
            raise ValueError(f"config {text!r}: cannot read {part!r}")
    return Config(text, kind="pipedp", **kw)  # type: ignore[arg-type]


DEFAULT = {
    "cpu": ["eager", "graph", "compile", "max-autotune", "pipedp", "pipedp:S=1,M=2", "pipedp:S=2,M=2"],
    "cuda": ["eager", "graph", "compile", "max-autotune", "graph+compile",
             "pipedp:graph", "pipedp:graph,compile", "pipedp:graph,branches,split_grads",
             "pipedp:S=1,M=1,graph", "pipedp:S=2,M=2,graph",
             "pipedp:S=2,M=4,graph", "pipedp:S=1,M=4,graph,recompute"],
}


def pipedp_skip_reason(cfg: Config, device: torch.device, compile_on_cpu: bool) -> str | None:
    if device.type != "cuda" and cfg.graph:
        return "cuda_graph=True needs a CUDA device"
    if device.type != "cuda" and cfg.compile and not compile_on_cpu:
        return "torch.compile on a CPU takes minutes per model: pass --compile-on-cpu to time it"
    return None


def make_step(cfg: Config, num: Numerics, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
              profile: bool) -> tuple[Step, object]:
    """The training step of ``cfg`` (and its pipedp engine, None for a baseline)."""
    if cfg.kind == "baseline":
        model, x = prepare(model, x, num)
        return make_baseline(cfg.baseline, num, model, x, y), None
    engine = pipedp.wrap(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
        microbatches=cfg.microbatches, stages=cfg.stages, schedule=cfg.schedule,  # type: ignore[arg-type]
        devices=x.device, profile=profile, sample=x, cuda_graph=cfg.graph, progress=False,
        precision=num.precision, channels_last=num.channels_last, compile=cfg.compile, recompute=cfg.recompute,
        branches=cfg.branches, split_grads=cfg.split_grads,
    )
    return engine.train_step, engine


def _chosen(cfg: Config, engine: object) -> Config:
    """``cfg`` with the plan its engine chose, so that a rebuild runs it without trials."""
    if engine is None:
        return cfg
    plan = engine.plan  # type: ignore[attr-defined]
    stages = 1 if len(plan.counts) == 1 else list(plan.counts)
    concurrent = plan.label.endswith(" concurrent") or cfg.stages != "auto"
    return replace(cfg, stages=stages, microbatches=plan.microbatches, compile=plan.compiled,
                   branches=cfg.branches and concurrent, split_grads=cfg.split_grads and concurrent)


def gpu_busy(step: Step, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> dict[str, float]:
    """From a profiler trace of ``steps`` steps: GPU busy fraction and the busy share with 2+ streams active."""
    from torch.profiler import ProfilerActivity, profile

    sync(x.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(x, y)
        sync(x.device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            b = busy_time(kernel_intervals(json.load(fh)))
    return {"busy_fraction": b.busy_fraction, "concurrent_share": b.concurrent_share, "kernel_streams": b.streams,
            "gpu_busy_ms_per_step": b.busy / 1e3 / steps}


def _peak_rss_mib() -> float:
    """This address space's peak RSS (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _rss_probe(args: tuple) -> float:
    """Child process: peak RSS growth (MiB) from before building the config through two steps."""
    cfg, num, work, batch, width, threads = args
    torch.set_num_threads(threads)
    model = work.build(width)
    x, y = work.batch(batch, torch.device("cpu"))
    gc.collect()
    base = _peak_rss_mib()
    step, _ = make_step(cfg, num, model, x, y, profile=False)
    for _ in range(2):
        step(x, y)
    return _peak_rss_mib() - base


def peak_memory_mib(cfg: Config, num: Numerics, work: Workload, batch: int, device: torch.device,
                    width: int) -> float:
    """Peak memory of ``cfg`` built alone: CUDA allocator peak over its model, or a child process's RSS on CPU."""
    if device.type == "cpu":
        with mp.get_context("spawn").Pool(1) as pool:
            return pool.map(_rss_probe, [(cfg, num, work, batch, width, torch.get_num_threads())])[0]
    gc.collect()
    torch.cuda.empty_cache()
    model = work.build(width).to(device)
    x, y = work.batch(batch, device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step, engine = make_step(cfg, num, model, x, y, profile=False)
    for _ in range(4):
        step(x, y)
    sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    del step, engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_group(work: Workload, batch: int, num: Numerics, configs: list[Config], args: argparse.Namespace,
                device: torch.device) -> dict:
    """All configurations of one model, batch size and numerics, timed in alternating windows."""
    base_model = work.build(args.width).to(device)
    x, y = work.batch(batch, device)
    xi = in_format(x, num)  # the batch as every configuration of this numerics takes it
    steps: dict[str, Step] = {}
    engines: dict[str, object] = {}
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}
    setup: dict[str, float] = {}
    where = f"{work.name} b{batch} {num.name}"
    for cfg in configs:
        why = (skip_reason(cfg.baseline, device, args.compile_on_cpu) if cfg.kind == "baseline"
               else pipedp_skip_reason(cfg, device, args.compile_on_cpu))
        if why is not None:
            skipped[cfg.name] = why
            continue
        t0 = time.perf_counter()
        try:
            step, engine = make_step(cfg, num, copy.deepcopy(base_model), x, y, args.profile)
            for _ in range(args.warmup):
                step(xi, y)
            sync(device)
        except Exception as e:  # report and go on with the other configurations
            errors[cfg.name] = f"{type(e).__name__}: {e}"
            _log(f"  {where} {cfg.name}: FAILED {errors[cfg.name][:300]}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        steps[cfg.name] = step
        setup[cfg.name] = time.perf_counter() - t0
        if engine is not None:
            engines[cfg.name] = engine
        _log(f"  {where} {cfg.name}: ready in {setup[cfg.name]:.1f} s")
    ran = [c for c in configs if c.name in steps]
    windows: dict[str, list[float]] = {c.name: [] for c in ran}
    for _ in range(args.rounds):
        for cfg in ran:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[cfg.name](xi, y)
            sync(device)
            windows[cfg.name].append(args.steps * batch / (time.perf_counter() - t0))
    ips = {c.name: statistics.median(windows[c.name]) for c in ran}
    baselines = [c.name for c in ran if c.kind == "baseline"]
    best = max(baselines, key=lambda n: ips[n]) if baselines else None
    eager = ips.get("eager")
    rows: dict[str, dict] = {}
    for cfg in ran:
        engine = engines.get(cfg.name)
        plan = engine.plan if engine is not None else None  # type: ignore[attr-defined]
        rows[cfg.name] = {
            "config": asdict(cfg), "images_per_s": ips[cfg.name], "images_per_s_windows": windows[cfg.name],
            "setup_s": setup[cfg.name],
            "vs_best_baseline": ips[cfg.name] / ips[best] if best else None,
            "vs_eager": ips[cfg.name] / eager if eager else None,
            "plan": str(plan) if plan is not None else None,
            "plan_label": plan.label if plan is not None else None,
        }
    if device.type == "cuda" and args.busy:
        for cfg in ran:
            try:
                rows[cfg.name]["gpu"] = gpu_busy(steps[cfg.name], xi, y)
            except Exception as e:
                errors[f"busy {cfg.name}"] = f"{type(e).__name__}: {e}"
    chosen = {c.name: _chosen(c, engines.get(c.name)) for c in ran}
    del steps, engines
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.memory:
        for cfg in ran:
            try:
                rows[cfg.name]["peak_memory_mib"] = peak_memory_mib(chosen[cfg.name], num, work, batch, device,
                                                                    args.width)
            except Exception as e:
                errors[f"memory {cfg.name}"] = f"{type(e).__name__}: {e}"
    return {"rows": rows, "best_baseline": best, "skipped": skipped, "errors": errors}


def print_group(work: Workload, batch: int, num: Numerics, res: dict) -> None:
    print(f"\n{work.name}, batch {batch}, {num.name} (best baseline: {res['best_baseline']})")
    print(f"  {'config':<34} {'img/s':>9} {'x best':>7} {'x eager':>8} {'setup s':>8} {'peak MiB':>9} {'busy':>6} "
          f"{'2+str':>6}")
    for cname, row in res["rows"].items():
        def f(v: object, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        gpu = row.get("gpu", {})
        print(f"  {cname:<34} {row['images_per_s']:>9.1f} {f(row['vs_best_baseline'], '.3f'):>7} "
              f"{f(row['vs_eager'], '.3f'):>8} {row['setup_s']:>8.1f} {f(row.get('peak_memory_mib'), '.0f'):>9} "
              f"{f(gpu.get('busy_fraction'), '.0%'):>6} {f(gpu.get('concurrent_share'), '.0%'):>6}")
        if row["plan_label"] and row["config"]["stages"] == "auto":
            print(f"  {'':<34} stages=auto chose {row['plan_label']}")
    for cname, why in res["skipped"].items():
        print(f"  {cname:<34} skipped: {why}")
    for cname, err in res["errors"].items():
        print(f"  {cname:<34} FAILED: {err[:200]}")


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--models", default="resnet18,resnet34,resnet50",
                   help="comma list of model specs name[@size][/classes], e.g. resnet50@224/101")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--batch", default="128", help="comma list of batch sizes")
    p.add_argument("--numerics", default="fp32,bf16cl", help="comma list: fp32, bf16cl (bf16 autocast + "
                   "channels_last)")
    p.add_argument("--configs", default=None, help="';' between configs (see parse_config); default: this device's "
                   "standard set")
    p.add_argument("--steps", type=int, default=None, help="steps per timing window; default: 10 on CUDA, 2 on CPU")
    p.add_argument("--rounds", type=int, default=4, help="alternating windows per config")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per config first")
    p.add_argument("--width", type=int, default=None, help="ResNet base width (default 64; 8 with --quick)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="pipedp profiles blocks (None: on CUDA) or uses the cost model")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each configuration's peak memory (default: on, off with --quick)")
    p.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU busy fraction and stream concurrency of every configuration from a profiler trace (CUDA)")
    p.add_argument("--compile-on-cpu", action="store_true", help="time torch.compile rows on a CPU too (slow)")
    p.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.backends.cudnn.benchmark for every configuration (CUDA)")
    p.add_argument("--quick", action="store_true", help="a smoke run: resnet18 of width 8, batch 8, 1 step per "
                   "window, 2 rounds, no memory probes")
    p.add_argument("--out", default=None, help="write results JSON here (after every group)")
    return p


def _defaults(args: argparse.Namespace, device: torch.device) -> None:
    if args.quick:
        if args.models == _parser().get_default("models"):
            args.models = "resnet18"
        if args.batch == _parser().get_default("batch"):
            args.batch = "8"
        args.width = args.width or 8
        args.steps = args.steps or 1
        args.rounds, args.warmup = min(args.rounds, 2), min(args.warmup, 1)
        args.memory = bool(args.memory)
    args.width = args.width or 64
    args.steps = args.steps or (10 if device.type == "cuda" else 2)
    args.memory = True if args.memory is None else args.memory
    args.profile = device.type == "cuda" if args.profile is None else args.profile


def bench(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark for ``argv``; the results (also written to --out when given)."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    _defaults(args, device)
    names = args.configs.split(";") if args.configs else DEFAULT["cuda" if device.type == "cuda" else "cpu"]
    configs = [parse_config(c) for c in names if c.strip()]
    if len({c.name for c in configs}) != len(configs):
        raise ValueError(f"--configs names a configuration twice: {args.configs!r}")
    works = [parse_workload(m) for m in args.models.split(",")]
    batches = parse_ints(args.batch, "--batch")
    nums = [numerics(n.strip()) for n in args.numerics.split(",")]
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    machine = describe(device)
    results: dict[str, dict] = {}
    out = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "steps_per_window": args.steps,
           "rounds": args.rounds, "warmup": args.warmup, "width": args.width, "cudnn_benchmark": args.cudnn_benchmark,
           "configs": [c.name for c in configs], "results": results}
    for work in works:
        for b in batches:
            for num in nums:
                _log(f"benchmarking {work.name} (batch {b}, {num.name}) on {device}")
                res = bench_group(work, b, num, configs, args, device)
                results.setdefault(work.name, {}).setdefault(str(b), {})[num.name] = res
                print_group(work, b, num, res)
                if args.out:  # after every group, so a cut-off run keeps what it measured
                    write_json(args.out, out)
    print(f"\nmachine: {machine}\n(ratios are medians of alternating windows in this one process)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.bench_pipeline: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(bench, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
