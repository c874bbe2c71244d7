"""bench_depthwise_gpu on the CPU with a small CPU-built library: rows, ratios, auto, the db, a wrong kernel.

The benchmark is for a GPU; everything around the timing (the plan, the library and its checks, the ratios,
the report, the database for kernels="auto") runs the same on a CPU, which is what these tests exercise.
"""

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("tvm")

from experiments import bench_depthwise_gpu as bench  # noqa: E402
from pipedp.kernels.tvm import remote  # noqa: E402
from pipedp.kernels.tvm.builder import schedule  # noqa: E402
from pipedp.kernels.tvm.remote import compile_candidates  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402
from pipedp.kernels.tvm.target import make_target, target_key  # noqa: E402
from pipedp.kernels.tvm.template import get_template  # noqa: E402
from pipedp.ops import load_library  # noqa: E402

ARGS = ["--device", "cpu", "--models", "mobilenet_v2", "--sizes", "32", "--batches", "2", "--dtypes", "float32",
        "--ops", "fwd,wgrad", "--limit", "2", "--rounds", "1", "--min-ms", "1", "--hbm-copy-mib", "8"]


def _valid(template, conv, op, seed=0):
    space, rng = template.space(conv, op), random.Random(seed)
    while True:
        cfg = space.sample(rng)
        try:
            template.validate(conv, op, cfg)
            return cfg
        except InvalidConfig:
            continue


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A CPU library (round format) with the first MobileNetV2 layer's fwd and wgrad kernels in both layouts."""
    folder = str(tmp_path_factory.mktemp("kernels"))
    (_, conv), *_ = bench.layers(["mobilenet_v2"], [32], ["float32"], batch=2)
    target = make_target("cpu")
    funcs, entries = {}, []
    for op in ("fwd", "wgrad"):
        for layout in ("NCHW", "NHWC"):
            cfg = _valid(get_template(target, layout), conv, op)
            sym = f"k{len(funcs)}"
            funcs[sym] = schedule(conv, op, cfg, target, symbol=sym).mod[sym]
            entries.append({"id": len(entries), "symbol": sym, "op": op, "problem": conv.key(), "layout": layout,
                            "config": cfg})
    lib, bad = compile_candidates(funcs, {}, target)
    assert not bad
    remote.write_round(folder, lib, 0, target_key(target), target, entries)
    return folder, conv


def test_dry_run_lists_every_row_and_times_nothing(capsys):
    out = bench.main(["--dry-run", "--models", "mobilenet_v2", "--sizes", "32", "--batches", "64,128"])
    assert out["plan"] == 10 * 2 * 2 * 3  # 10 distinct convs x batches x dtypes x ops
    assert "C=960 4x4 k3 s1" in capsys.readouterr().out


def test_rows_compare_our_best_layout_with_torchs_best_and_write_a_db(library, tmp_path):
    folder, conv = library
    report = bench.main(ARGS + ["--kernels", folder, "--out", str(tmp_path / "out"), "--db", str(tmp_path / "db")])
    rows = report["rows"]
    assert [(r["op"], r["n"]) for r in rows] == [("fwd", 2), ("wgrad", 2)]
    for r in rows:
        us = r["us"]
        assert set(us) == {"ours NCHW", "ours NHWC", "torch NCHW", "torch NHWC"} and not r["wrong"]
        assert r["ours_us"] == min(us["ours NCHW"], us["ours NHWC"]) == us[f"ours {r['ours_layout']}"]
        assert r["torch_best_us"] == min(us["torch NCHW"], us["torch NHWC"])
        assert r["speedup"] == pytest.approx(r["torch_best_us"] / r["ours_us"])
        assert r["bound_fraction"] == pytest.approx(r["bound_us"] / r["ours_us"])
        assert set(r["auto"]) == {"NCHW", "NHWC"} and r["auto_min"] == min(r["auto"].values()) > 0
        assert r["fits_l2"] is None and r["bytes"] == conv.min_bytes(r["op"])
    s = report["summary"]
    assert s["rows_with_kernels"] == 2 and s["geomean_speedup_fwd"] == pytest.approx(rows[0]["speedup"])
    saved = json.loads((tmp_path / "out" / "depthwise_gpu.json").read_text())
    assert saved["rows"][1]["us"] == pytest.approx(rows[1]["us"])
    md = (tmp_path / "out" / "depthwise_gpu.md").read_text()
    assert "| mobilenet_v2@32 | C=32 32x32 k3 s1 | wgrad | float32 | 2 |" in md
    lib = load_library(str(tmp_path / "db"), torch.device("cpu"))  # what kernels= loads
    assert len(lib.kernels) == 4 and lib.find("wgrad", conv, "NHWC") is not None
    lk = next(k for k in lib.timings if '"fwd"' in k and "NCHW" in k)
    taken = rows[0]["auto_choice"]["NCHW"] == "ours"
    assert lib.timings[lk] == {"us": rows[0]["us"]["ours NCHW"], "torch_us": rows[0]["us"]["torch NCHW"], "n": 2,
                               "faster": taken}
    assert lib.beats_torch(lk) == taken  # kernels="auto" takes what the benchmark's auto took


