"""A forecast of the best data parallel x pipeline layout for a machine the user does not have.

Profile the model's blocks on one device of the kind the machine has (here,
or on such a device elsewhere: a profile saves to JSON and loads anywhere),
name the machine's devices and link, and :func:`forecast` predicts every
layout's step with :mod:`pipedp.decide.layout` and ranks them. Every
assumption is printed with the result: a forecast is a model of the machine,
and the figures it rests on (a named link's nominal bandwidth, the profile's
device) are what a reader must be able to check.

    python -m pipedp.forecast --model resnet50 --batch 128 --devices 2,4,8 --link pcie4,nvlink4
    python -m pipedp.forecast --profile r50_h100.json --batch 128 --devices 8 --link "25 GB/s, 8 us"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import torch
from torch import nn

from .atomic import write_text
from .decide.layout import ASSUMPTIONS, BlockCosts, Prediction, rank
from .decide.links import NAMED, Link, parse_link
from .device import sync_devices
from .partition.blocks import blocks_of, module_mode
from .partition.check import check_chain
from .partition.parts import measurable, surrogate_loss
from .partition.profile import BlockProfile, profile_blocks
from .snapshot import preserved_state

__all__ = ["Profile", "Forecast", "profile_model", "update_ms", "whole_ms", "forecast", "main"]


@dataclass(frozen=True)
class Profile:
    """A model's blocks timed on ``batch`` samples on ``device`` (a name, e.g. ``"NVIDIA H100 80GB HBM3"``).

    ``small``: the same blocks timed again on ``small_batch`` samples (a fixed
    cost per call shows as the difference; empty: one size).
    """

    blocks: tuple[BlockProfile, ...]
    batch: int
    device: str
    threads: int  # intra-op threads the blocks ran with (CPU)
    update_ms: float = 0.0  # one optimizer update (SGD with momentum) of the whole model on that device
    small: tuple[BlockProfile, ...] = ()
    small_batch: int = 0

    def costs(self) -> BlockCosts:
        return BlockCosts(self.blocks, self.batch, self.small, self.small_batch)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (atomically: a killed save leaves the old file)."""
        data = {"batch": self.batch, "device": self.device, "threads": self.threads, "update_ms": self.update_ms,
                "blocks": [asdict(b) for b in self.blocks], "small_batch": self.small_batch,
                "small": [asdict(b) for b in self.small]}
        write_text(path, json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        try:
            with open(path) as f:
                data = json.load(f)
            return cls(tuple(BlockProfile(**b) for b in data["blocks"]), int(data["batch"]), str(data["device"]),
                       int(data.get("threads", 0)), float(data.get("update_ms", 0.0)),
                       tuple(BlockProfile(**b) for b in data.get("small", ())), int(data.get("small_batch", 0)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read a profile from {os.fspath(path)!r} ({e}): write one with "
                             f"`python -m pipedp.forecast --model NAME --save-profile FILE`") from e


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({torch.get_num_threads()} threads)"


def update_ms(model: nn.Module, device: torch.device, repeats: int = 5) -> float:
    """ms of one SGD-with-momentum update of copies of ``model``'s trained parameters on ``device`` (median)."""
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    opt.step()  # the momentum buffers, as after a first step
    times = []
    for _ in range(repeats):
        sync_devices([device])
        t0 = time.perf_counter()
        opt.step()
        sync_devices([device])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


SMALL = 4  # the second profile's samples are the first's over this (at least 2: BatchNorm needs them)


def whole_ms(model: nn.Module, x: torch.Tensor, repeats: int = 3, warmup: int = 1) -> float:
    """ms of the whole model's forward and backward on ``x`` (median after ``warmup`` calls; gradients dropped)."""
    times = []
    for i in range(repeats + warmup):
        sync_devices([x.device])
        t0 = time.perf_counter()
        surrogate_loss(model(x), x).backward()
        sync_devices([x.device])
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _calibrated(blocks: list[BlockProfile], whole: float) -> tuple[BlockProfile, ...]:
    """Blocks scaled so that they add up to the whole step's time.

    Timed alone, a block runs with its data hot in cache and no other
    block's allocations around it; in a step it does not (on a 2-core CPU
    the blocks of ResNet-18 summed to 0.85x of the step). The blocks give
    the shares, the whole step the level.
    """
    total = sum(b.cost_ms for b in blocks)
    f = whole / total if total > 0 else 1.0
    return tuple(replace(b, forward_ms=b.forward_ms * f, backward_ms=b.backward_ms * f) for b in blocks)


def profile_model(model: nn.Module, sample: torch.Tensor, *, depth: int = 1, progress: bool = False,
                  repeats: int = 5, warmup: int = 2) -> Profile:
    """Time ``model``'s blocks on ``sample`` (one replica's batch) and on a quarter of it, and its update.

    Each size's blocks are calibrated to the whole model's step at that size, which is timed first
    (after one warm-up call: a first call runs slower, ResNet-50 on a CPU core by a quarter). That call
    also ran every layer at the size, so the blocks after it may need no warm-up of their own. The model
    is left as it was. ``repeats``: timed runs per block (medians), and ``warmup`` untimed runs before
    them; fewer where the profile only ranks layouts that are then timed for real (``pp="auto"``).
    """
    device = sample.device
    blocks = blocks_of(model, depth=depth)
    copy_input = check_chain(model, blocks, sample)
    small_batch = sample.shape[0] // SMALL
    sizes = [sample] + ([sample[:small_batch]] if small_batch >= 2 else [])
    timed = []
    with preserved_state(model, [device]), module_mode(model, training=True), torch.enable_grad():
        for x in sizes:
            # The whole step on a copy where the first block modifies its input in place (the caller's batch).
            whole = whole_ms(model, x.clone() if copy_input[0] else x, repeats=max(1, repeats * 3 // 5))
            profiles = profile_blocks(measurable(blocks), x, progress=progress, copy_input=copy_input,
                                      warmup=min(warmup, repeats), repeats=repeats)
            timed.append(_calibrated(profiles, whole))
    return Profile(timed[0], sample.shape[0], _device_name(device), torch.get_num_threads(),
                   update_ms(model, device), timed[1] if len(timed) > 1 else (), small_batch if len(timed) > 1 else 0)


@dataclass(frozen=True)
class Forecast:
    """Every layout of ``ranks`` devices over ``link``, predicted, fastest first."""

    profile: Profile
    ranks: int
    global_batch: int
    link: Link
    predictions: tuple[Prediction, ...]

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def assumptions(self) -> list[str]:
        sizes = f"{self.profile.batch}" + (f" and {self.profile.small_batch}" if self.profile.small else "")
        return [f"{self.ranks} devices like the profiled one: {self.profile.device}, blocks timed on "
                f"{sizes} samples", f"link {self.link.describe()}", *ASSUMPTIONS]

    def __str__(self) -> str:
        dp_only = next((p for p in self.predictions if p.layout.pp == 1), None)
        lines = [f"forecast: {self.ranks} devices, global batch {self.global_batch}, link {self.link.name}",
                 f"  {'layout':<26} {'step ms':>9} {'vs dp':>6} {'sync ms':>8} {'exposed':>8} {'bubble':>7}"]
        for p in self.predictions:
            vs = f"{dp_only.step_ms / p.step_ms:.2f}x" if dp_only else "-"
            mark = "  best" if p is self.best else ""
            lines.append(f"  {p.layout.label:<26} {p.step_ms:9.2f} {vs:>6} {p.allreduce_ms:8.2f} {p.exposed_ms:8.2f} "
                         f"{p.bubble:7.0%}{mark}")
        lines += [f"assumes: {a}" for a in self.assumptions()]
        return "\n".join(lines)


def forecast(profile: Profile, ranks: int, global_batch: int, link: str | Link, *,
             microbatches: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = ("1f1b",),
             bucket_mb: float = 25.0) -> Forecast:
    """The layouts of ``ranks`` devices joined by ``link`` (a name of :data:`~pipedp.decide.links.NAMED` or
    ``"<GB/s> GB/s, <latency> us"``) training ``global_batch`` samples a step, fastest first."""
    if ranks < 1 or global_batch < 1:
        raise ValueError(f"ranks and global_batch must be >= 1, got {ranks} and {global_batch}")
    lk = parse_link(link)
    preds = rank(profile.costs(), ranks, global_batch, lk, update_ms=profile.update_ms,
                 microbatches=microbatches, schedules=schedules, bucket_bytes=bucket_mb * 2**20)
    if not preds:
        raise ValueError(f"no layout of {ranks} devices runs a global batch of {global_batch}: use a batch that "
                         f"divides by the data-parallel replicas with at least 2 samples each (a multiple of "
                         f"{ranks}, at least {2 * ranks})")
    return Forecast(profile, ranks, global_batch, lk, tuple(preds))


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipedp.forecast", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model of pipedp.models to profile here (resnet18, resnet50, mobilenet_v2, ...)")
    src.add_argument("--profile", help="a profile saved by --save-profile (measured on the machine's device kind)")
    p.add_argument("--input", default="3,32,32", help="input shape of one sample (default 3,32,32: CIFAR)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--profile-batch", type=int, default=None, help="samples the blocks are timed on "
                   "(default: the global batch over the largest device count)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--save-profile", default=None, help="write the profile here (JSON) for later forecasts")
    p.add_argument("--batch", type=int, required=True, help="global batch per step")
    p.add_argument("--devices", type=_ints, default=[2, 4, 8], help="device counts to forecast (comma list)")
    p.add_argument("--link", default="pcie4,nvlink4", help=f"links (comma list of names: {', '.join(NAMED)}; "
                   f"or one '<bandwidth> GB/s, <latency> us')")
    p.add_argument("--json", default=None, help="write every forecast here")
    args = p.parse_args(argv)
    links = [args.link] if "/s" in args.link else args.link.split(",")
    try:
        links_ = [parse_link(lk) for lk in links]
        if args.profile:
            prof = Profile.load(args.profile)
        else:
            from .models import get_model
            shape = _ints(args.input)
            pb = args.profile_batch or max(1, args.batch // max(args.devices))
            model = get_model(args.model, num_classes=args.classes).to(args.device)
            prof = profile_model(model, torch.randn(pb, *shape, device=args.device))
        if args.save_profile:
            prof.save(args.save_profile)
        out = []
        for lk in links_:
            for r in args.devices:
                f = forecast(prof, r, args.batch, lk)
                print(f, end="\n\n")
                out.append({"ranks": r, "link": asdict(lk), "batch": args.batch,
                            "predictions": [{"layout": pr.layout.label, **{k: v for k, v in asdict(pr).items()
                                                                             if k != "layout"}} for pr in f.predictions]})
        if args.json:
            write_text(args.json, json.dumps({"profile_device": prof.device, "profile_batch": prof.batch,
                                              "assumptions": list(ASSUMPTIONS), "forecasts": out}, indent=1) + "\n")
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"pipedp.forecast: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
