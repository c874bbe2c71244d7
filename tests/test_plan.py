from dataclasses import replace

import pytest

from pipedp import Plan, StagePlan


def plan(pred=(2.0, 4.0), measured=None):
    stages = tuple(
        StagePlan(i, tuple(f"b{i}{j}" for j in range(3)), "cpu", "host", p, activation_mb=1.5, param_mb=0.25)
        for i, p in enumerate(pred)
    )
    p = Plan(stages, microbatches=4, microbatch_size=16, schedule="1f1b", batchnorm="microbatch",
             predicted_step_ms=30.0, notes=("a note",))
    return p.with_measured(list(measured)) if measured else p


def test_balance_is_slowest_over_mean():
    assert plan().balance == pytest.approx(4.0 / 3.0)
    assert plan().measured_balance is None
    assert plan(measured=(3.0, 3.0)).measured_balance == pytest.approx(1.0)
    assert plan().counts == [3, 3]


def test_str_is_a_readable_table():
    text = str(plan(measured=(2.5, 3.5)))
    lines = text.splitlines()
    assert lines[0].startswith("pipedp plan: 2 stage(s) x 4 microbatch(es) of 16, schedule=1f1b")
    assert lines[1].split() == ["stage", "device", "stream", "blocks", "pred", "ms", "meas", "ms", "act", "MiB", "param", "MiB"]
    assert "b00 .. b02 (3)" in lines[2] and "2.50" in lines[2]
    assert "balance (slowest/mean): predicted 1.33, measured 1.17" in text
    assert text.endswith("note: a note")


def test_with_measured_checks_length():
    with pytest.raises(ValueError, match="1 measurements for 2 stages"):
        plan().with_measured([1.0])


def test_trials_are_a_table_against_the_strongest_alternative():
    p = plan()
    assert "trials" not in str(p)
    timed = replace(p, trials=(("plain", 10.0), ("plain channels_last", 9.0), ("2x4", 8.0), ("2x4 compiled", 6.0)),
                    trial_baseline_ms=9.0, bar="plain channels_last", planning_s=12.5)
    lines = str(timed).splitlines()
    start = lines.index("trials (ms per forward+backward step; the bar is the strongest alternative, plain "
                        "channels_last, 9.00 ms; planning took 12.5 s):")
    rows = [ln.split() for ln in lines[start + 1:start + 6]]
    assert rows[0] == ["configuration", "ms", "x", "bar"] and rows[1] == ["plain", "10.00", "0.90"]
    assert rows[2] == ["plain", "channels_last", "9.00", "1.00", "bar"]
    assert rows[3] == ["2x4", "8.00", "1.12", "chosen"] and rows[4] == ["2x4", "compiled", "6.00", "1.50"]
    compiled = str(replace(timed, compiled=True)).splitlines()
    assert compiled[start + 5].split()[-1] == "chosen" and compiled[start + 4].split()[-1] == "1.12"
    # The bar's own configuration run by pipedp has no trial of its own: a row says it was chosen.
    one = replace(timed, stages=timed.stages[:1], microbatches=1, channels_last=True)
    assert [ln.split() for ln in str(one).splitlines() if ln.startswith("  1x1")] == [
        ["1x1", "channels_last", "-", "-", "chosen"]]
    assert ", channels_last" in str(one).splitlines()[0]
    assert replace(timed, trial_chosen="2x4 concurrent").label == "2x4 concurrent"
