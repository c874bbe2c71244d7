"""One rank of ``bench_links``: every configuration of a model timed in alternating windows over torchrun's world.

Run by :mod:`experiments.bench_links` on each node of an emulated cluster
(``torchrun ... -m experiments.links_worker``). The configurations, each on its
own copy of one seeded model (SGD, cross entropy, a synthetic CIFAR batch):

* ``ddp``: ``DistributedDataParallel`` (default 25 MiB buckets,
  ``gradient_as_bucket_view=True``); ``ddp-fp16``: with the fp16 compression
  hook (gloo has no bf16); ``ddp-powersgd`` (``--powersgd``): PowerSGD at
  rank 2 (lossy: reported, never the bar; its first 2 steps are plain
  all-reduces), each bucket's compression started only once the previous
  bucket's is done (see :class:`InOrder`);
* ``pipedp-dp``: ``pipedp.wrap(pp=1)`` on one stage; ``pipedp-dp-fp16``: with
  ``reduce_dtype=torch.float16``, the counterpart of the hook;
* ``pipedp-pp2xM``: two pipeline ranks, one stage each, M microbatches (1F1B);
  ``pipedp-pp2xM-<schedule>`` for each other schedule of ``--schedules``
  (``interleaved``: two stages each, stage s on rank s mod 2);
* ``pp-auto``: ``pipedp.wrap(pp="auto", microbatches="auto")`` planning on the
  global batch, then training what it chose; ``pp-auto-16``: the same with
  ``reduce_dtype="auto"`` (a bf16 all-reduce allowed: lossy, against the
  fastest row exact or with a 16-bit all-reduce; PowerSGD is not its bar).

Data parallel rows train each rank on its half of the global batch; pipeline
rows feed the whole batch through the pipeline. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import copy
import functools
from dataclasses import replace
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import pipedp
from pipedp.decide.layout import Layout
from pipedp.decide.world import WorldChoice, window_ms

from .paired import paired_ratio
from .report import write_json

Step = Callable[[torch.Tensor, torch.Tensor], object]
LR, MOMENTUM = 0.01, 0.9
CPU = torch.device("cpu")
# Not the user's numerics: compressed gradients (fp16 casts, PowerSGD's low rank). Reported, never the bar.
COMPRESSED = ("ddp-fp16", "ddp-powersgd", "pipedp-dp-fp16", "pp-auto-16")
AUTOS = ("pp-auto", "pp-auto-16")


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


class InOrder:
    """PowerSGD's hook state, run one bucket after another.

    torch's PowerSGD hook issues a bucket's second all-reduce from the first's
    completion callback, while backward goes on issuing later buckets' from the
    main thread. gloo pairs collectives by the order each rank issues them, so
    the two orders cross between ranks and gloo aborts ("Received data size
    doesn't match expected size"; torch tests the hook on NCCL only,
    pytorch/pytorch#58467). Chaining the buckets gives every rank one order, at
    the cost of overlap between buckets' compressions.
    """

    def __init__(self, state: powerSGD_hook.PowerSGDState) -> None:
        self.state = state
        self.last: torch.futures.Future | None = None


def in_order_powersgd(chain: InOrder, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: :func:`powerSGD_hook` on ``bucket`` (a ``dist.GradBucket``) once the previous bucket's
    has completed. (Unannotated: DDP compares the annotations with its classes, and here they are strings.)"""
    out: torch.futures.Future = torch.futures.Future()

    def done(inner: torch.futures.Future) -> None:
        try:
            out.set_result(inner.value())
        except Exception as e:  # noqa: BLE001 - handed to DDP through the future
            out.set_exception(e)

    def run(_: object = None) -> None:
        try:
            powerSGD_hook.powerSGD_hook(chain.state, bucket).add_done_callback(done)
        except Exception as e:  # noqa: BLE001
            out.set_exception(e)

    prev, chain.last = chain.last, (None if bucket.is_last() else out)
    if prev is None:
        run()
    else:
        prev.add_done_callback(run)
    return out


def _ddp(model: nn.Module, hook: str | None) -> Step:
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(InOrder(state), in_order_powersgd)
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
                   ) -> tuple[dict[str, tuple[Step, bool]], dict[str, Layout], dict[str, tuple[pipedp.Engine, float]]]:
    """name -> (step, data parallel?) of every configuration, name -> the layout of each pipedp row (as
    pp="auto" names it), and name -> each pp="auto" engine with its setup seconds."""
    out: dict[str, tuple[Step, bool]] = {
        "ddp": (_ddp(copy.deepcopy(base), None), True),
        "ddp-fp16": (_ddp(copy.deepcopy(base), "fp16"), True),
    }
    layouts: dict[str, Layout] = {}
    for name, wire in (("pipedp-dp", None), ("pipedp-dp-fp16", torch.float16)):
        engine = _wrap(copy.deepcopy(base), stages=1, microbatches=1, profile=False, reduce_dtype=wire,
                       sample=full[: full.shape[0] // dist.get_world_size()])
        out[name] = (engine.train_step, True)
        layouts[name] = Layout(dist.get_world_size(), tuple(engine.plan.counts), 1, reduce_dtype=wire)
    if args.powersgd:
        out["ddp-powersgd"] = (_ddp(copy.deepcopy(base), "powersgd"), True)
    for sched in args.schedules.split(","):
        for m in (int(v) for v in args.microbatches.split(",")):
            if sched == "interleaved" and m % 2:
                continue  # its forwards go round the two ranks in pairs
            name = f"pipedp-pp2x{m}" + ("" if sched == "1f1b" else f"-{sched}")
            engine = _wrap(copy.deepcopy(base), pp=2, stages=4 if sched == "interleaved" else 2, microbatches=m,
                           sample=full, schedule=sched)
            out[name] = (engine.train_step, False)
            if sched != "interleaved":  # pp="auto" predicts one stage per rank
                layouts[name] = Layout(1, tuple(engine.plan.counts), m, sched)
    autos = {}
    for name, wire in zip(AUTOS, (None, "auto")):
        t0 = time.perf_counter()
        engine = _wrap(copy.deepcopy(base), pp="auto", microbatches="auto", sample=full, reduce_dtype=wire)
        autos[name] = (engine, time.perf_counter() - t0)
    return out, layouts, autos


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = build(name, args.width)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(args.batch, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (args.batch,), generator=g)
    half = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    configs, layouts, autos = configurations(base, args, full)
    runs = {k: (step, (full[half], labels[half]) if dp else (full, labels)) for k, (step, dp) in configs.items()}
    for k, (auto, _) in autos.items():
        assert auto.world is not None and auto.layout is not None
        b = args.batch // auto.world.layout.dp
        share = slice(auto.layout.dp_rank * b, (auto.layout.dp_rank + 1) * b)
        runs[k] = (auto.train_step, (full[share], labels[share]))
    for step, (x, y) in runs.values():
        for _ in range(args.warmup):
            step(x, y)
    windows: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            step, (x, y) = runs[k]
            windows[k].append(window_ms(functools.partial(step, x, y), CPU, args.steps))  # the slowest rank's
    ms = {k: statistics.median(v) for k, v in windows.items()}
    exact = [k for k in ms if k not in COMPRESSED and k not in AUTOS]
    best = min(exact, key=ms.__getitem__)
    # pp-auto-16's bar: the fastest row it could have been, exact or a 16-bit all-reduce (PowerSGD's low rank is
    # other math again, which no pipedp option offers: reported beside it, not its bar).
    best_any = min((k for k in ms if k not in AUTOS and k != "ddp-powersgd"), key=ms.__getitem__)
    pipelines = [k for k in ms if k.startswith("pipedp-pp2")]
    params = sum(p.numel() for p in base.parameters())
    return {
        "model": name, "global_batch": args.batch, "world": world, "params": params,
        "allreduce_bytes_fp32": 4 * params, "ms": ms, "windows_ms": windows, "best_exact": best,
        "best_pipeline": min(pipelines, key=ms.__getitem__) if pipelines else None,
        "vs_ddp": {k: paired_ratio(windows["ddp"], v) for k, v in windows.items()},
        "best_any": best_any,
        "auto": {k: _auto(engine, setup_s, windows, best if k == "pp-auto" else best_any, windows[k])
                 for k, (engine, setup_s) in autos.items()},
        "forecast": forecast(autos["pp-auto"][0].world, layouts, ms),
    }


def _auto(engine: pipedp.Engine, setup_s: float, windows: dict[str, list[float]], bar: str,
          mine: list[float]) -> dict[str, Any]:
    """What one pp="auto" engine chose, against ``bar`` (the fastest row it may match), and its probes."""
    world = engine.world
    assert world is not None
    return {"chosen": world.layout.label, "bar": bar, "vs_bar": paired_ratio(windows[bar], mine),
            "setup_s": setup_s, "planning_share_10min": setup_s / 600, "table": world.table(),
            "probed_bytes_per_s": {"allreduce": world.allreduce.bytes_per_s, "p2p": world.p2p.bytes_per_s}}


def forecast(choice: WorldChoice, layouts: dict[str, Layout], ms: dict[str, float]) -> dict[str, dict[str, float]]:
    """pp="auto"'s prediction of each pipedp row's layout (its very cut; one stage as pp="auto" cuts it into
    blocks), beside the row's median."""
    assert choice.costs is not None
    blocks = len(choice.costs.blocks)
    out = {}
    for name, lay in layouts.items():
        p = choice.predict(lay if lay.pp > 1 else replace(lay, counts=(blocks,)))
        if name in ms:
            out[name] = {"predicted_ms": p.step_ms, "measured_ms": ms[name], "error": p.step_ms / ms[name] - 1,
                         "allreduce_bytes": p.allreduce_bytes, "p2p_bytes": p.p2p_bytes}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18")
    p.add_argument("--batch", type=int, default=64, help="global batch per step")
    p.add_argument("--microbatches", default="2,4,8")
    p.add_argument("--schedules", default="1f1b", help="comma list: the schedules of the pipeline rows")
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
            write_json(args.out, results)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
