"""tune-kernels end to end on a model file, then training with kernels="tvm" in a fresh process; its
help, version and one-line failures, with and without the compiler's extra installed."""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pipedp.kernels.tvm import cli  # (imports no TVM: checked below)
from pipedp.ops import records as R

from tests import faults
from tests.model_files import DEPTHWISE_NET as MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTRA = ("tvm", "tvm_ffi", "xgboost")  # what pipedp[tvm] installs
NO_EXTRA = any(importlib.util.find_spec(m) is None for m in EXTRA)
needs_extra = pytest.mark.skipif(NO_EXTRA, reason="needs the 'tvm' extra (apache-tvm, tvm-ffi, xgboost)")

TRAIN = textwrap.dedent("""
    import copy, sys, torch
    from torch import nn
    sys.path.insert(0, sys.argv[1])
    import net, pipedp
    torch.manual_seed(0)
    model = net.build(); ref = copy.deepcopy(model)
    fmt = torch.channels_last if sys.argv[3] == "nhwc" else torch.contiguous_format
    model.to(memory_format=fmt)
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                         microbatches=2, stages=2, kernels="tvm", kernel_db=sys.argv[2], profile=False, progress=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        engine.train_step(x.contiguous(memory_format=fmt), y)
        opt.zero_grad()
        for xs, ys in zip(x.split(4), y.split(4)):
            (nn.CrossEntropyLoss()(ref(xs), ys) * 0.5).backward()
        opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    print("layers", engine.kernel_layers, "diff", diff, "compiler", "tvm" in sys.modules)
""")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    if NO_EXTRA:
        pytest.skip("needs the 'tvm' extra (apache-tvm, tvm-ffi, xgboost)")
    root = tmp_path_factory.mktemp("tune")
    (root / "net.py").write_text(MODEL)
    db = root / "db"
    assert cli.main(_args(root, db)) == 0
    return root, db


def _args(root, db, *more):
    # pipedp feeds microbatches of 4: tune at that batch size.
    return ["--model", f"{root / 'net.py'}:build", "--input-shape", "4,3,16,16", "--trials", "4",
            "--allocator", "default",  # (reuse is process-wide and lasting: not in the test process)
            "--batch", "2", "--db", str(db), "--no-progress", *more]


def _measured(db):
    return [r for r in R.read(db / R.RECORDS_FILE) if r["kind"] == "measure"]


def _key(r):
    return R.problem_key(r["op"], r["problem"], r["target"], r["layout"])


