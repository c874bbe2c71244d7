"""reproduce-paper's outputs beside its results.json: the paper-style table and two plots.

The plots are for reading at a glance: every bar carries its value, the 1.0
line (as fast as plain training) is always inside the axes, legends sit
outside the data, and a one-epoch run still shows both accuracies apart.
A single speedup hides how noisy a shared machine is, so the table and the
speedup plot also carry the spread of the alternating timing windows.
Results files written before the windows were recorded still render.
"""

from __future__ import annotations

import os
import statistics
import textwrap
import warnings
from typing import Any, Sequence

from pipedp.atomic import replace_atomically

from .report import write_text

__all__ = ["PAPER_SPEEDUP", "speedup_spread", "table_markdown", "speedup_figure", "accuracy_figure", "plot_speedup",
           "plot_accuracy", "write_outputs"]

# The seed paper's speedups of layer pipeline + data parallel over traditional training (several GPUs).
PAPER_SPEEDUP = {"cifar10": 1.47, "cifar100": 1.39, "caltech101": 2.44}
DATASET_NAMES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "caltech101": "Caltech-101", "digits": "digits",
                 "synthetic": "synthetic"}
MODEL_NAMES = {"resnet18": "ResNet-18", "resnet34": "ResNet-34", "resnet50": "ResNet-50", "mobilenet_v2": "MobileNetV2"}
PLAIN, OURS = "plain PyTorch", "pipedp"


def speedup_spread(plain_s: Sequence[float], pipedp_s: Sequence[float]) -> dict[str, Any] | None:
    """Median, quartiles and range of the per-window speedups (plain / pipedp time of the same batches)."""
    ratios = [a / b for a, b in zip(plain_s, pipedp_s, strict=True) if a > 0 and b > 0]
    if not ratios:
        return None
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios), "max": max(ratios),
            "windows": len(ratios)}


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _dataset(results: dict[str, Any]) -> str:
    name = results.get("data", {}).get("name") or (results["runs"][0]["dataset"] if results["runs"] else "")
    return DATASET_NAMES.get(name, name)


def _model(name: str) -> str:
    return MODEL_NAMES.get(name, name)


def _where(results: dict[str, Any]) -> str:
    m = results["machine"]
    return m.get("gpu") or f"{m['cpu']} ({m['cpu_cores']} cores, {m['torch_threads']} threads)"


def _epochs(n: int) -> str:
    return f"{n} epoch{'s' if n != 1 else ''}"


def _windows_cell(r: dict[str, Any]) -> str:
    s = r.get("speedup_windows")
    if not s:
        return "n/a"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}, {s['windows']})"


def _notes(results: dict[str, Any]) -> list[str]:
    runs = results["runs"]
    notes = ["Speedup is plain time / pipedp time over the whole run. Windows: the same ratio for each alternating "
             "timing window (both trainings on the same batches, back to back): median (min-max, number of windows). "
             "Its spread is the machine's noise; differences inside it are not results."]
    if any(r.get("speedup_windows") is None for r in runs):
        notes.append("Windows n/a: the results were recorded before per-window times were kept.")
    if any(PAPER_SPEEDUP.get(r["dataset"]) is None for r in runs):
        paper = ", ".join(f"{DATASET_NAMES[k]} {v:.2f}x" for k, v in PAPER_SPEEDUP.items())
        notes.append(f"Paper speedup n/a: the paper reports no figure for this dataset (it has {paper}, on several "
                     "GPUs).")
    if any(r["plan_summary"].startswith("1 stage") for r in runs):
        why = ("the planner (stages=auto) timed the choices and found one stage fastest here (on a CPU stages run "
               "one after another; on one GPU the streams' overlap seldom wins back what smaller kernels lose)"
               if results["args"].get("stages", "auto") == "auto" else "one stage was asked for (--stages 1)")
        notes.append(f"1 stage(s) in Plans: {why}, so pipedp differs from plain training by its other levers (the "
                     "layout, compile, microbatching), not by pipelining. The paper's speedups come from a pipeline "
                     "over several GPUs.")
    return [f"- {n}" for n in notes]


