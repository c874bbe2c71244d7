import random

import pytest
import torch

from pipedp.decide.layout import BlockCosts, Layout, layouts, predict, rank
from pipedp.decide.links import Link
from pipedp.partition.profile import BlockProfile

FREE = Link("free", 0.0, 1e30)
SLOW = Link("slow", 1e-4, 1e8)  # 100 MB/s


def blocks(n=8, fwd=1.0, bwd=2.0, out=1 << 20, params=4 << 20):
    return [BlockProfile(f"b{i}", fwd, bwd, out, out, params) for i in range(n)]


def costs(bl, batch=16):
    return BlockCosts(tuple(bl), batch)


def test_one_replica_of_one_stage_is_the_profiled_step_scaled_to_the_batch():
    bl = blocks()
    p = predict(costs(bl), Layout(1, (8,), 1), 64, FREE, overhead_ms=0.0)
    assert p.step_ms == pytest.approx(4 * 8 * 3.0) and p.exposed_ms == 0.0 and p.bubble == 0.0


def test_data_parallel_over_a_free_link_divides_the_compute():
    bl = blocks()
    p = predict(costs(bl), Layout(4, (8,), 1), 64, FREE, overhead_ms=0.0)
    assert p.step_ms == pytest.approx(8 * 3.0)


def test_a_pipeline_pays_its_bubble_and_data_parallel_its_sync():
    bl = blocks()
    pp = predict(costs(bl), Layout(1, (4, 4), 4), 64, FREE, overhead_ms=0.0)
    # 2 stages x 4 microbatches: (M + S - 1) / M of the ideal half-model time.
    assert pp.step_ms == pytest.approx(5 / 4 * 64 / 16 * 4 * 3.0) and pp.bubble == pytest.approx(0.2)
    dp_slow = predict(costs(bl), Layout(2, (8,), 1), 64, SLOW, overhead_ms=0.0)
    sync = 2 * 1e-4 * 2 + 32 * 2**20 / 1e8  # 2 buckets of 25 MiB for 32 MiB, ring over 2 ranks
    assert dp_slow.allreduce_ms == pytest.approx(sync * 1e3)
    assert dp_slow.exposed_ms > 0 and dp_slow.step_ms > predict(costs(bl), Layout(2, (8,), 1), 64, FREE,
                                                                overhead_ms=0.0).step_ms


def test_each_layout_says_what_it_moves_over_its_links_a_step():
    """The ring carries 2 (r - 1) / r of the busiest stage's gradient bytes; a cut its activation and gradient
    once per microbatch (block outputs scale with the microbatch's samples)."""
    bl = blocks()  # 8 blocks of 4 MiB parameters, 1 MiB outputs on 16 samples
    dp = predict(costs(bl), Layout(4, (8,), 1), 64, SLOW, overhead_ms=0.0)
    assert dp.allreduce_bytes == pytest.approx(2 * 3 / 4 * 32 * 2**20) and dp.p2p_bytes == 0.0
    pp = predict(costs(bl), Layout(1, (4, 4), 4), 64, SLOW, overhead_ms=0.0)
    assert pp.allreduce_bytes == 0.0 and pp.p2p_bytes == pytest.approx(2 * 4 * 2**20)  # 4 microbatches of 16
    hybrid = predict(costs(bl), Layout(2, (5, 3), 2), 64, SLOW, overhead_ms=0.0)
    assert hybrid.allreduce_bytes == pytest.approx(5 * 4 * 2**20)  # the 5-block stage, over 2 replicas
    assert "all-reduce 21 MB" in hybrid.moves() and "stage hop 4 MB" in hybrid.moves()


def test_a_16_bit_reduce_moves_half_the_bytes_and_wins_only_where_the_link_waits():
    """The buckets are packed at fp32 (the same count), the wire carries half; over a free link the two tie."""
    bl = blocks()
    fp32 = predict(costs(bl), Layout(2, (8,), 1), 64, SLOW, overhead_ms=0.0)
    bf16 = predict(costs(bl), Layout(2, (8,), 1, reduce_dtype=torch.bfloat16), 64, SLOW, overhead_ms=0.0)
    assert bf16.allreduce_bytes == pytest.approx(fp32.allreduce_bytes / 2)
    assert bf16.allreduce_ms == pytest.approx(2 * 1e-4 * 2 * 1e3 + 16 * 2**20 / 1e8 * 1e3)  # still 2 buckets
    assert bf16.step_ms < fp32.step_ms
    free = [predict(costs(bl), Layout(2, (8,), 1, reduce_dtype=d), 64, FREE, overhead_ms=0.0).step_ms
            for d in (None, torch.float16)]
    assert free[0] == pytest.approx(free[1])
    assert Layout(2, (8,), 1, reduce_dtype=torch.bfloat16).label == "dp 2 x pp 1, bfloat16 reduce"


