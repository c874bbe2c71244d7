"""The CUDA templates compile here, GPU or not, to a library with a binary and no CUDA source."""

import random
import re
import shutil

import pytest

pytest.importorskip("tvm")
if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc (the CUDA toolkit) to compile CUDA kernels", allow_module_level=True)

from pipedp.kernels.tvm import cuda  # noqa: E402
from pipedp.kernels.tvm.builder import compile_module, schedule  # noqa: E402
from pipedp.kernels.tvm.cuda_common import allocated_shared  # noqa: E402
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


def _source(conv, op, cfg):
    """The CUDA source of one kernel compiled for sm_90 (nvcc runs: a config that does not compile fails)."""
    target = make_target("cuda", "sm_90")
    lib = compile_module(schedule(conv, op, cfg, target).mod, target)
    return lib.mod.imports[0].inspect_source()


_NCHW = {"fwd": dict(tile_c=2, vt_h=1, vt_w=2, th=4, tw=8, ih=2, iw=1, unroll=16),
         "dgrad": dict(tile_c=4, vt_h=1, vt_w=1, th=2, tw=8, ih=1, iw=2, unroll=0),
         "wgrad": dict(threads=64, unroll=16, splits=1)}
_NHWC = {"fwd": dict(layout="NHWC", vec=4, tc=8, tw=4, th=2, vt_w=1, ih=2, iw=1, unroll=16),
         "dgrad": dict(layout="NHWC", vec=2, tc=16, tw=2, th=2, vt_w=2, ih=1, iw=1, unroll=0),
         "wgrad": dict(layout="NHWC", tc=16, ty=8, splits=1, unroll=16)}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_every_op_layout_and_dtype_compiles_and_accumulates_in_fp32(layout, op, dtype):
    conv = DepthwiseConv(16, 32, 28, 28, padding=1, stride=2 if op != "dgrad" else 1, dtype=dtype)
    src = _source(conv, op, (_NCHW if layout == "NCHW" else _NHWC)[op])
    elem = {"float32": "float", "float16": "half", "bfloat16": "nv_bfloat16"}[dtype]
    assert f"{elem}* __restrict__ {'x' if op != 'dgrad' else 'dy'}_ptr" in src  # the problem's dtype in memory
    accumulators = re.findall(r"alignas\(64\) (\w+) \w+_local_ptr\[", src)  # the registers the sums are kept in
    assert accumulators and set(accumulators) == {"float"}


def test_small_planes_offer_the_flat_mapping_and_it_runs_threads_as_one_flat_run():
    template = get_template(make_target("cuda", "sm_90"))
    small, large = DepthwiseConv(8, 64, 7, 7, padding=1), DepthwiseConv(8, 64, 56, 56, padding=1)
    assert "flat" in template.space(small, "fwd").names and "flat" not in template.space(large, "fwd").names
    cfg = dict(tile_c=8, vt_h=1, vt_w=1, th=1, tw=32, ih=1, iw=1, unroll=16, flat=1)
    for op, dtype in (("fwd", "bfloat16"), ("dgrad", "float32")):
        src = _source(DepthwiseConv(8, 64, 7, 7, padding=1, dtype=dtype), op, cfg)
        assert "__launch_bounds__(256)" in src and "threadIdx.y" not in src and "threadIdx.z" not in src
    with pytest.raises(InvalidConfig, match="set th to 1"):
        template.validate(small, "fwd", dict(cfg, th=2))
    with pytest.raises(InvalidConfig, match="unknown knob"):
        template.validate(large, "fwd", cfg)
    with pytest.raises(InvalidConfig, match="would idle"):
        template.validate(DepthwiseConv(8, 64, 3, 3, padding=1), "fwd", dict(cfg, tile_c=1))  # 32 threads, 9 outputs


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_grad_weight_is_two_stages_and_threads_past_the_taps_write_nothing(layout, dtype):
    conv = DepthwiseConv(16, 48, 14, 14, kernel=5, padding=2, dtype=dtype)  # 48 channels: not a multiple of tc=32
    cfg = dict(_NCHW["wgrad"], splits=4) if layout == "NCHW" else dict(_NHWC["wgrad"], tc=32, ty=4, splits=4)
    src = _source(conv, "wgrad", cfg)
    kernels = re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", src)
    # stage 1 (partial sums per split), stage 2 (their sum); NHWC and fp16/bf16 add the small transpose/rounding
    extra = layout == "NHWC" or dtype != "float32"
    assert len(set(kernels)) == 2 + extra
    assert "_rf_ptr" in src and "atomic" not in src  # a global buffer of partial sums, no atomics
    taps_guard = r"threadIdx\.x\) < 25" if layout == "NCHW" else r"threadIdx\.y\)\) < 25"
    assert re.search(taps_guard, src), "the threads past the 25 taps must be guarded"
    template = get_template(make_target("cuda", "sm_90"), layout)
    few = DepthwiseConv(1, 48, 4, 4, kernel=5, padding=2)
    with pytest.raises(InvalidConfig, match="terms of the"):
        template.validate(few, "wgrad", cfg)  # 16 terms over 4 splits x the threads


