"""Cross-rank programs: messages inserted in the global order, checked for mismatch and deadlock."""

import itertools

import pytest

from pipedp.pipeline.ranks import Op, check_programs, rank_programs
from pipedp.pipeline.schedule import SCHEDULES, forward_only
from pipedp.pipeline.simulate import ScheduleError, simulate


def test_messages_follow_the_compute_that_makes_them():
    order = simulate(SCHEDULES["gpipe"](2, 2)).order
    progs = rank_programs(order, [0, 1])
    assert [str(op) for op in progs[0]] == [
        "F0@stage0", "send act0 of stage 0 to rank 1", "F1@stage0", "send act1 of stage 0 to rank 1",
        "recv grad0 of stage 0 from rank 1", "B0@stage0", "recv grad1 of stage 0 from rank 1", "B1@stage0",
    ]
    assert [op.kind for op in progs[1]] == ["recv", "F", "recv", "F", "B", "send", "B", "send"]
    check_programs(progs)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_and_rank_split_is_deadlock_free(name):
    for stages, m in itertools.product(range(1, 7), range(1, 6)):
        for ranks in range(1, stages + 1):
            if stages % ranks:
                continue
            k = stages // ranks
            stage_rank = [s // k for s in range(stages)]
            check_programs(rank_programs(simulate(SCHEDULES[name](stages, m)).order, stage_rank))
            check_programs(rank_programs(simulate(forward_only(stages, m), training=False).order, stage_rank))


def test_a_receive_that_would_get_another_message_is_reported():
    progs = {
        0: [Op("F", 0, 0), Op("send", 0, 0, "act", 1), Op("F", 0, 1), Op("send", 0, 1, "act", 1)],
        1: [Op("recv", 1, 1, "act", 0), Op("F", 1, 1), Op("recv", 1, 0, "act", 0), Op("F", 1, 0)],
    }
    with pytest.raises(ScheduleError, match="rank 1 expects recv act1 .* sent send act0"):
        check_programs(progs)


def test_ranks_waiting_on_each_other_is_a_deadlock():
    progs = {
        0: [Op("recv", 0, 0, "grad", 1), Op("B", 0, 0), Op("F", 0, 1), Op("send", 0, 1, "act", 1)],
        1: [Op("recv", 1, 1, "act", 0), Op("F", 1, 1), Op("B", 1, 0), Op("send", 1, 0, "grad", 0)],
    }
    with pytest.raises(ScheduleError, match="deadlock across ranks: rank 0 waits at recv grad0.*rank 1 waits"):
        check_programs(progs)


def test_a_message_never_received_is_reported():
    with pytest.raises(ScheduleError, match="never received"):
        check_programs({0: [Op("send", 0, 0, "act", 1)], 1: []})


def test_a_stage_closes_after_its_last_accumulation_and_the_gradient_it_sends_back():
    from pipedp.pipeline.ranks import close_stages, format_program, lower_programs
    from pipedp.pipeline.zero_bubble import zb_h1

    progs = rank_programs(simulate(SCHEDULES["1f1b"](2, 2)).order, [0, 1])
    closed = {r: close_stages(ops) for r, ops in progs.items()}
    assert format_program(closed[1]).endswith("1B1 1SEND_B1 1REDUCE_GRAD 1UPDATE")
    assert format_program(closed[0]).endswith("0RECV_B1 0B1 0REDUCE_GRAD 0UPDATE")
    check_programs(closed)  # the closes are local: the messages still match
    # Split backwards: the close follows the stage's last W, not its last I.
    split = zb_h1(2, 3)
    ops = lower_programs({0: [(s, a) for s, acts in enumerate(split) for a in acts]}, [0, 0])[0]
    text = format_program(close_stages(ops))
    assert text.count("REDUCE_GRAD") == 2 and all(f"{s}W2 {s}REDUCE_GRAD {s}UPDATE" in text for s in (0, 1))


def test_a_stage_with_deferred_statistics_commits_them_after_its_last_forward_and_its_send():
    from pipedp.pipeline.ranks import close_stages, format_program

    progs = rank_programs(simulate(SCHEDULES["1f1b"](2, 2)).order, [0, 1])
    closed = {r: close_stages(ops, commits={0, 1}) for r, ops in progs.items()}
    rank0, rank1 = format_program(closed[0]), format_program(closed[1])
    assert "0F1 0SEND_F1 0BN_COMMIT" in rank0 and "1F1 1BN_COMMIT" in rank1
    assert rank0.index("0BN_COMMIT") < rank0.index("0B1") and rank1.count("BN_COMMIT") == 1
    check_programs(closed)
    only = format_program(close_stages(progs[1], commits={0}))  # no stage of rank 1 defers: nothing added
    assert "BN_COMMIT" not in only