def _train(root, db, layout="nchw"):
    done = subprocess.run([sys.executable, "-c", TRAIN, str(root), str(db), layout], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    return done


def test_cli_tunes_every_depthwise_kernel_and_exports(tuned, capsys):
    _, db = tuned
    recs = R.read(db / R.RECORDS_FILE)
    export = R.latest_export(recs, recs[-1]["target"])
    assert export is not None and len(export["kernels"]) == 12  # 2 problems x fwd, dgrad, wgrad x NCHW, NHWC
    measured = [r for r in recs if r["kind"] == "measure"]
    ok = [r for r in measured if r["status"] == "ok"]
    assert all(r["us"] > 0 and set(r["torch_us"]) == {"nchw", "nhwc"} and "tvm" in r["versions"] for r in ok)
    assert all(r["us"] is None and r["error"] for r in measured if r["status"] != "ok")  # every candidate recorded
    assert {r["layout"] for r in measured} == {"NCHW", "NHWC"}
    assert all(r["layout"] == r["config"]["layout"] for r in measured if r["layout"] == "NHWC")
    tuned_keys = [_key(r) for r in recs if r["kind"] == "tuned"]
    assert len(tuned_keys) == len(set(tuned_keys)) == 12  # each search marked done, once
    assert {r["schema"] for r in recs} == {R.SCHEMA}


def test_a_second_run_skips_the_tuned_kernels(tuned, tmp_path, capsys):
    root, good = tuned
    db = tmp_path / "db"
    shutil.copytree(good, db)
    before = _measured(db)
    assert cli.main(_args(root, db)) == 0
    assert "12 of 12 kernel(s) already tuned with --trials 4 or more" in capsys.readouterr().out
    assert _measured(db) == before


@pytest.mark.slow  # (two more runs, each exporting again)
def test_a_larger_budget_or_retune_tunes_tuned_kernels_further(tuned, tmp_path):
    root, good = tuned
    db = tmp_path / "db"
    shutil.copytree(good, db)
    for more in (["--trials", "5"], ["--retune", "--trials", "1"]):  # each: one more candidate per kernel
        count = len(_measured(db))
        assert cli.main(_args(root, db, *more, "--ops", "fwd", "--layouts", "nchw")) == 0
        new = _measured(db)[count:]
        assert len(new) == 2 and {(r["op"], r["layout"]) for r in new} == {("fwd", "NCHW")}, more
        for r in new:  # none measured before
            assert r["config"] not in [o["config"] for o in _measured(db)[:count] if _key(o) == _key(r)]


def test_a_kernel_cut_short_resumes_where_it_stopped(tuned, tmp_path):
    root, good = tuned
    db = tmp_path / "db"
    shutil.copytree(good, db)
    records = R.read(db / R.RECORDS_FILE)
    cut = _key(next(r for r in records if r["kind"] == "measure"))  # as if Ctrl-C came after its first candidate
    first = next(r for r in records if r["kind"] == "measure" and _key(r) == cut)
    kept = [r for r in records if r["kind"] not in ("measure", "tuned") or _key(r) != cut or r is first]
    (db / R.RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert cli.main(_args(root, db)) == 0
    new = _measured(db)[len([r for r in kept if r["kind"] == "measure"]):]
    assert len(new) == 3 and {_key(r) for r in new} == {cut}  # the other 11 kernels were done
    assert first["config"] not in [r["config"] for r in new]
    assert _key(R.read(db / R.RECORDS_FILE)[-2]) == cut  # its search is marked done (then the export)


def test_records_of_an_earlier_pipedp_are_resumed_not_tuned_anew(tuned, tmp_path):
    root, good = tuned
    db = tmp_path / "db"
    shutil.copytree(good, db)
    old = [{k: v for k, v in r.items() if k != "schema"} for r in R.read(db / R.RECORDS_FILE) if r["kind"] != "tuned"]
    (db / R.RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))  # schema 1: no marks, no stamps
    assert cli.main(_args(root, db)) == 0
    assert len(_measured(db)) == len([r for r in old if r["kind"] == "measure"])  # every kernel had its 4 trials
    assert len([r for r in R.read(db / R.RECORDS_FILE) if r["kind"] == "tuned"]) == 12


@pytest.mark.slow  # (two fresh workers and a time limit run out; tests/kernels/test_runner.py shows it in seconds)
def test_a_candidate_that_crashes_or_hangs_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    from pipedp.kernels.tvm import isolated

    monkeypatch.setenv(faults.FAULTS, str(tmp_path))  # the first candidate crashes, the second hangs
    monkeypatch.setattr(isolated, "build_and_measure", faults.build_and_measure)
    (tmp_path / "net.py").write_text(MODEL)
    db = tmp_path / "db"
    assert cli.main(_args(tmp_path, db, "--trials", "3", "--batch", "3", "--ops", "fwd", "--layouts", "nchw",
                          "--candidate-timeout", "5")) == 0
    measured = _measured(db)
    assert [r["status"] for r in measured] == ["crash", "timeout", "ok", "ok", "ok", "ok"]
    assert "SIGSEGV" in measured[0]["error"] and "time limit of 5 s" in measured[1]["error"]
    records = R.read(db / R.RECORDS_FILE)
    assert len(R.latest_export(records, measured[0]["target"])["kernels"]) == 2


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_training_with_tuned_kernels_matches_torch_without_the_compiler(tuned, layout):
    root, db = tuned
    done = _train(root, db, layout)  # kernels="tvm": a layer without a kernel in this layout is an error
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    assert words[1] == "2" and float(words[3]) <= 1e-5 and words[5] == "False", done.stdout


def test_a_tampered_library_is_refused(tuned, tmp_path):
    root, db = tuned
    bad = tmp_path / "db"
    bad.mkdir()
    for f in os.listdir(db):
        (bad / f).write_bytes((db / f).read_bytes())
    lib = next(f for f in os.listdir(bad) if f.endswith(".so"))
    with open(bad / lib, "ab") as f:
        f.write(b"\0")
    with open(bad / R.RECORDS_FILE, "a") as f:
        f.write("{corrupt\n")  # and a corrupt record: a warning, not a crash
    done = _train(root, bad)
    assert done.returncode != 0
    assert "refusing to load" in done.stderr and "run tune-kernels again" in done.stderr
    assert "skipping a corrupt tuning record" in done.stderr


def _fails(capsys, argv, reason):
    """``cli.main(argv)`` exits 1 with one line on stderr that gives ``reason``."""
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tune-kernels: error: ") and reason in err and len(err.strip().splitlines()) == 1, err


@needs_extra
def test_find_depthwise_dedupes_and_bad_arguments(capsys, tmp_path):
    from pipedp.models import mobilenet_v2

    probs = cli.find_depthwise(mobilenet_v2(), (2, 3, 32, 32))
    assert len(probs) == len(set(probs)) and all(p.kernel == (3, 3) for p in probs)
    db = ["--db", str(tmp_path / "db")]
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32", *db], "N,C,H,W")
    _fails(capsys, ["--model", "nope", "--input-shape", "2,3,32,32", *db], "not a zoo model")
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--layouts", "nchwc", *db],
           "come in nchw,nhwc")
    _fails(capsys, ["--model", f"{tmp_path / 'none.py'}:build", "--input-shape", "2,3,32,32", *db], "no file")
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--ops", "fwd,bwd", *db],
           "choose from fwd,dgrad,wgrad")
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--trials", "0", *db], "at least 1")
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--candidate-timeout", "0", *db],
           "give a positive number of seconds")
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--retune", "--remote-round",
                    str(tmp_path / "round"), *db], "--retune does not go with --remote-round")
    _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--target", "cuda", "--remote-round",
                    str(tmp_path / "round"), *db], "needs the GPU host's --arch")
    if not __import__("torch").cuda.is_available():
        _fails(capsys, ["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--target", "cuda", *db],
               "run where torch sees one")
    assert not (tmp_path / "db").exists()  # nothing written for a run that could not start


