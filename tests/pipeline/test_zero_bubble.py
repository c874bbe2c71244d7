"""ZB-H1: the backward split into I and W, W where 1F1B would wait, within 1F1B's peak of activations."""

import itertools

import pytest

from pipedp.pipeline.ranks import check_programs, format_program, lower_programs
from pipedp.pipeline.schedule import Action, one_f_one_b
from pipedp.pipeline.simulate import simulate
from pipedp.pipeline.zero_bubble import zb_h1

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _unit(stage, action):
    return UNIT[action.kind]


def test_every_stage_runs_f_i_and_w_of_each_microbatch_once_and_w_after_its_i():
    for p, m in itertools.product(range(1, 7), range(1, 11)):
        sched = zb_h1(p, m)
        for acts in sched:
            assert sorted(acts) == sorted(Action(k, i) for k in "FIW" for i in range(m))
            assert all(acts.index(Action("W", i)) > acts.index(Action("I", i)) for i in range(m))
        simulate(sched)  # complete, no deadlock, no dependency violation


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32), (3, 5)])
def test_it_idles_less_than_1f1b_at_the_same_peak_of_activations(p, m):
    zb, base = simulate(zb_h1(p, m), duration=_unit), simulate(one_f_one_b(p, m), duration=_unit)
    assert base.makespan == 3 * (m + p - 1)
    assert 3 * m + p - 1 <= zb.makespan <= 3 * m + p + 1 and zb.makespan < base.makespan
    assert max(zb.peak_activations) <= max(base.peak_activations) == p


def test_four_stages_eight_microbatches_idle_17_percent_against_27():
    zb, base = simulate(zb_h1(4, 8), duration=_unit), simulate(one_f_one_b(4, 8), duration=_unit)
    assert (zb.makespan, base.makespan) == (29, 33)
    assert round(zb.bubble, 2) == 0.17 and round(base.bubble, 2) == 0.27


def test_a_smaller_hold_keeps_each_stage_to_it_and_still_runs():
    for p, m in itertools.product(range(2, 6), range(1, 9)):
        for hold in range(1, p + 1):
            sim = simulate(zb_h1(p, m, hold=hold), duration=_unit)
            assert max(sim.peak_activations) <= hold
    with pytest.raises(ValueError, match="hold must be a positive int"):
        zb_h1(2, 2, hold=0)


def test_uneven_stage_times_still_finish_and_beat_1f1b():
    def uneven(s, a):  # stage 1 slow, I a bit longer than W
        scale = 1.6 if s == 1 else 1.0
        return scale * {"F": 1.0, "B": 2.1, "I": 1.2, "W": 0.9}[a.kind]

    for p, m in [(3, 6), (4, 8)]:
        assert simulate(zb_h1(p, m), duration=uneven).makespan < simulate(one_f_one_b(p, m), duration=uneven).makespan


def test_lowered_onto_a_rank_per_stage_the_messages_match_and_print():
    for p, m in itertools.product(range(1, 6), range(1, 7)):
        per_rank = {s: [(s, a) for a in acts] for s, acts in enumerate(zb_h1(p, m))}
        check_programs(lower_programs(per_rank, list(range(p))))
    progs = lower_programs({s: [(s, a) for a in acts] for s, acts in enumerate(zb_h1(2, 2))}, [0, 1])
    assert format_program(progs[0]) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1"
    assert format_program(progs[1]) == "1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1W1"
