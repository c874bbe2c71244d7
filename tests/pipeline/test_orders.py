"""A named schedule as each rank's order on its placement: per-stage and interleaved schedules in one shape."""

import pytest

from pipedp.pipeline.interleaved import interleaved
from pipedp.pipeline.orders import NAMES, check_schedule, per_stage, placement, rank_orders, simulate_schedule
from pipedp.pipeline.ranks import check_programs, lower_programs
from pipedp.pipeline.schedule import SCHEDULES, Action, get_schedule
from pipedp.pipeline.simulate import simulate


def test_consecutive_stages_per_rank_unless_interleaved():
    assert placement("1f1b", 6, 2) == [0, 0, 0, 1, 1, 1]
    assert placement("zb-h1", 4, 1) == [0, 0, 0, 0]
    assert placement("interleaved", 6, 2) == [0, 1, 0, 1, 0, 1]


def test_stages_that_do_not_spread_over_the_ranks_are_refused():
    with pytest.raises(ValueError, match="5 stages cannot be spread over 2 pipeline ranks: use a multiple of 2"):
        placement("interleaved", 5, 2)


def test_an_unknown_name_is_refused_listing_every_schedule():
    with pytest.raises(ValueError, match=r"unknown schedule 'zbv'.*'interleaved'.*'zb-h1'"):
        check_schedule("zbv")
    assert set(NAMES) == {*SCHEDULES, "interleaved"}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_per_stage_schedule_splits_the_simulated_order_by_rank(name):
    orders = rank_orders(name, 4, 4, 2)
    order = simulate(get_schedule(name)(4, 4)).order
    assert orders == [[x for x in order if x[0] < 2], [x for x in order if x[0] >= 2]]
    assert per_stage(orders, 4) == get_schedule(name)(4, 4)
    check_programs(lower_programs(dict(enumerate(orders)), placement(name, 4, 2)))


def test_interleaved_orders_are_the_interleaved_programs():
    assert rank_orders("interleaved", 6, 4, 2) == interleaved(2, 3, 4)
    stages = per_stage(rank_orders("interleaved", 6, 4, 2), 6)
    assert all(sorted(a.microbatch for a in acts if a.kind == "F") == [0, 1, 2, 3] for acts in stages)


def test_an_interleaved_step_is_timed_by_rank_a_per_stage_one_by_stage():
    # Four stages of F 1 / B 2 on two ranks: interleaved ranks run one action at a time and fill sooner.
    inter = simulate_schedule("interleaved", 4, 4, 2)
    assert inter.lanes == 2 and inter.stages == 4
    plain = simulate_schedule("1f1b", 4, 4, 2)
    assert plain.lanes == 0 and plain.makespan == 3 * (4 + 4 - 1)
    half = simulate_schedule("interleaved", 4, 4, 2, duration=lambda s, a: 0.5 if a.kind == "F" else 1.0)
    assert half.makespan < simulate_schedule("1f1b", 2, 4).makespan  # the same work as 1F1B's two stages


def test_an_i_directly_followed_by_its_w_runs_as_b_where_no_message_comes_between():
    from pipedp.pipeline.orders import join_backwards

    I, W, F, B = (lambda i, k=k: Action(k, i) for k in "IWFB")
    orders = [[(0, F(0)), (0, I(0)), (0, W(0)), (0, I(1)), (0, F(1)), (0, W(1))],  # stage 0: no gradient to send
              [(1, F(0)), (1, I(0)), (1, W(0))]]  # stage 1's I sends its gradient to rank 0 first
    assert join_backwards(orders) == [[(0, F(0)), (0, B(0)), (0, I(1)), (0, F(1)), (0, W(1))],
                                      [(1, F(0)), (1, I(0)), (1, W(0))]]
    # Two stages on one rank: the second's gradient stays on the rank, so its I and W join too.
    local = [[(0, F(0)), (1, F(0)), (1, I(0)), (1, W(0)), (0, I(0)), (0, W(0))]]
    assert join_backwards(local) == [[(0, F(0)), (1, F(0)), (1, B(0)), (0, B(0))]]
    # Unless the two stages run at once (CUDA streams): stage 0's backward would wait for stage 1's W too.
    assert join_backwards(local, lambda a, b: True) == [[(0, F(0)), (1, F(0)), (1, I(0)), (1, W(0)), (0, B(0))]]
    assert join_backwards(rank_orders("1f1b", 2, 3, 2)) == rank_orders("1f1b", 2, 3, 2)  # nothing split
