"""reproduce-paper: the paper's experiment, plain PyTorch training vs ``pipedp.wrap``, end to end.

For each model, two runs start from the same initial weights and see the very
same batches (same shuffle, same augmentation): plain PyTorch training and the
same model wrapped by pipedp. They are timed in alternating windows of steps
(plain-pipedp, then pipedp-plain, ...) so both see the same machine state.
Per epoch each run records training time, images/s, peak device memory (CUDA),
mean training loss and test accuracy, and each timing window's times, since
one speedup hides how much a shared machine varies: table.md gives the
median and range of the per-window speedups beside the overall one.
``--out`` gets results.json, table.md (laid out like the paper's table, its
speedups beside ours), speedup.png and accuracy.png.

    reproduce-paper --quick                                      # offline digits, 2 CPU cores, minutes
    reproduce-paper --models resnet18,resnet34,resnet50 --dataset cifar10 --data-root ~/data --device cuda
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

import pipedp
from pipedp import console
from pipedp.models import MODELS
from pipedp.pipeline.orders import NAMES as SCHEDULES

from . import data as D
from .machine import describe, sync
from .models import paper_model
from .paper_report import speedup_spread, write_outputs
from .report import write_json

__all__ = ["main", "reproduce", "run_model"]

PROG = "reproduce-paper"
# --quick: a ResNet-18 of width 16 learns the digits (every image, 5 epochs of 23 steps each) in about a minute
# on 2 cores, in windows of 2 steps so that the spread of the windows says something.
QUICK = {"epochs": 5, "train": None, "test": None, "batch_size": 64, "window": 2, "width": 16}


@dataclass
class Run:
    """One of the two trainings of a model: how it steps, predicts and switches mode."""

    name: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]
    mode: Callable[[bool], Any]
    scheduler: Any
    epochs: list[dict[str, Any]] = field(default_factory=list)
    time_s: float = 0.0
    peak: int = 0
    loss_sum: Any = 0.0
    steps: int = 0
    window_s: list[float] = field(default_factory=list)  # every timing window's time, in order


def _optimizer(model: nn.Module, lr: float, epochs: int) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(epochs, 1))


def _plain(model: nn.Module, lr: float, epochs: int) -> Run:
    opt, sched = _optimizer(model, lr, epochs)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    @torch.no_grad()
    def predict(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    return Run("plain", step, predict, model.train, sched)


def _pipedp(model: nn.Module, lr: float, epochs: int, args: argparse.Namespace, sample: tuple[int, ...]) -> tuple[Run, Any]:
    opt, sched = _optimizer(model, lr, epochs)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=args.microbatches,
                         stages=args.stages, schedule=args.schedule, kernels=args.kernels, sample=sample,
                         progress=False)
    return Run("pipedp", engine.train_step, engine, engine.train, sched), engine


def _windows(batches: Any, size: int) -> Any:
    chunk: list = []
    for b in batches:
        chunk.append(b)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _timed_window(run: Run, batches: list, device: torch.device, bar: Any) -> None:
    """Train ``run`` on ``batches``, adding the wall time to its total and to its list of windows."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    for x, y in pipedp.data.prefetch(batches, device):
        run.loss_sum = run.loss_sum + run.step(x, y)
        run.steps += 1
        if bar is not None:
            bar.update(1)
    sync(device)
    dt = time.perf_counter() - t0
    run.time_s += dt
    run.window_s.append(dt)
    if device.type == "cuda":
        run.peak = max(run.peak, torch.cuda.max_memory_allocated(device))


@torch.no_grad()
def _accuracy(run: Run, test: D.Batches, device: torch.device) -> float:
    run.mode(False)
    correct = total = 0
    for x, y in test.epoch():
        pred = run.predict(x.to(device)).argmax(1).cpu()
        correct += int((pred == y).sum())
        total += len(y)
    run.mode(True)
    return 100.0 * correct / max(total, 1)


