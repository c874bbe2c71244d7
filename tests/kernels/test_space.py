"""Knob spaces and the templates' constraints, checked before anything compiles."""

import random

import pytest

pytest.importorskip("tvm")

from pipedp.kernels.tvm import template  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig, Knob, Space, divisors  # noqa: E402

SPACE = Space("t", (Knob("a", (1, 2, 4)), Knob("b", ("x", "y"))))
cpu, cuda = template.get_template("llvm"), template.get_template("cuda")


def test_space_size_enumeration_and_features():
    assert len(SPACE) == 6 and len(list(SPACE.all())) == 6
    assert SPACE.features({"a": 4, "b": "y"}) == [4.0, 1.0]
    assert divisors(12, 6) == (1, 2, 3, 4, 6)


def test_neighbours_stay_in_the_space_and_move():
    rng = random.Random(0)
    for _ in range(50):
        c = SPACE.sample(rng)
        n = SPACE.neighbours(c, rng)
        SPACE.check(n)
        assert n != c


@pytest.mark.parametrize("cfg, match", [
    ({"a": 3, "b": "x"}, "not one of"), ({"a": 1}, "missing"), ({"a": 1, "b": "x", "c": 0}, "unknown knob"),
])
def test_check_names_the_bad_knob(cfg, match):
    with pytest.raises(InvalidConfig, match=match):
        SPACE.check(cfg)


def test_cuda_constraints_reject_before_compiling():
    conv = DepthwiseConv(8, 32, 56, 56, padding=1)
    ok = {"tile_c": 1, "vt_h": 1, "vt_w": 2, "th": 4, "tw": 8, "ih": 2, "iw": 1, "unroll": 16}
    cuda.validate(conv, "fwd", ok)
    with pytest.raises(InvalidConfig, match="threads per block"):
        cuda.validate(conv, "fwd", {**ok, "tile_c": 1, "th": 1, "tw": 4})  # 4 threads: under a warp
    with pytest.raises(InvalidConfig, match="shared memory"):
        cuda.validate(DepthwiseConv(1, 8, 512, 512, kernel=7, padding=3), "fwd",
                      {**ok, "tile_c": 4, "th": 8, "tw": 16, "ih": 4, "vt_h": 2, "vt_w": 4, "iw": 2})
    with pytest.raises(InvalidConfig, match="registers per block"):  # 1024 threads x 64 accumulators: would spill
        cuda.validate(DepthwiseConv(1, 8, 512, 512, padding=1), "fwd",
                      {**ok, "tile_c": 4, "th": 16, "tw": 16, "ih": 4, "vt_h": 2, "vt_w": 4, "iw": 2})
    with pytest.raises(InvalidConfig, match="twice"):
        cuda.validate(DepthwiseConv(8, 32, 4, 4, padding=1), "fwd", {**ok, "flat": 0})  # (small planes have flat)
    assert len(cuda.features(conv, "fwd", ok)) == 7 and len(cpu.features(conv, "wgrad", {"lanes": 8})) == 3


def test_cuda_constraints_hold_at_every_batch_size():
    # A kernel serves every batch size: a block's planes are one sample's channels, whatever n was tuned.
    with pytest.raises(InvalidConfig, match="exceeds the 2 channels of a sample"):
        cuda.validate(DepthwiseConv(64, 2, 16, 16, padding=1), "fwd",
                      {"tile_c": 4, "vt_h": 1, "vt_w": 1, "th": 2, "tw": 8, "ih": 1, "iw": 1, "unroll": 0, "flat": 0})
    # grad-weight keeps every thread's partial sums of all taps in shared memory
    cuda.validate(DepthwiseConv(8, 32, 14, 14, kernel=5, padding=2), "wgrad",
                  {"threads": 256, "unroll": 16, "splits": 1})
    with pytest.raises(InvalidConfig, match="51200 bytes of shared memory per block"):
        cuda.validate(DepthwiseConv(8, 32, 14, 14, kernel=5, padding=2), "wgrad",
                      {"threads": 512, "unroll": 16, "splits": 1})


def test_cpu_space_uses_tiles_that_divide_the_output():
    conv = DepthwiseConv(2, 8, 28, 28, padding=1, stride=2)
    sp = cpu.space(conv, "fwd")
    tiles = dict((k.name, k.choices) for k in sp.knobs)
    assert all(14 % t == 0 for t in tiles["tile_h"]) and all(14 % t == 0 for t in tiles["tile_w"])
    assert cpu.space(DepthwiseConv(2, 8, 28, 28), "fwd").knobs[2].choices == ("none",)  # no padding stage


def test_configs_recorded_before_a_knob_existed_get_what_they_did_then():
    grown = Space("t", (Knob("a", (1, 2)), Knob("stream", (0, 1), since=0)))
    assert grown.complete({"a": 2}) == {"a": 2, "stream": 0}
    assert grown.complete({"a": 2, "stream": 1}) == {"a": 2, "stream": 1}
    with pytest.raises(InvalidConfig, match="knob a missing"):
        grown.check(grown.complete({"stream": 1}))  # a knob without `since` stays required


def test_templates_are_registered_by_target_kind_and_layout(monkeypatch):
    assert (cpu.name, cuda.name, template.get_template("llvm", "NHWC").name) == ("cpu", "cuda", "cpu-nhwc")
    assert template.layouts_for("llvm") == ("NCHW", "NHWC") and template.layouts_for("cuda") == ("NCHW", "NHWC")
    with pytest.raises(ValueError, match="no template for rocm targets: there are for cuda, llvm"):
        template.get_template("rocm")

    class Plain:  # a new target kind is one registered object: nothing else changes
        name = "plain"

        def __getattr__(self, method):
            return getattr(cpu, method)

    monkeypatch.setitem(template._REGISTRY, ("rocm", "NHWC"), Plain())
    assert template.layouts_for("rocm") == ("NHWC",) and template.get_template("rocm", "NHWC").name == "plain"
    with pytest.raises(ValueError, match="layout 'NCHWc'"):
        template.register("rocm", "NCHWc", Plain())
