"""Benchmark: plain PyTorch training vs pipedp on CIFAR-shaped ResNets.

Every configuration trains its own copy of the same model on the same
synthetic batch; timing windows alternate between configurations (round
robin, several rounds) so all of them see the same machine state, and the
median window gives images/s. Ratios are against plain eager training at the
same batch size. Peak memory is measured for each configuration on its own
(CUDA allocator peak, or the peak RSS of a child process on CPU). On CUDA the
stream overlap of a pipelined step is read from a profiler trace.

    python -m experiments.bench_pipeline --device cpu --models resnet18
    python -m experiments.bench_pipeline --device cuda --out experiments/results/pipeline_h100.json
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
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import pipedp
from pipedp import console
from pipedp.models import get_model
from pipedp.pipeline.graphed import fresh_cublas_workspaces

from .machine import describe, sync
from .report import write_json

PROG = "python -m experiments.bench_pipeline"
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Config:
    """One way to train: plain PyTorch (eager, CUDA-graphed or compiled) or pipedp."""

    name: str
    kind: str = "plain"  # "plain" or "pipedp"
    stages: object = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    graph: bool = False
    compile: bool = False


def parse_config(text: str) -> Config:
    """``plain``, ``plain+graph``, ``plain+compile`` or ``pipedp:S=2,M=4[,gpipe][,graph]``."""
    if text in ("plain", "plain+graph", "plain+compile"):
        return Config(text, graph=text.endswith("graph"), compile=text.endswith("compile"))
    if not text.startswith("pipedp"):
        raise ValueError(f"unknown config {text!r}: plain, plain+graph, plain+compile or pipedp:S=..,M=..[,gpipe][,graph]")
    kw: dict[str, object] = {}
    for part in text.partition(":")[2].split(","):
        if not part:
            continue
        if part in ("gpipe", "1f1b"):
            kw["schedule"] = part
        elif part == "graph":
            kw["graph"] = True
        elif part.startswith("S="):
            v = part[2:]
            kw["stages"] = v if v == "auto" else int(v)
        elif part.startswith("M="):
            kw["microbatches"] = int(part[2:])
        else:
            raise ValueError(f"config {text!r}: cannot read {part!r}")
    return Config(text, kind="pipedp", **kw)  # type: ignore[arg-type]


DEFAULT = {
    "cpu": ["plain", "pipedp:S=1,M=1", "pipedp:S=1,M=2", "pipedp:S=1,M=4", "pipedp:S=2,M=4", "pipedp:S=4,M=4"],
    "cuda": [
        "plain", "plain+graph",
        "pipedp:S=1,M=1", "pipedp:S=2,M=2", "pipedp:S=4,M=4",
        "pipedp:S=1,M=1,graph", "pipedp:S=2,M=2,graph", "pipedp:S=2,M=4,graph",
        "pipedp:S=3,M=3,graph", "pipedp:S=4,M=4,graph",
    ],
}


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _graphed_plain_step(model: nn.Module, opt: torch.optim.Optimizer, x0: torch.Tensor, y0: torch.Tensor) -> Step:
    """Plain training captured whole as a CUDA graph (PyTorch's documented recipe)."""
    eager = _plain_step(model, opt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager(x0, y0)
    torch.cuda.current_stream().wait_stream(side)
    sx, sy = x0.clone(), y0.clone()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    # Own capture stream and fresh cuBLAS workspaces: several graphs live in
    # this process (see pipedp.pipeline.graphed and pytorch/pytorch#193402).
    fresh_cublas_workspaces()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        loss = F.cross_entropy(model(sx), sy)
        loss.backward()
        opt.step()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sx.copy_(x, non_blocking=True)
        sy.copy_(y, non_blocking=True)
        graph.replay()
        return loss.detach().clone()

    # The graph writes into the model's buffers and the optimizer's state:
    # they must live as long as the step does.
    step.owners = (model, opt)  # type: ignore[attr-defined]
    return step


def make_step(cfg: Config, model: nn.Module, x: torch.Tensor, y: torch.Tensor, profile: bool) -> tuple[Step, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if cfg.kind == "plain":
        if cfg.compile:
            return _plain_step(torch.compile(model), opt), None
        if cfg.graph:
            return _graphed_plain_step(model, opt, x, y), None
        return _plain_step(model, opt), None
    engine = pipedp.wrap(
        model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=cfg.microbatches,
        stages=cfg.stages, schedule=cfg.schedule, devices=x.device, profile=profile,
        sample=x, cuda_graph=cfg.graph, progress=False,
    )
    return engine.train_step, engine


def stream_overlap(step: Step, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> dict[str, float]:
    """From a profiler trace: GPU busy time, and the share of it with kernels on 2+ streams at once."""
    from torch.profiler import ProfilerActivity, profile

    sync(x.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(x, y)
        sync(x.device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            trace = json.load(fh)
    points: list[tuple[float, int]] = []
    streams = set()
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and "dur" in ev:
            t0, t1 = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
            points += [(t0, 1), (t1, -1)]
            streams.add(ev.get("args", {}).get("stream"))
    points.sort()
    busy = multi = 0.0
    depth, last = 0, None
    for t, d in points:
        if last is not None and depth > 0:
            busy += t - last
            if depth > 1:
                multi += t - last
        depth += d
        last = t
    return {"kernel_streams": len(streams), "gpu_busy_ms_per_step": busy / 1e3 / steps,
            "overlap_fraction": multi / busy if busy else 0.0}


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
    cfg, model_name, batch, threads = args
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = get_model(model_name)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    gc.collect()
    base = _peak_rss_mib()
    step, _ = make_step(cfg, model, x, y, profile=False)
    for _ in range(2):
        step(x, y)
    return _peak_rss_mib() - base


def peak_memory_mib(cfg: Config, model_name: str, device: torch.device, batch: int, profile: bool) -> float:
    if device.type == "cpu":
        with mp.get_context("spawn").Pool(1) as pool:
            return pool.map(_rss_probe, [(cfg, model_name, batch, torch.get_num_threads())])[0]
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = get_model(model_name).to(device)
    x, y = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step, engine = make_step(cfg, model, x, y, profile)
    for _ in range(4):
        step(x, y)
    sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    del step, engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def bench_model(name: str, configs: list[Config], args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    base_model = get_model(name).to(device)
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    if args.channels_last:
        base_model = base_model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    steps: dict[str, Step] = {}
    plans: dict[str, str] = {}
    engines: dict[str, object] = {}
    errors: dict[str, str] = {}
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            step, engine = make_step(cfg, copy.deepcopy(base_model), x, y, args.profile)
            for _ in range(args.warmup):
                step(x, y)
            sync(device)
        except Exception as e:  # report and go on with the other configurations
            errors[cfg.name] = f"{type(e).__name__}: {e}"
            print(f"  {name} {cfg.name}: FAILED {errors[cfg.name][:300]}", file=sys.stderr, flush=True)
            continue
        steps[cfg.name] = step
        if engine is not None:
            engines[cfg.name] = engine
        print(f"  {name} {cfg.name}: ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    configs = [c for c in configs if c.name in steps]
    windows: dict[str, list[float]] = {c.name: [] for c in configs}
    for _ in range(args.rounds):
        for cfg in configs:
            step = steps[cfg.name]
            if args.verbose:
                print(f"  window {cfg.name}", file=sys.stderr, flush=True)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            sync(device)
            windows[cfg.name].append(args.steps * args.batch / (time.perf_counter() - t0))
    for cname, engine in engines.items():
        plans[cname] = str(engine.plan)  # type: ignore[attr-defined]
    rows = {}
    plain = statistics.median(windows["plain"]) if "plain" in windows else None
    for cfg in configs:
        ips = statistics.median(windows[cfg.name])
        rows[cfg.name] = {
            "config": asdict(cfg),
            "images_per_s": ips,
            "images_per_s_windows": windows[cfg.name],
            "speedup_vs_plain": ips / plain if plain else None,
            "plan": plans.get(cfg.name),
        }
    pipedp_rows = [c for c in configs if c.kind == "pipedp"]
    best = max(pipedp_rows, key=lambda c: rows[c.name]["images_per_s"]) if pipedp_rows else None
    overlap: dict[str, object] | None = None
    if device.type == "cuda" and best is not None and args.overlap:
        overlap = {}
        for cfg in pipedp_rows:
            if cfg.stages != 1:
                try:
                    overlap[cfg.name] = stream_overlap(steps[cfg.name], x, y)
                except Exception as e:
                    errors[f"overlap {cfg.name}"] = f"{type(e).__name__}: {e}"
    if args.memory:
        for cfg in configs:
            # Same cut as the timed engine, without profiling it again.
            engine = engines.get(cfg.name)
            same = cfg
            if engine is not None:
                counts = list(engine.plan.counts)  # type: ignore[attr-defined]
                same = replace(cfg, stages=1 if len(counts) == 1 else counts)
            try:
                rows[cfg.name]["peak_memory_mib"] = peak_memory_mib(same, name, device, args.batch, False)
            except Exception as e:
                errors[f"memory {cfg.name}"] = f"{type(e).__name__}: {e}"
    del steps, engines
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "best_pipedp": best.name if best else None, "stream_overlap": overlap, "errors": errors}


def print_table(results: dict, machine: dict) -> None:
    print(f"\nmachine: {machine}")
    print(f"{'model':<9} {'config':<26} {'img/s':>9} {'x plain':>8} {'peak MiB':>9}")
    for model, res in results.items():
        for cname, row in res["rows"].items():
            mem = row.get("peak_memory_mib")
            star = " *" if cname == res["best_pipedp"] else ""
            ratio = row["speedup_vs_plain"]
            print(
                f"{model:<9} {cname:<26} {row['images_per_s']:>9.1f} "
                f"{(f'{ratio:.3f}' if ratio else '-'):>8} {(f'{mem:.0f}' if mem is not None else '-'):>9}{star}"
            )
        for cname, err in res.get("errors", {}).items():
            print(f"{model:<9} {cname:<26} FAILED: {err[:200]}")
        if res.get("stream_overlap"):
            for cname, ov in res["stream_overlap"].items():
                print(f"{'':<9} overlap {cname}: {ov['overlap_fraction']:.1%} of GPU-busy time on 2+ streams "
                      f"({ov['kernel_streams']} streams, {ov['gpu_busy_ms_per_step']:.2f} ms busy/step)")
    print("(* best pipedp configuration; ratios are medians of alternating windows in this one process)")


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--models", default="resnet18,resnet34,resnet50", help="comma list of models")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--batch", type=int, default=128, help="images per step")
    p.add_argument("--configs", default=None, help="';' between configs (see parse_config); default: this device's "
                   "standard set")
    p.add_argument("--steps", type=int, default=None, help="steps per timing window; default: 15 on CUDA, 2 on CPU")
    p.add_argument("--rounds", type=int, default=4, help="alternating windows per config")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per config first")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="profile blocks (None: on CUDA) or use the cost model")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure each configuration's peak memory")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="read the stream overlap of a pipelined step from a profiler trace (CUDA)")
    p.add_argument("--channels-last", action="store_true", help="channels_last model and batch")
    p.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.backends.cudnn.benchmark for every configuration (CUDA)")
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--verbose", action="store_true", help="log every timing window")
    return p


def bench(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark for ``argv``; the results (also written to --out when given)."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if args.profile is None:
        args.profile = device.type == "cuda"
    if args.steps is None:
        args.steps = 15 if device.type == "cuda" else 2
    names = args.configs.split(";") if args.configs else DEFAULT["cuda" if device.type == "cuda" else "cpu"]
    configs = [parse_config(c.strip()) for c in names]
    if "plain" not in [c.name for c in configs]:
        configs.insert(0, parse_config("plain"))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    machine = describe(device)
    results: dict[str, dict] = {}
    out = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "batch": args.batch,
           "steps_per_window": args.steps, "rounds": args.rounds, "cudnn_benchmark": args.cudnn_benchmark,
           "channels_last": args.channels_last, "results": results}
    for name in args.models.split(","):
        print(f"benchmarking {name} (batch {args.batch}) on {device}", file=sys.stderr, flush=True)
        results[name] = bench_model(name, configs, args, device)
        if args.out:  # after every model, so a cut-off run keeps what it measured
            write_json(args.out, out)
    print_table(results, machine)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.bench_pipeline: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(bench, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