def _alternate(*answers):
    """A stand-in for harness.alternate that answers the contenders' timings in turn (the bound's copy: 1 µs)."""
    calls = iter(answers)

    def alternate(fns, device, rounds, min_ms):
        if set(fns) == {"copy"}:
            return {"copy": 1.0}
        us = next(calls)
        assert set(us) == set(fns)
        return us

    return alternate


def test_auto_takes_ours_only_by_a_margin_confirmed_in_fresh_rounds_and_reports_a_third_timing(library,
                                                                                                 monkeypatch):
    folder, conv = library
    lib = bench.Library(folder, torch.device("cpu"))
    first = {"torch NCHW": 100.0, "torch NHWC": 100.0, "ours NCHW": 97.0, "ours NHWC": 90.0}
    # NCHW 3% faster: within the margin, torch; NHWC 10% faster but not confirmed: torch
    monkeypatch.setattr(bench.harness, "alternate", _alternate(first, {"ours": 101.0, "torch": 100.0}))
    row = bench.bench_row(lib, "s", conv, "fwd", torch.device("cpu"), 1, 1.0, None)
    assert row["auto_choice"] == {"NCHW": "torch", "NHWC": "torch"} and row["auto"] == {"NCHW": 1.0, "NHWC": 1.0}
    assert row["auto_confirmed"] == {"NHWC": pytest.approx(100 / 101)} and row["hbm_bound_us"] is None
    # NHWC confirmed: taken, and the ratio reported is the third timing's, not the confirmation's
    monkeypatch.setattr(bench.harness, "alternate", _alternate(first, {"ours": 90.0, "torch": 100.0},
                                                               {"ours": 95.0, "torch": 93.0}))
    row = bench.bench_row(lib, "s", conv, "fwd", torch.device("cpu"), 1, 1.0, None)
    assert row["auto_choice"] == {"NCHW": "torch", "NHWC": "ours"}
    assert row["auto"]["NHWC"] == pytest.approx(93 / 95) and row["auto_min"] == pytest.approx(93 / 95)


def test_the_db_leaves_out_wrong_and_failed_kernels_and_marks_faster_only_what_auto_took_at_every_batch(
        library, tmp_path):
    import dataclasses

    folder, conv = library
    lib = bench.Library(folder, torch.device("cpu"), load=False)  # (the benchmark's own process never loads it)

    def row(op, n, choice, wrong=()):
        us = {"torch NCHW": 10.0, "torch NHWC": 10.0}
        us.update({f"ours {v}": 5.0 for v in ("NCHW", "NHWC") if v not in wrong})
        return {"set": "s", "layer": "l", "problem": dataclasses.replace(conv, n=n).key(), "op": op, "n": n,
                "us": us, "wrong": {v: "differs" for v in wrong}, "auto_choice": choice}

    rows = [row("fwd", 2, {"NCHW": "ours", "NHWC": "ours"}), row("fwd", 4, {"NCHW": "ours", "NHWC": "torch"}),
            row("wgrad", 2, {"NCHW": "ours", "NHWC": "ours"}),
            bench._unmeasured("s", dataclasses.replace(conv, n=4), "wgrad", "error: AcceleratorError: CUDA error")]
    record = bench.write_db(str(tmp_path / "db"), lib, rows)
    assert record["left_out"] == 2
    got = load_library(str(tmp_path / "db"), torch.device("cpu"))
    assert got.find("wgrad", conv, "NCHW") is None and got.find("wgrad", conv, "NHWC") is None  # failed at n=4
    assert got.find("fwd", conv, "NCHW", faster_only=True) is not None  # auto took it at both batches
    assert got.find("fwd", conv, "NHWC", faster_only=True) is None  # not at n=4
    assert got.find("fwd", conv, "NHWC") is not None  # (kernels="tvm" may still run it: it was never wrong)
    rows[1]["wrong"] = {"NCHW": "differs"}
    del rows[1]["us"]["ours NCHW"]
    bench.write_db(str(tmp_path / "db2"), lib, rows)
    assert load_library(str(tmp_path / "db2"), torch.device("cpu")).find("fwd", conv, "NCHW") is None


