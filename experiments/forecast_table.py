"""The layout forecast for machines not at hand, from profiles taken on this device: one call, every model.

For each model (CIFAR shapes) and each replica batch, the blocks are
profiled here (``pipedp.forecast.profile_model``) and saved, and every
layout of 2, 4 and 8 devices of this kind over each named link is predicted
for one global batch. The JSON holds the profiles and every prediction;
the printed table gives each world's best layout against pure data
parallelism, where the reference's 1.4-2.4x over data parallelism can and
cannot hold.

    python -m experiments.forecast_table --device cuda --models resnet18,resnet34,resnet50 --out forecast.json
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import asdict
from typing import Any, Sequence

import torch

from pipedp import console
from pipedp.decide.layout import ASSUMPTIONS
from pipedp.forecast import forecast, profile_model
from pipedp.models import get_model

from .machine import describe
from .report import write_json

PROG = "python -m experiments.forecast_table"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def table(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="resnet18,resnet34,resnet50")
    p.add_argument("--batch", type=int, default=128, help="global batch per step")
    p.add_argument("--devices", default="2,4,8", help="device counts (comma list)")
    p.add_argument("--links", default="pcie4,nvlink4", help="named links (comma list)")
    p.add_argument("--out", default=None, help="write profiles and forecasts here (JSON)")
    args = p.parse_args(argv)
    counts = _ints(args.devices)
    out: dict[str, Any] = {"benchmark": "forecast_table", "date": datetime.date.today().isoformat(),
                           "machine": describe(args.device), "settings": vars(args), "assumptions": list(ASSUMPTIONS),
                           "models": []}
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = get_model(name, num_classes=10).to(args.device)
        # One replica's batch at the largest and the smallest world: the sizes the layouts' microbatches span.
        prof = profile_model(model, torch.randn(args.batch // min(counts), 3, 32, 32, device=args.device))
        entry: dict[str, Any] = {"model": name, "profile": {**asdict(prof)}, "forecasts": []}
        for link in args.links.split(","):
            for r in counts:
                f = forecast(prof, r, args.batch, link)
                dp = next(pr for pr in f.predictions if pr.layout.pp == 1)
                entry["forecasts"].append({"ranks": r, "link": asdict(f.link), "best": f.best.layout.label,
                                           "best_ms": f.best.step_ms, "dp_ms": dp.step_ms,
                                           "best_vs_dp": dp.step_ms / f.best.step_ms,
                                           "predictions": [{"layout": pr.layout.label, "step_ms": pr.step_ms,
                                                            "exposed_ms": pr.exposed_ms, "bubble": pr.bubble}
                                                           for pr in f.predictions]})
                print(f"{name:<9} {r} x {link:<8} best {f.best.layout.label:<24} {f.best.step_ms:9.2f} ms, "
                      f"{dp.step_ms / f.best.step_ms:.2f}x data parallel ({dp.step_ms:.2f} ms)", flush=True)
        out["models"].append(entry)
        if args.out:
            write_json(args.out, out, indent=1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.forecast_table: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(table, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
