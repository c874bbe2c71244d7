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
included; ``data_time`` beside it) and their ratio per round, the order of
the two alternating. Processes of one kind spread far more than 1% on a
small VM, so each batch size ends with both sides in one process, in
alternating windows of the same loop (the plain side on a copy of the model
taken before ``wrap``), and the median of the per-pair ratios.

    python -m experiments.bench_script --arch resnet18 --batch 32,16 --rounds 4 --windows 30 \
        --image-size 32 --image-folder /tmp/imgf --out experiments/results/script_cpu_<machine>.json
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


def _setup(args: argparse.Namespace):  # noqa: ANN202 - (model, criterion, optimizer, loader)
    """The example's model, loss, optimizer and loader (seeded alike in every process)."""
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
    return model, criterion, optimizer, loader


def _stepper(model, criterion, optimizer, engine):  # noqa: ANN001, ANN202 - the example's step, plain or pipedp's
    """One training step as the example writes it (or ``engine.train_step``), its meters read every step."""
    def step(x, y) -> None:  # noqa: ANN001
        if engine is None:
            output = model(x)
            loss = criterion(output, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            loss, output = engine.train_step(x, y, return_outputs=True)
        loss.item(), (output.argmax(1) == y).float().mean().item()  # the script's loss and top-1 meters
    return step


def _wrap(model, criterion, optimizer, args: argparse.Namespace):  # noqa: ANN001, ANN202 - a pipedp.Engine
    import pipedp

    return pipedp.wrap(model, optimizer=optimizer, loss_fn=criterion, progress=False,
                       plan_cache=args.plan_cache or True)


def _loop(args: argparse.Namespace) -> dict[str, object]:
    """One process's run: the ImageNet example's loop, plain or with pipedp; per-step times after warm-up."""
    model, criterion, optimizer, loader = _setup(args)
    engine = None if args.plain else _wrap(model, criterion, optimizer, args)
    step = _stepper(model, criterion, optimizer, engine)
    times, data, end = [], [], time.time()
    for x, y in loader:
        data.append(time.time() - end)  # the example's data_time meter
        step(x, y)
        times.append(time.time() - end)  # its batch_time meter: loading included
        end = time.time()
    kept = times[args.warmup:]
    return {"median_s": statistics.median(kept), "steps": len(kept),
            "data_median_s": statistics.median(data[args.warmup:]),
            "plan": None if engine is None else engine.plan.label}


def _together(args: argparse.Namespace) -> dict[str, object]:
    """Both sides in one process, in alternating windows of the example's loop, each timed as it times a step.

    The plain side trains a copy of the model taken before ``wrap``, so what
    the plan changes on the model (its layout) shows; what it would leave on
    the process (threads, flags, live threads) is kept out by a test
    (``tests/reliability/test_planning_leaves_user_state.py``). Between
    processes this machine's step times spread far wider than 1% (see the
    rounds); side by side the spread is the windows'.
    """
    import copy

    model, criterion, optimizer, loader = _setup(args)
    twin = copy.deepcopy(model)
    twin_opt = type(optimizer)(twin.parameters(), **optimizer.defaults)
    engine = _wrap(model, criterion, optimizer, args)
    sides = {"plain": _stepper(twin, criterion, twin_opt, None), "pipedp": _stepper(model, criterion, optimizer, engine)}
    batches = iter(())

    def batch():  # noqa: ANN202 - the loader's next batch, epoch after epoch
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    windows: dict[str, list[float]] = {"plain": [], "pipedp": []}
    for w in range(args.warmup_windows + 2 * args.windows):
        name = ("plain", "pipedp")[(w // 2 + w) % 2]  # plain, pipedp, pipedp, plain, ...: ABBA, drift-neutral
        times, end = [], time.time()
        for _ in range(args.window):
            sides[name](*batch())
            times.append(time.time() - end)
            end = time.time()
        if w >= args.warmup_windows:
            windows[name].append(statistics.median(times))
    ratios = [p / q for p, q in zip(windows["pipedp"], windows["plain"])]
    return {"plain_s": statistics.median(windows["plain"]), "pipedp_s": statistics.median(windows["pipedp"]),
            "ratio": statistics.median(ratios), "ratio_quartiles": statistics.quantiles(ratios, n=4),
            "windows": len(ratios), "window_steps": args.window, "plan": engine.plan.label,
            "plain_windows_s": windows["plain"], "pipedp_windows_s": windows["pipedp"]}


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


def _child(args: argparse.Namespace, plain: bool, batch: int, together: bool = False) -> dict[str, object]:
    cmd = [sys.executable, "-m", __spec__.name, "--child", "--arch", args.arch, "--batch", str(batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--image-size", str(args.image_size), "--plan-cache", args.plan_cache, "--image-folder", args.image_folder,
           "--windows", str(args.windows), "--window", str(args.window),
           "--warmup-windows", str(args.warmup_windows)]
    if plain:
        cmd.append("--plain")
    if together:
        cmd.append("--together")
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
    p.add_argument("--windows", type=int, default=20, help="side by side in one process: windows of each side "
                                                            "(0: no such run)")
    p.add_argument("--window", type=int, default=5, help="steps per window")
    p.add_argument("--warmup-windows", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--together", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.batch = int(args.batch)
        print(json.dumps(_together(args) if args.together else _loop(args)))
        return
    from .machine import describe

    if args.image_folder and not os.path.isdir(args.image_folder):
        write_folder(args.image_folder, max(int(b) for b in args.batch.split(",")) * (args.steps + 1),
                     args.image_size * 5 // 4)
    rows, together = [], []
    for batch in (int(b) for b in args.batch.split(",")):
        _child(args, False, batch)  # the first pipedp run plans and fills the cache; the rounds replay it
        for r in range(args.rounds):
            if r % 2 == 0:  # which goes first alternates, so that drift between processes favours neither
                plain, piped = _child(args, True, batch), _child(args, False, batch)
            else:
                piped, plain = _child(args, False, batch), _child(args, True, batch)
            ratio = piped["median_s"] / plain["median_s"]
            rows.append({"batch": batch, "round": r, "plain_s": plain["median_s"], "pipedp_s": piped["median_s"],
                         "ratio": ratio, "plan": piped["plan"], "plain_data_s": plain["data_median_s"],
                         "pipedp_data_s": piped["data_median_s"]})
            print(f"batch {batch} round {r}: plain {plain['median_s']:.4f} s, pipedp {piped['median_s']:.4f} s "
                  f"({ratio:.3f}x, {piped['plan']})", flush=True)
        if args.windows:
            row = {"batch": batch, **_child(args, False, batch, together=True)}
            together.append(row)
            q = row["ratio_quartiles"]
            print(f"batch {batch} side by side in one process: plain {row['plain_s']:.4f} s, pipedp "
                  f"{row['pipedp_s']:.4f} s, {row['ratio']:.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f}, "
                  f"{row['windows']} window pairs, {row['plan']})", flush=True)
    medians = {str(b): statistics.median(r["ratio"] for r in rows if r["batch"] == b)
               for b in sorted({r["batch"] for r in rows})}
    if medians:
        print("median ratio per batch:", ", ".join(f"{b}: {m:.3f}x" for b, m in medians.items()))
    result = {"machine": describe("cpu"), "median_ratio": medians, "arch": args.arch, "threads": args.threads,
              "image_size": args.image_size,
              "data": "image folder" if args.image_folder else "tensors",
              "steps": args.steps, "warmup": args.warmup, "rows": rows, "window_steps": args.window,
              "side_by_side": together}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
