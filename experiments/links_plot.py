"""The plot of ``bench_links``: step time against link rate, one line per configuration, one panel per model.

Where the lines cross is where a pipeline overtakes data parallelism. Both
axes are logarithmic (rates span 100 Mbit/s to unlimited, steps a factor of
twenty); the unlimited link sits at the right edge. Written as a plain SVG
(no plotting library: the results page only needs the figure).

    python -m experiments.links_plot fast.json slow.json --out links.svg

Several reports make one figure: a later report's run at a rate (and delay)
replaces an earlier one's.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Sequence
from xml.sax.saxutils import escape

from pipedp import console

PROG = "python -m experiments.links_plot"
# What each line shows: a row of the benchmark, or the fastest pipeline row ("best pipeline").
SERIES = (("ddp", "DDP", "#1f77b4", ""), ("ddp-fp16", "DDP + fp16 hook", "#1f77b4", "6,4"),
          ("pipedp-dp", "pipedp DP", "#2ca02c", ""), ("pipedp-dp-fp16", "pipedp DP, fp16 reduce", "#2ca02c", "6,4"),
          ("pipeline", "best pipeline (pp 2)", "#d62728", ""), ("pp-auto", "pp=auto", "#000000", ""),
          ("pp-auto-16", "pp=auto, bf16 allowed", "#000000", "6,4"))
PANEL_W, PANEL_H, PAD_L, PAD_B, PAD_T, COLS = 360, 240, 58, 40, 26, 2


def points(report: dict[str, Any]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """model -> series -> [(rate in Mbit/s, inf where unlimited; median step ms)], by rising rate.

    Runs at another delay than the first run's are left out: one figure, one latency.
    """
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    delay = report["runs"][0].get("delay_ms", 0.0) if report["runs"] else 0.0
    for run in report["runs"]:
        if run.get("delay_ms", 0.0) != delay:
            continue
        rate = run.get("rate_mbit") or math.inf
        for r in run["results"]:
            ms = dict(r["ms"])
            pipes = [v for k, v in ms.items() if k.startswith("pipedp-pp")]
            if pipes:
                ms["pipeline"] = min(pipes)
            for key, *_ in SERIES:
                if key in ms:
                    out.setdefault(r["model"], {}).setdefault(key, []).append((rate, ms[key]))
    for lines in out.values():
        for pts in lines.values():
            pts.sort()
    return out


def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report of the runs of ``reports``: at each rate and delay, the last report's run."""
    runs: dict[tuple[float | None, float], dict[str, Any]] = {}
    for report in reports:
        for run in report["runs"]:
            runs[(run.get("rate_mbit"), run.get("delay_ms", 0.0))] = run
    return {**reports[-1], "runs": list(runs.values())}


def _scale(lo: float, hi: float, a: float, b: float, v: float) -> float:
    """``v`` on a log axis from ``lo`` (at ``a``) to ``hi`` (at ``b``)."""
    return a + (b - a) * (math.log(v) - math.log(lo)) / ((math.log(hi) - math.log(lo)) or 1.0)


def svg(report: dict[str, Any], title: str = "") -> str:
    """The figure of ``report`` (a bench_links JSON) as an SVG document."""
    data = points(report)
    models = list(data)
    rows = max(1, math.ceil(len(models) / COLS))
    width, height = COLS * (PANEL_W + PAD_L) + 20, rows * (PANEL_H + PAD_B + PAD_T) + 40 + 16 * len(SERIES)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="10" y="16" font-size="13">{escape(title)}</text>']
    finite = sorted({x for lines in data.values() for pts in lines.values() for x, _ in pts if x != math.inf})
    lo_x = finite[0] if finite else 1.0
    hi_x = (finite[-1] if finite else 10.0) * 3  # where "unlimited" is drawn
    for i, model in enumerate(models):
        x0, y0 = 10 + (i % COLS) * (PANEL_W + PAD_L) + PAD_L, 30 + (i // COLS) * (PANEL_H + PAD_B + PAD_T) + PAD_T
        ys = [y for pts in data[model].values() for _, y in pts]
        lo_y, hi_y = min(ys) / 1.1, max(ys) * 1.1

        def px(x: float) -> float:
            return _scale(lo_x, hi_x, x0, x0 + PANEL_W, hi_x if x == math.inf else x)

        def py(y: float) -> float:
            return _scale(lo_y, hi_y, y0 + PANEL_H, y0, y)

        parts.append(f'<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#999"/>')
        parts.append(f'<text x="{x0 + 4}" y="{y0 - 6}" font-size="12">{escape(model)}</text>')
        for x in [*finite, math.inf]:
            label = "unlim." if x == math.inf else (f"{x / 1000:g}G" if x >= 1000 else f"{x:g}M")
            parts.append(f'<text x="{px(x):.1f}" y="{y0 + PANEL_H + 14}" text-anchor="middle">{label}</text>')
        for y in _ticks(lo_y, hi_y):
            parts.append(f'<line x1="{x0}" x2="{x0 + PANEL_W}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#eee"/>')
            parts.append(f'<text x="{x0 - 4}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
        parts.append(f'<text x="{x0 + PANEL_W / 2}" y="{y0 + PANEL_H + 30}" text-anchor="middle">link rate '
                     f'(bit/s)</text>')
        parts.append(f'<text x="{x0 - 44}" y="{y0 + PANEL_H / 2}" transform="rotate(-90 {x0 - 44} '
                     f'{y0 + PANEL_H / 2})" text-anchor="middle">ms per step</text>')
        for key, _, color, dash in SERIES:
            pts = data[model].get(key)
            if pts:
                coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
                parts.append(f'<polyline data-series="{key}" points="{coords}" fill="none" stroke="{color}" '
                             f'stroke-width="1.6"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
    legend_y = height - 16 * len(SERIES) - 4
    for j, (_, label, color, dash) in enumerate(SERIES):
        y = legend_y + 16 * j
        parts.append(f'<line x1="20" x2="50" y1="{y}" y2="{y}" stroke="{color}" stroke-width="1.6"'
                     + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        parts.append(f'<text x="56" y="{y + 4}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _ticks(lo: float, hi: float) -> list[float]:
    """Round values (1, 2, 5 x 10^k) inside ``lo``..``hi`` for a log axis."""
    out = []
    for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        out += [m * 10**k for m in (1, 2, 5) if lo <= m * 10**k <= hi]
    return out


def plot(argv: Sequence[str] | None = None) -> str:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("reports", nargs="+", help="bench_links JSON files (a later one's run at a rate wins)")
    p.add_argument("--out", required=True, help="the SVG to write")
    args = p.parse_args(argv)
    loaded = []
    for path in args.reports:
        with open(path) as f:
            loaded.append(json.load(f))
    report = merge(loaded)
    m = report.get("machine", {})
    s = report.get("settings", {})
    title = (f"bench_links: {m.get('cpu', '?')}, {m.get('cpu_cores', '?')} cores; 2 nodes, global batch "
             f"{s.get('batch', '?')}; median step against link rate")
    text = svg(report, title)
    with open(args.out, "w") as f:
        f.write(text)
    return args.out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.links_plot: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(plot, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