def test_each_reduce_dtype_is_a_layout_only_where_replicas_reduce():
    bl = blocks(n=4)
    got = layouts(bl, 2, 16, microbatches=(1, 2), reduce_dtypes=(None, torch.bfloat16))
    dp = [lay for lay in got if lay.dp == 2]
    assert {lay.reduce_dtype for lay in dp} == {None, torch.bfloat16} and len(dp) == 2
    assert all(lay.reduce_dtype is None for lay in got if lay.dp == 1)  # a lone replica reduces nothing
    # 512 MiB of gradients against a 64 MiB activation per 16 samples: halving the all-reduce wins.
    heavy = blocks(params=64 << 20, out=64 << 20)
    best = rank(costs(heavy), 2, 64, SLOW, microbatches=(1, 2), reduce_dtypes=(None, torch.bfloat16))[0]
    assert best.layout.dp == 2 and best.layout.reduce_dtype == torch.bfloat16


def test_the_update_is_split_over_the_stages_by_their_parameters():
    bl = blocks()
    one = predict(costs(bl), Layout(1, (8,), 1), 64, FREE, update_ms=8.0, overhead_ms=0.0)
    assert one.step_ms == pytest.approx(96.0 + 8.0)
    two = predict(costs(bl), Layout(1, (4, 4), 4), 64, FREE, update_ms=8.0, overhead_ms=0.0)
    assert two.step_ms == pytest.approx(60.0 + 4.0)


def test_a_slow_link_and_heavy_parameters_favour_the_pipeline_a_free_link_data_parallel():
    heavy = blocks(params=64 << 20, out=1 << 16)
    assert rank(costs(heavy), 2, 64, FREE)[0].layout.pp == 1
    assert rank(costs(heavy), 2, 64, SLOW)[0].layout.pp == 2


def test_layouts_are_those_the_engine_can_run():
    bl = blocks(n=3)
    got = {(lay.dp, lay.pp, lay.microbatches) for lay in layouts(bl, 4, 16, microbatches=(1, 2, 4, 8))}
    # pp divides the ranks and is at most the blocks; replicas split the batch; >= 2 samples per microbatch.
    assert (4, 1, 1) in got and (2, 2, 4) in got and (2, 2, 8) not in got
    assert {lay.dp for lay in layouts(bl, 8, 8)} == {4}  # 8 replicas of 1 sample: BatchNorm cannot train them
    assert all(pp in (1, 2) for _, pp, _ in got)
    assert {lay.dp for lay in layouts(bl, 4, 6)} == {2}  # 6 samples split over 2 replicas, not over 4
    with pytest.raises(ValueError, match="does not split over dp=4"):
        predict(costs(bl), Layout(4, (3,), 1), 6, FREE)


def test_over_a_slow_hop_the_cut_moves_to_a_smaller_activation():
    """Balanced compute cuts after block 1, whose 8 MiB output crawls over 100 MB/s; the hop-aware cut sends
    block 2's 64 KiB instead, and that layout is predicted faster."""
    bl = [BlockProfile(f"b{i}", 1.0, 2.0, out, out, 0) for i, out in enumerate((8 << 20, 8 << 20, 1 << 16, 1 << 16))]
    free = {lay.counts for lay in layouts(bl, 2, 16, hop=FREE, profile_batch=8) if lay.pp == 2}
    assert free == {(2, 2)}  # over a free hop the balanced cut is the only one
    slow = {lay.counts for lay in layouts(bl, 2, 16, hop=SLOW, profile_batch=8) if lay.pp == 2}
    assert slow == {(2, 2), (3, 1)}
    best = min((p for p in rank(costs(bl, 8), 2, 16, SLOW) if p.layout.pp == 2), key=lambda p: p.step_ms)
    assert best.layout.counts == (3, 1)


def test_the_choice_is_never_slower_than_a_layout_it_could_have_chosen_over_random_costs():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 10)
        bl = [BlockProfile(f"b{i}", rng.uniform(0.1, 5), rng.uniform(0.2, 10), rng.randint(1, 1 << 22),
                           0, rng.randint(0, 1 << 26)) for i in range(n)]
        link = Link("r", rng.uniform(0, 1e-3), rng.uniform(1e7, 1e11))
        ranks, batch = rng.choice([2, 4, 8]), rng.choice([32, 64, 128])
        update = rng.uniform(0, 20)
        preds = rank(costs(bl, 8), ranks, batch, link, update_ms=update)
        every = [predict(costs(bl, 8), lay, batch, link, update_ms=update)
                 for lay in layouts(bl, ranks, batch, hop=link, profile_batch=8)]
        assert preds and len(preds) == len(every) and preds[0].step_ms == min(p.step_ms for p in every)
        # A faster link never makes a layout slower, and a pipeline's step is at least its slowest stage's work.
        faster = Link("f", link.alpha_s / 2, link.bytes_per_s * 2)
        for p in every:
            assert predict(costs(bl, 8), p.layout, batch, faster, update_ms=update).step_ms <= p.step_ms + 1e-9
            per_mb = batch / p.layout.dp / p.layout.microbatches / 8
            start = 0
            for k in p.layout.counts:
                work = sum(b.cost_ms for b in bl[start:start + k]) * per_mb * p.layout.microbatches
                assert p.step_ms >= work - 1e-6
                start += k