def table_markdown(results: dict[str, Any]) -> str:
    """Model x dataset rows: both times, speedup with its window spread, the paper's, both accuracies; notes."""
    a = results["args"]
    lines = [
        f"# reproduce-paper on {_where(results)}",
        "",
        f"{_epochs(a['epochs'])}, batch {a['batch_size']}, "
        f"{a['microbatches'] if a.get('microbatches') is not None else 'pipedp-chosen'} microbatches, "
        f"device {a['device']}"
        f"{', quick' if a.get('quick') else ''}; times are training only (setup and evaluation excluded), "
        f"the two runs alternating in windows of {a.get('window', '?')} steps.",
        "",
        *(["--quick is the small job: a narrow ResNet-18 (width 16) on the offline digits, a few epochs; the "
           "paper's sizes need the full run (no --quick).", ""] if a.get("quick") else []),
        "| Model | Dataset | Plain time (s) | pipedp time (s) | Speedup | Windows: median (min-max, n) | Paper speedup "
        "| Plain acc (%) | pipedp acc (%) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        paper = PAPER_SPEEDUP.get(r["dataset"])
        lines.append(
            f"| {r['model']} | {DATASET_NAMES.get(r['dataset'], r['dataset'])} | {r['plain']['time_s']:.1f} | "
            f"{r['pipedp']['time_s']:.1f} | {r['speedup']:.2f}x | {_windows_cell(r)} | "
            f"{_fmt(paper, '.2f') + ('x' if paper else '')} | "
            f"{_fmt(r['plain']['final_acc'], '.2f')} | {_fmt(r['pipedp']['final_acc'], '.2f')} |"
        )
    lines += ["", *_notes(results), "", "Plans:", ""]
    for r in results["runs"]:
        lines += [f"- {r['model']}: {r['plan_summary']}"]
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        warnings.warn("plots skipped: matplotlib is not installed (pip install matplotlib, or pipedp[experiments])",
                      stacklevel=4)  # the caller of plot_speedup or plot_accuracy
        return None


def _subtitle(results: dict[str, Any]) -> str:
    a, d = results["args"], results.get("data", {})
    data = _dataset(results)
    if d.get("train"):
        data += f" ({d['train']} train / {d['test']} test images, {d['classes']} classes)"
    return f"{data}\n{_epochs(a['epochs'])}, batch {a['batch_size']}, {a['microbatches']} microbatches, " \
           f"on {_where(results)}"


def _suptitle(fig: Any, text: str) -> None:
    """A figure title wrapped to the figure's width (about 12 characters an inch at this size)."""
    chars = int(fig.get_figwidth() * 13)
    fig.suptitle("\n".join(textwrap.fill(line, chars) for line in text.split("\n")), fontsize=10)


def speedup_figure(results: dict[str, Any], plt: Any) -> Any:
    """Bars of our speedup per model (whiskers: the windows' range) beside the paper's, values on the bars."""
    runs = results["runs"]
    paper = [PAPER_SPEEDUP.get(r["dataset"]) for r in runs]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 * len(runs) + 3.5), 4.4), layout="constrained")
    xs = list(range(len(runs)))
    width = 0.38 if any(paper) else 0.55
    ours_x = [x - width / 2 for x in xs] if any(paper) else xs
    ours = [r["speedup"] for r in runs]
    spread = [r.get("speedup_windows") for r in runs]
    low = [v - s["min"] if s else 0.0 for v, s in zip(ours, spread)]
    high = [s["max"] - v if s else 0.0 for v, s in zip(ours, spread)]
    whiskers = [[max(e, 0.0) for e in low], [max(e, 0.0) for e in high]] if any(spread) else None
    ax.bar(ours_x, ours, width, yerr=whiskers, capsize=4, color="C0", label=f"{OURS}, this run")
    tops = [v + h for v, h in zip(ours, high)]
    px = [x + width / 2 for x in xs]
    pv = [p or 0.0 for p in paper]
    if any(paper):
        ax.bar(px, pv, width, color="C1", label="paper (several GPUs)")
    ymax = max([1.0, *tops, *pv]) * 1.2
    ax.set_ylim(0, ymax)
    ax.axhline(1.0, color="black", ls="--", lw=1.2, zorder=3, label="1.0 = as fast as plain")
    labels = [(x, t, f"{v:.2f}x", "bold") for x, v, t in zip(ours_x, ours, tops)]
    if any(paper):
        labels += [(x, p or 0.0, f"{p:.2f}x" if p else "n/a", "normal") for x, p in zip(px, paper)]
    for x, top, text, weight in labels:
        y = 1.0 if 0 < 1.0 - top < 0.07 * ymax else top  # just under the 1.0 line: written above it
        ax.annotate(text, (x, y), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=9,
                    fontweight=weight)
    ax.set_xticks(xs, [_model(r["model"]) for r in runs])
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylabel(f"speedup over {PLAIN}\n(time plain / time pipedp)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9,
              title="whiskers: fastest and\nslowest timing window" if whiskers else None, title_fontsize=8)
    _suptitle(fig, f"Training speedup of pipedp over {PLAIN}\n{_subtitle(results)}")
    return fig


