import pytest

from pipedp.pipeline import Action, ScheduleError, gpipe, one_f_one_b, simulate
from pipedp.pipeline.simulate import simulate_ranks

F = lambda i: Action("F", i)  # noqa: E731
B = lambda i: Action("B", i)  # noqa: E731


def deps_done_before(order, stages):
    seen = set()
    for s, a in order:
        if a.kind == "F" and s > 0:
            assert (s - 1, a) in seen
        if a.kind == "B":
            assert (s, F(a.microbatch)) in seen
            if s < stages - 1:
                assert (s + 1, a) in seen
        seen.add((s, a))


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
def test_issue_order_is_topological(fn):
    for stages in (1, 2, 3, 5, 8):
        for m in (1, 2, 7, 16):
            sim = simulate(fn(stages, m), duration=lambda s, a: 0.0 if s % 2 else 1.5)
            deps_done_before(sim.order, stages)
            assert len(sim.order) == 2 * stages * m


def test_deadlock_is_reported_with_stages_and_actions():
    sched = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(1), B(0)]]
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits at B0 for B0 of stage 1; stage 1 waits at F1 for F1 of stage 0"):
        simulate(sched)


def test_dependency_violation_is_reported():
    with pytest.raises(ScheduleError, match=r"dependency violation: stage 0 runs B0 before its own F0"):
        simulate([[B(0), F(0)]])


@pytest.mark.parametrize(
    "sched, match",
    [
        ([], "no stages"),
        ([[F(0), F(0), B(0)]], "runs F0 more than once"),
        ([[F(0), B(0)], [F(0)]], r"stage 1: B actions cover microbatches \[\]"),
        ([[F(0), B(0), F(1), B(1)], [F(0), B(0)]], r"missing \[1\]"),
        ([[Action("X", 0)]], "is not one of"),
        ([[F(1), B(1)]], "numbered 0..m-1"),
    ],
)
def test_malformed(sched, match):
    with pytest.raises(ScheduleError, match=match):
        simulate(sched)


def test_forward_only_rejects_backward():
    with pytest.raises(ScheduleError, match="is not one of"):
        simulate([[F(0), B(0)]], training=False)


def test_shared_resource_serialises_stages():
    sched = one_f_one_b(4, 8)
    free = simulate(sched, duration=lambda s, a: 1.0)
    shared = simulate(sched, duration=lambda s, a: 1.0, resources=[0, 0, 0, 0])
    assert shared.makespan == pytest.approx(2 * 4 * 8)  # everything one after another
    assert free.makespan < shared.makespan
    assert 0.0 < free.bubble < 1.0


def test_one_f_one_b_holds_fewer_activations_than_gpipe():
    assert simulate(one_f_one_b(4, 16)).peak_activations[0] == 4
    assert simulate(gpipe(4, 16)).peak_activations[0] == 16


def test_a_transfer_delays_the_dependent_stage_and_its_link_carries_one_message_at_a_time():
    """The sender goes on computing while its result crosses; the receiver starts when it has arrived."""
    one = simulate(gpipe(2, 1), duration=lambda s, a: 1.0 if a.kind == "F" else 2.0, transfer=lambda s, a: 0.5)
    start = {(sl.stage, str(sl.action)): sl.start for sl in one.slots}
    assert start[(1, "F0")] == 1.5 and start[(0, "B0")] == 5.0 and one.makespan == 7.0
    two = simulate(gpipe(2, 2), duration=lambda s, a: 1.0 if a.kind == "F" else 0.0, transfer=lambda s, a: 3.0)
    start = {(sl.stage, str(sl.action)): sl.start for sl in two.slots}
    assert start[(0, "F1")] == 1.0  # the sender did not wait for its first message to cross
    assert start[(1, "F0")] == 4.0 and start[(1, "F1")] == 7.0  # the second waited for the link, not the sender
    with pytest.raises(ScheduleError, match="transfer of F0 from stage 0 is negative"):
        simulate(gpipe(2, 1), transfer=lambda s, a: -1.0)


@pytest.mark.parametrize(
    "sched, match",
    [
        ([[F(0), B(0), Action("I", 0), Action("W", 0)]], r"runs both B and I of microbatch\(es\) \[0\]"),
        ([[F(0), Action("I", 0)]], r"W actions cover microbatches \[\], expected those it runs I of, \[0\]"),
        ([[F(0), Action("W", 0), Action("I", 0)]], r"stage 0 runs W0 before its own I0 \(dependency violation\)"),
    ],
)
def test_a_split_backward_needs_its_i_then_its_w(sched, match):
    with pytest.raises(ScheduleError, match=match):
        simulate(sched)


def test_an_input_gradient_made_by_i_travels_like_one_made_by_b():
    i, w = Action("I", 0), Action("W", 0)
    sim = simulate([[F(0), B(0)], [F(0), i, w]], duration=lambda s, a: 1.0, transfer=lambda s, a: 0.5)
    start = {(sl.stage, sl.action): sl.start for sl in sim.slots}
    # F0 ends at 1, arrives 1.5; stage 1's I0 ends at 3.5 and reaches stage 0 at 4, while its W0 runs
    assert start[(1, F(0))] == 1.5 and start[(1, w)] == 3.5 and start[(0, B(0))] == 4.0


def test_rank_programs_run_in_their_order_and_report_where_they_wait():
    sim = simulate_ranks([[(0, F(0)), (2, F(0)), (2, B(0)), (0, B(0))], [(1, F(0)), (1, B(0))]])
    assert sim.lanes == 2 and sim.stages == 3 and sim.makespan == 9.0
    # rank 0 takes stage 0's backward before stage 2's forward: each rank waits for the other
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 \(stage 0\) waits at B0 for B0 of stage 1; "
                                            r"rank 1 \(stage 1\) waits at B0 for B0 of stage 2"):
        simulate_ranks([[(0, F(0)), (0, B(0)), (2, F(0)), (2, B(0))], [(1, F(0)), (1, B(0))]])
    with pytest.raises(ScheduleError, match=r"must be numbered 0..n-1"):
        simulate_ranks([[(1, F(0)), (1, B(0))]])
