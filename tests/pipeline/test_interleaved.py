"""Interleaved 1F1B: several stages per rank round the ranks, a shorter fill and drain, its messages checked."""

import itertools

import pytest

from pipedp.pipeline.interleaved import interleaved, interleaved_placement
from pipedp.pipeline.ranks import check_programs, lower_programs
from pipedp.pipeline.schedule import one_f_one_b
from pipedp.pipeline.simulate import ScheduleError, simulate, simulate_ranks


def test_stage_s_lives_on_rank_s_mod_ranks():
    assert interleaved_placement(2, 3) == [0, 1, 0, 1, 0, 1]


def _sizes():
    for p, v in itertools.product(range(1, 5), range(1, 4)):
        for m in range(p, 3 * p + 1, p):
            yield p, v, m


def test_every_size_runs_to_the_end_and_its_messages_match():
    for p, v, m in _sizes():
        progs = interleaved(p, v, m)
        sim = simulate_ranks(progs)  # every stage's F and B once, no deadlock
        assert sim.stages == p * v and sim.lanes == p
        place = interleaved_placement(p, v)
        assert all(place[s] == r for r, prog in enumerate(progs) for s, _ in prog)
        check_programs(lower_programs(dict(enumerate(progs)), place))


def test_one_stage_per_rank_is_1f1b():
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        if m % p == 0:
            assert [[a for _, a in prog] for prog in interleaved(p, 1, m)] == one_f_one_b(p, m)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 4, 8), (4, 2, 8), (4, 4, 16)])
def test_the_fill_and_drain_shrink_with_the_stages_per_rank(p, v, m):
    # The same model: a rank's work per microbatch is F 1, B 2, in one stage or in v stages of 1/v each.
    inter = simulate_ranks(interleaved(p, v, m), duration=lambda s, a: (1.0 if a.kind == "F" else 2.0) / v)
    plain = simulate(one_f_one_b(p, m))
    assert plain.makespan == 3 * (m + p - 1)
    assert inter.makespan < plain.makespan and inter.bubble < plain.bubble
    assert inter.makespan == pytest.approx(3 * m + 3 * (p - 1) / v, rel=0.15)  # about a v-th of the fill


def test_a_microbatch_count_that_does_not_go_round_the_ranks_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="multiple of 4 microbatches, got 6: pass microbatches=8"):
        interleaved(4, 2, 6)


def test_a_stage_split_across_ranks_is_refused():
    progs = interleaved(2, 1, 2)
    progs[1].append(progs[0].pop())
    with pytest.raises(ScheduleError, match="stage 0 has actions on ranks 0 and 1"):
        simulate_ranks(progs)
