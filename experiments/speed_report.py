"""The README's one-GPU speed tables from benchmark JSON: baselines, pipedp rows, ceiling share, goals.

Input: results of ``experiments.bench_pipeline`` (one or several files, e.g.
one per part of ``gpu_run.sh``) and optionally of ``experiments.ceiling``.
Output (markdown): per model, batch and numerics the baselines' images/s, the
pipedp rows as ratios to the best baseline of the same group (with the plan
``stages="auto"`` chose, peak memory against eager, the GPU busy fraction and
the busy share with 2+ streams from the profiler), the ceiling of K graphed
copies and the share of its spare capacity that pipedp's ``stages="auto"``
captured, the paper's speed table, and each goal of issue 17 checked against
the numbers (a goal without its numbers says so; nothing is filled in).

    python -m experiments.speed_report OUT/bench_*.json --ceiling OUT/ceiling*.json --out OUT/speed.md
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Iterable, Sequence

from pipedp import console

from .baselines import BASELINES
from .ceiling import captured_fraction
from .paper_report import PAPER_SPEEDUP
from .report import write_text

__all__ = ["merge", "auto_rows", "goal_checks", "render", "main"]

PROG = "python -m experiments.speed_report"
PAPER_SHAPES = {"cifar10": "@32/10", "cifar100": "@32/100", "caltech101": "@224/101"}
Groups = dict[str, dict[str, dict[str, dict[str, Any]]]]  # model -> batch -> numerics -> group


def _canonical(model: str) -> str:
    return model if "@" in model else f"{model}@32/10"


def merge(results: Iterable[dict[str, Any]], key: str = "results") -> tuple[Groups, list[str]]:
    """The groups of several results files in one tree (a later file's group replaces an earlier one's) and
    the machines they name."""
    out: Groups = {}
    machines: list[str] = []
    for r in results:
        m = r.get("machine", {})
        name = m.get("gpu") or m.get("cpu") or "?"
        if name not in machines:
            machines.append(name)
        for model, batches in r.get(key, {}).items():
            for batch, nums in batches.items():
                out.setdefault(_canonical(model), {}).setdefault(batch, {}).update(nums)
    return out, machines


def auto_rows(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pipedp rows whose plan ``stages="auto"`` chose (with or without microbatches="auto")."""
    return {n: r for n, r in group.get("rows", {}).items()
            if r["config"]["kind"] == "pipedp" and r["config"]["stages"] == "auto"}


