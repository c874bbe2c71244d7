"""Build here, measure there, on a CPU: rounds compiled with the compiler, measured by a process that has only the TVM
runtime, ingested, the next round proposed from them, and the result exported."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")
import torch  # noqa: E402

from pipedp.kernels.tvm import cli, remote  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.target import make_target, target_key  # noqa: E402
from pipedp.ops import measure  # noqa: E402
from pipedp.ops import records as R  # noqa: E402
from pipedp.ops.harness import check  # noqa: E402
from pipedp.ops.runtime import load_library  # noqa: E402

from tests.model_files import DEPTHWISE_NET as MODEL  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = make_target("cpu")
CONV = DepthwiseConv(2, 8, 12, 12, padding=1)
TASKS = [(CONV, "fwd", "NCHW"), (CONV, "wgrad", "NHWC")]

# What the GPU host has: no TVM compiler package, no xgboost, no pipedp.kernels (the sitecustomize refuses them, in
# the measuring process and in the workers it starts); the runtime libraries from PIPEDP_TVM_LIB, as the .gpu bundle
# ships them.
SITE = textwrap.dedent("""
    import sys

    class _NotHere:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tvm", "xgboost") or (name + ".").startswith("pipedp.kernels."):
                raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU host)", name=name)
            return None

    sys.meta_path.insert(0, _NotHere())
""")
MEASURE = textwrap.dedent("""
    import json, sys
    from pipedp.ops import measure
    code = measure.main([sys.argv[1], "--min-ms", "1", "--rounds", "1"])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tvm", "xgboost") or m.startswith("pipedp.kernels"))
    print("exit", code, "compiler", json.dumps(loaded))
""")


def _measure_elsewhere(folder, tmp_path):
    """``python -m pipedp.ops.measure`` as on the GPU host: a separate process with the TVM runtime only."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    lib = os.path.join(os.path.dirname(importlib.util.find_spec("tvm").origin), "lib")
    env = {**os.environ, "PIPEDP_TVM_LIB": lib,
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), ROOT, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exit 0 compiler []" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow  # tens of seconds on 2 cores: the slow run (CI runs it) keeps the default suite short
def test_rounds_built_here_and_measured_with_the_runtime_alone_tune_and_export(tmp_path, capsys):
    (tmp_path / "net.py").write_text(MODEL)
    db, folder = tmp_path / "db", tmp_path / "round"
    args = ["--model", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,3,16,16", "--trials", "3", "--batch", "2",
            "--ops", "fwd", "--layouts", "nchw", "--db", str(db), "--remote-round", str(folder)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "round 1: 4 candidate(s) of 2 kernel(s)" in out and f"python -m pipedp.ops.measure {folder}" in out
    first = measure.read_manifest(str(folder))
    assert sorted(os.listdir(folder)) == ["kernels-round-1.so", "round.json"]
    assert cli.main(args) == 1  # not measured yet: building it again would waste it
    assert "holds round 1 (4 candidates), not measured yet" in capsys.readouterr().err

    _measure_elsewhere(folder, tmp_path)
    assert cli.main(args) == 0  # ingests round 1, builds round 2 from it
    out = capsys.readouterr().out
    assert "round 1: 4 candidate(s) measured, 0 failed" in out and "round 2: 2 candidate(s) of 2 kernel(s)" in out
    measured = [r for r in R.read(db / R.RECORDS_FILE) if r["kind"] == "measure"]
    assert len(measured) == 4 and all(r["round"] == 1 and r["us"] > 0 and set(r["torch_us"]) == {"nchw", "nhwc"}
                                      for r in measured)
    second = measure.read_manifest(str(folder))
    assert sorted(os.listdir(folder)) == ["kernels-round-2.so", "round.json"]
    for c in second["candidates"]:  # the search goes on: no config measured before
        assert c["config"] not in [d["config"] for d in first["candidates"] if d["problem"] == c["problem"]]

    assert measure.main([str(folder), "--min-ms", "1", "--rounds", "1"]) == 0  # (round 2 measured here)
    assert cli.main(args) == 0  # ingests round 2: every kernel has its 3 trials, so it exports
    out = capsys.readouterr().out
    assert "every kernel is tuned" in out and "exported 2 kernel(s)" in out and os.listdir(folder) == []
    records = R.read(db / R.RECORDS_FILE)
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2]
    assert len([r for r in records if r["kind"] == "tuned"]) == 2
    lib = load_library(str(db), torch.device("cpu"))
    problems = {json.dumps(c["problem"]): DepthwiseConv.from_key(c["problem"]) for c in first["candidates"]}
    for conv in problems.values():
        check(lib.find("fwd", conv, "NCHW"), conv, "fwd", torch.device("cpu"))


