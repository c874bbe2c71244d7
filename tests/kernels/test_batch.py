"""One tuned kernel per layer serves every batch size: built, exported, looked up and run at sizes never tuned;
libraries exported before that still serve the size they were tuned at, and say how to re-export for the rest."""

import dataclasses
import hashlib
import itertools
import logging
import random
import re

import pytest

pytest.importorskip("tvm")
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipedp.kernels.tvm import builder as B  # noqa: E402
from pipedp.kernels.tvm import export as E  # noqa: E402
from pipedp.kernels.tvm import runner  # noqa: E402
from pipedp.kernels.tvm.ops import OPS, DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402
from pipedp.kernels.tvm.target import make_target, target_key  # noqa: E402
from pipedp.kernels.tvm.template import get_template  # noqa: E402
from pipedp.ops import records as R  # noqa: E402
from pipedp.ops import runtime  # noqa: E402
from pipedp.ops.artifact import sha256  # noqa: E402
from pipedp.ops.layout import LAYOUTS  # noqa: E402
from pipedp.ops.runtime import KernelLibrary, load_library  # noqa: E402
from pipedp.ops.swap import swap_depthwise  # noqa: E402

CPU = torch.device("cpu")
TUNED_N = 4
ODD = [  # each tuned at batch 4
    DepthwiseConv(TUNED_N, 4, 11, 10, stride=2, padding=1),                        # stride 2
    DepthwiseConv(TUNED_N, 3, 8, 8, multiplier=2, padding=1),                       # multiplier 2
    DepthwiseConv(TUNED_N, 2, 9, 9, dilation=2, padding=2),                         # dilation 2
    DepthwiseConv(TUNED_N, 3, 9, 9, kernel=5, padding=2),                           # 5x5
    DepthwiseConv(TUNED_N, 3, 7, 7),                                                # no padding
    DepthwiseConv(TUNED_N, 2, 8, 6, kernel=(3, 5), padding=(1, 0), stride=(1, 2)),  # non-square
]
BATCHES = (1, 3, TUNED_N, 7)


@pytest.fixture(scope="module")
def target():
    return make_target("cpu")


def _config(conv: DepthwiseConv, op: str, layout: str, target, seed: int = 0) -> dict:
    """A config the template accepts for ``conv`` (as a tuner would pick one)."""
    tmpl = get_template(target, layout)
    space = tmpl.space(conv, op)
    rng = random.Random(seed)
    for cfg in itertools.chain((space.sample(rng) for _ in range(200)), space.all()):
        try:
            tmpl.validate(conv, op, cfg)
            return cfg
        except InvalidConfig:
            continue
    raise AssertionError(f"no valid {layout} {op} config for {conv}")


