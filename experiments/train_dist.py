"""The README's torchrun example: data parallel x pipeline training with checkpoints.

The same script runs alone or under torchrun; with torchrun every process is a
rank (gloo on CPU, NCCL on GPUs), feeds its own shard of the data
(``DistributedSampler`` over the data-parallel replicas), and pipedp averages
gradients over the replicas. ``--pp 2`` spreads each pipeline over 2 ranks.
A checkpoint is written atomically every ``--save-every`` steps and
``--resume`` continues from it.

    torchrun --nproc-per-node 2 -m experiments.train_dist --steps 20
    torchrun --nproc-per-node 4 -m experiments.train_dist --pp 2 --ckpt run.pt --resume
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pipedp
from pipedp import console
from .demo import pattern_data
from pipedp.models import resnet18

PROG = "python -m experiments.train_dist"


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--steps", type=int, default=20, help="train until the engine has taken this many steps")
    p.add_argument("--batch", type=int, default=32, help="per data-parallel replica")
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks per replica")
    p.add_argument("--stages", default="auto", help="'auto' or a number of pipeline stages")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--width", type=int, default=16, help="ResNet-18 base width (64 is the real model)")
    p.add_argument("--ckpt", default="train_dist.pt", help="checkpoint file")
    p.add_argument("--save-every", type=int, default=10, help="write the checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt when it exists")
    return p


def train(argv: Sequence[str] | None = None) -> list[float]:
    """Train for ``argv`` (alone or as a torchrun rank); this rank's losses."""
    args = _parser().parse_args(argv)

    launched = "RANK" in os.environ
    if launched:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        torch.manual_seed(0)  # the same initial model on every rank
        model = resnet18(num_classes=10, width=args.width).to(device)
        engine = pipedp.wrap(
            model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
            loss_fn=nn.CrossEntropyLoss(),
            microbatches=args.microbatches,
            stages=int(args.stages) if args.stages != "auto" else "auto",
            pp=args.pp,
            progress=False,
        )
        lay = engine.layout
        replicas, replica = (lay.dp, lay.dp_rank) if lay else (1, 0)
        x, y = map(torch.cat, zip(*pattern_data(8, 64)))
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=replicas, rank=replica, seed=0)
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, sampler=sampler, drop_last=True,
                            pin_memory=device.type == "cuda")
        if args.resume and os.path.exists(args.ckpt):
            engine.load(args.ckpt)
        rank0 = not launched or dist.get_rank() == 0
        losses: list[float] = []
        epoch = 0
        while engine.steps < args.steps:
            sampler.set_epoch(epoch)
            for xb, yb in pipedp.data.prefetch(loader, device):
                loss = engine.train_step(xb, yb).item()
                losses.append(loss)
                if rank0:
                    print(f"step {engine.steps:3d}  loss {loss:.4f}", flush=True)
                if engine.steps % args.save_every == 0 or engine.steps == args.steps:
                    engine.save(args.ckpt)
                if engine.steps >= args.steps:
                    break
            epoch += 1
        if rank0:
            print(engine.plan)
        return losses
    finally:
        if launched:
            dist.barrier()
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.train_dist: exit status 0 on success; a failure is one line on stderr, status 1."""

    def status(a: Sequence[str] | None) -> int:
        train(a)
        return 0

    return console.run(status, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
