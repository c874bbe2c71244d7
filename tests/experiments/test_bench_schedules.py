"""bench_schedules on two gloo ranks: every schedule timed beside 1F1B, its prediction and its program kept."""

from __future__ import annotations

import argparse

import pytest

from tests.multiproc import run


def _measure(rank: int, world: int) -> dict:
    from experiments.bench_schedules import measure

    args = argparse.Namespace(schedules="1f1b,zb-h1,interleaved,dp", batch=8, microbatches=2, rounds=1, steps=1,
                              per_rank=2)
    return measure("resnet18", args)


@pytest.mark.slow
def test_each_schedule_is_timed_against_the_first_and_predicted():
    r, _ = run(_measure, 2, timeout_s=300)
    assert set(r["ms"]) == {"1f1b", "zb-h1", "interleaved", "dp"} and r["vs_first"]["1f1b"] == 1.0
    assert all(v > 0 for v in r["ms"].values())
    assert [len(r["counts"][k]) for k in ("1f1b", "interleaved", "dp")] == [2, 4, 1]
    assert r["predicted_idle"]["zb-h1"] < r["predicted_idle"]["1f1b"]
    assert r["predicted_idle"]["interleaved"] < r["predicted_idle"]["1f1b"]
    assert set(r["measured_idle"]) == {"1f1b", "zb-h1", "interleaved"}
    assert all(0 <= v < 1 for v in r["measured_idle"].values())
    assert "I0" in r["program"]["zb-h1"] and "I0" not in r["program"]["1f1b"]
    assert r["program"]["interleaved"].startswith("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0")


def test_a_row_may_name_its_cut():
    from experiments.bench_schedules import row

    assert row("interleaved@7-4-5-7") == ("interleaved", [7, 4, 5, 7])
    assert row("1f1b") == ("1f1b", None) and row("dp") == ("dp", None)