def test_auto_on_cpu_swaps_only_on_torchs_thread_team(tuned, monkeypatch):
    import torch
    from torch import nn

    from pipedp.ops import parallel, runtime
    from pipedp.ops.swap import TunedDepthwiseConv2d, swap_depthwise

    _, db = tuned
    cpu = torch.device("cpu")
    net = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8))
    monkeypatch.setattr(runtime, "_loaded", {})  # a fresh process's cache: the library is loaded (and routed) again
    monkeypatch.setattr(parallel, "route", lambda path: False)  # as without a C compiler: kernels on TVM's pool
    assert swap_depthwise(net, "auto", str(db), cpu).count == 0 and type(net[0]) is nn.Conv2d
    monkeypatch.setattr(runtime, "_loaded", {})
    monkeypatch.setattr(parallel, "route", lambda path: True)
    assert swap_depthwise(net, "auto", str(db), cpu).count == 1 and type(net[0]) is TunedDepthwiseConv2d
    choice = net[0].kernels
    assert choice.faster_only and not choice.strict  # auto: a kernel only where it beat torch


def test_faster_only_takes_a_kernel_only_where_it_beat_torch_in_its_layout(tuned):
    # what kernels="auto" does per kernel where it swaps (GPUs); checked here on the CPU export
    import torch
    from torch import nn

    from pipedp.ops.problem import DepthwiseConv
    from pipedp.ops.runtime import load_library
    from pipedp.ops.swap import swap_depthwise

    _, db = tuned
    cpu = torch.device("cpu")
    lib = load_library(str(db), cpu)
    assert set(lib.timings) == set(lib.kernels)
    best = R.best(R.read(db / R.RECORDS_FILE)).values()
    saved = dict(lib.timings)
    try:
        for r in best:
            pk = R.layer_key(r["op"], r["problem"], lib.target, r["layout"])
            t = lib.timings[pk]
            assert t["us"] == r["us"] and t["torch_us"] == r["torch_us"][r["layout"].lower()]
            args = (r["op"], DepthwiseConv.from_key(r["problem"]), r["layout"])
            assert (lib.find(*args, faster_only=True) is not None) == (t["us"] < t["torch_us"])
            lib.timings[pk] = {"us": 0.5, "torch_us": 1.0}  # a winner is taken ...
            assert lib.find(*args, faster_only=True) is not None
            lib.timings[pk] = {"us": 2.0, "torch_us": 1.0}  # ... a loser is not, unless kernels="tvm"
            assert lib.find(*args, faster_only=True) is None
            assert lib.find(*args, faster_only=False) is not None
    finally:
        lib.timings.clear()
        lib.timings.update(saved)  # the library is cached for the process: leave it as loaded
    net = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8))
    swap_depthwise(net, "tvm", str(db), cpu)
    assert not net[0].kernels.faster_only and net[0].kernels.strict and net[0].kernels.library == lib.key


