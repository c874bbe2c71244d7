"""Benchmark: training steps with the tuned depthwise kernels vs plain PyTorch (default: MobileNetV2 at 32x32).

What a user of ``kernels=`` gets: the same model, from the same weights, on
the same batches, trained by plain PyTorch and with its depthwise layers
swapped onto pipedp's kernels (``pipedp.ops.swap_depthwise``, the step
``pipedp.wrap`` takes) and nothing else changed: no pipeline, no
microbatches, so the ratio is the kernels' alone. Timing windows alternate
(plain, kernels, kernels, plain, ...) so both see the same machine state. The
losses of the two runs are compared step by step (they differ only by
floating-point summation order; the exactness check is one step's gradients
from the same weights, since training amplifies rounding).

The kernels come from ``--db``; ``--tune`` first runs ``tune-kernels`` on the
model at this input shape and layout. ``--layout best`` runs the model in
both memory formats, with and without the kernels (four runs, alternating),
and compares the faster of each: what a user who picks torch's best layout
gets, against the kernels in theirs.

    python -m experiments.bench_kernels_train --tune --trials 8 --db /tmp/pipedp-kernels \
        --out experiments/results/kernels_train_cpu.json
    python -m experiments.bench_kernels_train --model path/to/file.py:factory --input-shape 32,3,64,64 --db DIR
    python -m experiments.bench_kernels_train --device cuda --input-shape 128,3,32,32 --layout best --db DIR
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Callable

import torch
from pipedp.kernels.tvm import allocator
from pipedp.kernels.tvm.cli import load_model, parse_input_shape
from torch import nn

from pipedp.ops.swap import swap_depthwise

from .machine import describe, sync
from .report import write_json

__all__ = ["main", "train_step"]


def train_step(model: nn.Module, lr: float = 0.05) -> Callable[[torch.Tensor, torch.Tensor], float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _grad_difference(a: nn.Module, b: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest gradient difference of one backward from the same weights, relative to the largest gradient.

    The exactness check: later losses drift apart as training amplifies
    rounding differences, this does not. TF32 is off for it (torch's default
    on Ampere and later lets cuDNN run fp32 convolutions in TF32): the
    layers around the depthwise ones would round their inputs to 10 bits,
    and an input that differs in its last fp32 bit (summation order) can
    round the other way, 1e-3 of the largest gradient after a few layers.
    """
    grads = []
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for m in (a, b):
            m.zero_grad(set_to_none=True)
            nn.CrossEntropyLoss()(m(x), y).backward()
            grads.append([p.grad.detach().clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    scale = max(g.abs().max().item() for g in grads[0])
    return max((g - h).abs().max().item() for g, h in zip(*grads, strict=True)) / max(scale, 1e-30)


def _window(step: Callable[..., float], batches: list, device: torch.device) -> tuple[float, list[float]]:
    sync(device)
    t0 = time.perf_counter()
    losses = [step(x, y) for x, y in batches]
    sync(device)
    return time.perf_counter() - t0, losses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mobilenet_v2", help="zoo name or path/to/file.py:factory (as tune-kernels)")
    p.add_argument("--input-shape", default="64,3,32,32", help="N,C,H,W of a training batch")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--layout", choices=["nhwc", "nchw", "best"], default="nhwc",
                   help="activation memory format of both runs (best: both, each with and without the kernels)")
    p.add_argument("--kernels", choices=["faster", "tvm"], default="faster",
                   help="faster: kernels='auto' (each of a layer's kernels only where its tuning beat torch); "
                        "tvm: every tuned kernel")
    p.add_argument("--db", required=True, help="kernel database (tune-kernels --db)")
    p.add_argument("--tune", action="store_true", help="run tune-kernels on the model first")
    p.add_argument("--trials", type=int, default=8, help="with --tune: trials per kernel")
    p.add_argument("--windows", type=int, default=6, help="timed windows per run (after one warm-up each)")
    p.add_argument("--window", type=int, default=2, help="steps per window")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    allocator.add_argument(p)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if min(args.windows, args.window, args.trials) < 1:
        raise SystemExit("bench_kernels_train: --windows, --window and --trials must be at least 1")
    try:
        shape = parse_input_shape(args.input_shape)
    except ValueError as e:
        raise SystemExit(f"bench_kernels_train: {e}") from e
    device = torch.device(args.device)
    if not allocator.measure_with(args.allocator):
        raise SystemExit("bench_kernels_train: --allocator reuse needs glibc (mallopt); use --allocator default")
    layouts = ["nchw", "nhwc"] if args.layout == "best" else [args.layout]
    if args.tune:
        from pipedp.kernels.tvm import cli

        status = cli.main(["--model", args.model, "--input-shape", args.input_shape, "--target", device.type,
                           "--trials", str(args.trials), "--layouts", ",".join(layouts), "--db", args.db,
                           "--num-classes", str(args.num_classes), "--allocator", args.allocator, "--no-progress"])
        if status != 0:
            raise SystemExit(f"bench_kernels_train: tune-kernels failed (exit status {status}, reason above)")
    torch.manual_seed(args.seed)
    try:
        base = load_model(args.model, args.num_classes)
    except ValueError as e:  # an unknown zoo name or a model file without its factory
        raise SystemExit(f"bench_kernels_train: {e}") from e
    g = torch.Generator().manual_seed(args.seed)
    data = [(torch.randn(shape, generator=g), torch.randint(0, args.num_classes, (shape[0],), generator=g))
            for _ in range(args.window)]
    models: dict[str, nn.Module] = {}
    batches: dict[str, list] = {}
    swapped_by_layout: dict[str, int] = {}
    grad_diff = 0.0
    for layout in layouts:  # the same weights and batches in every run
        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        suffix = f" {layout}" if len(layouts) > 1 else ""
        plain = copy.deepcopy(base).to(device, memory_format=fmt)
        tuned = copy.deepcopy(plain)
        try:
            count = swap_depthwise(tuned, "auto" if args.kernels == "faster" else "tvm", args.db, device).count
        except RuntimeError:  # no export for this device in the db
            count = 0
        swapped_by_layout[layout] = count  # (0 in one layout of --layout best: auto kept torch there)
        batches[layout] = [(x.to(device).contiguous(memory_format=fmt), y.to(device)) for x, y in data]
        grad_diff = max(grad_diff, _grad_difference(plain, tuned, *batches[layout][0]))
        models[f"plain{suffix}"], models[f"kernels{suffix}"] = plain, tuned
    swapped = max(swapped_by_layout.values())
    if swapped == 0:
        raise SystemExit(f"bench_kernels_train: no depthwise layer swapped: {args.db} has no kernels for {device} "
                         "(run with --tune, or tune-kernels), or kernels='auto' left them to torch (see the log)")
    runs = {name: train_step(m) for name, m in models.items()}
    data_of = {name: batches[name.split()[-1] if len(layouts) > 1 else layouts[0]] for name in runs}
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for name, step in runs.items():  # warm-up: first-call costs (library load, allocator) stay out
        losses[name] += _window(step, data_of[name], device)[1]
    names = list(runs)
    order = names + names[::-1]  # (plain, kernels, kernels, plain): each run early and late alike
    for i in range(args.windows * len(names)):
        name = order[i % len(order)]
        secs, ls = _window(runs[name], data_of[name], device)
        times[name].append(secs / args.window)
        losses[name] += ls
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    plain_best = min((k for k in med if k.startswith("plain")), key=med.get)
    kernels_best = min((k for k in med if k.startswith("kernels")), key=med.get)
    diff = max(abs(a - b) for layout in layouts for a, b in zip(
        losses[f"plain{' ' + layout if len(layouts) > 1 else ''}"],
        losses[f"kernels{' ' + layout if len(layouts) > 1 else ''}"], strict=True))
    report = {
        "benchmark": "bench_kernels_train", "date": time.strftime("%Y-%m-%d"), "machine": describe(device),
        "settings": vars(args), "depthwise_layers_swapped": swapped, "swapped_by_layout": swapped_by_layout,
        "step_s": times,
        "median_step_s": med, "images_per_s": {k: shape[0] / v for k, v in med.items()},
        "speedup": med[plain_best] / med[kernels_best], "plain_best": plain_best, "kernels_best": kernels_best,
        "speedup_same_layout": {layout: med[f"plain {layout}"] / med[f"kernels {layout}"] for layout in layouts}
        if len(layouts) > 1 else {layouts[0]: med["plain"] / med["kernels"]},
        "grad_rel_diff": grad_diff, "max_loss_diff": diff, "losses": losses,
    }
    print(f"{args.model} input {args.input_shape} {args.layout} on {device}: "
          f"plain ({plain_best}) {med[plain_best] * 1e3:.1f} ms/step, kernels={args.kernels} ({kernels_best}) "
          f"{med[kernels_best] * 1e3:.1f} ms/step, speedup {report['speedup']:.2f}x ({swapped} depthwise layers); "
          f"gradients of one step differ by {grad_diff:.1e} of the largest, losses after "
          f"{len(losses[plain_best])} steps by {diff:.1e}")
    if not grad_diff <= 1e-4:
        print("warning: one step's gradients differ by more than summation order explains")
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
