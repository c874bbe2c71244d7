import pytest

from pipedp.pipeline import Action, forward_only, get_schedule, gpipe, one_f_one_b, simulate

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_stage_runs_each_action_once(name):
    for stages in range(1, 9):
        for m in range(1, 33):
            sched = SCHEDULES[name](stages, m)
            assert len(sched) == stages
            for acts in sched:
                assert sorted(a for a in acts if a.kind == "F") == [Action("F", i) for i in range(m)]
                assert sorted(a for a in acts if a.kind == "B") == [Action("B", i) for i in range(m)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulator_accepts_stages_1_to_8_by_microbatches_1_to_32(name):
    for stages in range(1, 9):
        for m in range(1, 33):
            sim = simulate(SCHEDULES[name](stages, m))
            # With forward 1 and backward 2 and one device per stage, both schedules
            # take (m + stages - 1) forward slots and as many backward slots.
            assert sim.makespan == pytest.approx(3 * (m + stages - 1)), (stages, m)
            expected_peak = [m] * stages if name == "gpipe" else [min(stages - s, m) for s in range(stages)]
            assert list(sim.peak_activations) == expected_peak


def test_one_f_one_b_layout():
    assert [str(a) for a in one_f_one_b(3, 4)[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [str(a) for a in one_f_one_b(3, 4)[2]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [str(a) for a in gpipe(2, 3)[1]] == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_forward_only():
    sched = forward_only(3, 2)
    assert all([str(a) for a in acts] == ["F0", "F1"] for acts in sched)
    assert simulate(sched, training=False).makespan == pytest.approx(4)


def test_get_schedule():
    assert get_schedule("1f1b") is one_f_one_b
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        get_schedule("pipedream")


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive int"):
        gpipe(bad, 2)
    with pytest.raises(ValueError, match="positive int"):
        one_f_one_b(2, bad)
