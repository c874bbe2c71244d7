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
model at this input shape and layout.

    python -m experiments.bench_kernels_train --tune --trials 8 --db /tmp/pipedp-kernels \
        --out experiments/results/kernels_train_cpu.json
    python -m experiments.bench_kernels_train --model path/to/file.py:factory --input-shape 32,3,64,64 --db DIR
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
    rounding differences, this does not.
    """
    grads = []
    for m in (a, b):
        m.zero_grad(set_to_none=True)
        nn.CrossEntropyLoss()(m(x), y).backward()
        grads.append([p.grad.detach().clone() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
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
    p.add_argument("--layout", choices=["nhwc", "nchw"], default="nhwc", help="activation memory format of both runs")
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
    if args.tune:
        from pipedp.kernels.tvm import cli

        status = cli.main(["--model", args.model, "--input-shape", args.input_shape, "--target", device.type,
                           "--trials", str(args.trials), "--layouts", args.layout, "--db", args.db,
                           "--num-classes", str(args.num_classes), "--allocator", args.allocator, "--no-progress"])
        if status != 0:
            raise SystemExit(f"bench_kernels_train: tune-kernels failed (exit status {status}, reason above)")
    fmt = torch.channels_last if args.layout == "nhwc" else torch.contiguous_format
    torch.manual_seed(args.seed)
    try:
        plain = load_model(args.model, args.num_classes)
    except ValueError as e:  # an unknown zoo name or a model file without its factory
        raise SystemExit(f"bench_kernels_train: {e}") from e
    plain = plain.to(device, memory_format=fmt)
    tuned = copy.deepcopy(plain)
    try:
        swapped = swap_depthwise(tuned, "auto" if args.kernels == "faster" else "tvm", args.db, device).count
    except RuntimeError:  # no export for this device in the db
        swapped = 0
    if swapped == 0:
        raise SystemExit(f"bench_kernels_train: no depthwise layer swapped: {args.db} has no kernels for {device} "
                         "(run with --tune, or tune-kernels), or kernels='auto' left them to torch (see the log)")
    g = torch.Generator().manual_seed(args.seed)
    batches = [(torch.randn(shape, generator=g).to(device).contiguous(memory_format=fmt),
                torch.randint(0, args.num_classes, (shape[0],), generator=g).to(device)) for _ in range(args.window)]
    grad_diff = _grad_difference(plain, tuned, *batches[0])
    runs = {"plain": train_step(plain), "kernels": train_step(tuned)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for name, step in runs.items():  # warm-up: first-call costs (library load, allocator) stay out
        losses[name] += _window(step, batches, device)[1]
    order = ["plain", "kernels", "kernels", "plain"]
    for i in range(args.windows * 2):
        name = order[i % 4]
        secs, ls = _window(runs[name], batches, device)
        times[name].append(secs / args.window)
        losses[name] += ls
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["kernels"], strict=True))
    report = {
        "benchmark": "bench_kernels_train", "date": time.strftime("%Y-%m-%d"), "machine": describe(device),
        "settings": vars(args), "depthwise_layers_swapped": swapped, "step_s": times,
        "median_step_s": med, "images_per_s": {k: shape[0] / v for k, v in med.items()},
        "speedup": med["plain"] / med["kernels"], "grad_rel_diff": grad_diff, "max_loss_diff": diff,
        "losses": losses,
    }
    print(f"{args.model} input {args.input_shape} {args.layout} on {device}: "
          f"plain {med['plain'] * 1e3:.1f} ms/step, kernels={args.kernels} {med['kernels'] * 1e3:.1f} ms/step, "
          f"speedup {report['speedup']:.2f}x ({swapped} depthwise layers); gradients of one step differ by "
          f"{grad_diff:.1e} of the largest, losses after {len(losses['plain'])} steps by {diff:.1e}")
    if not grad_diff <= 1e-4:
        print("warning: one step's gradients differ by more than summation order explains")
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
