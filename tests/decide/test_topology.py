import pytest

from pipedp.decide.links import NAMED, Link, allreduce_s
from pipedp.decide.topology import (Cluster, flat_equivalent, hierarchical_allreduce_s, node_link_bytes, place,
                                    shared)

FAST = Link("fast", 5e-6, 100e9)
SLOW = Link("slow", 50e-6, 1e9)


def test_hierarchical_allreduce_by_hand():
    # 4 devices a node, 2 nodes, 8 MB, 2 buckets.
    # Latency per bucket: inside 2*3 steps of 5 us, across 2*1 steps of 50 us = 30 + 100 = 130 us.
    # Bytes: inside 2 * 3/4 * 8e6 / 100e9 = 120 us; across 2 * 1/2 * 8e6 / 1e9 = 8000 us.
    got = hierarchical_allreduce_s(FAST, SLOW, 8e6, per_node=4, nodes=2, buckets=2)
    assert got == pytest.approx(2 * 130e-6 + 120e-6 + 8000e-6)
    # The NIC shared with 3 other groups: the across part takes 4x as long.
    shared4 = hierarchical_allreduce_s(FAST, SLOW, 8e6, per_node=4, nodes=2, buckets=2, nic_share=0.25)
    assert shared4 == pytest.approx(2 * 130e-6 + 120e-6 + 4 * 8000e-6)


@pytest.mark.parametrize("n,buckets", [(1e3, 1), (8e6, 1), (8e6, 5), (3e8, 12)])
def test_limiting_cases_are_the_flat_rings(n, buckets):
    # One node: the flat ring over the fast link; one device a node: the flat ring over the slow link.
    assert hierarchical_allreduce_s(FAST, SLOW, n, 8, 1, buckets) == pytest.approx(allreduce_s(FAST, n, 8, buckets))
    assert hierarchical_allreduce_s(FAST, SLOW, n, 1, 6, buckets) == pytest.approx(allreduce_s(SLOW, n, 6, buckets))
    assert hierarchical_allreduce_s(FAST, SLOW, n, 1, 1, buckets) == 0.0
    assert hierarchical_allreduce_s(FAST, SLOW, 0, 4, 4, buckets) == 0.0


@pytest.mark.parametrize("k,m,share", [(8, 8, 1.0), (2, 4, 0.25), (4, 2, 0.5), (1, 8, 1 / 8), (8, 1, 1.0)])
@pytest.mark.parametrize("n,buckets", [(1.0, 1), (4e6, 1), (4e6, 7), (2e8, 3)])
def test_flat_equivalent_is_exact_for_every_size_and_bucket_count(k, m, share, n, buckets):
    eq = flat_equivalent(NAMED["nvlink4"], NAMED["eth25"], k, m, nic_share=share)
    want = hierarchical_allreduce_s(NAMED["nvlink4"], NAMED["eth25"], n, k, m, buckets, nic_share=share)
    assert allreduce_s(eq, n, k * m, buckets) == pytest.approx(want, rel=1e-12)
    assert flat_equivalent(FAST, SLOW, 1, 1) is FAST
    with pytest.raises(ValueError, match="nic_share"):
        flat_equivalent(FAST, SLOW, 2, 2, nic_share=0.0)


def test_more_devices_a_node_never_send_more_through_the_nic():
    # 64 devices as 8 x 8 (hierarchical) against 64 x 1 (a flat ring across 64 NICs): fewer bytes per NIC.
    eight = hierarchical_allreduce_s(FAST, SLOW, 1e8, 8, 8)
    flat = hierarchical_allreduce_s(FAST, SLOW, 1e8, 1, 64)
    assert eight < flat


def test_shared_link_splits_bandwidth_only():
    s = shared(SLOW, 4)
    assert s.alpha_s == SLOW.alpha_s and s.bytes_per_s == SLOW.bytes_per_s / 4
    assert shared(SLOW, 1) is SLOW
    with pytest.raises(ValueError, match="senders"):
        shared(SLOW, 0)


