"""Default CUDA configs: valid for the problem (after scheduling too), dividing tiles, enough blocks, stable."""

import pytest

pytest.importorskip("tvm")

from pipedp.kernels.tvm.builder import schedule  # noqa: E402
from pipedp.kernels.tvm.cuda import small_plane  # noqa: E402
from pipedp.kernels.tvm.defaults import MIN_BLOCKS, default_config  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402


@pytest.mark.parametrize("conv", [DepthwiseConv(64, 32, 112, 112, padding=1),
                                  DepthwiseConv(64, 144, 56, 56, kernel=5, padding=2, stride=2, dtype="bfloat16"),
                                  DepthwiseConv(64, 960, 7, 7, padding=1)], ids=str)
def test_defaults_schedule_and_tile_large_planes_evenly(conv):
    target = make_target("cuda", "sm_90")
    for layout in ("NCHW", "NHWC"):
        for op in ("fwd", "dgrad"):
            cfg = default_config(conv, op, layout)
            schedule(conv, op, cfg, target)  # raises InvalidConfig for a config that does not fit
            assert default_config(conv, op, layout) == cfg  # the same every time
            h, w = conv.out_hw if op == "fwd" else (conv.h, conv.w)
            if layout == "NCHW" and not small_plane(conv, op):
                assert h % (cfg["th"] * cfg["ih"]) == 0 and w % (cfg["vt_w"] * cfg["tw"] * cfg["iw"]) == 0
            if layout == "NCHW" and small_plane(conv, op):
                assert cfg["flat"] == 1
            if layout == "NHWC":
                channels = conv.out_channels if op == "fwd" else conv.c
                assert cfg["vec"] == (4 if conv.dtype == "float32" else 8)  # 16-byte loads
                assert channels % (cfg["tc"] * cfg["vec"]) == 0


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_default_grad_weight_splits_its_sum_over_enough_blocks(layout):
    conv = DepthwiseConv(64, 32, 56, 56, padding=1)  # 32 channels: 32 blocks without splits
    cfg = default_config(conv, "wgrad", layout)
    channel_blocks = 32 if layout == "NCHW" else -(-32 // cfg["tc"])
    assert channel_blocks * cfg["splits"] >= MIN_BLOCKS
    schedule(conv, "wgrad", cfg, make_target("cuda", "sm_90"))
