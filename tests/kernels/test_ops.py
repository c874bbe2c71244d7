"""The three depthwise operators, unscheduled and scheduled by the CPU template, against torch."""

import itertools
import random

import pytest

pytest.importorskip("tvm")
import torch  # noqa: E402

from pipedp.kernels.tvm import runner  # noqa: E402
from pipedp.kernels.tvm.builder import build  # noqa: E402
from pipedp.ops.layout import LAYOUTS, arrange  # noqa: E402
from pipedp.kernels.tvm.ops import OPS, DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402
from pipedp.kernels.tvm.template import get_template, layout_of, layouts_for  # noqa: E402

GRID = [
    DepthwiseConv(2, 4, 9, 7, padding=1),                                   # non-square input
    DepthwiseConv(1, 4, 11, 10, stride=2, padding=1),                        # stride 2
    DepthwiseConv(2, 2, 9, 9, dilation=2, padding=2),                        # dilation 2
    DepthwiseConv(2, 3, 8, 8, multiplier=2, kernel=5, padding=2),            # multiplier 2, kernel 5
    DepthwiseConv(1, 2, 8, 6, kernel=(3, 5), padding=(1, 0), stride=(1, 2)),  # non-square kernel
    DepthwiseConv(2, 3, 7, 7),                                               # padding 0
    DepthwiseConv(1, 2, 7, 7, kernel=7, padding=3),
    DepthwiseConv(1, 2, 5, 5, kernel=3, padding=3),                          # padding beyond the kernel
    DepthwiseConv(1, 2, 9, 9, stride=2, dilation=2, padding=2),              # stride and dilation on one axis
    DepthwiseConv(1, 2, 10, 9, kernel=4, stride=2, padding=1),               # taps divide evenly into phases
    DepthwiseConv(1, 3, 11, 11, multiplier=2, kernel=5, stride=3, padding=2),  # stride 3
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target():
    return make_target("cpu")


@pytest.mark.parametrize("conv", GRID, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scheduled_kernels_match_torch(conv, op, layout, target):
    tmpl = get_template(target, layout)
    space = tmpl.space(conv, op)
    rng = random.Random(hash((str(conv), op, layout)) & 0xFFFF)

    def valid(cfg):
        try:
            tmpl.validate(conv, op, cfg)
            return True
        except InvalidConfig:  # (the tuner never compiles these)
            return False

    configs = list(itertools.islice(filter(valid, space.all()), 1))
    configs += list(itertools.islice(filter(valid, (space.sample(rng) for _ in range(100))), 2))
    for cfg in configs:
        assert layout_of(cfg) == layout
        runner.check(build(conv, op, cfg, target), conv, op, CPU, layout)  # raises if off


def test_nhwc_kernels_take_channels_last_tensors_without_a_copy(target):
    conv = DepthwiseConv(2, 8, 6, 5, padding=1)
    kernel = build(conv, "fwd", get_template(target, "NHWC").space(conv, "fwd").sample(random.Random(0)), target)
    (x, w), ref = runner.reference(conv, "fwd", CPU)
    x = x.contiguous(memory_format=torch.channels_last)
    y = runner.call(kernel, "fwd", "NHWC", [arrange(x, "NHWC"), w], tuple(ref.shape))
    assert arrange(x, "NHWC").data_ptr() == x.data_ptr()
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.allclose(y, ref, atol=1e-5)


def test_cuda_has_a_template_for_each_layout():
    cuda = make_target("cuda", "sm_90")
    assert layouts_for(cuda) == LAYOUTS and layouts_for(make_target("cpu")) == LAYOUTS
    assert (get_template(cuda, "NCHW").name, get_template(cuda, "NHWC").name) == ("cuda", "cuda-nhwc")
    with pytest.raises(ValueError, match="layout 'NCHWc' has no cuda template"):
        get_template(cuda, "NCHWc")


def test_check_rejects_a_wrong_kernel():
    conv = DepthwiseConv(1, 2, 6, 6, padding=1)

    def wrong(x, w, y):
        y.zero_()

    with pytest.raises(ValueError, match="differs from torch"):
        runner.check(wrong, conv, "fwd", CPU)


@pytest.mark.parametrize("kw, match", [
    (dict(kernel=9), "1..7"), (dict(stride=0), "stride"), (dict(dtype="int8"), "dtype"),
    (dict(h=2, kernel=5), "empty"), (dict(multiplier=0), "multiplier"),
])
def test_bad_problems_are_clear_errors(kw, match):
    base = dict(n=1, c=2, h=8, w=8)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        DepthwiseConv(**base)


def test_problem_key_round_trips():
    p = DepthwiseConv(2, 3, 8, 6, multiplier=2, kernel=(3, 5), stride=(1, 2), padding=(1, 0))
    assert DepthwiseConv.from_key(p.key()) == p
    assert p.min_bytes("fwd") == 4 * (2 * 3 * 8 * 6 + 6 * 15 + 2 * 6 * 8 * 1)
