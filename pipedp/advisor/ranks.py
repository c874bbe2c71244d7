"""Step time with ranks as the resource: one torchrun launch per configuration.

A step's time depends on shapes, not on the values in the batch, so each rank
trains a model of pipedp's zoo on a random batch of its share of the global
batch (``batch // ranks``) through :func:`pipedp.wrap`, which averages
gradients over the ranks. Every rank times the same steps after a warm-up
and a barrier; a step ends for all when its gradient all-reduce does, and the
slowest rank's median is the step time. The launch itself (starting the
processes, building the model) is outside the timed steps but inside what
profiling costs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m pipedp.advisor.ranks --batch 64
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..checks import positive_int
from ..distributed import DEFAULT_TIMEOUT_S, all_reduce
from .space import Config

__all__ = ["TorchrunStepTimer"]

_MARK = "pipedp-advise-step-s"


@dataclass(frozen=True)
class TorchrunStepTimer:
    """Seconds per step of a configuration, ``resources`` = ranks launched with torchrun on this machine."""

    model: str = "resnet18"
    width: int = 8
    image_size: int = 32
    classes: int = 10
    steps: int = 5
    warmup: int = 2
    threads_per_rank: int = 1
    device: str = "cpu"
    timeout_s: float = 600.0

    def __call__(self, config: Config) -> float:
        if config.batch % config.resources:
            raise ValueError(f"a global batch of {config.batch} does not split evenly over {config.resources} "
                             f"ranks: use batch sizes that are multiples of the rank counts")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(config.resources), "-m", "pipedp.advisor.ranks", "--batch", str(config.batch // config.resources),
               "--microbatches", str(config.microbatches), "--model", self.model, "--width", str(self.width),
               "--image-size", str(self.image_size), "--classes", str(self.classes), "--steps", str(self.steps),
               "--warmup", str(self.warmup), "--threads", str(self.threads_per_rank), "--device", self.device]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads_per_rank)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.timeout_s)
        found = [ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith(_MARK)]
        if done.returncode != 0 or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"torchrun with {config.resources} rank(s) for {config} failed "
                               f"(exit status {done.returncode}): {tail[0]}")
        return float(found[-1])


def _worker(argv: Sequence[str] | None = None) -> None:
    import torch.distributed as dist
    from torch import nn

    from ..api import wrap
    from ..models import get_model

    p = argparse.ArgumentParser(prog="python -m pipedp.advisor.ranks")
    for name, default in (("batch", 32), ("microbatches", 1), ("width", 8), ("image-size", 32), ("classes", 10),
                          ("steps", 5), ("warmup", 2), ("threads", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    for name in ("batch", "microbatches", "steps", "warmup", "threads"):
        positive_int(name, getattr(args, name))
    torch.set_num_threads(args.threads)  # this process's own setting: it exists for this measurement only
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        torch.manual_seed(0)
        width = args.width / 64 if args.model == "mobilenet_v2" else args.width
        model = get_model(args.model, num_classes=args.classes, width=width, cifar=args.image_size <= 64).to(device)
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device)
        y = torch.randint(0, args.classes, (args.batch,), generator=g).to(device)
        engine = wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                      loss_fn=nn.CrossEntropyLoss(), microbatches=args.microbatches, stages=1, devices=device,
                      profile=False, progress=False, sample=x)
        for _ in range(args.warmup):
            engine.train_step(x, y)
        times = []
        for _ in range(args.steps):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            engine.train_step(x, y)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        median = torch.tensor([statistics.median(times)], dtype=torch.float64)
        all_reduce(median, "max", None, datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))  # the slowest rank's
        if dist.get_rank() == 0:
            print(f"{_MARK} {median.item():.9f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