def test_placements_fit_and_route_traffic():
    c = Cluster(nodes=4, per_node=8, inside=FAST, between=SLOW)
    # Pipeline across nodes, one stage a node: dp = 8 replicas inside each node, every cut crosses.
    a = place(c, 8, 4, "pp-across")
    assert (a.stages, a.replicas, a.span, a.groups) == (1, 8, 4, 1)
    assert a.allreduce is FAST and a.p2p.bytes_per_s == SLOW.bytes_per_s / 8 and a.p2p_exact
    assert a.crossing == (True, True, True)
    # Two stages a node: every other cut stays inside, charged the NIC all the same (an upper bound).
    b = place(c, 4, 8, "pp-across")
    assert (b.stages, b.replicas, b.span, b.groups) == (2, 4, 4, 1)
    assert b.crossing == (False, True, False, True, False, True, False) and not b.p2p_exact
    assert b.p2p.bytes_per_s == SLOW.bytes_per_s / 4
    # 16 replicas of a 2-stage pipeline: the pipeline spans 2 nodes, 2 such pairs data parallel across nodes;
    # each node holds one stage, so its all-reduce has the whole NIC.
    h = place(c, 16, 2, "pp-across", stage_bytes=(1e7, 9e7))
    assert (h.stages, h.replicas, h.span, h.groups) == (1, 8, 2, 2) and h.crossing == (True,)
    assert allreduce_s(h.allreduce, 9e7, 16) == pytest.approx(hierarchical_allreduce_s(FAST, SLOW, 9e7, 8, 2))
    assert place(c, 32, 1, "pp-across") is None  # one stage: data parallelism, not a pipeline across nodes
    # Data parallel across nodes, a 2-stage pipeline inside: 4 replicas of each stage a node, NIC halved.
    d = place(c, 16, 2, "dp-across")
    assert (d.stages, d.replicas, d.span, d.groups) == (2, 4, 1, 4)
    assert d.p2p is FAST and d.crossing == (False,)
    assert allreduce_s(d.allreduce, 1e8, 16) == pytest.approx(
        hierarchical_allreduce_s(FAST, SLOW, 1e8, 4, 4, nic_share=0.5))
    # Unequal stages: the NIC is through when the node's bytes are: the largest stage's share is 3/4.
    u = place(c, 16, 2, "dp-across", stage_bytes=(2.5e7, 7.5e7))
    assert allreduce_s(u.allreduce, 7.5e7, 16) == pytest.approx(
        hierarchical_allreduce_s(FAST, SLOW, 7.5e7, 4, 4, nic_share=0.75))
    assert allreduce_s(u.allreduce, 7.5e7, 16) == pytest.approx(  # = all 1e8 bytes through the whole NIC
        hierarchical_allreduce_s(FAST, SLOW, 7.5e7, 4, 1) + hierarchical_allreduce_s(FAST, SLOW, 1e8, 1, 4),
        rel=1e-9)
    with pytest.raises(ValueError, match="2 gradient sizes"):
        place(c, 16, 2, "dp-across", stage_bytes=(1.0,))
    assert place(c, 2, 16, "dp-across") is None  # a 16-stage pipeline does not fit a node of 8
    assert place(Cluster(3, 8, FAST, SLOW), 12, 2, "pp-across") is None  # pairs of nodes do not divide 3 nodes
    with pytest.raises(ValueError, match="does not fill"):
        place(c, 4, 4, "dp-across")
    with pytest.raises(ValueError, match="unknown placement"):
        place(c, 8, 4, "diagonal")


def test_one_node_keeps_everything_inside():
    c = Cluster(1, 8, FAST, SLOW)
    for kind in ("pp-across", "dp-across"):
        p = place(c, 4, 2, kind)
        assert p.p2p is FAST and p.p2p_exact and not any(p.crossing)
        assert allreduce_s(p.allreduce, 1e8, 4) == pytest.approx(allreduce_s(FAST, 1e8, 4))
        assert node_link_bytes(p, (5e7, 5e7), (5e6,)) == (0.0, 0.0)


def test_node_link_bytes():
    c = Cluster(4, 8, FAST, SLOW)
    # Data parallel across 4 nodes: each NIC sends 2 * 3/4 of the gradients, whatever the pipeline inside.
    assert node_link_bytes(place(c, 32, 1, "dp-across"), (1e8,), ()) == (pytest.approx(1.5e8), pytest.approx(6e8))
    assert node_link_bytes(place(c, 16, 2, "dp-across"), (2e7, 8e7), (5e6,)) == (pytest.approx(1.5e8),
                                                                                pytest.approx(6e8))
    # Pipeline across nodes, cuts of 1, 2, 3 MB (global batch): node 2 sends cut 2 forward and cut 1's gradient.
    a = place(c, 8, 4, "pp-across")
    busiest, total = node_link_bytes(a, (1e7,) * 4, (1e6, 2e6, 3e6))
    assert busiest == pytest.approx(5e6) and total == pytest.approx(12e6)
    # Two pairs of nodes: each pair carries half the batch's activations, and each stage's all-reduce
    # sends 2 * 1/2 of its gradients from each of its nodes.
    h = place(c, 16, 2, "pp-across")
    busiest, total = node_link_bytes(h, (1e7, 9e7), (4e6,))
    assert busiest == pytest.approx(9e7 + 2e6) and total == pytest.approx(2 * (1e7 + 9e7 + 4e6))
    with pytest.raises(ValueError, match="3 cuts"):
        node_link_bytes(a, (1e7,) * 4, (1e6,))