def test_a_wrong_kernel_is_reported_never_timed(library, monkeypatch):
    folder, _ = library

    def zero(*tensors):
        tensors[-1].zero_()

    found = bench.Library.kernel
    monkeypatch.setattr(bench.Library, "kernel", lambda self, *a: (zero, found(self, *a)[1]))
    report = bench.main(ARGS + ["--kernels", folder, "--limit", "1", "--in-process"])  # (the patch is here)
    (row,) = report["rows"]
    assert set(row["wrong"]) == {"NCHW", "NHWC"} and "differs from torch" in row["wrong"]["NCHW"]
    assert set(row["us"]) == {"torch NCHW", "torch NHWC"} and row["speedup"] is None
    assert report["summary"]["rows_wrong"] == 1


def test_a_library_for_another_device_is_refused_and_a_changed_one_never_loads(library, tmp_path):
    folder, _ = library
    with pytest.raises(ValueError, match="run with --device cpu"):
        bench.Library(folder, torch.device("meta"))
    copy = tmp_path / "copy"
    copy.mkdir()
    manifest = json.loads(Path(folder, "round.json").read_text())
    (copy / "round.json").write_text(json.dumps(manifest))
    (copy / manifest["library"]).write_bytes(b"not the library")
    with pytest.raises(ValueError, match="sha256"):
        bench.Library(str(copy), torch.device("cpu"))


def test_gpu_script_is_valid_bash_and_runs_modules_and_tests_that_exist():
    import importlib.util
    import re
    import subprocess

    script = Path(__file__).parents[2] / "experiments" / "gpu_kernels.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    modules = set(re.findall(r"python3 -m ([\w.]+)", text)) - {"pip"}
    assert {"experiments.bench_depthwise_gpu", "experiments.bench_kernels_train", "pipedp.ops.measure"} <= modules
    assert all(importlib.util.find_spec(m) is not None for m in modules)
    for test_file in re.findall(r"(tests/\S+\.py)", text):
        assert (script.parents[1] / test_file).is_file()


@pytest.mark.slow
def test_gpu_script_imports_pipedp_kernels_from_its_overlay_where_pipedp_is_not_installed(tmp_path):
    # As on the GPU host: pipedp not installed (here: python -S, so the editable install's finder is not
    # loaded), the script run from anywhere. The checkout's pipedp/ has no kernels/: run from the checkout,
    # `python3 -m` would put it first on sys.path, ahead of any overlay in PYTHONPATH.
    import os
    import subprocess
    import sys
    import sysconfig

    script = Path(__file__).parents[2] / "experiments" / "gpu_kernels.sh"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/bash\nexec {sys.executable} -S "$@"\n')
    (shim / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    no_overlay = subprocess.run(["python3", "-c", "import pipedp.kernels"], env=env, cwd=script.parents[1],
                                capture_output=True, text=True)
    assert no_overlay.returncode != 0  # (the condition this test is about)
    done = subprocess.run(["bash", str(script), str(tmp_path / "out"), "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "/pipedp/kernels" in done.stdout and "4 tests collected" in done.stdout and "rows" in done.stdout


def test_a_row_that_hangs_or_crashes_its_worker_is_recorded_and_the_run_goes_on(library, tmp_path):
    folder, _ = library
    report = bench.main(ARGS + ["--kernels", folder, "--row-timeout", "0.001", "--out", str(tmp_path)])
    assert [r["status"].split(":")[0] for r in report["rows"]] == ["timeout", "timeout"]
    assert report["summary"]["rows_with_kernels"] == 0
    assert "| timeout: no result within the time limit" in (tmp_path / "depthwise_gpu.md").read_text()