def run_model(name: str, ds: D.Dataset, args: argparse.Namespace, device: torch.device,
              trace: str | None = None) -> dict[str, Any]:
    """Train ``name`` on ``ds`` twice (plain, pipedp) side by side; the per-epoch record of both."""
    from tqdm import tqdm

    mean, std = ds.stats()
    train = D.Batches(ds.train_x, ds.train_y, args.batch_size, mean=mean, std=std, train=True, flip=ds.flip,
                      seed=args.seed)
    test = D.Batches(ds.test_x, ds.test_y, args.batch_size, mean=mean, std=std, train=False)
    torch.manual_seed(args.seed)
    model = paper_model(name, ds.classes, ds.image_size, args.width).to(device)
    twin = copy.deepcopy(model)
    lr = args.lr * args.batch_size / 128
    plain = _plain(model, lr, args.epochs)
    t0 = time.perf_counter()
    piped, engine = _pipedp(twin, lr, args.epochs, args, (args.batch_size, 3, ds.image_size, ds.image_size))
    setup_s = time.perf_counter() - t0
    print(against_bar(name, engine.plan), flush=True)
    runs = (plain, piped)
    window_steps: list[int] = []
    for e in range(1, args.epochs + 1):
        times = {r.name: r.time_s for r in runs}
        bar = tqdm(total=2 * len(train), desc=f"{name} epoch {e}/{args.epochs}", unit="step", leave=False,
                   disable=not args.progress)
        traced_window = min(1, (len(train) - 1) // args.window)  # the second window: past warm-up
        for w, window in enumerate(_windows(train.epoch(e), args.window)):
            window_steps.append(len(window))
            if device.type == "cuda":  # page-locked, so the prefetcher's copies overlap the steps
                window = [(x.pin_memory(), y.pin_memory()) for x, y in window]
            if trace and e == 1 and w == traced_window:
                engine.trace(trace)
            for run in runs if w % 2 == 0 else runs[::-1]:
                _timed_window(run, window, device, bar)
        bar.close()
        for run in runs:
            run.scheduler.step()
            dt, n = run.time_s - times[run.name], run.steps  # loss_sum and steps count this epoch
            loss = float(run.loss_sum) / n if n else math.nan
            run.loss_sum, run.steps = 0.0, 0
            run.epochs.append({
                "epoch": e, "time_s": dt, "images_per_s": n * args.batch_size / dt if dt > 0 else None,
                "train_loss": loss, "test_acc": _accuracy(run, test, device),
                "peak_mem_mb": run.peak / 2**20 if device.type == "cuda" else None,
            })
        a, b = plain.epochs[-1], piped.epochs[-1]
        print(f"{name} epoch {e}: plain {a['time_s']:.1f} s acc {a['test_acc']:.2f}%  |  pipedp {b['time_s']:.1f} s "
              f"acc {b['test_acc']:.2f}%  |  speedup {a['time_s'] / b['time_s']:.2f}x", flush=True)
    plan = engine.plan
    out: dict[str, Any] = {"model": name, "dataset": ds.name, "image_size": ds.image_size,
                           "params": sum(p.numel() for p in model.parameters()), "setup_s": setup_s,
                           "plan": str(plan), "plan_summary": _plan_summary(plan), "planning_s": plan.planning_s,
                           "bar": plan.bar or None, "bar_ms": plan.trial_baseline_ms,
                           "plan_ms": dict(plan.trials).get(plan.label), "trials": [list(t) for t in plan.trials]}
    for run in runs:
        out[run.name] = {"epochs": run.epochs, "time_s": run.time_s, "final_acc": run.epochs[-1]["test_acc"],
                         "peak_mem_mb": run.peak / 2**20 if device.type == "cuda" else None,
                         "window_s": run.window_s}
    out["speedup"] = plain.time_s / piped.time_s
    out["window_steps"] = window_steps
    out["speedup_windows"] = speedup_spread(plain.window_s, piped.window_s)
    return out


def against_bar(name: str, plan: Any) -> str:
    """One line: what the plan chose against the strongest alternative its trials timed, and what planning took.

    The bar is what a knowledgeable user runs instead (their own step in the
    faster layout, compiled where allowed), not plain eager: the speed-up of
    the epochs below is against plain eager NCHW, the paper's baseline.
    """
    math = f" ({plan.contract})" if plan.contract else ""
    if not plan.trials or plan.trial_baseline_ms is None:
        return f"{name}: pipedp runs {plan.label}{math}, the stages you gave (nothing timed against your step)"
    ms = dict(plan.trials).get(plan.label)
    bar = f"your step at its fastest ({plan.bar}, {plan.trial_baseline_ms:.1f} ms per forward+backward)"
    if ms:
        verdict = (f"its own plan {plan.label}{math} ran {plan.trial_baseline_ms / ms:.2f}x as fast as {bar}, so it "
                   f"runs that")
    else:
        verdict = f"no plan of its own beat it, so it runs that step: {plan.label}{math}"
    return f"{name}: pipedp timed its plans against {bar}; {verdict}. Planning took {plan.planning_s:.1f} s"


def _plan_summary(plan: Any) -> str:
    counts = [len(s.blocks) for s in plan.stages]
    return f"{len(counts)} stage(s) of {'+'.join(map(str, counts))} blocks, {plan.microbatches} microbatches"


class _Later:
    """A default that depends on ``--quick`` (or the dataset), or that ``None`` would show badly: settled by
    :func:`_resolve`, shown by --help as ``text``."""

    def __init__(self, full: Any, quick: Any, text: str | None = None) -> None:
        self.full, self.quick = full, quick
        self.text = text or f"{'all' if full is None else full}; {quick} with --quick"

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--models", default=_Later("resnet18,resnet34,resnet50", "resnet18"),
                   help="comma list of " + ", ".join(MODELS))
    p.add_argument("--dataset", default="digits", choices=D.DATASETS,
                   help="digits: offline, ships with scikit-learn; synthetic: generated; the others are read from "
                        "--data-root")
    p.add_argument("--data-root", default=_Later(None, None, "none; needed by cifar10, cifar100, caltech101"),
                   help="folder holding cifar-10-batches-py, cifar-100-python or 101_ObjectCategories (never "
                        "downloaded)")
    p.add_argument("--epochs", type=int, default=_Later(10, QUICK["epochs"]), help="training epochs per model")
    p.add_argument("--batch-size", type=int, default=_Later(128, QUICK["batch_size"]),
                   help="images per training step (both runs)")
    p.add_argument("--microbatches", type=int,
                   default=_Later(None, None, "pipedp's: your step's math, one microbatch for these BatchNorm models"),
                   help="microbatches per pipedp step")
    p.add_argument("--stages", default="auto", help="'auto' or a number of pipeline stages")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "tvm"],
                   help="pipedp's depthwise-convolution kernels (pipedp.wrap's kernels=)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate at batch 128 (scaled linearly)")
    p.add_argument("--width", type=int, default=_Later(64, QUICK["width"]),
                   help="ResNet base width (64: the standard models)")
    p.add_argument("--image-size", type=int, default=_Later(None, None, "32; 224 for caltech101"),
                   help="image size of digits, synthetic and caltech101 (CIFAR's is 32)")
    p.add_argument("--train-images", type=int, default=_Later(None, QUICK["train"], "all"),
                   help="use the first N training images")
    p.add_argument("--test-images", type=int, default=_Later(None, QUICK["test"], "all"),
                   help="use the first N test images")
    p.add_argument("--window", type=int, default=_Later(4, QUICK["window"]),
                   help="steps per alternating timing window (each window's speedup is recorded)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the shuffle and the augmentation")
    p.add_argument("--quick", action="store_true",
                   help=f"a few minutes on 2 CPU cores: {QUICK['epochs']} epochs of every image, ResNet width "
                        f"{QUICK['width']}, batch {QUICK['batch_size']}, windows of {QUICK['window']} steps")
    p.add_argument("--trace", default=_Later(None, None, "none"), help="write one pipelined step as a "
                   "Chrome/Perfetto trace (JSON; one file per model, named after it, when there are several)")
    p.add_argument("--out", default="reproduce-out", help="folder for results.json, table.md and the plots")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    for k, v in list(vars(args).items()):
        if isinstance(v, _Later):
            setattr(args, k, v.quick if args.quick else v.full)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.model_list if m not in MODELS]
    if bad or not args.model_list:
        raise ValueError(f"unknown model(s) {bad}: choose from {', '.join(MODELS)}")
    if args.stages != "auto":
        try:
            args.stages = int(args.stages)
        except ValueError:
            raise ValueError(f"--stages must be 'auto' or an integer, got {args.stages!r}") from None
    for k in ("epochs", "batch_size", "microbatches", "window", "width"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be at least 1")
    if args.microbatches is not None and args.batch_size < args.microbatches:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches}")
    return args


