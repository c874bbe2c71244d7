"""reproduce-paper's outputs beside its results.json: the paper-style table and two plots."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .report import write_text
from pipedp.atomic import replace_atomically

__all__ = ["PAPER_SPEEDUP", "table_markdown", "plot_speedup", "plot_accuracy", "write_outputs"]

# The seed paper's speedups of layer pipeline + data parallel over traditional training (several GPUs).
PAPER_SPEEDUP = {"cifar10": 1.47, "cifar100": 1.39, "caltech101": 2.44}
DATASET_NAMES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "caltech101": "Caltech-101", "digits": "digits",
                 "synthetic": "synthetic"}


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def table_markdown(results: dict[str, Any]) -> str:
    """Model x dataset rows: plain and pipedp time, speedup (ours, paper's), plain and pipedp accuracy."""
    m = results["machine"]
    where = m.get("gpu") or f"{m['cpu']} ({m['cpu_cores']} cores, {m['torch_threads']} threads)"
    a = results["args"]
    lines = [
        f"# reproduce-paper on {where}",
        "",
        f"{a['epochs']} epoch(s), batch {a['batch_size']}, {a['microbatches']} microbatches, device {a['device']}"
        f"{', quick' if a.get('quick') else ''}; times are training only (setup and evaluation excluded), "
        "the two runs alternating in windows of steps.",
        "",
        *(["--quick measures speed: a few steps leave both models near chance accuracy; accuracy needs the full "
           "epochs (e.g. `--dataset digits --epochs 10`).", ""] if a.get("quick") else []),
        "| Model | Dataset | Plain time (s) | pipedp time (s) | Speedup | Paper speedup | Plain acc (%) | pipedp acc (%) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        paper = PAPER_SPEEDUP.get(r["dataset"])
        lines.append(
            f"| {r['model']} | {DATASET_NAMES.get(r['dataset'], r['dataset'])} | {r['plain']['time_s']:.1f} | "
            f"{r['pipedp']['time_s']:.1f} | {r['speedup']:.2f}x | {_fmt(paper, '.2f') + ('x' if paper else '')} | "
            f"{_fmt(r['plain']['final_acc'], '.2f')} | {_fmt(r['pipedp']['final_acc'], '.2f')} |"
        )
    lines += ["", "Plans:", ""]
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
                      stacklevel=3)
        return None


def plot_speedup(results: dict[str, Any], path: str) -> bool:
    """Bars of our speedup per model beside the paper's for the dataset; False when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    runs = results["runs"]
    labels = [f"{r['model']}\n{DATASET_NAMES.get(r['dataset'], r['dataset'])}" for r in runs]
    ours = [r["speedup"] for r in runs]
    paper = [PAPER_SPEEDUP.get(r["dataset"], 0.0) for r in runs]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(runs) + 1), 3.6))
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="pipedp (this run)")
    if any(paper):
        ax.bar([x + 0.2 for x in xs], paper, 0.4, label="paper")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("speedup over plain training")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def plot_accuracy(results: dict[str, Any], path: str) -> bool:
    """Test accuracy per epoch, plain (dashed) and pipedp (solid), per model."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for k, r in enumerate(results["runs"]):
        color = f"C{k}"
        for side, style in (("plain", "--"), ("pipedp", "-")):
            ep = r[side]["epochs"]
            ax.plot([e["epoch"] for e in ep], [e["test_acc"] for e in ep], style, color=color, marker="o", ms=3,
                    label=f"{r['model']} {side}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


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