def test_two_profiled_sizes_give_each_block_a_fixed_cost_per_call():
    big = [BlockProfile("a", 10.0, 20.0, 1 << 20, 0, 0)]
    small = [BlockProfile("a", 4.0, 8.0, 1 << 18, 0, 0)]  # a quarter of the samples: 2 ms + 2 ms fixed
    c = BlockCosts(tuple(big), 16, tuple(small), 4)
    (at8,) = c.at(8)
    assert at8.forward_ms == pytest.approx(6.0) and at8.backward_ms == pytest.approx(12.0)
    assert at8.output_bytes == 1 << 19
    assert BlockCosts(tuple(big), 16).at(8)[0].forward_ms == pytest.approx(5.0)  # one size: in proportion
    # Eight microbatches of 2 pay the fixed part eight times: slower than the samples alone say.
    assert 8 * c.at(2)[0].forward_ms > 8 * BlockCosts(tuple(big), 16).at(2)[0].forward_ms
    # Faster than in proportion on fewer samples (cache): each size is predicted as measured, the sizes between
    # on the line through both, those outside in proportion to the nearer size (never a negative time).
    steep = BlockCosts(tuple(big), 16, (BlockProfile("a", 1.0, 2.0, 0, 0, 0),), 4)
    assert [steep.at(n)[0].forward_ms for n in (4, 16)] == pytest.approx([1.0, 10.0])
    assert steep.at(8)[0].forward_ms == pytest.approx(4.0) and steep.at(2)[0].forward_ms == pytest.approx(0.5)
    assert steep.at(32)[0].forward_ms == pytest.approx(20.0)
    noisy = BlockCosts(tuple(big), 16, (BlockProfile("a", 12.0, 30.0, 0, 0, 0),), 4)  # fewer samples slower
    assert noisy.at(8)[0].forward_ms == pytest.approx(10.0) and noisy.at(8)[0].backward_ms == pytest.approx(20.0)
    with pytest.raises(ValueError, match="fewer samples than 16"):
        BlockCosts(tuple(big), 16, tuple(small), 16)


def test_layouts_that_cannot_run_are_refused_by_name():
    bl = blocks(n=3)
    with pytest.raises(ValueError, match="every stage needs a block"):
        predict(costs(bl), Layout(1, (3, 0), 2), 16, FREE)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        predict(costs(bl), Layout(1, (3,), 1), 16, FREE, bucket_bytes=0)


def test_interleaved_layouts_put_two_stages_on_each_rank_and_halve_the_bubble():
    bl = blocks()
    every = layouts(costs(bl), 4, 64, microbatches=(2, 4), schedules=("1f1b", "interleaved"))
    inter = [lay for lay in every if lay.schedule == "interleaved"]
    assert inter and all(lay.per_rank == 2 and len(lay.counts) == 2 * lay.pp for lay in inter)
    assert all(lay.microbatches % lay.pp == 0 for lay in inter)  # the forwards go round the ranks in groups
    assert {(lay.dp, lay.pp) for lay in inter} == {(2, 2), (1, 4)} and "interleaved v2" in inter[0].label
    assert not [lay for lay in every if lay.pp == 1 and lay.schedule == "interleaved"]
    # Over a free link the fill and drain shrink: 2 ranks, 4 microbatches, uniform blocks.
    one = predict(costs(bl), Layout(1, (4, 4), 4), 64, FREE, overhead_ms=0.0)
    two = predict(costs(bl), Layout(1, (2, 2, 2, 2), 4, "interleaved", per_rank=2), 64, FREE, overhead_ms=0.0)
    assert two.bubble < one.bubble and two.step_ms < one.step_ms
    # A rank's two stages reduce their gradients over its one link: a rank carries half the model.
    slow = predict(costs(bl), Layout(2, (2, 2, 2, 2), 4, "interleaved", per_rank=2), 64, SLOW, overhead_ms=0.0)
    half = sum(b.param_bytes for b in bl) / 2
    assert slow.allreduce_bytes == pytest.approx(2 * (2 - 1) / 2 * half)


def test_an_interleaved_layouts_cut_balances_the_ranks_sums_not_only_the_stages():
    from pipedp.decide.layout import rank_balanced_cut
    from pipedp.partition.profile import BlockProfile

    blocks = [BlockProfile(f"b{i}", float(c), 0.0, 1, 1, 1) for i, c in enumerate([5, 1, 3, 1, 4, 4])]
    # Stages 0 and 2 on rank 0: the bottleneck-optimal cut [1, 2, 2, 1] (stages 5 4 5 4) loads rank 0 with 10.
    assert rank_balanced_cut(blocks, (1, 2, 2, 1), [0, 1, 0, 1]) == (1, 3, 1, 1)  # 9 and 9
    assert rank_balanced_cut(blocks, (1, 3, 1, 1), [0, 1, 0, 1]) == (1, 3, 1, 1)
