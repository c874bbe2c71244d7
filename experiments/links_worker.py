"""One rank of ``bench_links``: every configuration of a model timed in alternating windows over torchrun's world.

Run by :mod:`experiments.bench_links` on each node of an emulated cluster
(``torchrun ... -m experiments.links_worker``). The configurations, each on its
own copy of one seeded model (SGD, cross entropy, a synthetic CIFAR batch):

* ``ddp``: ``DistributedDataParallel`` (default 25 MiB buckets,
  ``gradient_as_bucket_view=True``); ``ddp-fp16``: with the fp16 compression
  hook (gloo has no bf16); ``ddp-powersgd`` (``--powersgd``): PowerSGD at
  rank 2 (lossy: reported, never the bar; its first 2 steps are plain
  all-reduces). Off by default: at ResNet-18's full width two ranks aborted
  in it with gloo's "Received data size doesn't match expected size";
  not yet understood;
* ``pipedp-dp``: ``pipedp.wrap(pp=1)`` on one stage; ``pipedp-dp-fp16``: with
  ``reduce_dtype=torch.float16``, the counterpart of the hook;
* ``pipedp-pp2xM``: two pipeline ranks, one stage each, M microbatches;
* ``pp-auto``: ``pipedp.wrap(pp="auto", microbatches="auto")`` planning on the
  global batch, then training what it chose.

Data parallel rows train each rank on its half of the global batch; pipeline
rows feed the whole batch through the pipeline. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import pipedp
from pipedp.world import window_ms

from .paired import paired_ratio

Step = Callable[[torch.Tensor, torch.Tensor], object]
LR, MOMENTUM = 0.01, 0.9
CPU = torch.device("cpu")
# Not the user's numerics: compressed gradients (fp16 casts, PowerSGD's low rank). Reported, never the bar.
COMPRESSED = ("ddp-fp16", "ddp-powersgd", "pipedp-dp-fp16")


def build(name: str, width: int | None = None) -> nn.Module:
    """A CIFAR-shaped model by name: pipedp's zoo (``width``: its base width), or ``vgg11_bn``.

    ``vgg11_bn`` is torchvision's, made the CIFAR VGG-11: its features end at 1x1 on 32-pixel images, so
    the classifier takes those 512 values (not 7x7 copies of them: a 25088-wide first layer of 100M
    parameters) into its two 4096-wide layers; 28.5M parameters, three quarters in the classifier.
    """
    if name == "vgg11_bn":
        from .zoo import torchvision_models

        model = torchvision_models().vgg11_bn(num_classes=10)
        model.avgpool = nn.AdaptiveAvgPool2d(1)
        model.classifier[0] = nn.Linear(512, 4096)
        return model
    from pipedp.models import get_model

    return get_model(name, num_classes=10, **({} if width is None else {"width": width}))


def _ddp(model: nn.Module, hook: str | None) -> Step:
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()

    return step


def _wrap(model: nn.Module, **kw: Any) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                       loss_fn=nn.CrossEntropyLoss(), progress=False, plan_cache=False, **kw)


def configurations(base: nn.Module, args: argparse.Namespace, full: torch.Tensor
                   ) -> tuple[dict[str, tuple[Step, bool]], pipedp.Engine, float]:
    """name -> (step, data parallel?) of every configuration, the pp="auto" engine, and its setup seconds."""
    out: dict[str, tuple[Step, bool]] = {
        "ddp": (_ddp(copy.deepcopy(base), None), True),
        "ddp-fp16": (_ddp(copy.deepcopy(base), "fp16"), True),
        "pipedp-dp": (_wrap(copy.deepcopy(base), stages=1, microbatches=1, profile=False).train_step, True),
        "pipedp-dp-fp16": (_wrap(copy.deepcopy(base), stages=1, microbatches=1, profile=False,
                                 reduce_dtype=torch.float16).train_step, True),
    }
    if args.powersgd:
        out["ddp-powersgd"] = (_ddp(copy.deepcopy(base), "powersgd"), True)
    for m in (int(v) for v in args.microbatches.split(",")):
        out[f"pipedp-pp2x{m}"] = (_wrap(copy.deepcopy(base), pp=2, stages=2, microbatches=m).train_step, False)
    t0 = time.perf_counter()
    auto = _wrap(copy.deepcopy(base), pp="auto", microbatches="auto", sample=full)
    return out, auto, time.perf_counter() - t0


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = build(name, args.width)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(args.batch, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (args.batch,), generator=g)
    half = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    configs, auto, auto_setup_s = configurations(base, args, full)
    assert auto.world is not None
    b = args.batch // auto.world.layout.dp
    share = slice(auto.layout.dp_rank * b, (auto.layout.dp_rank + 1) * b) if auto.layout is not None else slice(None)
    runs = {k: (step, (full[half], labels[half]) if dp else (full, labels)) for k, (step, dp) in configs.items()}
    runs["pp-auto"] = (auto.train_step, (full[share], labels[share]))
    for step, (x, y) in runs.values():
        for _ in range(args.warmup):
            step(x, y)
    windows: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            step, (x, y) = runs[k]
            windows[k].append(window_ms(functools.partial(step, x, y), CPU, args.steps))  # the slowest rank's
    ms = {k: statistics.median(v) for k, v in windows.items()}
    exact = [k for k in ms if k not in COMPRESSED and k != "pp-auto"]
    best = min(exact, key=ms.__getitem__)
    pipelines = [k for k in ms if k.startswith("pipedp-pp2")]
    params = sum(p.numel() for p in base.parameters())
    return {
        "model": name, "global_batch": args.batch, "world": world, "params": params,
        "allreduce_bytes_fp32": 4 * params, "ms": ms, "windows_ms": windows, "best_exact": best,
        "best_pipeline": min(pipelines, key=ms.__getitem__) if pipelines else None,
        "vs_ddp": {k: paired_ratio(windows["ddp"], v) for k, v in windows.items()},
        "auto": {"chosen": auto.world.layout.label, "vs_best_exact": paired_ratio(windows[best], windows["pp-auto"]),
                 "setup_s": auto_setup_s, "planning_share_10min": auto_setup_s / 600, "table": auto.world.table(),
                 "probed_bytes_per_s": {"allreduce": auto.world.allreduce.bytes_per_s,
                                        "p2p": auto.world.p2p.bytes_per_s}},
        "forecast": forecast(auto.world, ms),
    }


def forecast(choice: Any, ms: dict[str, float]) -> dict[str, dict[str, float]]:
    """pp="auto"'s prediction of each layout that is also a configuration here, beside the configuration's median."""
    out = {}
    for row in choice.rows:
        lay = row.layout
        name = "pipedp-dp" if lay.pp == 1 else f"pipedp-pp2x{lay.microbatches}" if lay.dp == 1 and lay.pp == 2 else None
        if name in ms:
            p = row.prediction
            out[name] = {"predicted_ms": p.step_ms, "measured_ms": ms[name], "error": p.step_ms / ms[name] - 1,
                         "allreduce_bytes": p.allreduce_bytes, "p2p_bytes": p.p2p_bytes}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18")
    p.add_argument("--batch", type=int, default=64, help="global batch per step")
    p.add_argument("--microbatches", default="2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--width", type=int, default=None, help="base width of pipedp's zoo models (default theirs)")
    p.add_argument("--powersgd", action="store_true", help="also DDP with PowerSGD")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        results = [measure(name, args) for name in args.models.split(",")]
        if dist.get_rank() == 0:
            with open(args.out + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
