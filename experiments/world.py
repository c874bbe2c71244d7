"""A world of processes on loopback for the multi-process benchmarks: launch, join, collect.

Every rank joins a process group (gloo on CPU with ``args.threads`` threads
per process, NCCL on CUDA with one GPU per rank) and measures each model of
``args.models`` in turn with the benchmark's ``measure(name, args, device,
rank, world)`` (collective: all ranks call it together); rank 0 prints each
result's line and keeps the results as JSON after every model (in
``args.out`` too, marked partial, so a run cut short keeps them), which
:func:`run_world` returns once every rank is done.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
from typing import Any, Callable

from .machine import describe
from .report import write_json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world", "world_report"]

Measure = Callable[[str, argparse.Namespace, torch.device, int, int], dict[str, Any]]
Show = Callable[[dict[str, Any]], str]


def _entry(rank: int, world: int, port: int, measure: Measure, show: Show, args: argparse.Namespace,
           out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        results = []
        for name in args.models.split(","):
            results.append(measure(name, args, device, rank, world))
            if rank == 0:
                print(show(results[-1]), flush=True)
                write_json(out_path, results)
                if args.out:  # what is done so far survives a run cut short; the full report replaces it
                    write_json(args.out, {"partial": True, "results": results}, indent=2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(measure: Measure, show: Show, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every model of ``args.models`` measured by ``args.procs`` processes (``args.device``: cpu or cuda)."""
    if args.device == "cuda" and torch.cuda.device_count() < args.procs:
        raise SystemExit(f"--procs {args.procs} needs {args.procs} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        mp.spawn(_entry, args=(args.procs, port, measure, show, args, path), nprocs=args.procs, join=True)
        with open(path) as f:
            return json.load(f)


def world_report(benchmark: str, args: argparse.Namespace, rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The benchmark's report (machine, settings, ``extra``, results), printed in brief and written to ``args.out``."""
    report = {"benchmark": benchmark, "date": datetime.date.today().isoformat(), "machine": describe(args.device),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, **extra, "results": rows}
    print(f"machine: {report['machine']}")
    if args.out:
        write_json(args.out, report, indent=2)
    return report
