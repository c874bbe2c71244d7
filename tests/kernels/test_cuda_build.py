"""The CUDA templates compile here, GPU or not, to a library with a binary and no CUDA source."""

import random
import shutil

import pytest

pytest.importorskip("tvm")
if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc (the CUDA toolkit) to compile CUDA kernels", allow_module_level=True)

from pipedp.kernels.tvm.builder import compile_module, schedule  # noqa: E402
from pipedp.kernels.tvm.offline_cuda import CUDA_SOURCE_MARKERS  # noqa: E402
from pipedp.kernels.tvm.ops import OPS, DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402
from pipedp.kernels.tvm.template import get_template  # noqa: E402


@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compile_to_a_binary(op, tmp_path):
    target = make_target("cuda", "sm_90")
    template = get_template(target)
    conv = DepthwiseConv(4, 16, 14, 14, padding=1, stride=2 if op == "fwd" else 1)
    space = template.space(conv, op)
    rng = random.Random(0)
    while True:
        cfg = space.sample(rng)
        try:
            template.validate(conv, op, cfg)
            break
        except InvalidConfig:
            continue
    lib = compile_module(schedule(conv, op, cfg, target).mod, target)
    path = tmp_path / f"{op}.so"
    lib.export_library(str(path))
    data = path.read_bytes()
    assert not any(m in data for m in CUDA_SOURCE_MARKERS), "the library embeds CUDA source"
    assert b"sm_90" in data  # the fatbin for the requested arch
