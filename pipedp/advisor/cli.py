"""pipedp-advise: the cheapest (resources, batch size, microbatches) that meets a time limit and an accuracy target.

Profiles a few configurations of a model from pipedp's zoo on this machine's
CPU cores (a few steps each, with pipedp.wrap) and trains a few short runs for
accuracy, fits monotone models of step time and accuracy, and prints every
candidate's predicted time and cost with the cheapest plan marked. Data: a
.npz file with train_x, train_y, test_x, test_y (images N x C x H x W, uint8
or float; int labels), or 'synthetic' (class templates plus noise, to try the
tool). --resource ranks counts data-parallel ranks instead: each
configuration's step time is measured by a torchrun launch of that many
ranks (gloo on the CPU, one thread each; NCCL with --device cuda), and the
accuracy runs train in this process on one core at the global batch.

    pipedp-advise --data digits.npz --resources 1,2 --batches 16,32,64,128 --accuracy 0.9 --time-limit 60
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

import numpy as np
import torch

from .. import console
from ..atomic import write_text
from ..models import MODELS, get_model
from .api import Advice, Profiling, advise
from .choose import Targets
from .profile import CpuStepTimer, StepTimer, Task, TrainAccuracy
from .ranks import TorchrunStepTimer
from .space import SearchSpace

__all__ = ["main", "load_task"]

PROG = "pipedp-advise"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated whole numbers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--data", default="synthetic", help="a .npz of train_x, train_y, test_x, test_y, or 'synthetic'")
    p.add_argument("--model", default="resnet18", choices=sorted(MODELS), help="the model of pipedp's zoo")
    p.add_argument("--width", type=int, default=8, help="the model's channel width (64: the standard model)")
    p.add_argument("--train-images", type=int, default=None, help="use the first N training images (default: all)")
    p.add_argument("--resource", choices=("cores", "ranks"), default="cores", help="what --resources counts")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the ranks' device (--resource ranks)")
    p.add_argument("--resources", default=f"1,{os.cpu_count() or 1}", help="core (or rank) counts to consider")
    p.add_argument("--batches", default="16,32,64,128", help="batch sizes to consider")
    p.add_argument("--microbatches", default="1,2,4", help="microbatch counts to consider")
    p.add_argument("--accuracy", type=float, default=0.9, help="the test accuracy target (0..1)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds the whole training may take")
    p.add_argument("--max-epochs", type=int, default=30, help="the most epochs a plan may train")
    p.add_argument("--accuracy-epochs", type=int, default=3, help="epochs of each short accuracy run")
    p.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate (momentum 0.9), at every batch size")
    p.add_argument("--steps", type=int, default=5, help="timed steps per profiled configuration")
    p.add_argument("--staged", action="store_true", help="also find the cheapest two-phase plan")
    p.add_argument("--out", default=None, help="write the advice as JSON here")
    return p


def _synthetic(train: int, test: int, classes: int = 10, size: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    templates = torch.rand(classes, 3, size, size, generator=g)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, classes, (n,), generator=g)
        return 0.6 * templates[y] + 0.4 * torch.rand(n, 3, size, size, generator=g), y

    return (*make(train), *make(test))


def _npz(path: str) -> tuple[torch.Tensor, ...]:
    keys = ("train_x", "train_y", "test_x", "test_y")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file; give a .npz with {', '.join(keys)}, or 'synthetic'")
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in keys if k not in z.files]
        if missing:
            raise ValueError(f"--data {path} lacks {', '.join(missing)}: it must hold {', '.join(keys)}")
        arrays = [z[k] for k in keys]
    x_train, y_train, x_test, y_test = (torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    if x_train.ndim != 4 or x_test.ndim != 4:
        raise ValueError(f"--data {path}: images must be N x C x H x W, got {tuple(x_train.shape)}")
    return x_train, y_train.long(), x_test, y_test.long()


def load_task(data: str, model: str, width: int, lr: float, train_images: int | None) -> Task:
    """The task to profile: images normalised per channel by the training set's statistics."""
    xs = _synthetic(1024, 256) if data == "synthetic" else _npz(data)
    x_train, y_train, x_test, y_test = xs
    if train_images:
        x_train, y_train = x_train[:train_images], y_train[:train_images]
    scale = 255.0 if x_train.dtype == torch.uint8 else 1.0
    x_train, x_test = x_train.float() / scale, x_test.float() / scale
    mean, std = x_train.mean((0, 2, 3), keepdim=True), x_train.std((0, 2, 3), keepdim=True).clamp_min(1e-3)
    classes = int(max(int(y_train.max()), int(y_test.max())) + 1)
    size = x_train.shape[-1]

    def build() -> torch.nn.Module:
        w = width / 64 if model == "mobilenet_v2" else width  # its width is a fraction of the standard one
        return get_model(model, num_classes=classes, width=w, cifar=size <= 64)

    return Task(build, (x_train - mean) / std, y_train, (x_test - mean) / std, y_test, lr=lr)


def run(argv: Sequence[str] | None = None) -> Advice:
    """What the console script does; the advice (also printed, and written to --out)."""
    args = _parser().parse_args(argv)
    space = SearchSpace(_ints(args.resources), _ints(args.batches), _ints(args.microbatches))
    targets = Targets(args.accuracy, args.time_limit, args.max_epochs)
    task = load_task(args.data, args.model, args.width, args.lr, args.train_images)
    if args.out:
        from ..atomic import require_folder

        require_folder(args.out)
    if args.resource == "ranks":
        acc_r = 1
        timer: StepTimer = TorchrunStepTimer(args.model, args.width, int(task.train_x.shape[-1]),
                                             int(max(int(task.train_y.max()), int(task.test_y.max())) + 1),
                                             steps=args.steps, device=args.device)
    else:
        acc_r = max(space.resources)
        timer = CpuStepTimer(task, steps=args.steps)
    advice = advise(timer, TrainAccuracy(task, resources=acc_r), space=space,
                    targets=targets, dataset_size=len(task.train_x),
                    profiling=Profiling(accuracy_epochs=args.accuracy_epochs), accuracy_resources=acc_r,
                    staged=args.staged)
    print(advice.table())
    if args.out:
        write_text(args.out, json.dumps(advice.to_dict(), indent=1) + "\n")
        print(f"wrote {args.out}")
    return advice


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: 0 on success; a failure is one line on stderr and status 1."""
    return console.run_job(run, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
