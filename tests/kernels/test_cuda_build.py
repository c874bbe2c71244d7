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


@pytest.mark.parametrize("conv", [DepthwiseConv(4, 3, 9, 7, multiplier=2, kernel=5, padding=2),   # tile_c 2 of 3 (6)
                                  DepthwiseConv(2, 8, 9, 9, stride=2),                            # no padding
                                  DepthwiseConv(3, 6, 10, 8, kernel=(3, 5), padding=(1, 2), dilation=2)], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compile_for_any_batch_size(conv, op):
    # A block's tile lies within one sample, so TVM's bounds of the shared-memory tile never involve the batch
    # (with the batch fused into the planes they did, and a symbolic batch overflowed them).
    target = make_target("cuda", "sm_90")
    template = get_template(target)
    space = template.space(conv, op)
    rng = random.Random(1)
    built = 0
    while built < 2:
        cfg = space.sample(rng)
        if op != "wgrad":
            cfg["tile_c"] = 2
        try:
            template.validate(conv, op, cfg)
        except InvalidConfig:
            continue
        mod = schedule(conv, op, cfg, target).mod
        assert 'T.Buffer(("n",' in mod.script()  # the batch is the kernel's argument, not conv.n
        compile_module(mod, target)
        built += 1
