"""tune-kernels end to end on a model file, then training with kernels="tvm" in a fresh process."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")

from kernels.tvm import cli  # noqa: E402
from kernels.tvm import records as R  # noqa: E402

from tests.model_files import DEPTHWISE_NET as MODEL  # noqa: E402

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
    root = tmp_path_factory.mktemp("tune")
    (root / "net.py").write_text(MODEL)
    db = root / "db"
    # pipedp feeds microbatches of 4: tune at that batch size.
    code = cli.main(["--model", f"{root / 'net.py'}:build", "--input-shape", "4,3,16,16", "--trials", "4",
                     "--allocator", "default",  # (reuse is process-wide and lasting: not in the test process)
                     "--batch", "2", "--db", str(db), "--no-progress"])
    assert code == 0
    return root, db


def _train(root, db, layout="nchw"):
    done = subprocess.run([sys.executable, "-c", TRAIN, str(root), str(db), layout], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return done


def test_cli_tunes_every_depthwise_kernel_and_exports(tuned, capsys):
    _, db = tuned
    recs = R.read(db / R.RECORDS_FILE)
    export = R.latest_export(recs, recs[-1]["target"])
    assert export is not None and len(export["kernels"]) == 12  # 2 problems x fwd, dgrad, wgrad x NCHW, NHWC
    measured = [r for r in recs if r["kind"] == "measure"]
    assert all(r["us"] > 0 and set(r["torch_us"]) == {"nchw", "nhwc"} and "tvm" in r["versions"] for r in measured)
    assert {r["layout"] for r in measured} == {"NCHW", "NHWC"}
    assert all(r["layout"] == r["config"]["layout"] for r in measured if r["layout"] == "NHWC")


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


def test_find_depthwise_dedupes_and_bad_arguments():
    from experiments.models import mobilenet_v2

    probs = cli.find_depthwise(mobilenet_v2(), (2, 3, 32, 32))
    assert len(probs) == len(set(probs)) and all(p.kernel == (3, 3) for p in probs)
    with pytest.raises(SystemExit, match="N,C,H,W"):
        cli.main(["--model", "mobilenet_v2", "--input-shape", "2,3,32"])
    with pytest.raises(SystemExit, match="not a zoo model"):
        cli.main(["--model", "nope", "--input-shape", "2,3,32,32"])
    with pytest.raises(SystemExit, match="come in nchw,nhwc"):
        cli.main(["--model", "mobilenet_v2", "--input-shape", "2,3,32,32", "--layouts", "nchwc"])


def test_auto_on_cpu_swaps_only_on_torchs_thread_team(tuned, monkeypatch):
    import torch
    from torch import nn

    from kernels.tvm import parallel
    from pipedp.ops.depthwise import active_library
    from pipedp.ops.swap import TunedDepthwiseConv2d, swap_depthwise

    _, db = tuned
    cpu = torch.device("cpu")
    net = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8))
    monkeypatch.setattr(parallel, "route", lambda path: False)  # as without a C compiler: kernels on TVM's pool
    assert swap_depthwise(net, "auto", str(db), cpu) == 0 and type(net[0]) is nn.Conv2d
    monkeypatch.setattr(parallel, "route", lambda path: True)
    assert swap_depthwise(net, "auto", str(db), cpu) == 1 and type(net[0]) is TunedDepthwiseConv2d
    assert active_library(cpu).faster_only and not net[0]._strict  # auto: a kernel only where it beat torch


def test_faster_only_takes_a_kernel_only_where_it_beat_torch_in_its_layout(tuned):
    # what kernels="auto" does per kernel where it swaps (GPUs); checked here on the CPU export
    import torch
    from torch import nn

    from kernels.tvm.problem import DepthwiseConv
    from pipedp.ops.depthwise import active_library, load
    from pipedp.ops.swap import swap_depthwise

    _, db = tuned
    cpu = torch.device("cpu")
    lib = load(str(db), cpu)
    lib.faster_only = True
    assert set(lib.timings) == set(lib.kernels)
    best = R.best(R.read(db / R.RECORDS_FILE)).values()
    for r in best:
        pk = R.problem_key(r["op"], r["problem"], lib.target, r["layout"])
        t = lib.timings[pk]
        assert t["us"] == r["us"] and t["torch_us"] == r["torch_us"][r["layout"].lower()]
        args = (r["op"], DepthwiseConv.from_key(r["problem"]), r["layout"])
        assert (lib.find(*args) is not None) == (t["us"] < t["torch_us"])
        lib.timings[pk] = {"us": 0.5, "torch_us": 1.0}  # a winner is taken ...
        assert lib.find(*args) is not None
        lib.timings[pk] = {"us": 2.0, "torch_us": 1.0}  # ... a loser is not, unless kernels="tvm"
        assert lib.find(*args) is None
        lib.faster_only = False
        assert lib.find(*args) is not None
        lib.faster_only = True
    swap_depthwise(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8)), "tvm", str(db), cpu)
    assert not active_library(cpu).faster_only
