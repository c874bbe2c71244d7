"""The README's main job: a short pipelined training run of a CIFAR-shaped ResNet-18.

Offline: the data is generated here (ten classes, each a fixed random 32x32x3
pattern plus noise), so the loss visibly falls within a few steps. It prints
the plan, the loss of every step, and images/s of pipedp against plain PyTorch
training measured in alternating windows in this process.

    python -m experiments.demo                      # CPU, 2 stages x 4 microbatches
    python -m experiments.demo --device cuda --stages auto --cuda-graph
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import pipedp
from pipedp import console
from pipedp.models import resnet18
from pipedp.pipeline.orders import NAMES as SCHEDULES

from .machine import describe, sync

PROG = "python -m experiments.demo"


def pattern_data(batches: int, batch: int, classes: int = 10, seed: int = 0, noise: float = 0.8):
    """Learnable offline data: class templates plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 3, 32, 32, generator=g)
    out = []
    for _ in range(batches):
        y = torch.randint(0, classes, (batch,), generator=g)
        x = templates[y] + noise * torch.randn(batch, 3, 32, 32, generator=g)
        out.append((x, y))
    return out


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--steps", type=int, default=6, help="training steps to print")
    p.add_argument("--batch", type=int, default=64, help="images per step")
    p.add_argument("--stages", default="2", help="number of stages, or 'auto'")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per pipedp step")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (momentum 0.9), both sides")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule")
    p.add_argument("--width", type=int, default=64, help="ResNet base width (64 is the real model)")
    p.add_argument("--windows", type=int, default=2, help="alternating timing windows per side")
    p.add_argument("--cuda-graph", action="store_true", help="capture pipedp's step as a CUDA graph")
    return p


def demo(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo for ``argv``; the losses, images/s of both sides and the plan."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = resnet18(width=args.width).to(device)
    plain_model = copy.deepcopy(model)
    data = [(x.to(device), y.to(device)) for x, y in pattern_data(args.steps, args.batch)]
    stages = args.stages if args.stages == "auto" else int(args.stages)

    print(f"machine: {describe(device)}")
    engine = pipedp.wrap(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        loss_fn=nn.CrossEntropyLoss(),
        microbatches=args.microbatches,
        stages=stages,
        schedule=args.schedule,
        devices=device,
        sample=data[0][0],
        cuda_graph=args.cuda_graph,
    )
    losses = []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        loss = engine.train_step(x, y).item()
        losses.append(loss)
        print(f"step {i}: loss {loss:.4f}  ({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    print(engine.plan)

    opt = torch.optim.SGD(plain_model.parameters(), lr=args.lr, momentum=0.9)

    def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain_model(x), y).backward()
        opt.step()

    plain_step(*data[0])  # warm-up on both sides
    engine.train_step(*data[0])
    speed: dict[str, list[float]] = {"plain": [], "pipedp": []}
    for _ in range(args.windows):  # alternate, so both see the same machine state
        for name, step in (("plain", plain_step), ("pipedp", engine.train_step)):
            sync(device)
            t0 = time.perf_counter()
            for x, y in data:
                step(x, y)
            sync(device)
            speed[name].append(len(data) * args.batch / (time.perf_counter() - t0))
    plain, piped = statistics.median(speed["plain"]), statistics.median(speed["pipedp"])
    print(f"images/s: plain {plain:.1f}, pipedp {piped:.1f} -> {piped / plain:.2f}x of plain "
          f"(median of {args.windows} alternating windows of {len(data)} steps)")
    if device.type == "cpu" and len(engine.plan.stages) > 1:
        print("note: on a CPU the stages run one after another (one device, no streams), so stages add "
              "nothing there (stages='auto' picks one); what can help on a CPU is microbatching "
              "(smaller working sets). On a GPU stages overlap on CUDA streams; use cuda_graph=True "
              "there, since eager microbatches multiply kernel launches.")
    return {"losses": losses, "plain_images_per_s": plain, "pipedp_images_per_s": piped, "plan": engine.plan}


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.demo: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(demo, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
