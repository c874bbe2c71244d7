import math

import pytest

from pipedp.decide.links import NAMED, Link, allreduce_s, fit, p2p_s, parse_link


def test_alpha_beta_costs():
    link = Link("x", alpha_s=1e-5, bytes_per_s=1e9)
    assert p2p_s(link, 1e6) == pytest.approx(1e-5 + 1e-3)
    assert p2p_s(link, 0) == 0.0
    # Ring all-reduce over 4 ranks: 6 steps, each rank's link carries 2 * 3/4 of the bytes.
    assert allreduce_s(link, 4e6, 4) == pytest.approx(6e-5 + 6e-3)
    assert allreduce_s(link, 4e6, 4, buckets=3) == pytest.approx(3 * 6e-5 + 6e-3)
    assert allreduce_s(link, 4e6, 1) == 0.0  # one replica: nothing to sync


def test_named_and_given_links():
    assert parse_link("pcie4") is NAMED["pcie4"] and parse_link("NVLink4") is NAMED["nvlink4"]
    given = parse_link("25 GB/s, 8 us")
    assert given.bytes_per_s == 25e9 and given.alpha_s == pytest.approx(8e-6) and given.source == "given"
    assert parse_link("100 Gb/s").bytes_per_s == pytest.approx(12.5e9)  # bits
    assert parse_link("500 MB/s, 1 ms").alpha_s == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="unknown link 'pcie9'.*pcie4.*'25 GB/s, 10 us'"):
        parse_link("pcie9")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link("bad", 0.0, 0.0)


def test_fit_recovers_a_link_from_its_own_times():
    true = Link("t", 3e-5, 2.5e9)
    sizes = [1 << 16, 1 << 20, 4 << 20, 16 << 20]
    got = fit("t", sizes, [p2p_s(true, n) for n in sizes])
    assert got.alpha_s == pytest.approx(true.alpha_s, rel=1e-6) and got.bytes_per_s == pytest.approx(2.5e9, rel=1e-6)
    assert got.source == "measured"
    # With steps: an all-reduce's time is alpha per step plus its carried bytes over the bandwidth.
    steps, carried = [2.0] * 4, [n for n in sizes]
    got = fit("ar", carried, [2 * true.alpha_s + n / true.bytes_per_s for n in carried], steps=steps)
    assert got.alpha_s == pytest.approx(true.alpha_s, rel=1e-6) and got.bytes_per_s == pytest.approx(2.5e9, rel=1e-6)


def test_fit_clamps_a_negative_latency_and_refuses_what_cannot_fit():
    got = fit("n", [1e6, 2e6], [0.9e-3, 2.0e-3])  # the intercept would be negative
    assert got.alpha_s == 0.0 and math.isfinite(got.bytes_per_s)
    with pytest.raises(ValueError, match="two different sizes"):
        fit("n", [1e6, 1e6], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="do not grow with the size"):
        fit("n", [1e6, 2e6], [2e-3, 1e-3])
