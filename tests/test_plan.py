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