def _check_extras(dataset: str) -> None:
    """Fail before any training when the dataset needs the experiments extra; say early that plots will be skipped."""
    if dataset == "caltech101":
        console.require("PIL", "experiments", "--dataset caltech101 (reading its images)")
    if dataset == "digits" and not os.path.isfile(os.environ.get("PIPEDP_DIGITS_NPZ", "")):
        console.require("sklearn.datasets", "experiments", "--dataset digits (it ships with scikit-learn; or set "
                        "PIPEDP_DIGITS_NPZ, see experiments.data.save_digits)")
    try:
        console.require("matplotlib", "experiments", "the plots")
    except console.MissingExtra as e:
        print(f"{PROG}: note: speedup.png and accuracy.png will be skipped: {e}", file=sys.stderr, flush=True)


def reproduce(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the experiment reproduce-paper's options ``argv`` describe; the results (also written to --out)."""
    args = _resolve(_parser().parse_args(argv))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but this torch build sees no GPU; use --device cpu")
    _check_extras(args.dataset)
    ds = D.load(args.dataset, args.data_root, image_size=args.image_size, seed=args.seed)
    ds = ds.subset(args.train_images, args.test_images)
    os.makedirs(args.out, exist_ok=True)
    if args.trace:
        os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "model_list"}
    data = {"name": ds.name, "train": len(ds.train_x), "test": len(ds.test_x), "classes": ds.classes,
            "image_size": ds.image_size}
    results: dict[str, Any] = {"benchmark": "reproduce_paper", "date": time.strftime("%Y-%m-%d"),
                               "machine": describe(device), "args": settings, "data": data, "runs": []}
    where = results["machine"].get("gpu") or results["machine"]["cpu"]
    print(f"{PROG}: {ds.name} ({len(ds.train_x)} train / {len(ds.test_x)} test images, {ds.classes} classes, "
          f"{ds.image_size}x{ds.image_size}) on {where}", flush=True)
    for name in args.model_list:
        trace = None
        if args.trace:
            stem, suffix = os.path.splitext(args.trace)
            trace = args.trace if len(args.model_list) == 1 else f"{stem}_{name}{suffix or '.json'}"
        results["runs"].append(run_model(name, ds, args, device, trace))
        write_json(os.path.join(args.out, "results.json"), results)  # a cut-off run keeps finished models
    for path in [os.path.join(args.out, "results.json"), *write_outputs(results, args.out)]:
        print(f"wrote {path}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """The reproduce-paper console script: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(reproduce, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