def test_nhwc_template_loads_a_vector_of_channels_per_instruction():
    for dtype, vec, vector in (("float32", 4, "float4"), ("bfloat16", 8, "uint4"), ("float16", 2, "uint1")):
        conv = DepthwiseConv(4, 32, 14, 14, padding=1, dtype=dtype)
        cfg = dict(_NHWC["fwd"], vec=vec, tc=4)
        src = _source(conv, "fwd", cfg)
        if vec > 2:
            assert f"*({vector}*)(x_ptr" in src
    template = get_template(make_target("cuda", "sm_90"), "NHWC")
    assert template.space(DepthwiseConv(1, 144, 8, 8), "fwd").knobs[1].choices == (1, 2, 4)  # fp32: 16 bytes
    assert template.space(DepthwiseConv(1, 144, 8, 8, dtype="bfloat16"), "fwd").knobs[1].choices == (1, 2, 4, 8)
    assert template.space(DepthwiseConv(1, 3, 8, 8), "fwd").knobs[1].choices == (1,)
    with pytest.raises(InvalidConfig, match="shared memory"):
        template.validate(DepthwiseConv(1, 512, 64, 64), "fwd",
                          dict(_NHWC["fwd"], vec=4, tc=32, tw=8, th=4, ih=2, iw=2, vt_w=1))


@pytest.mark.parametrize("layout, op, cfg", [
    ("NCHW", "fwd", dict(tile_c=32, vt_h=1, vt_w=1, th=8, tw=4, ih=1, iw=1, unroll=64, flat=0)),
    ("NHWC", "fwd", dict(layout="NHWC", vec=1, tc=32, tw=8, th=1, vt_w=1, ih=4, iw=1, unroll=0)),
    ("NHWC", "dgrad", dict(layout="NHWC", vec=4, tc=16, tw=2, th=1, vt_w=2, ih=2, iw=2, unroll=0))])
def test_shared_memory_is_counted_as_the_kernel_declares_it(layout, op, cfg):
    conv = DepthwiseConv(8, 672, 14, 14, kernel=5, padding=2, stride=2 if op == "fwd" else 1)
    mod = schedule(conv, op, cfg, make_target("cuda", "sm_90")).mod
    declared = sum({"float": 4, "half": 2, "nv_bfloat16": 2}[t] * int(n) for t, n in
                   re.findall(r"__shared__ alignas\(\d+\) (\w+) \w+\[(\d+)\]", _source(conv, op, cfg)))
    assert allocated_shared(mod) == declared > 0


def test_a_tile_that_does_not_divide_the_plane_is_rejected_after_scheduling():
    # 4x4 tiles of a 14x14 output: TVM stages each block's 32 whole padded planes (160000 bytes), where the
    # tile-size estimate that validate uses says 18688: the check after scheduling refuses it before nvcc would
    conv = DepthwiseConv(8, 672, 28, 28, kernel=5, padding=2, stride=2)
    cfg = dict(tile_c=32, vt_h=1, vt_w=1, th=4, tw=4, ih=1, iw=1, unroll=0, flat=0)
    template = get_template(make_target("cuda", "sm_90"))
    template.validate(conv, "fwd", cfg)
    assert cuda.shared_bytes(conv, "fwd", cfg) == 18688
    with pytest.raises(InvalidConfig, match="160000 bytes of shared memory per block"):
        schedule(conv, "fwd", cfg, make_target("cuda", "sm_90"))
