"""The CUDA templates compile here, GPU or not, to a library with a binary and no CUDA source."""

import random
import shutil

import pytest

pytest.importorskip("tvm")
if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc (the CUDA toolkit) to compile CUDA kernels", allow_module_level=True)

from kernels.tvm import build as B  # noqa: E402
from kernels.tvm.offline_cuda import CUDA_SOURCE_MARKERS  # noqa: E402
from kernels.tvm.ops import OPS, DepthwiseConv  # noqa: E402
from kernels.tvm.space import InvalidConfig  # noqa: E402


@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compile_to_a_binary(op, tmp_path):
    target = B.make_target("cuda", "sm_90")
    conv = DepthwiseConv(4, 16, 14, 14, padding=1, stride=2 if op == "fwd" else 1)
    space = B.space(conv, op, target)
    rng = random.Random(0)
    while True:
        cfg = space.sample(rng)
        try:
            B.template(target).validate(conv, op, cfg)
            break
        except InvalidConfig:
            continue
    lib = B.compile_module(B.schedule(conv, op, cfg, target).mod, target)
    path = tmp_path / f"{op}.so"
    lib.export_library(str(path))
    data = path.read_bytes()
    assert not any(m in data for m in CUDA_SOURCE_MARKERS), "the library embeds CUDA source"
    assert b"sm_90" in data  # the fatbin for the requested arch
