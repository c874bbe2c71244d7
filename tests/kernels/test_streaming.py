"""Streaming output stores: the IR pass, the template knob, and kernels that use them matching torch."""

import json
import re
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("tvm")

from pipedp.kernels.tvm import builder as B  # noqa: E402
from pipedp.kernels.tvm import export as E  # noqa: E402
from pipedp.ops import records as R  # noqa: E402
from pipedp.kernels.tvm import streaming  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.runner import check  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402
from pipedp.kernels.tvm.target import make_target, target_key  # noqa: E402
from pipedp.kernels.tvm.template import get_template  # noqa: E402

pytestmark = pytest.mark.skipif(not streaming.available(), reason="streaming stores are an x86-64 pass")

CPU = torch.device("cpu")
CONV = DepthwiseConv(2, 32, 6, 10, padding=1)  # small: the tests lower the size floor instead
CFG = {"layout": "NHWC", "vec": 16, "tile_w": 2, "task": "row", "cache": 1, "unroll": 1, "stream": 1}


@pytest.fixture
def no_floor(monkeypatch):
    monkeypatch.setattr(streaming, "MIN_BYTES", 0)


def _ir(op="fwd", cfg=CFG):
    target = make_target("cpu")
    plain = dict(cfg, stream=0)
    return B.compile_module(B.schedule(CONV, op, plain, target).mod, target).mod.inspect_source("ll")


def _marked(text):
    return [line for line in text.split("\n") if "!nontemporal" in line]


@pytest.mark.parametrize("op,buffer", [("fwd", "y"), ("dgrad", "dx")])
def test_mark_streams_the_output_stores_and_fences(no_floor, op, buffer):
    ll = _ir(op)
    text = streaming.mark(ll, {B.default_symbol(op): buffer})
    marked = _marked(text)
    assert marked and all(re.match(r"\s*store <\d+ x float>", line) for line in marked)
    assert text.count("call void @llvm.x86.sse.sfence()") >= 1 and text.count(streaming._FENCE) == 1


def test_mark_leaves_other_buffers_alone(no_floor):
    ll = _ir("fwd", dict(CFG, cache=1))
    text = streaming.mark(ll, {"depthwise_fwd": "y"})
    local = [line for line in _marked(text) if "%y_local" in line]
    assert not local  # the register tile's stores stay plain


def test_mark_refuses_what_it_cannot_stream(no_floor):
    ll = _ir("fwd")
    with pytest.raises(streaming.StreamingError, match="no vector store to its output 'x'"):
        streaming.mark(ll, {"depthwise_fwd": "x"})  # the input is never stored to
    with pytest.raises(streaming.StreamingError, match="no function"):
        streaming.mark(ll, {"depthwise_dgrad": "dx"})


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("conv", [CONV, DepthwiseConv(2, 32, 9, 7, stride=2, padding=1),
                                  DepthwiseConv(1, 16, 8, 8, multiplier=2, kernel=5, padding=2)])
def test_streaming_kernels_match_torch(no_floor, op, conv):
    cfg = dict(CFG, vec=16, tile_w=1)
    check(B.build(conv, op, cfg, make_target("cpu")), conv, op, CPU, "NHWC")  # raises if off


def test_knob_only_for_outputs_that_leave_the_cache():
    target = make_target("cpu")
    nhwc = get_template(target, "NHWC")
    small = nhwc.space(CONV, "fwd")
    big = DepthwiseConv(32, 32, 112, 112, padding=1)  # 51 MB output
    assert "stream" not in small.names and "stream" in nhwc.space(big, "fwd").names
    assert "stream" in nhwc.space(big, "dgrad").names
    assert "stream" not in nhwc.space(big, "wgrad").names  # its output is the weights' size
    with pytest.raises(InvalidConfig, match="stream=1 needs cache=1"):
        B.schedule(big, "fwd", dict(CFG, cache=0), target)


def test_exported_library_streams_and_matches_torch(no_floor, tmp_path):
    target = make_target("cpu")
    key = target_key(target)
    for op in ("fwd", "dgrad"):
        R.append(tmp_path / R.RECORDS_FILE, {"kind": "measure", "op": op, "problem": CONV.key(), "layout": "NHWC",
                                              "target": key, "config": CFG, "us": 1.0, "torch_us": {}})
    record = E.export(str(tmp_path), target)
    path = tmp_path / record["library"]
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True).stdout
        assert "vmovntps" in asm and "sfence" in asm
    import tvm_ffi

    lib = tvm_ffi.load_module(str(path))
    for pk, symbol in record["kernels"].items():
        op = json.loads(pk)[0]
        check(lib[symbol], CONV, op, CPU, "NHWC")
