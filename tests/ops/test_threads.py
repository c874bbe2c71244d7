"""TVM's CPU pool follows torch's thread count (TVM alone takes half the vCPUs on x86)."""

import os
import random

import pytest
import torch

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402

from pipedp.kernels.tvm import runner  # noqa: E402
from pipedp.kernels.tvm.builder import build  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402
from pipedp.kernels.tvm.template import get_template  # noqa: E402
from pipedp.ops import threads  # noqa: E402
from pipedp.ops.problem import DepthwiseConv  # noqa: E402


def _tvm_threads() -> int:
    return int(tvm_ffi.get_global_func("runtime.NumThreads")())


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    threads.match_torch()


@pytest.mark.parametrize("n", sorted({1, min(2, len(os.sched_getaffinity(0)))}))
def test_configure_sets_pool_width(n, torch_threads):
    threads.configure(n)
    assert _tvm_threads() == n


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_configure_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="positive int"):
        threads.configure(bad)


def test_kernel_calls_follow_torch(torch_threads):
    conv = DepthwiseConv(2, 8, 6, 6, padding=(1, 1))
    target = make_target("cpu")
    kernel = build(conv, "fwd", get_template(target).space(conv, "fwd").sample(random.Random(0)), target)
    inputs, ref = runner.reference(conv, "fwd", torch.device("cpu"))
    for n in (1, 2):
        torch.set_num_threads(n)
        out = runner.call(kernel, "fwd", "NCHW", inputs, tuple(ref.shape))
        assert _tvm_threads() == n
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