def _env(tmp_path, block):
    """This environment, or one where the extra is unimportable: a sitecustomize that refuses tvm, tvm_ffi and
    xgboost, as where they are not installed."""
    env = dict(os.environ)
    if block:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
            import sys

            EXTRA = {EXTRA!r}

            class _NotInstalled:
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] in EXTRA:
                        raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                    return None

            sys.meta_path.insert(0, _NotInstalled())
        """))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def _script(args, tmp_path, block=False):
    """tune-kernels as installed (the console script, else ``python -m``)."""
    script = os.path.join(os.path.dirname(sys.executable), "tune-kernels")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "pipedp.kernels.tvm.cli"]
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=_env(tmp_path, block))


@pytest.mark.parametrize("block", [False, True], ids=["installed", "without-extra"])
def test_help_and_version_show_defaults_and_the_extra(tmp_path, block):
    done = _script(["--help"], tmp_path, block)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # (argparse wraps lines)
    assert "pip install 'pipedp[tvm]'" in out
    for shown in ("(default: 64)", "(default: 8)", "(default: cpu)", "(default: fwd,dgrad,wgrad)", "(default: auto)",
                  "(default: reuse)", "(default: 10)", "(default: 0)", "(default: True)", "(required)",
                  "(default: False)", "(default: 60.0)", "(default: off)"):
        assert shown in out, shown
    assert "(default: None)" not in out  # every default says what it means (--arch: auto, the GPU's own)
    done = _script(["--version"], tmp_path, block)
    assert done.returncode == 0 and done.stdout.startswith("tune-kernels (pipedp) "), done.stdout + done.stderr


def test_every_option_has_help_and_a_default_shown(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per option: argparse wraps at hyphens too
    parser = cli.build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.required:
            assert action.help.endswith("(required)"), action.option_strings
        else:  # shown, and saying what it means ("None" would not)
            assert action.default is not None and action.default is not argparse.SUPPRESS, action.option_strings
            assert f"{' '.join(action.help.split())} (default: {action.default})" in text, action.option_strings


def test_the_tvm_extra_takes_xgboosts_cpu_build_where_there_is_one():
    # The tuner's cost model runs on the CPU: xgboost-cpu (no NCCL, no CUDA) on Linux and Windows; macOS wheels of
    # xgboost carry no CUDA, and there is no xgboost-cpu for macOS.
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = [Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["tvm"]]

    def installs(platform):
        env = {"sys_platform": platform, "platform_system": {"linux": "Linux", "win32": "Windows",
                                                             "darwin": "Darwin"}[platform]}
        return {r.name for r in extra if r.marker is None or r.marker.evaluate(env)}

    for platform in ("linux", "win32"):
        assert {"xgboost-cpu"} == installs(platform) & {"xgboost", "xgboost-cpu"}, platform
    assert {"xgboost"} == installs("darwin") & {"xgboost", "xgboost-cpu"}


def test_without_the_extra_a_run_fails_in_one_line_naming_it(tmp_path):
    for module in EXTRA:  # the stand-in for an install without the extra works
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                               cwd=tmp_path, env=_env(tmp_path, True))
        assert probe.returncode != 0 and f"No module named '{module}'" in probe.stderr
    done = _script(["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--db", str(tmp_path / "db"),
                    "--no-progress"], tmp_path, block=True)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'pipedp[tvm]'" in lines[0] and "tvm" in lines[0], done.stderr
    assert not (tmp_path / "db").exists()


def test_the_cli_module_imports_no_compiler():
    code = ("import sys; from pipedp.kernels.tvm import cli; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {EXTRA!r} "
            "or m.startswith('pipedp.kernels.tvm.') and m.rsplit('.', 1)[1] not in ('cli', 'allocator')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