@pytest.fixture
def built(tmp_path):
    path = str(tmp_path / R.RECORDS_FILE)
    done = remote.build_round(str(tmp_path / "round"), TASKS, TARGET, path, trials=4, batch=2)
    return done, path


def _results(manifest, statuses, digest=None):
    entries = [{"id": c["id"], "status": s, "us": 10.0 + c["id"], "torch_us": {"nchw": 20.0, "nhwc": 30.0}}
               if s == "ok" else {"id": c["id"], "status": s, "us": None, "error": "CandidateFailed: it died"}
               for c, s in zip(manifest["candidates"], statuses)]
    return {"format": measure.RESULTS_FORMAT, "version": 1, "round": manifest["round"], "target": manifest["target"],
            "sha256": digest or manifest["sha256"], "device": "test", "torch": torch.__version__, "complete": True,
            "results": entries}


def test_results_of_another_round_are_refused_and_a_round_is_ingested_once(built):
    done, path = built
    results = os.path.join(done.folder, measure.RESULTS)
    with open(results, "w") as f:
        json.dump(_results(done.manifest, ["ok"] * 4, digest="0" * 64), f)
    with pytest.raises(ValueError, match="holds the results of another round .* measure this round again"):
        remote.round_state(done.folder)
    with open(results, "w") as f:
        json.dump(_results(done.manifest, ["ok", "crash", "wrong", "ok"]), f)
    assert remote.round_state(done.folder) == "measured"
    got = remote.ingest(done.folder, path, target_key(TARGET))
    assert (got.measured, got.failed, got.again) == (2, 2, False) and got.statuses == {"ok": 2, "crash": 1, "wrong": 1}
    measured = [r for r in R.read(path) if r["kind"] == "measure"]
    assert [(r["status"], r["us"]) for r in measured] == [("ok", 10.0), ("crash", None), ("wrong", None), ("ok", 13.0)]
    assert remote.ingest(done.folder, path, target_key(TARGET)).again  # a second time adds nothing
    assert len(R.read(path)) == 5  # the four measurements and the round
    with pytest.raises(ValueError, match="built for cpu:.*this run tunes for cuda:sm_90"):
        remote.ingest(done.folder, path, "cuda:sm_90")


def test_a_candidate_that_does_not_compile_is_recorded_as_failed_and_not_shipped(tmp_path, monkeypatch):
    real = remote.compile_module

    def fails_on_c1(mod, target, streams=None):
        if any(gv.name_hint == "pipedp_c1" for gv in mod.get_global_vars()):
            raise RuntimeError("LLVM ERROR: out of registers")
        return real(mod, target, streams)

    monkeypatch.setattr(remote, "compile_module", fails_on_c1)
    path = str(tmp_path / R.RECORDS_FILE)
    done = remote.build_round(str(tmp_path / "round"), TASKS, TARGET, path, trials=4, batch=2)
    assert [c["symbol"] for c in done.manifest["candidates"]] == ["pipedp_c0", "pipedp_c2", "pipedp_c3"]
    (failed,) = R.read(path)
    assert failed["status"] == "error" and "does not compile" in failed["error"] and failed["round"] == 1
    assert failed["config"] not in [c["config"] for c in done.manifest["candidates"]]


def test_a_kernel_that_stopped_improving_is_tuned_until_its_budget_grows(tmp_path):
    import random

    from pipedp.kernels.tvm.database import measure_record
    from pipedp.kernels.tvm.template import get_template
    from pipedp.kernels.tvm.tuner import Measurement

    path = str(tmp_path / R.RECORDS_FILE)
    task, key = TASKS[0], target_key(TARGET)
    space = get_template(TARGET).space(CONV, "fwd")
    configs = {json.dumps(c, sort_keys=True): c for c in (space.sample(random.Random(i)) for i in range(40))}
    for number, config in enumerate(list(configs.values())[:5], 1):  # five rounds, the first one's best never beaten
        R.append(path, measure_record(task, key, Measurement(config, 10.0), round=number))
    folder = str(tmp_path / "round")
    assert remote.build_round(folder, [task], TARGET, path, trials=16, batch=2, patience=4) is None
    (mark,) = [r for r in R.read(path) if r["kind"] == "tuned"]
    assert mark["trials"] == 16 and mark["measured"] == 5
    assert remote.build_round(folder, [task], TARGET, path, trials=16, batch=2, patience=4) is None  # still tuned
    grown = remote.build_round(folder, [task], TARGET, path, trials=17, batch=2, patience=4)
    assert len(grown.manifest["candidates"]) == 2  # a larger budget: patience starts again
