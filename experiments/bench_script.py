"""A real script's step time, plain against pipedp's defaults, each run in its own process, alternating.

In-process benchmarks alternate plain and pipedp steps on one model, which
hides what a plan leaves on the process or the model (a memory format, a
thread setting, per-step work outside the step). This runs the training loop
of PyTorch's ImageNet example as users port it (a torchvision model by name,
SGD with momentum and weight decay, a ``DataLoader`` with ``-j 0`` over
synthetic images, top-1 accuracy and ``loss.item()`` every step), once plain
and once with ``pipedp.wrap`` and its defaults, round after round, and
reports each process's median per-step time as that script measures it
(``batch_time``: from the end of one step to the end of the next, loading
included) and their ratio per round.

    python -m experiments.bench_script --arch resnet18 --batch 32,16 --rounds 3 \
        --out experiments/results/script_cpu_<machine>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["main"]


def _loop(args: argparse.Namespace) -> dict[str, object]:
    """One process's run: the ImageNet example's loop, plain or with pipedp; per-step times after warm-up."""
    import torch
    from torch import nn

    from .zoo import torchvision_models

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision_models().__dict__[args.arch](num_classes=10)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    n = args.batch * (args.steps + 1)
    if args.image_folder:
        data = _image_folder(args.image_folder, args.image_size)
    else:
        data = torch.utils.data.TensorDataset(torch.randn(n, 3, args.image_size, args.image_size),
                                              torch.randint(0, 10, (n,)))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, num_workers=0, drop_last=True)
    engine = None
    if not args.plain:
        import pipedp

        engine = pipedp.wrap(model, optimizer=optimizer, loss_fn=criterion, progress=False,
                             plan_cache=args.plan_cache or True)
    times, seen, end = [], [], time.time()
    for x, y in loader:
        if engine is None:
            output = model(x)
            loss = criterion(output, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            loss, output = engine.train_step(x, y, return_outputs=True)
        seen.append((loss.item(), (output.argmax(1) == y).float().mean().item()))  # the script's meters
        times.append(time.time() - end)
        end = time.time()
    kept = times[args.warmup:]
    return {"median_s": statistics.median(kept), "steps": len(kept),
            "plan": None if engine is None else engine.plan.label}


def write_folder(root: str, images: int, size: int, classes: int = 10) -> None:
    """A synthetic image folder as ``torchvision.datasets.ImageFolder`` reads it: random PNGs, one folder a class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(images):
        folder = os.path.join(root, f"class{i % classes}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i}.png"))


def _image_folder(root: str, size: int):  # noqa: ANN202 - a torchvision dataset
    """The ImageNet example's training set and transforms (crop, flip, to tensor, normalise) over ``root``."""
    from .zoo import torchvision_models

    torchvision_models()  # torchvision importable beside the CPU torch
    import torchvision.datasets as datasets
    import torchvision.transforms as transforms

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    return datasets.ImageFolder(root, transforms.Compose([
        transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))


def _child(args: argparse.Namespace, plain: bool, batch: int) -> dict[str, object]:
    cmd = [sys.executable, "-m", __spec__.name, "--child", "--arch", args.arch, "--batch", str(batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--image-size", str(args.image_size), "--plan-cache", args.plan_cache, "--image-folder", args.image_folder]
    if plain:
        cmd.append("--plain")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--batch", default="32,16", help="batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--plan-cache", default="", help="a plan-cache folder (default: the user's)")
    p.add_argument("--image-folder", default="", help="load a synthetic image folder (PNG decode, the example's "
                                                        "transforms) made here, instead of tensors in memory")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.batch = int(args.batch)
        print(json.dumps(_loop(args)))
        return
    from .machine import describe

    if args.image_folder and not os.path.isdir(args.image_folder):
        write_folder(args.image_folder, max(int(b) for b in args.batch.split(",")) * (args.steps + 1),
                     args.image_size * 5 // 4)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        _child(args, False, batch)  # the first pipedp run plans and fills the cache; the rounds replay it
        for r in range(args.rounds):
            plain, piped = _child(args, True, batch), _child(args, False, batch)
            ratio = piped["median_s"] / plain["median_s"]
            rows.append({"batch": batch, "round": r, "plain_s": plain["median_s"], "pipedp_s": piped["median_s"],
                         "ratio": ratio, "plan": piped["plan"]})
            print(f"batch {batch} round {r}: plain {plain['median_s']:.4f} s, pipedp {piped['median_s']:.4f} s "
                  f"({ratio:.3f}x, {piped['plan']})", flush=True)
    result = {"machine": describe("cpu"), "arch": args.arch, "threads": args.threads, "image_size": args.image_size,
              "data": "image folder" if args.image_folder else "tensors",
              "steps": args.steps, "warmup": args.warmup, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
