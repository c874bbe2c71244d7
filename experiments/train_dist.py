"""The README's torchrun example: data parallel x pipeline training with checkpoints.

The same script runs alone or under torchrun; with torchrun every process is a
rank (gloo on CPU, NCCL on GPUs), feeds its own shard of the data
(``DistributedSampler`` over the data-parallel replicas), and pipedp averages
gradients over the replicas. ``--pp 2`` spreads each pipeline over 2 ranks.
A checkpoint (``--ckpt``, by default out/train_dist.pt: out/ is git-ignored)
is written atomically every ``--save-every`` steps and at the end, and
``--resume`` continues from it, at its step and place in the data, until the
engine has taken ``--steps`` steps (a checkpoint already there is a note and
exit status 0). It may resume on another number of ranks: the model and
optimizer are whole in the checkpoint; only the per-rank RNG streams cannot
continue (rank 0 says so once), which this script does not draw from while
training.

    torchrun --nproc-per-node 2 -m experiments.train_dist --steps 10
    torchrun --nproc-per-node 4 -m experiments.train_dist --pp 2 --steps 20 --resume
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import warnings
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pipedp
from pipedp import console
from pipedp.models import resnet18

from .demo import pattern_data

PROG = "python -m experiments.train_dist"
DEFAULT_CKPT = os.path.join("out", "train_dist.pt")
# engine.load's warning when the checkpoint was written by another number of ranks (each would warn once).
_OTHER_WORLD = re.compile(r"RNG states of (\d+) rank")


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--steps", type=int, default=20, help="train until the engine has taken this many steps")
    p.add_argument("--batch", type=int, default=32, help="per data-parallel replica")
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks per replica")
    p.add_argument("--stages", default="auto", help="'auto' or a number of pipeline stages")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--width", type=int, default=16, help="ResNet-18 base width (64 is the real model)")
    p.add_argument("--ckpt", default=DEFAULT_CKPT, help="checkpoint file (its folder is created)")
    p.add_argument("--save-every", type=int, default=10, help="write the checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt when it exists (on any number of "
                   "ranks)")
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
        if len(loader) == 0:
            raise ValueError(f"--batch {args.batch} is more than the {len(sampler)} images each of the {replicas} "
                             f"replica(s) gets: pass --batch {len(sampler)} or less")
        rank0 = not launched or dist.get_rank() == 0
        os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
        if args.resume:
            _resume(engine, args.ckpt, rank0)
        if engine.steps >= args.steps:
            if rank0:
                print(f"nothing to do: {args.ckpt} is at step {engine.steps} and --steps is {args.steps}; "
                      "pass a larger --steps to train on", flush=True)
            return []
        losses: list[float] = []
        epoch, done = divmod(engine.steps, len(loader))  # resume where the data left off
        while engine.steps < args.steps:
            sampler.set_epoch(epoch)
            batches = itertools.islice(loader, done, None)
            done = 0
            for xb, yb in pipedp.data.prefetch(batches, device):
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


def _resume(engine: pipedp.Engine, path: str, rank0: bool) -> None:
    """Load ``path`` if it exists; a checkpoint of another number of ranks is said once (rank 0), not per rank."""
    if not os.path.exists(path):
        if rank0:
            print(f"no checkpoint at {path}: starting at step 0", flush=True)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load(path)
    written_by = None
    for w in caught:
        match = _OTHER_WORLD.search(str(w.message))
        if match:
            written_by = int(match.group(1))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not rank0:
        return
    print(f"resumed at step {engine.steps} from {path}", flush=True)
    if written_by is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"note: {path} was written by {written_by} rank(s), this run has {world}: model, optimizer and step "
              "carry over; each rank's RNG stream starts afresh (this script draws no random numbers while training)",
              flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.train_dist: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(train, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
