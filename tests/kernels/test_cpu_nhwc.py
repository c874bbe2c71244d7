"""The NHWC CPU template's loop structure: what it parallelises and vectorises."""

import pytest
import torch

pytest.importorskip("tvm")

from tvm.tirx import ForKind  # noqa: E402

from pipedp.kernels.tvm.builder import build, schedule  # noqa: E402
from pipedp.kernels.tvm.runner import check  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402


@pytest.mark.parametrize("nsplit", [1, 4])
def test_wgrad_parallel_tasks_are_n_splits_times_channel_blocks(nsplit):
    conv = DepthwiseConv(8, 96, 6, 6, padding=1)
    cfg = {"layout": "NHWC", "vec": 16, "nsplit": nsplit, "unroll": 1, "tile_w": 2}
    sch = schedule(conv, "wgrad", cfg, make_target("cpu"))
    block = sch.get_sblock("dwT_rf_update" if nsplit > 1 else "dwT_update")
    loops = [sch.get(loop) for loop in sch.get_loops(block)]
    kinds = [loop.kind for loop in loops]
    assert int(loops[0].extent) == nsplit * 96 // 16 and kinds[0] == ForKind.PARALLEL
    assert int(loops[-1].extent) == 16 and kinds[-1] == ForKind.VECTORIZED  # the channel vector
    assert [int(loop.extent) for loop in loops[-4:-1]] == [3, 3, 2] and kinds[-4:-1] == [ForKind.UNROLLED] * 3


def test_wgrad_register_tile_loads_shared_taps_once_and_old_records_still_build():
    conv = DepthwiseConv(2, 32, 6, 8, padding=1)
    target = make_target("cpu")
    cfg = {"layout": "NHWC", "vec": 16, "nsplit": 1, "unroll": 1, "tile_w": 4}
    sch = schedule(conv, "wgrad", cfg, target)
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("dwT_update"))]
    assert [int(loop.extent) for loop in loops[-3:]] == [3, 4, 16]  # s, w tile, channels
    assert [loop.kind for loop in loops[-2:]] == [ForKind.UNROLLED, ForKind.VECTORIZED]
    old = {"layout": "NHWC", "vec": 16, "nsplit": 1, "unroll": 1}  # a record from before tile_w
    check(build(conv, "wgrad", old, target), conv, "wgrad", torch.device("cpu"), "NHWC")
    check(build(conv, "wgrad", cfg, target), conv, "wgrad", torch.device("cpu"), "NHWC")


@pytest.mark.parametrize("conv", [DepthwiseConv(4, 32, 7, 9, padding=1), DepthwiseConv(4, 16, 9, 8, stride=2, padding=1),
                                  DepthwiseConv(2, 8, 6, 6, multiplier=2, kernel=5, padding=2)], ids=str)
def test_wgrad_pixel_order_runs_every_channel_of_a_task_and_matches_torch(conv):
    target = make_target("cpu")
    cfg = {"layout": "NHWC", "vec": 16 if conv.out_channels % 16 == 0 else 8, "nsplit": 2, "unroll": 1,
           "tile_w": 1, "order": "pixel"}
    sch = schedule(conv, "wgrad", cfg, target)
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("dwT_rf_update"))]
    assert loops[0].kind == ForKind.PARALLEL and int(loops[0].extent) == 2  # the n splits only
    assert int(loops[4].extent) == conv.out_channels // cfg["vec"]  # channel blocks inside (n, h, w_outer)
    check(build(conv, "wgrad", cfg, target), conv, "wgrad", torch.device("cpu"), "NHWC")
    with pytest.raises(InvalidConfig, match="nsplit >= 2"):
        schedule(conv, "wgrad", dict(cfg, nsplit=1), target)
