"""The CUDA templates' kernels, run on the CPU thread after thread (kernels.tvm.emulate): in bounds, every output
element written once, right, at batch sizes other than the one they were validated at.

The H100 run of 2026-11-25 (experiments/results/depthwise_gpu_h100_2026-11-25.*) found two faults in the
generated kernels, both from the schedules, both reproduced here without a GPU:

- NCHW forward and grad-input with the flat mapping of small planes wrote back their accumulators under the
  buffer's bounds only: past the block's tile the flat index runs into the next block's planes, whose first
  outputs then got another thread's unset accumulator (14x14 and 7x7 planes: 16 rows "wrong");
- grad-weight (both layouts) lost the predicate of its split (n, h, w) sum when the partial sums were moved
  with compute_at: threads summed past their chunk (twice-counted terms: wrong at most batch sizes, e.g. the
  CUDA tests' 1 and 3) and, in the last chunk, read past the end of x and dy ("an illegal memory access").

The H200 round of 2026-11-28 (experiments/results/depthwise_gpu_h200_2026-11-28.log, rows 41 and 42) found a
third: NHWC grad-weight with a channel tile wider than the channels (tc=64, c=32) summed its partial sums in a
loop over the 32 channels bound to threadIdx.x, in a kernel launched with 64: TVM guards no such loop, so threads
32..63 ran past the channels, past the end of the shared partial sums and of the global ones ("an illegal memory
access"). Serially on a CPU every loop runs its own extent, so the emulator finds this one in the schedule
(emulate.thread_mismatches). The same configs copied their registers' sums to shared memory unguarded where the
split of (n, h, w) leaves a tail (e.g. 14x14 planes): threads past the channels overwrote other taps' sums. And
with fewer (tap, channel) outputs than 64 (up to 7 channels of 3x3 taps), the second kernel of a split sum wrote
past the end of grad-weight (both layouts).

Each check runs in a worker process: a read far out of bounds can end the process, as it faults on a GPU.
"""

import dataclasses

import pytest

pytest.importorskip("tvm")

from pipedp.kernels.tvm import emulate  # noqa: E402
from pipedp.ops.problem import DepthwiseConv  # noqa: E402
from pipedp.ops.worker import Worker  # noqa: E402

NCHW_FLAT = {"flat": 1, "ih": 1, "iw": 1, "th": 1, "tile_c": 8, "tw": 16, "unroll": 16, "vt_h": 1, "vt_w": 1}