def _final_labels(ax: Any, x: float, plain: float, ours: float) -> None:
    """The last epoch's two accuracies written beside the points, apart even when they are equal."""
    up, down = ("plain", plain, "C0"), (OURS, ours, "C1")
    if ours > plain:
        up, down = down, up
    for (name, v, color), dy in ((up, 7), (down, -7)):
        ax.annotate(f"{name} {v:.1f}%", (x, v), xytext=(10, dy), textcoords="offset points", va="center",
                    fontsize=8, color=color)


def _accuracy_range(accs: list[float], chance: float | None) -> tuple[float, float]:
    """Room around the data (markers at 0% or 100% stay whole); chance level inside when the data is near it."""
    lo, hi = (min(accs), max(accs)) if accs else (0.0, 100.0)
    if chance is not None and lo < chance + 20:
        lo, hi = min(lo, chance), max(hi, chance)
    pad = max(3.0, 0.12 * (hi - lo))
    edge = 0.05 * (hi - lo + 2 * pad)
    return max(lo - pad, -edge), min(hi + pad, 100.0 + edge)


def accuracy_figure(results: dict[str, Any], plt: Any) -> Any:
    """Test accuracy per epoch, one panel per model; plain (hollow circles, dashed) and pipedp (filled squares)."""
    runs = results["runs"]
    epochs = max((len(r["plain"]["epochs"]) for r in runs), default=1)
    fig, axes = plt.subplots(1, max(len(runs), 1), figsize=(max(3.6 * len(runs) + 1.8, 7.0), 4.4), sharey=True,
                             squeeze=False, layout="constrained")
    classes = results.get("data", {}).get("classes")
    ylim = _accuracy_range([e["test_acc"] for r in runs for s in ("plain", "pipedp") for e in r[s]["epochs"]],
                           100.0 / classes if classes else None)
    big = 1.0 if epochs <= 12 else 0.5  # many epochs: smaller markers, the lines carry the shape
    for ax, r in zip(axes[0], runs):
        for side, style in (("plain", dict(ls="--", marker="o", ms=9 * big, mfc="none", mew=1.5, color="C0")),
                            ("pipedp", dict(ls="-", marker="s", ms=5 * big, color="C1"))):
            ep = r[side]["epochs"]
            ax.plot([e["epoch"] for e in ep], [e["test_acc"] for e in ep], label=PLAIN if side == "plain" else OURS,
                    **style)
        last = r["plain"]["epochs"][-1]["epoch"]
        _final_labels(ax, last, r["plain"]["epochs"][-1]["test_acc"], r["pipedp"]["epochs"][-1]["test_acc"])
        if classes and ylim[0] <= 100.0 / classes <= ylim[1]:
            ax.axhline(100.0 / classes, color="grey", ls=":", lw=1, label="chance")
        ax.set_xlim(0.5, epochs + 0.5 + 0.5 * epochs)  # room on the right for the value labels
        ax.set_xticks(list(range(1, epochs + 1)) if epochs <= 12 else
                      [e for e in range(1, epochs + 1) if e == 1 or e % max(1, epochs // 8) == 0])
        ax.set_xlabel("epoch")
        ax.set_title(_model(r["model"]), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (%)")
    axes[0][0].set_ylim(*ylim)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=9)
    note = "\n--quick: a speed run, near-chance accuracy expected" if results["args"].get("quick") else ""
    _suptitle(fig, f"Test accuracy per epoch: {PLAIN} vs pipedp, same weights, same batches\n"
                   f"{_subtitle(results)}{note}")
    return fig


def _render(results: dict[str, Any], path: str, figure: Any) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig = figure(results, plt)
    try:
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


def plot_speedup(results: dict[str, Any], path: str) -> bool:
    """speedup.png (:func:`speedup_figure`); False when matplotlib is missing."""
    return _render(results, path, speedup_figure)


def plot_accuracy(results: dict[str, Any], path: str) -> bool:
    """accuracy.png (:func:`accuracy_figure`); False when matplotlib is missing."""
    return _render(results, path, accuracy_figure)


def _save(fig: Any, path: str) -> None:
    with replace_atomically(path) as f:
        fig.savefig(f, format="png", dpi=120)


def write_outputs(results: dict[str, Any], out: str) -> list[str]:
    """table.md, speedup.png and accuracy.png in ``out``; the paths written."""
    written = [os.path.join(out, "table.md")]
    write_text(written[0], table_markdown(results))
    for name, fn in (("speedup.png", plot_speedup), ("accuracy.png", plot_accuracy)):
        if fn(results, os.path.join(out, name)):
            written.append(os.path.join(out, name))
    return written
