"""gpu_run.sh's parts, checked with a stand-in python that records each call (no GPU needed)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_run.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")


def run(tmp_path, *args, python=None):
    env = dict(os.environ)
    if python is not None:
        env["PYTHON"] = str(python)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *args], cwd=SCRIPT.parents[1], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def recorder(tmp_path):
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\n[ "$1" = "-" ] && cat >/dev/null\necho "$*" >> {calls}\n')
    stub.chmod(0o755)
    return stub, calls


def parts(tmp_path):
    lines = run(tmp_path, "list").stdout.splitlines()
    return [ln.split()[0] for ln in lines if not ln.startswith("report")]


def test_every_part_is_one_call_under_ten_minutes(tmp_path, recorder):
    stub, calls = recorder
    names = parts(tmp_path)
    assert {"tests", "r18-fp32", "mbv2-bf16cl", "imagenet", "ceiling-cifar", "compile-r18", "paper-caltech",
            "digits"} <= set(names)
    for name in names:
        calls.write_text("")
        r = run(tmp_path, name, python=stub)
        assert r.returncode == 0, (name, r.stderr)
        work = [c for c in calls.read_text().splitlines() if c != "-"]
        assert len(work) == 1, (name, work)  # one timed step per part: its limit bounds the call
        for c in work:
            # The layouts parts measure the GPU host's 16 CPU cores (processes as the devices), named as such;
            # cpu-stages runs the CPU-only thread-team benchmark there.
            assert "--device cuda" in c or c.startswith("-m pytest") or (
                name.startswith("layouts-") and "--device cpu" in c) or (
                name == "cpu-stages" and c.startswith("-m experiments.bench_cpu_stages")), c
            if "experiments.bench_pipeline" in c or "experiments.ceiling" in c:
                assert f"{tmp_path}/out/" in c and ".json" in c
    # Every step's time limit leaves room for start-up inside one 600 s call.
    limits = [int(v) for v in re.findall(r'(?:timeout |limit=(?:\$\{6:-)?|_rows" )(\d+)', SCRIPT.read_text())]
    assert len(limits) >= 6 and max(limits) <= 540
    assert "ceiling-imagenet" in names


def test_bench_part_arguments_and_quick(tmp_path, recorder):
    stub, calls = recorder
    assert run(tmp_path, "r34-bf16cl", python=stub).returncode == 0
    (call,) = [c for c in calls.read_text().splitlines() if "bench_pipeline" in c]
    assert "--models resnet34 --batch 32,64,128,256 --numerics bf16cl" in call and "pipedp:graph" in call
    calls.write_text("")
    assert run(tmp_path, "paper-cifar", "--quick", python=stub).returncode == 0
    (call,) = [c for c in calls.read_text().splitlines() if "bench_pipeline" in c]
    assert "--models resnet18@32/10 --batch 128 --numerics fp32" in call


def test_best_parts_run_the_strongest_alternative_benchmark(tmp_path, recorder):
    stub, calls = recorder
    assert run(tmp_path, "best-b128", python=stub).returncode == 0
    (call,) = [c for c in calls.read_text().splitlines() if "bench_best" in c]
    assert "--device cuda --models resnet18 --batch 128 --precision fp32,bf16" in call
    assert f"{tmp_path}/out/best-b128_gpu.json" in call and "--md" in call


def test_unknown_part_and_report_without_results(tmp_path, recorder):
    stub, _ = recorder
    r = run(tmp_path, "everything", python=stub)
    assert r.returncode == 2 and "unknown part 'everything'" in r.stderr
    r = run(tmp_path, "report", python=sys.executable)
    assert r.returncode == 1 and "no bench_*.json" in r.stderr


def test_report_turns_the_json_into_speed_md(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    row = {"config": {"kind": "baseline", "stages": 1}, "images_per_s": 100.0, "vs_eager": 1.0,
           "vs_best_baseline": 1.0, "plan_label": None}
    group = {"rows": {"eager": row}, "best_baseline": "eager", "skipped": {}, "errors": {}}
    (out / "bench_a.json").write_text(json.dumps({"machine": {"gpu": "H100"}, "results": {"resnet18": {"64": {
        "fp32": group}}}}))
    (out / "ceiling_a.json").write_text(json.dumps({"machine": {"gpu": "H100"}, "results": {}}))
    r = run(tmp_path, "report", python=sys.executable)
    assert r.returncode == 0, r.stderr
    assert "| resnet18 | 64 | fp32 | 100 |" in (out / "speed.md").read_text()