def _conv(c, h, k=3, s=1, dtype="float32"):
    return DepthwiseConv(64, c, h, h, kernel=(k, k), stride=(s, s), padding=(k // 2, k // 2), dtype=dtype)


# The configs of the H100's library (.gpu/kernels/round.json) for the first rows that were wrong or faulted, and
# the CUDA tests' first failures (grad-weight at n=1 and 3).
H100_FAILURES = [
    pytest.param(_conv(192, 28, s=2), "fwd", NCHW_FLAT, id="row259-fwd-14x14-flat"),
    pytest.param(_conv(576, 14), "dgrad", {**NCHW_FLAT, "tile_c": 16}, id="row272-dgrad-14x14-flat"),
    pytest.param(_conv(960, 7, dtype="bfloat16"), "fwd", {**NCHW_FLAT, "tile_c": 16}, id="fwd-7x7-flat-bf16"),
    pytest.param(_conv(192, 28, s=2), "wgrad", {"splits": 2, "threads": 256, "unroll": 16}, id="row261-wgrad-nchw"),
    pytest.param(_conv(192, 28, s=2), "wgrad", {"layout": "NHWC", "splits": 64, "tc": 32, "ty": 8, "unroll": 16},
                 id="row261-wgrad-nhwc"),
    pytest.param(_conv(576, 14, s=2), "wgrad", {"splits": 1, "threads": 256, "unroll": 16},
                 id="row279-wgrad-7x7-one-split"),  # (its sum kept in the output: one write counted, at its init)
    pytest.param(_conv(576, 14, s=2, dtype="bfloat16"), "wgrad", {"splits": 1, "threads": 256, "unroll": 16},
                 id="row282-illegal-access-wgrad-7x7-bf16"),
    pytest.param(_conv(576, 14, s=2, dtype="bfloat16"), "wgrad",
                 {"layout": "NHWC", "splits": 16, "tc": 32, "ty": 8, "unroll": 16}, id="row282-wgrad-nhwc-bf16"),
    pytest.param(_conv(32, 32), "wgrad", {"splits": 16, "threads": 256, "unroll": 16}, id="test1-wgrad-c32"),
    pytest.param(_conv(144, 32, s=2), "wgrad", {"layout": "NHWC", "splits": 64, "tc": 32, "ty": 8, "unroll": 16},
                 id="test1-wgrad-nhwc-c144"),
]


_H200 = DepthwiseConv(128, 32, 32, 32, kernel=(3, 3), padding=(1, 1))  # (c=32 at n=128, as tuned)
# Grad-weight of few channels: NHWC channel tiles wider than the channels (the configs of the H200 round that
# faulted, rows 41 and 42; the default config of 8 channels, whose split of (n, h, w) has a tail at every batch
# size), and the splits' sum over fewer (tap, channel) outputs than its block's 64 threads (3x3 taps x 4 channels,
# either layout: its threads past them wrote past grad-weight's end)
FEW_CHANNELS = [
    pytest.param(_H200, {"layout": "NHWC", "splits": 16, "tc": 64, "ty": 4, "unroll": 64}, id="h200-row41-tc64-c32"),
    pytest.param(_H200, {"layout": "NHWC", "splits": 128, "tc": 64, "ty": 16, "unroll": 16}, id="h200-row42-tc64-c32"),
    pytest.param(_H200, {"layout": "NHWC", "splits": 1, "tc": 64, "ty": 8, "unroll": 16}, id="tc64-c32-one-split"),
    pytest.param(_conv(8, 14, s=2), {"layout": "NHWC", "splits": 64, "tc": 16, "ty": 8, "unroll": 16},
                 id="default-tc16-c8-split-with-a-tail"),
    pytest.param(_conv(4, 14), {"splits": 8, "threads": 64, "unroll": 16}, id="nchw-splits-sum-of-36"),
    pytest.param(_conv(4, 14), {"layout": "NHWC", "splits": 8, "tc": 8, "ty": 32, "unroll": 16},
                 id="nhwc-splits-sum-of-36"),
]


@pytest.fixture(scope="module")
def worker():
    with Worker() as w:
        yield w


def _ok(findings):
    assert findings and all(f.ok for f in findings), "\n".join(map(str, findings))


@pytest.mark.parametrize("conv, op, config", H100_FAILURES)
def test_the_kernels_that_failed_on_the_h100_are_in_bounds_and_right(worker, conv, op, config):
    _ok(worker.call(emulate.check, (conv, op, config, (1, 3)), 600))


@pytest.mark.parametrize("conv, config", FEW_CHANNELS)
def test_grad_weight_of_few_channels_idles_the_threads_past_them(worker, conv, config):
    _ok(worker.call(emulate.check, (conv, "wgrad", config, (1, 3)), 600))


def test_grad_weight_at_the_benchmarks_batch_sizes_too(worker):
    # (64 * 7 * 7 is no multiple of the 256 threads: the row that faulted first, at its batch size)
    conv = _conv(576, 14, s=2, dtype="bfloat16")
    _ok(worker.call(emulate.check, (conv, "wgrad", {"splits": 1, "threads": 256, "unroll": 16}, (64,)), 600))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_default_configs_of_planes_and_channels_no_tile_divides(worker, op, layout):
    # 7x7 planes (49: no thread count divides them), 20 channels (no vector or channel tile of 8+ divides)
    from pipedp.kernels.tvm.defaults import default_config

    conv = DepthwiseConv(64, 20, 7, 7, kernel=(3, 3), padding=(1, 1))
    _ok(worker.call(emulate.check, (conv, op, default_config(conv, op, layout), (1, 3)), 600))


def _old_flat(conv, cfg):
    """The flat mapping as it was before the fix: the write-back computed at the split's inner loop."""
    from pipedp.kernels.tvm import cuda
    from pipedp.kernels.tvm.cuda_common import write_back

    sch = _schedule(conv, "fwd")
    out, cast = cuda._output(sch, "fwd")
    n, c, i, j, *taps = sch.get_loops(out)
    co, ci = sch.split(c, [None, cfg["tile_c"]])
    block = sch.fuse(n, co)
    sch.bind(block, "blockIdx.x")
    threads = cfg["tile_c"] * cfg["tw"]
    each, lane = sch.split(sch.fuse(ci, i, j), [None, threads])
    sch.reorder(lane, each)
    sch.bind(lane, "threadIdx.x")
    write_back(sch, out, cast, each)
    cuda._stage_inputs(sch, conv, "fwd", out, block, [(threads, "threadIdx.x")])
    sch.decompose_reduction(out, taps[0])
    return sch


def _old_wgrad(conv, cfg):
    """Grad-weight's partial sums as they were before the fix: moved with compute_at (one split)."""
    from pipedp.kernels.tvm import cuda

    sch = _schedule(conv, "wgrad")
    out, _ = cuda._output(sch, "wgrad")
    o, z, r, s, n, i, j = sch.get_loops(out)
    ro, ri = sch.split(sch.fuse(n, i, j), [None, cfg["threads"]])
    rf = sch.rfactor(ri, factor_axis=0)
    sch.compute_inline(sch.get_sblock("pad"))
    head = sch.get_loops(out)
    chan = sch.fuse(*head[:-3])
    sch.bind(chan, "blockIdx.x")
    _, taps = sch.split(sch.fuse(head[-3], head[-2]), [None, cfg["threads"]])
    sch.bind(taps, "threadIdx.x")
    sch.set_scope(rf, 0, "shared")
    sch.compute_at(rf, chan)
    rri, rr, rs, rro = sch.get_loops(rf)[1:]
    sch.reorder(rri, rro, rr, rs)
    sch.bind(rri, "threadIdx.x")
    return sch


def _schedule(conv, op):
    import tvm
    from tvm import s_tir, te

    from pipedp.kernels.tvm.ops import batch_var, compute

    func = te.create_prim_func(compute(conv, op, "NCHW", batch_var())).with_attr("global_symbol", f"depthwise_{op}")
    sch = s_tir.Schedule(tvm.IRModule({f"depthwise_{op}": func}))
    sch.work_on(f"depthwise_{op}")
    return sch


def old_schedule_findings(which, conv, cfg, batches):
    """(A worker's job) the emulator's findings on a schedule as it was before the fix."""
    sch = {"flat": _old_flat, "wgrad": _old_wgrad}[which](conv, cfg)
    op = "fwd" if which == "flat" else "wgrad"
    return emulate.check(conv, op, cfg, batches, scheduled=sch.mod)


def test_the_emulator_finds_the_h100s_faults_in_the_schedules_as_they_were(worker):
    # The checker itself: serially the flat race leaves the right values behind, the write counts see it
    conv = DepthwiseConv(64, 32, 14, 14, kernel=(3, 3), padding=(1, 1))
    (found,) = worker.call(old_schedule_findings, ("flat", conv, NCHW_FLAT, (2,)), 600)
    assert found.error <= found.tolerance and found.miswritten > 0 and not found.ok
    # ... and grad-weight's lost predicate reads past x and dy (NaN from the guards) at a batch with a tail
    conv = dataclasses.replace(conv, h=7, w=7)
    (found,) = worker.call(old_schedule_findings, ("wgrad", conv, {"threads": 64}, (1,)), 600)
    assert not found.error <= found.tolerance and not found.ok


def test_emulated_source_serialises_threads_and_counts_the_outputs_stores():
    from pipedp.kernels.tvm.builder import schedule
    from pipedp.kernels.tvm.target import make_target

    sch = schedule(_conv(32, 14), "fwd", NCHW_FLAT, make_target("cuda", "sm_90"))
    text = emulate.emulated_source(sch.mod.script())
    assert "thread_binding" not in text and 'scope="shared"' not in text and 'scope="local"' not in text
    assert f"{emulate.COUNTS}: T.Buffer((n, 32, 14, 14), \"int32\")" in text
    assert text.count(f"{emulate.COUNTS}[") == 2  # one store of y, counted: read and written once


_TWO_KERNELS = '''
    @T.prim_func(s_tir=True)
    def f(a: T.Buffer((128,), "float32"), b: T.Buffer((128,), "float32")):
        for bx in T.thread_binding(2, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("A"):
                    a[bx * 64 + tx] = T.float32(1)
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                with T.sblock("B"):
                    b[bx * 64 + tx] = a[bx * 64 + tx]
        for bx in T.thread_binding(4, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                with T.sblock("C"):
                    b[bx * 32 + tx] = b[bx * 32 + tx] + T.float32(1)
'''


def test_thread_mismatches_are_loops_off_their_kernels_first_extent_along_an_axis():
    # (TVM launches a kernel with the extent of its first loop bound to an axis; each kernel has its own)
    assert emulate.thread_mismatches(_TWO_KERNELS.replace("TX", "64")) == []
    (short,) = emulate.thread_mismatches(_TWO_KERNELS.replace("TX", "32"))
    assert "a loop over 32 threadIdx.x in a kernel launched with 64: its threadIdx.x 32..63 run its body" in short
    (long,) = emulate.thread_mismatches(_TWO_KERNELS.replace("TX", "128"))
    assert "its iterations 64..127 never run" in long
