import pytest
import torch.distributed as dist

from pipedp.decide.probe import probe_allreduce, probe_p2p
from tests.multiproc import run


def _probe(rank, world):
    ar = probe_allreduce(repeats=3)
    p2p = probe_p2p(1 - rank, repeats=3)
    return ar, p2p


def test_two_gloo_ranks_measure_the_same_links():
    (ar0, p0), (ar1, p1) = run(_probe, 2)
    # Every timing is the slowest rank's: both ranks fit the same link, which the layout model can then share.
    assert ar0 == ar1 and p0 == p1
    for link in (ar0, p0):
        assert link.source == "measured" and link.alpha_s >= 0 and 1e6 < link.bytes_per_s < 1e12


def _alone(rank, world):
    with pytest.raises(ValueError, match="is this rank"):
        probe_p2p(rank)
    return dist.get_world_size()


def test_a_rank_cannot_probe_itself():
    assert run(_alone, 2) == [2, 2]


def test_latency_bound_timings_give_a_bound_instead_of_an_error():
    from pipedp.decide.probe import _fit

    got = _fit("x", [1e3, 1e6], [2e-3, 1e-3], [1.0, 1.0])  # noise: the larger message was faster
    assert got.alpha_s == 1e-3 and got.bytes_per_s == pytest.approx(1e9) and got.source == "measured"


def test_sizes_stop_growing_once_a_message_measures_the_bandwidth():
    from pipedp.decide.probe import ENOUGH_S, _enough

    secs: list[float] = []
    sent = []
    for n in _enough([1, 2, 3, 4], secs):
        sent.append(n)
        secs.append(ENOUGH_S * n / 2)  # size 2 takes ENOUGH_S: size 3 is the last one worth nothing more
    assert sent == [1, 2]
    secs = []
    assert [n for n in _enough([1, 2, 3], secs) if not secs.append(1.0)] == [1, 2]  # at least two sizes
    secs = []
    assert [n for n in _enough([1, 2, 3], secs) if not secs.append(0.0)] == [1, 2, 3]  # fast links: every size
