"""The bandwidth bound: a copy of the operator's bytes, at their size on a CPU, at HBM scale on a GPU."""

import math

import pytest
import torch

from pipedp.kernels.tvm import roofline
from pipedp.ops.problem import DepthwiseConv

CONV = DepthwiseConv(4, 16, 20, 20, padding=(1, 1))


def test_copy_time_is_a_real_positive_measurement():
    us = roofline.copy_us(1 << 20, torch.device("cpu"))
    assert math.isfinite(us) and us > 0


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_cpu_bound_times_a_copy_of_the_operators_own_bytes(monkeypatch, op):
    seen = []
    monkeypatch.setattr(roofline, "copy_us", lambda n, d: seen.append(n) or 7.0)
    assert roofline.bound_us(CONV, op, torch.device("cpu")) == 7.0
    assert seen == [CONV.min_bytes(op)]


def test_gpu_bound_scales_the_hbm_copy_rate(monkeypatch):
    seen = []
    monkeypatch.setattr(roofline, "copy_us", lambda n, d: seen.append(n) or 1000.0)
    bound = roofline.bound_us(CONV, "fwd", torch.device("cuda"))
    assert seen == [roofline._GPU_COPY_BYTES]
    assert bound == pytest.approx(1000.0 * CONV.min_bytes("fwd") / roofline._GPU_COPY_BYTES)
