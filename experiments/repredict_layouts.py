"""The committed layout runs re-predicted by the current layout model, from their own profiles and links.

A layouts benchmark JSON (:mod:`experiments.bench_layouts`) holds each run's
block profile, measured links and measured steps, so a change to the layout
model (:mod:`pipedp.decide.layout`) is judged on every world measured so far
without timing anything again: each layout's measured step is printed beside
the prediction recorded with the run and the current one, with the share of
layouts within 15% of measured.

    python -m experiments.repredict_layouts experiments/results/layouts_*.json --out repredicted.json
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Sequence

from pipedp import console
from pipedp.decide.layout import BlockCosts, Layout, predict
from pipedp.decide.links import Link
from pipedp.partition.profile import BlockProfile

from .report import write_json

PROG = "python -m experiments.repredict_layouts"
GOAL = 0.15  # the forecast's goal: within 15% of the measured step


def costs_of(run: dict[str, Any]) -> BlockCosts:
    """The block costs a run recorded (one or two profiled sizes)."""
    p = run["profile"]
    return BlockCosts(tuple(BlockProfile(**b) for b in p["blocks"]), p["batch"],
                      tuple(BlockProfile(**b) for b in p.get("small", ())), p.get("small_batch", 0))


def repredict(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every layout of one recorded run: measured, recorded and current prediction (ms), and both errors."""
    costs, link, p2p = costs_of(run), Link(**run["allreduce_link"]), Link(**run["p2p_link"])
    rows = []
    for row in run["rows"]:
        lay = Layout(row["dp"], tuple(row["counts"]), row["microbatches"], row.get("schedule", "1f1b"))
        ms = predict(costs, lay, run["global_batch"], link, p2p=p2p, update_ms=run["profile"]["update_ms"],
                     bucket_bytes=run["bucket_mb"] * 2**20).step_ms
        rows.append({"layout": row["layout"], "measured_ms": row["measured_ms"], "recorded_ms": row["predicted_ms"],
                     "predicted_ms": ms, "recorded_error": row["predicted_ms"] / row["measured_ms"] - 1,
                     "error": ms / row["measured_ms"] - 1})
    return rows


def summary(rows: Sequence[dict[str, Any]], key: str = "error") -> dict[str, float]:
    """How many of ``rows`` are within the goal, and the mean absolute error, by ``key``."""
    errors = [abs(r[key]) for r in rows]
    return {"layouts": len(rows), "within_goal": sum(e <= GOAL for e in errors),
            "mean_abs_error": statistics.fmean(errors) if errors else 0.0}


def report(paths: Sequence[str]) -> dict[str, Any]:
    """Every run of every file at ``paths``, re-predicted, with the totals recorded and current."""
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                results = json.load(f)["results"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a layouts benchmark JSON ({e}); write one with "
                             f"`python -m experiments.bench_layouts --out FILE`") from e
        for run in results:
            runs.append({"file": os.path.basename(path), "model": run["model"], "global_batch": run["global_batch"],
                         "world": run["world"], "rows": repredict(run)})
    every = [r for run in runs for r in run["rows"]]
    return {"benchmark": "repredict_layouts", "goal": GOAL, "runs": runs,
            "recorded": summary(every, "recorded_error"), "current": summary(every)}


def _table(rep: dict[str, Any]) -> str:
    lines = [f"{'file / model / layout':<58} {'measured':>9} {'recorded':>9} {'now':>9} {'err was':>8} {'err now':>8}"]
    for run in rep["runs"]:
        lines.append(f"{run['file']}: {run['model']}, global batch {run['global_batch']}, {run['world']} ranks")
        for r in run["rows"]:
            lines.append(f"  {r['layout']:<56} {r['measured_ms']:9.1f} {r['recorded_ms']:9.1f} "
                         f"{r['predicted_ms']:9.1f} {r['recorded_error']:+8.1%} {r['error']:+8.1%}")
    for name in ("recorded", "current"):
        s = rep[name]
        lines.append(f"{name}: {s['within_goal']} of {s['layouts']} layouts within {GOAL:.0%}, mean absolute error "
                     f"{s['mean_abs_error']:.1%}")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Re-predict the files of ``argv``; the report (also written to --out when given)."""
    p = console.make_parser(PROG, __doc__)
    p.add_argument("files", nargs="+", help="layouts benchmark JSON files")
    p.add_argument("--out", default=None, help="write the re-predicted rows here (JSON)")
    args = p.parse_args(argv)
    rep = report(args.files)
    print(_table(rep))
    if args.out:
        write_json(args.out, rep)
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.repredict_layouts: exit status 0 on success; a failure is one line on stderr."""
    return console.run_job(run, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
