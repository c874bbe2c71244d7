"""The NHWC CPU template's loop structure: what it parallelises and vectorises."""

import pytest

pytest.importorskip("tvm")

from tvm.tirx import ForKind  # noqa: E402

from kernels.tvm import build as B  # noqa: E402
from kernels.tvm.ops import DepthwiseConv  # noqa: E402


@pytest.mark.parametrize("nsplit", [1, 4])
def test_wgrad_parallel_tasks_are_n_splits_times_channel_blocks(nsplit):
    conv = DepthwiseConv(8, 96, 6, 6, padding=1)
    cfg = {"layout": "NHWC", "vec": 16, "nsplit": nsplit, "unroll": 1}
    sch = B.schedule(conv, "wgrad", cfg, B.make_target("cpu"))
    block = sch.get_sblock("dwT_rf_update" if nsplit > 1 else "dwT_update")
    loops = [sch.get(loop) for loop in sch.get_loops(block)]
    kinds = [loop.kind for loop in loops]
    assert int(loops[0].extent) == nsplit * 96 // 16 and kinds[0] == ForKind.PARALLEL
    assert int(loops[-1].extent) == 16 and kinds[-1] == ForKind.VECTORIZED  # the channel vector
    assert [int(loop.extent) for loop in loops[-3:-1]] == [3, 3] and kinds[-3:-1] == [ForKind.UNROLLED] * 2