def _best_auto(group: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    rows = auto_rows(group)
    return max(rows.items(), key=lambda kv: kv[1]["images_per_s"]) if rows else None


def _ceiling_share(group: dict[str, Any], ceiling: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """(ceiling, fraction captured) for a group: pipedp's best auto row against the graphed baseline,
    the reference the ceiling's copies are measured against."""
    if not ceiling or "ceiling" not in ceiling:
        return None, None
    best = _best_auto(group)
    ref = group.get("rows", {}).get("graph")
    if best is None or ref is None:
        return ceiling["ceiling"], None
    return ceiling["ceiling"], captured_fraction(best[1]["images_per_s"] / ref["images_per_s"], ceiling["ceiling"])


def _f(v: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if v is None else format(v, spec) + suffix


def _short(model: str) -> str:
    return model.replace("@32/10", "")


def baseline_table(groups: Groups) -> list[str]:
    lines = ["| model | batch | numerics | " + " | ".join(f"{b} img/s" for b in BASELINES) + " | best |",
             "|---|---|---|" + "---|" * (len(BASELINES) + 1)]
    for model, batches in groups.items():
        for batch, nums in sorted(batches.items(), key=lambda kv: int(kv[0])):
            for num, g in nums.items():
                rows = g.get("rows", {})
                cells = [(_f(rows[b]["images_per_s"], ".0f") if b in rows else
                          ("skipped" if b in g.get("skipped", {}) else "failed" if b in g.get("errors", {}) else "-"))
                         for b in BASELINES]
                lines.append(f"| {_short(model)} | {batch} | {num} | " + " | ".join(cells) +
                             f" | {g.get('best_baseline') or 'n/a'} |")
    return lines


def pipedp_table(groups: Groups, ceilings: Groups) -> list[str]:
    lines = ["| model | batch | numerics | pipedp config | plan | x best baseline | x eager | peak MiB vs eager | "
             "GPU busy | busy with 2+ streams | ceiling (K copies) | share of spare captured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, batches in groups.items():
        for batch, nums in sorted(batches.items(), key=lambda kv: int(kv[0])):
            for num, g in nums.items():
                rows = g.get("rows", {})
                eager_mem = rows.get("eager", {}).get("peak_memory_mib")
                ceil, share = _ceiling_share(g, ceilings.get(model, {}).get(batch, {}).get(num))
                for name, r in rows.items():
                    if r["config"]["kind"] != "pipedp":
                        continue
                    mem = r.get("peak_memory_mib")
                    memcell = f"{mem:.0f} vs {eager_mem:.0f}" if mem is not None and eager_mem else "n/a"
                    gpu = r.get("gpu", {})
                    auto = r["config"]["stages"] == "auto"
                    lines.append(
                        f"| {_short(model)} | {batch} | {num} | {name} | {r.get('plan_label') or ''} | "
                        f"{_f(r['vs_best_baseline'], '.2f', 'x')} | {_f(r['vs_eager'], '.2f', 'x')} | {memcell} | "
                        f"{_f(gpu.get('busy_fraction'), '.0%')} | {_f(gpu.get('concurrent_share'), '.0%')} | "
                        f"{_f(ceil, '.2f', 'x') if auto else ''} | {_f(share, '.0%') if auto else ''} |")
                for b in BASELINES:
                    gpu = rows.get(b, {}).get("gpu")
                    if gpu:
                        lines.append(f"| {_short(model)} | {batch} | {num} | ({b}) | | | "
                                     f"{_f(rows[b]['vs_eager'], '.2f', 'x')} | | {_f(gpu['busy_fraction'], '.0%')} "
                                     f"| {_f(gpu['concurrent_share'], '.0%')} | | |")
    return lines


def goal_checks(groups: Groups) -> list[tuple[str, str, bool | None]]:
    """Issue 17's goals, each (goal, the numbers behind it, met: True/False, None without numbers)."""
    checks: list[tuple[str, str, bool | None]] = []
    for model, batches in groups.items():
        base = model.split("@")[0]
        cifar = model.endswith("@32/10")
        for batch, nums in sorted(batches.items(), key=lambda kv: int(kv[0])):
            b = int(batch)
            for num, g in nums.items():
                where = f"{_short(model)} b{batch} {num}"
                best = _best_auto(g)
                if best is None or g.get("best_baseline") is None:
                    checks.append((f"{where}: stages=auto >= 0.98x best baseline", "no stages=auto row or baseline",
                                   None))
                    continue
                name, row = best
                ratio = row["vs_best_baseline"]
                vs = f"{name} {ratio:.3f}x {g['best_baseline']}"
                checks.append((f"{where}: stages=auto >= 0.98x best baseline", vs, ratio >= 0.98))
                if cifar and base in ("resnet18", "resnet34") and b <= 64:
                    checks.append((f"{where}: stages=auto >= 1.10x best baseline", vs, ratio >= 1.10))
                if cifar and base in ("resnet18", "resnet34") and b == 128:
                    checks.append((f"{where}: stages=auto >= 1.03x best baseline", vs, ratio >= 1.03))
                checks.append(_memory_goal(where, g))
    return checks


def _memory_goal(where: str, g: dict[str, Any]) -> tuple[str, str, bool | None]:
    """At >= 0.95x of the best throughput of the group, the least pipedp peak memory <= 0.7x eager's."""
    goal = f"{where}: a pipedp row at >= 0.95x best throughput with peak memory <= 0.7x eager"
    rows = g.get("rows", {})
    eager = rows.get("eager", {}).get("peak_memory_mib")
    if not rows or not eager:
        return goal, "no eager peak memory", None
    top = max(r["images_per_s"] for r in rows.values())
    fast = [(n, r["peak_memory_mib"]) for n, r in rows.items()
            if r["config"]["kind"] == "pipedp" and r["images_per_s"] >= 0.95 * top and r.get("peak_memory_mib")]
    if not fast:
        return goal, "no pipedp row within 0.95x of the best throughput", False
    name, mem = min(fast, key=lambda t: t[1])
    return goal, f"{name}: {mem:.0f} vs {eager:.0f} MiB ({mem / eager:.2f}x)", mem <= 0.7 * eager


def paper_table(groups: Groups) -> list[str]:
    """Speed of pipedp (best stages=auto row) over plain eager training, CIFAR-10/100 and Caltech-101 shapes."""
    lines = ["| model | dataset shape | batch | numerics | pipedp x eager (paper: traditional training) | "
             "x best baseline | paper (several GPUs) |", "|---|---|---|---|---|---|---|"]
    for model in ("resnet18", "resnet34", "resnet50"):
        for ds, shape in PAPER_SHAPES.items():
            for batch, nums in sorted(groups.get(model + shape, {}).items(), key=lambda kv: int(kv[0])):
                for num, g in nums.items():
                    best = _best_auto(g)
                    if best is None:
                        continue
                    r = best[1]
                    lines.append(f"| {model} | {ds} ({shape[1:]}) | {batch} | {num} | {_f(r['vs_eager'], '.2f', 'x')} "
                                 f"| {_f(r['vs_best_baseline'], '.2f', 'x')} | {PAPER_SPEEDUP[ds]:.2f}x |")
    return lines


def render(bench: Sequence[dict[str, Any]], ceiling: Sequence[dict[str, Any]] = ()) -> str:
    groups, machines = merge(bench)
    ceilings, cmachines = merge(ceiling)
    checks = goal_checks(groups)
    met = sum(1 for _, _, ok in checks if ok)
    missed = [c for c in checks if c[2] is False]
    out = [f"Machine(s): {', '.join(dict.fromkeys(machines + cmachines))}. Ratios are medians of alternating "
           f"windows of one process, against the best baseline of the same model, batch and numerics "
           f"(fp32: NCHW, no autocast; bf16cl: bf16 autocast + channels_last).", "",
           "### Baselines (images/s)", "", *baseline_table(groups), "",
           "### pipedp", "", *pipedp_table(groups, ceilings), "",
           "Ceiling: K independent graphed copies of the step on K streams over one copy (the most any overlap "
           "can gain at that batch). Share captured: (pipedp stages=auto / graphed eager - 1) / (ceiling - 1); "
           "n/a when the ceiling is within 2% of 1.0.", ""]
    paper = paper_table(groups)
    if len(paper) > 2:
        out += ["### Paper speed table (synthetic data, dataset shapes)", "", *paper, ""]
    out += [f"### Goals: {met} of {len(checks)} met, {len(missed)} missed, "
            f"{sum(1 for c in checks if c[2] is None)} without numbers", "", "| goal | numbers | met |",
            "|---|---|---|"]
    out += [f"| {g} | {n} | {'yes' if ok else 'no' if ok is False else 'n/a'} |" for g, n, ok in checks]
    return "\n".join(out) + "\n"


def _load(paths: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        try:
            with open(p) as f:
                out.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read results file {p}: {e}") from None
    return out


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("bench", nargs="+", help="experiments.bench_pipeline results JSON file(s)")
    p.add_argument("--ceiling", nargs="*", default=[], help="experiments.ceiling results JSON file(s)")
    p.add_argument("--out", default=None, help="write the markdown here (else print it)")
    return p


def report(argv: Sequence[str] | None = None) -> str:
    args = _parser().parse_args(argv)
    text = render(_load(args.bench), _load(args.ceiling))
    if args.out:
        write_text(args.out, text)
    else:
        print(text, end="")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    return console.run_job(report, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
