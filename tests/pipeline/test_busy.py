"""Busy fraction and concurrent share from synthetic kernel intervals (what a profiler trace gives on a GPU)."""

import pytest

from pipedp.pipeline.busy import busy_time, kernel_intervals


def test_one_stream_with_gaps():
    b = busy_time([("s0", 0, 2), ("s0", 3, 5), ("s0", 5, 6)], window=(0, 10))
    assert (b.wall, b.busy, b.concurrent, b.streams) == (10, 5, 0, 1)
    assert b.busy_fraction == 0.5 and b.concurrent_share == 0.0


def test_two_streams_overlapping_count_once_as_busy_and_the_overlap_as_concurrent():
    b = busy_time([("a", 0, 4), ("b", 2, 6), ("b", 8, 10)])
    assert (b.wall, b.busy, b.concurrent, b.streams) == (10, 8, 2, 2)
    assert b.busy_fraction == pytest.approx(0.8) and b.concurrent_share == pytest.approx(0.25)


def test_overlapping_kernels_of_one_stream_are_one_active_stream():
    b = busy_time([("a", 0, 4), ("a", 3, 5), ("b", 4.5, 6)])
    assert b.busy == 6 and b.concurrent == pytest.approx(0.5)


def test_touching_kernels_of_two_streams_do_not_overlap():
    assert busy_time([("a", 0, 2), ("b", 2, 4)]).concurrent == 0


def test_three_streams_and_a_window_that_clips():
    b = busy_time([("a", -5, 10), ("b", 1, 3), ("c", 2, 20)], window=(0, 10))
    assert (b.busy, b.concurrent) == (10, 9)  # from 1 to 10 at least two of them run


def test_empty_and_bad_input():
    b = busy_time([])
    assert (b.busy_fraction, b.concurrent_share, b.streams) == (0.0, 0.0, 0)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        busy_time([("a", 3, 1)])
    with pytest.raises(ValueError, match="window"):
        busy_time([("a", 0, 1)], window=(5, 1))


def test_kernel_intervals_from_a_chrome_trace():
    trace = {"traceEvents": [
        {"cat": "kernel", "ts": 10.0, "dur": 5.0, "args": {"stream": 7}},
        {"cat": "kernel", "ts": 12.0, "dur": 4.0, "args": {"stream": 13}},
        {"cat": "cuda_runtime", "ts": 1.0, "dur": 1.0},
        {"cat": "kernel", "ts": 30.0, "tid": 7},  # no duration: not a finished kernel
        "junk",
    ]}
    got = kernel_intervals(trace)
    assert got == [(7, 10.0, 15.0), (13, 12.0, 16.0)]
    b = busy_time(got)
    assert (b.busy, b.concurrent, b.streams) == (6.0, 3.0, 2)
    assert kernel_intervals({}) == []
