import json

from experiments.speed_report import goal_checks, main, merge, render


def row(kind, ips, eager, best, stages=1, label=None, mem=None, gpu=None):
    r = {"config": {"kind": kind, "stages": stages}, "images_per_s": ips, "vs_eager": ips / eager,
         "vs_best_baseline": ips / best, "plan_label": label}
    if mem is not None:
        r["peak_memory_mib"] = mem
    if gpu is not None:
        r["gpu"] = gpu
    return r


def group(auto_ips, auto_mem=900.0):
    e, g = 1000.0, 1400.0
    return {"best_baseline": "graph", "skipped": {"max-autotune": "why"}, "errors": {"compile": "boom"}, "rows": {
        "eager": row("baseline", e, e, g, mem=1000.0),
        "graph": row("baseline", g, e, g, mem=1000.0, gpu={"busy_fraction": 0.5, "concurrent_share": 0.0}),
        "pipedp:graph": row("pipedp", auto_ips, e, g, stages="auto", label="2x4", mem=auto_mem,
                            gpu={"busy_fraction": 0.8, "concurrent_share": 0.4}),
        "pipedp:S=1,M=4,graph,recompute": row("pipedp", 0.96 * max(g, auto_ips), e, g, stages=1, label="1x4",
                                              mem=600.0),
    }}


BENCH = {"machine": {"gpu": "NVIDIA H100"}, "results": {
    "resnet18": {"64": {"bf16cl": group(1.12 * 1400)}, "128": {"fp32": group(1.0 * 1400)}},
    "resnet50@224/101": {"64": {"fp32": group(1.05 * 1400, auto_mem=1200.0)}},
}}
CEILING = {"machine": {"gpu": "NVIDIA H100"}, "results": {"resnet18": {"64": {"bf16cl": {"ceiling": 1.5}}}}}


def test_goals_are_checked_against_the_numbers():
    groups, machines = merge([BENCH])
    assert machines == ["NVIDIA H100"] and set(groups) == {"resnet18@32/10", "resnet50@224/101"}
    checks = {g: ok for g, _, ok in goal_checks(groups)}
    assert checks["resnet18 b64 bf16cl: stages=auto >= 0.98x best baseline"] is True
    assert checks["resnet18 b64 bf16cl: stages=auto >= 1.10x best baseline"] is True
    assert checks["resnet18 b128 fp32: stages=auto >= 1.03x best baseline"] is False  # 1.00x
    assert "resnet50@224/101 b64 fp32: stages=auto >= 1.10x best baseline" not in checks  # only ResNet-18/34 CIFAR
    # 600 MiB of a 1.0x-speed row against eager's 1000: 0.6x, met.
    assert checks["resnet18 b64 bf16cl: a pipedp row at >= 0.95x best throughput with peak memory <= 0.7x eager"]


def test_render_gives_tables_ceiling_share_and_paper_rows(tmp_path):
    text = render([BENCH], [CEILING])
    assert "| resnet18 | 64 | bf16cl | 1000 | 1400 | failed | skipped | - | - | graph |" in text  # graph+compile, graph+max-autotune not run
    # 1.12x the graphed step with a ceiling of 1.5x: 0.12 / 0.5 = 24% of the spare capacity.
    line = next(ln for ln in text.splitlines() if ln.startswith("| resnet18 | 64 | bf16cl | pipedp:graph |"))
    assert "| 2x4 | 1.12x | 1.57x | 900 vs 1000 | 80% | 40% | 1.50x | 24% |" in line
    assert "| resnet50 | caltech101 (224/101) | 64 | fp32 | 1.47x | 1.05x | 2.44x |" in text
    assert "### Goals:" in text and "| no |" in text
    b, c, out = tmp_path / "b.json", tmp_path / "c.json", tmp_path / "speed.md"
    b.write_text(json.dumps(BENCH))
    c.write_text(json.dumps(CEILING))
    assert main([str(b), "--ceiling", str(c), "--out", str(out)]) == 0 and out.read_text() == text
    assert main([str(tmp_path / "missing.json")]) == 1