@pytest.mark.parametrize("conv", ODD, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_kernel_tuned_at_one_batch_size_matches_torch_at_every_batch_size(conv, op, layout, target):
    kernel = B.build(conv, op, _config(conv, op, layout, target), target)
    for n in BATCHES:
        runner.check(kernel, dataclasses.replace(conv, n=n), op, CPU, layout)  # raises if off


@pytest.mark.parametrize("order", ["channel", "pixel"])
def test_nhwc_wgrad_splits_any_batch_into_its_n_splits(order, target):
    # nsplit divides the tuned batch; at other sizes the last split is partial or empty (a predicate)
    conv = DepthwiseConv(8, 16, 6, 7, padding=1)
    cfg = {"layout": "NHWC", "vec": 16, "nsplit": 8, "unroll": 1, "tile_w": 1, "order": order}
    kernel = B.build(conv, "wgrad", cfg, target)
    for n in (1, 3, 5, 8, 13):
        runner.check(kernel, dataclasses.replace(conv, n=n), "wgrad", CPU, "NHWC")


def test_a_kernel_for_exactly_one_batch_size_is_still_built_on_request(target):
    conv = DepthwiseConv(2, 4, 6, 6, padding=1)
    cfg = _config(conv, "fwd", "NCHW", target)
    fixed = B.build(conv, "fwd", cfg, target, batch=3)  # (for benchmarks: validated for the tuned problem)
    runner.check(fixed, dataclasses.replace(conv, n=3), "fwd", CPU)
    with pytest.raises(Exception, match="shape"):  # TVM checks its arguments' shapes
        runner.check(fixed, conv, "fwd", CPU)


# -- export: one kernel per layer -----------------------------------------------------------------------------


LAYER = DepthwiseConv(8, 8, 6, 6, multiplier=2, kernel=5, stride=2, padding=2)


def _measure(conv: DepthwiseConv, op: str, config: dict, us: float, key: str, layout: str = "NCHW") -> dict:
    return {"kind": "measure", "op": op, "problem": conv.key(), "layout": layout, "target": key, "config": config,
            "us": us, "torch_us": {"nchw": 2 * us, "nhwc": 3 * us}}


def test_export_keys_one_kernel_per_layer_tuned_at_the_largest_batch(tmp_path, target):
    key = target_key(target)
    path = tmp_path / R.RECORDS_FILE
    small, large = dataclasses.replace(LAYER, n=2), LAYER
    for op in OPS:
        R.append(path, _measure(small, op, _config(small, op, "NCHW", target, seed=1), 1.0, key))  # faster, smaller
        R.append(path, _measure(large, op, _config(large, op, "NCHW", target, seed=2), 9.0, key))
        R.append(path, _measure(large, op, _config(large, op, "NCHW", target, seed=3), 8.0, key))  # its best
    record = E.export(str(tmp_path), target)
    assert set(record["kernels"]) == {R.layer_key(op, LAYER.key(), key) for op in OPS}  # no batch size in a key
    assert all(R.batch_of(k) is None for k in record["kernels"])
    assert all(t == {"us": 8.0, "torch_us": 16.0, "n": 8} for t in record["timings"].values())
    lib = load_library(str(tmp_path), CPU)
    for op, n in itertools.product(OPS, (1, 2, 5, 8, 11)):
        conv = dataclasses.replace(LAYER, n=n)
        runner.check(lib.find(op, conv), conv, op, CPU)  # one kernel, every batch size
        assert lib.find(op, conv, "NHWC") is None and lib.fixed_batches(op, conv) == []


def test_export_passes_over_a_config_the_template_no_longer_takes(tmp_path, target):
    key = target_key(target)
    path = tmp_path / R.RECORDS_FILE
    small = dataclasses.replace(LAYER, n=2)
    R.append(path, _measure(small, "fwd", _config(small, "fwd", "NCHW", target), 3.0, key))
    R.append(path, _measure(LAYER, "fwd", {"tile_h": 1, "retired_knob": 1}, 1.0, key))  # an older template's
    with pytest.warns(UserWarning, match="no longer fits the template.*tune-kernels"):
        record = E.export(str(tmp_path), target)
    assert list(record["timings"].values()) == [{"us": 3.0, "torch_us": 6.0, "n": 2}]


# -- runtime: any batch size, in slices where 32-bit indexing would overflow ----------------------------------


def test_a_batch_whose_tensors_would_overflow_32_bit_indexing_runs_in_slices(tmp_path, target, monkeypatch):
    key = target_key(target)
    conv = DepthwiseConv(4, 8, 7, 6, padding=1)
    for op in OPS:
        for layout in LAYOUTS:
            R.append(tmp_path / R.RECORDS_FILE, _measure(conv, op, _config(conv, op, layout, target), 1.0, key, layout))
    E.export(str(tmp_path), target)
    lib = load_library(str(tmp_path), CPU)
    calls = []
    for sym, f in list(lib._funcs.items()):
        monkeypatch.setitem(lib._funcs, sym, lambda *a, f=f: (calls.append(a[0].shape[0]), f(*a))[1])
    monkeypatch.setattr(runtime, "INDEX_LIMIT", 3 * 8 * 9 * 8 + 1)  # room for 3 samples of the padded input
    assert runtime.batch_limit(conv) == 3
    for op, layout in itertools.product(OPS, LAYOUTS):
        calls.clear()
        big = dataclasses.replace(conv, n=8)
        runner.check(lib.find(op, big, layout), big, op, CPU, layout)
        assert calls == [3, 3, 2], (op, layout)
        calls.clear()
        small = dataclasses.replace(conv, n=3)
        runner.check(lib.find(op, small, layout), small, op, CPU, layout)  # within the limit: one call
        assert calls == [3]


@pytest.mark.parametrize("limit, calls", [(18, [16, 4]), (3, [3, 3, 3, 3, 3, 3, 2])])
def test_slices_hand_the_kernels_aligned_tensors_only(tmp_path, target, monkeypatch, limit, calls):
    # 3x5x5 fp32 samples are 300 bytes: a slice after one starts off TVM's 64-byte alignment, which vector loads
    # rely on (a misaligned address faults on a GPU). Slices of 16 samples (4800 bytes) start on it again; a
    # limit below 16 gets aligned copies instead.
    from pipedp.ops.layout import ALIGNMENT

    key = target_key(target)
    conv = DepthwiseConv(4, 3, 5, 5, padding=1)
    for op in OPS:
        R.append(tmp_path / R.RECORDS_FILE, _measure(conv, op, _config(conv, op, "NCHW", target), 1.0, key, "NCHW"))
    E.export(str(tmp_path), target)
    lib = load_library(str(tmp_path), CPU)
    seen = []

    def spy(*args, f):
        seen.append((args[0].shape[0], all(t.data_ptr() % ALIGNMENT == 0 for t in args)))
        return f(*args)

    for sym, f in list(lib._funcs.items()):
        monkeypatch.setitem(lib._funcs, sym, lambda *a, f=f: spy(*a, f=f))
    per_sample = 3 * 7 * 7  # the padded input: what batch_limit counts
    monkeypatch.setattr(runtime, "INDEX_LIMIT", limit * per_sample + 1)
    assert runtime.batch_limit(conv) == limit
    big = dataclasses.replace(conv, n=20)
    for op in OPS:
        seen.clear()
        runner.check(lib.find(op, big, "NCHW"), big, op, CPU, "NCHW")  # (right, every slice added up)
        assert [n for n, _ in seen] == calls and all(ok for _, ok in seen), (op, seen)


def test_the_batch_limit_keeps_every_tensor_under_2_31_elements():
    p = DepthwiseConv(1, 32, 112, 112, padding=1)
    limit = runtime.batch_limit(p)
    assert limit * 32 * 114 * 114 < 2**31 <= (limit + 1) * 32 * 114 * 114
    assert runtime.batch_limit(DepthwiseConv(1, 2048, 1024, 1024, padding=1)) == 1  # (a sample over it: one a call)


# -- libraries exported before kernels took any batch size ----------------------------------------------------


def _old_export(db, target, conv: DepthwiseConv) -> dict:
    """An export as pipedp wrote it before: each kernel keyed by its exact problem, compiled for that batch size."""
    import tvm

    key = target_key(target)
    mod, kernels = tvm.IRModule(), {}
    for op in OPS:
        pk = R.problem_key(op, conv.key(), key, "NCHW")
        sym = "pipedp_dw_" + hashlib.sha1(pk.encode()).hexdigest()[:16]
        mod[sym] = B.schedule(conv, op, _config(conv, op, "NCHW", target), target, symbol=sym, batch=conv.n).mod[sym]
        kernels[pk] = sym
    name = E.library_name(key)
    B.compile_module(mod, target).export_library(str(db / name))
    record = {"kind": "export", "target": key, "library": name, "sha256": sha256(str(db / name)), "kernels": kernels,
              "timings": {pk: {"us": 1.0, "torch_us": 2.0} for pk in kernels}, "cpu_flags": []}
    R.append(db / R.RECORDS_FILE, record)
    return record


def test_an_older_export_serves_its_batch_size_and_strict_mode_says_to_re_export(tmp_path, target, caplog):
    conv = DepthwiseConv(4, 8, 6, 6, padding=1)
    _old_export(tmp_path, target, conv)
    with caplog.at_level(logging.WARNING, logger="pipedp.ops.runtime"):
        lib = KernelLibrary(str(tmp_path), R.latest_export(R.read(tmp_path / R.RECORDS_FILE), target_key(target)))
    assert "exported before kernels served every batch size" in caplog.text and "tune-kernels again" in caplog.text
    other = dataclasses.replace(conv, n=3)
    for op in OPS:
        runner.check(lib.find(op, conv), conv, op, CPU)  # the size it was compiled for still runs
        assert lib.find(op, other) is None and lib.fixed_batches(op, other) == [4]
    net = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8))
    swap_depthwise(net, "tvm", str(tmp_path), CPU)
    with torch.no_grad():
        net(torch.randn(4, 8, 6, 6))
        with pytest.raises(RuntimeError, match=r"exported before kernels served every batch size.*batch size 4 only"
                                               r".*tune-kernels .*--db " + re.escape(str(tmp_path)) +
                                               r".*again to re-export"):
            net(torch.randn(3, 8, 6, 6))
