"""The three depthwise operators, unscheduled and scheduled by the CPU template, against torch."""

import itertools
import random

import pytest

pytest.importorskip("tvm")
import torch  # noqa: E402

from kernels.tvm import build as B  # noqa: E402
from kernels.tvm.ops import OPS, DepthwiseConv  # noqa: E402

GRID = [
    DepthwiseConv(2, 4, 9, 7, padding=1),                                   # non-square input
    DepthwiseConv(1, 4, 11, 10, stride=2, padding=1),                        # stride 2
    DepthwiseConv(2, 2, 9, 9, dilation=2, padding=2),                        # dilation 2
    DepthwiseConv(2, 3, 8, 8, multiplier=2, kernel=5, padding=2),            # multiplier 2, kernel 5
    DepthwiseConv(1, 2, 8, 6, kernel=(3, 5), padding=(1, 0), stride=(1, 2)),  # non-square kernel
    DepthwiseConv(2, 3, 7, 7),                                               # padding 0
    DepthwiseConv(1, 2, 7, 7, kernel=7, padding=3),
    DepthwiseConv(1, 2, 5, 5, kernel=3, padding=3),                          # padding beyond the kernel
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target():
    return B.make_target("cpu")


@pytest.mark.parametrize("conv", GRID, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_scheduled_kernels_match_torch(conv, op, target):
    space = B.space(conv, op, target)
    rng = random.Random(hash((str(conv), op)) & 0xFFFF)
    configs = list(itertools.islice(space.all(), 1)) + [space.sample(rng) for _ in range(2)]
    for cfg in configs:
        B.check(B.build(conv, op, cfg, target), conv, op, CPU)  # raises if off


def test_check_rejects_a_wrong_kernel():
    conv = DepthwiseConv(1, 2, 6, 6, padding=1)

    def wrong(x, w, y):
        y.zero_()

    with pytest.raises(ValueError, match="differs from torch"):
        B.check(wrong, conv, "fwd", CPU)


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
