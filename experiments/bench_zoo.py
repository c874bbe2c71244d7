"""Benchmark: the model zoo (torchvision's CNNs, a fixed sample of timm's families) through pipedp.

For each model of :mod:`experiments.zoo` (random init, random layers on as
users build them, batch 8 of 64x64 images, CPU):

* ``wraps``: ``pipedp.wrap(model, optimizer=..., loss_fn=...)`` with default
  options trains a step (and why not), with the seconds it took to plan
  (wrap plus the first step, which plans);
* ``cut``: whether the model was cut into blocks (or trains as one stage, and
  why), the number of blocks;
* ``balance2`` / ``balance4``: slowest stage over the mean for the optimal cut
  into 2 and 4 stages of the profiled block times (1.0 is perfect);
* ``exact1``: random layers on, all blocks in one stage x 2 microbatches: the
  largest parameter or buffer difference after two SGD-momentum steps
  against plain PyTorch with the same microbatches and seed (the one-stage
  contract for random layers: the same masks, <= 1e-5);
* ``repeat2``: random layers on, 2 stages x 2 microbatches, run twice from
  one seed: the difference (the several-stage contract: bit for bit, 0);
* ``exact2`` / ``exact4``: the same model with its dropout and drop-path
  rates set to 0 (:func:`experiments.zoo.quiet`), 2 stages x 2 microbatches
  and 4 x 4 against plain PyTorch with the same microbatches (<= 1e-5).

    python -m experiments.bench_zoo --out experiments/results/zoo_cpu.json --md experiments/results/zoo_cpu.md
    python -m experiments.bench_zoo --library timm --models resnet18,mixnet_s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable

import torch
from torch import nn

import pipedp
from pipedp.partition.balance import balance, stage_costs
from pipedp.partition.blocks import CutError, blocks_of
from pipedp.partition.check import check_chain
from pipedp.partition.profile import profile_blocks

from . import zoo
from .baselines import accum_step, numerics
from .machine import describe
from .report import write_json, write_text

TOL = 1e-5
BATCH = 8


def _plain(model: nn.Module, batches, m: int) -> None:
    step = accum_step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), numerics("fp32"), m)
    for x, y in batches:
        step(x, y)


def _diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(((sa[k].double() - sb[k].double()).abs().max().item() for k in sa if sa[k].is_floating_point()),
               default=0.0)


def _trained(make: Callable[[], nn.Module], batches, stages: int | list[int], microbatches: int,
             seed: int = 0) -> nn.Module:
    """A model from ``make`` (seeded) after two pipedp steps with ``stages``, the generator seeded before them."""
    torch.manual_seed(0)
    model = make()
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), stages=stages, microbatches=microbatches, profile=False,
                         progress=False)
    torch.manual_seed(seed)
    for x, y in batches:
        engine.train_step(x, y)
    return model


def _exact(make: Callable[[], nn.Module], batches, stages: int | list[int], microbatches: int) -> float:
    """Max difference after two steps with ``stages`` against plain training with the same microbatches."""
    model = _trained(make, batches, stages, microbatches)
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    _plain(ref, batches, microbatches)
    return _diff(model, ref)


def _repeat(make: Callable[[], nn.Module], batches, stages: int) -> float:
    """Difference between two runs with ``stages`` stages x ``stages`` microbatches from one seed."""
    return _diff(_trained(make, batches, stages, stages), _trained(make, batches, stages, stages))


def _ratio(costs: list[float], stages: int) -> float | None:
    if len(costs) < stages:
        return None
    per = stage_costs(costs, balance(costs, stages))
    return float(max(per) / (sum(per) / len(per)))


def one(library: str, name: str) -> dict[str, object]:
    """The row of one model (errors are recorded, not raised)."""
    row: dict[str, object] = {"library": library, "model": name}
    make = zoo.build(library, name)
    size = zoo.input_size(library, name)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(BATCH, 3, size, size, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
               for _ in range(2)]
    torch.manual_seed(0)
    model = make()
    row["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    t0 = time.perf_counter()
    try:
        engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                             loss_fn=nn.CrossEntropyLoss(), progress=False, plan_cache=False)  # planned afresh
        engine.train_step(*batches[0])
        row["wraps"], row["plan_s"] = True, round(time.perf_counter() - t0, 2)
        row["plan"] = f"{len(engine.plan.stages)}x{engine.plan.microbatches}"
        row["plan_notes"] = [n for n in engine.plan.notes if n.startswith("stages=auto: one stage (")]
    except Exception as e:  # noqa: BLE001 - the row says why
        row["wraps"], row["wrap_error"] = False, f"{type(e).__name__}: {e}"[:400]
        return row
    torch.manual_seed(0)
    model = make()
    try:
        blocks = blocks_of(model)
        flags = check_chain(model, blocks, batches[0][0][:2])
        row["cut"], row["blocks"] = True, len(blocks)
    except CutError as e:
        row["cut"], row["why_not_cut"] = False, e.reason[:400]
        return row
    costs = [p.cost_ms for p in profile_blocks(blocks, batches[0][0][: BATCH // 2], progress=False, repeats=2,
                                                 copy_input=flags)]
    row["balance2"], row["balance4"] = _ratio(costs, 2), _ratio(costs, 4)
    quiet = zoo.build(library, name, random_layers=False)
    checks: dict[str, Callable[[], float]] = {
        "exact1": lambda: _exact(make, batches, [len(blocks)], 2),
        "repeat2": lambda: _repeat(make, batches, 2),
        "exact2": lambda: _exact(quiet, batches, 2, 2),
        "exact4": lambda: _exact(quiet, batches, 4, 4),
    }
    for key, check in checks.items():
        try:
            row[key] = check()
        except Exception as e:  # noqa: BLE001
            row[key], row[f"error_{key}"] = None, f"{type(e).__name__}: {e}"[:400]
    return row


def _ok(row: dict[str, object], key: str) -> bool:
    v = row.get(key)
    return isinstance(v, float) and v <= (0.0 if key.startswith("repeat") else TOL)


_CHECKS = ("exact1", "repeat2", "exact2", "exact4")


def _error(row: dict[str, object]) -> str:
    return str(row.get("wrap_error") or row.get("why_not_cut")
               or next((row[f"error_{k}"] for k in _CHECKS if row.get(f"error_{k}")), ""))


def summary(rows: list[dict[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for lib in sorted({str(r["library"]) for r in rows}):
        mine = [r for r in rows if r["library"] == lib]
        out[lib] = {"models": len(mine), "wraps": sum(bool(r.get("wraps")) for r in mine),
                    "cut": sum(bool(r.get("cut")) for r in mine), **{k: sum(_ok(r, k) for r in mine) for k in _CHECKS}}
    return out


def markdown(rows: list[dict[str, object]], machine: dict[str, object]) -> str:
    lines = [f"Machine: {machine}; batch {BATCH}, 64x64 (Inceptions 96x96, timm's fixed-size models theirs), fp32; "
             f"random layers on as users build them (torchvision's defaults; timm with {zoo.TIMM_DROP}); "
             f"exact: max difference after 2 steps vs plain PyTorch with the same microbatches (contract <= {TOL:g}): "
             f"exact 1 with random layers on (one stage of all blocks x 2, one seed), exact 2 / exact 4 with their "
             f"rates set to 0; repeat 2: two runs of 2 stages with random layers on from one seed (contract 0); "
             f"rows marked * were run again by name after the full run (`--update`).", "",
             "| library | model | M params | wraps (defaults) | plan s | cut | blocks | 2-stage balance | "
             "4-stage balance | exact 1 | repeat 2 | exact 2 | exact 4 | why not |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: object, fmt: str = "{:.2f}") -> str:
        return "" if v is None else fmt.format(v) if isinstance(v, float) else str(v)

    for r in rows:
        checks = " | ".join(f(r.get(k), "{:.1e}") for k in _CHECKS)
        lines.append(f"| {r['library']} | {r['model']}{' *' if r.get('rerun') else ''} | {f(r.get('params_m'))} | {'yes' if r.get('wraps') else 'no'} "
                     f"| {f(r.get('plan_s'), '{:.1f}')} | {'yes' if r.get('cut') else 'no'} | {f(r.get('blocks'))} "
                     f"| {f(r.get('balance2'))} | {f(r.get('balance4'))} | {checks} "
                     f"| {_error(r).replace('|', '/')[:160]} |")
    lines += ["", "| library | models | wrap with defaults | cut | exact 1 stage (random on) | repeat 2 stages "
              "(random on) | exact 2 stages | exact 4 stages |", "|---|---|---|---|---|---|---|---|"]
    for lib, s in summary(rows).items():
        lines.append(f"| {lib} | {s['models']} | {s['wraps']} | {s['cut']} | "
                     + " | ".join(str(s[k]) for k in _CHECKS) + " |")
    return "\n".join(lines) + "\n"


def _all() -> list[tuple[str, str]]:
    return [("torchvision", n) for n in zoo.TORCHVISION] + [("timm", n) for n in zoo.TIMM]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--library", choices=("torchvision", "timm", "all"), default="all")
    p.add_argument("--models", default=None, help="comma list (default: the zoo's list, without the too-big ones)")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--update", action="store_true", help="keep the rows already in --out and replace those of the "
                   "models run now (marked as run again), e.g. after a fix")
    args = p.parse_args(argv)
    libs = ("torchvision", "timm") if args.library == "all" else (args.library,)
    todo = []
    for lib in libs:
        names = args.models.split(",") if args.models else (
            [n for n in zoo.TORCHVISION if n not in zoo.TOO_BIG] if lib == "torchvision" else list(zoo.TIMM))
        todo += [(lib, n) for n in names]
    machine = describe("cpu")
    kept: list[dict[str, object]] = []
    if args.update and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            kept = json.load(f)["rows"]
    rows: list[dict[str, object]] = []
    for i, (lib, name) in enumerate(todo, 1):
        t0 = time.perf_counter()
        try:
            row = one(lib, name)
        except Exception as e:  # noqa: BLE001 - building the model itself failed
            traceback.print_exc(limit=2)
            row = {"library": lib, "model": name, "wraps": False, "wrap_error": f"{type(e).__name__}: {e}"[:400]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["rerun"] = bool(kept)
        rows.append(row)
        print(f"[{i}/{len(todo)}] {lib} {name}: wraps={row.get('wraps')} cut={row.get('cut')} "
              + " ".join(f"{k}={row.get(k)}" for k in _CHECKS) + f" ({row['seconds']} s) {_error(row)}"[:300],
              flush=True)
        done = {(r["library"], r["model"]) for r in rows}
        merged = [r for r in kept if (r["library"], r["model"]) not in done] + rows
        order = {(lib, n): k for k, (lib, n) in enumerate(_all())}
        merged.sort(key=lambda r: order.get((r["library"], r["model"]), len(order)))
        data = {"benchmark": "bench_zoo", "machine": machine, "torch": torch.__version__, "batch": BATCH,
                "rows": merged, "summary": summary(merged)}
        if args.out:
            write_json(args.out, data)
        if args.md:
            write_text(args.md, markdown(merged, machine))
    print(summary(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
