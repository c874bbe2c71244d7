"""Devices in nodes: a fast link inside each node, a slower one between, and where a layout's traffic goes.

A cluster is ``nodes`` nodes of ``per_node`` devices; inside a node the
devices share a fast link (NVLink, PCIe), between nodes each node has one
network interface (NIC) on a slower link (Ethernet). A layout ``dp x pp``
can sit on it two ways, and which link each kind of traffic crosses decides
its step:

* ``"pp-across"``: the pipeline across nodes, data parallelism inside.
  Consecutive stages sit on consecutive nodes (as few stages a node as
  fit), so activations and their gradients cross the NIC; a stage's
  replicas share a node, their all-reduce on the fast link. Where a
  stage's replicas outnumber a node's devices, the pipeline spans a group
  of nodes and the groups are data parallel across nodes too.
* ``"dp-across"``: data parallelism across nodes, the pipeline inside. A
  whole pipeline sits in one node (activations stay on the fast link); each
  stage's replicas span the nodes, so its gradients cross the NIC.

An all-reduce whose group spans nodes is costed as the hierarchical one
collective libraries run there (NCCL's tree and ring differ; this is the
usual model): reduce-scatter inside each node over the fast link, a ring
all-reduce of each device's shard across nodes (one ring per device of the
node, side by side through the node's NIC, which so carries
``2 (nodes - 1) / nodes`` of the bytes), all-gather inside. In the
alpha-beta form that is a latency per message plus bytes over bandwidth, so
:func:`flat_equivalent` can state it as the one :class:`~.links.Link` whose
flat ring over the same group costs the same for every message size and
bucket count, which is what :func:`~.layout.predict` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .links import Link

__all__ = ["Cluster", "Placement", "PLACEMENTS", "ASSUMPTIONS", "hierarchical_allreduce_s", "flat_equivalent",
           "shared", "place", "node_link_bytes"]

PLACEMENTS = ("pp-across", "dp-across")

ASSUMPTIONS = (
    "devices sit in nodes: a fast link inside each node (every device its own share of it, no contention), "
    "one NIC per node on the link between nodes, full duplex",
    "an all-reduce whose group spans nodes is hierarchical: reduce-scatter inside the node, one ring per device "
    "of the node across nodes on its shard (the NIC carries 2(nodes-1)/nodes of the bytes), all-gather inside",
    "the stages of a node sync their gradients over its NIC at once (their last backwards end within a few "
    "microbatches, short next to a sync over Ethernet), sharing it fairly and leaving it idle never: the syncs are "
    "through when the busiest node's gradients are, so the largest stage is charged the NIC's share that ends it "
    "then (its gradients over the busiest node's) and the smaller stages, charged the same link, finish earlier than "
    "they would but never later than it",
    "with the pipeline across nodes, the replicas of a stage in a node send each microbatch's activation (and "
    "receive its gradient) over the NIC at once, each with its share of it; activations out and gradients in do "
    "not slow each other (full duplex), nor does a stage's all-reduce slow the pipeline's hops on a shared NIC",
    "where a node holds more than one stage of a pipeline across nodes, predict takes one link for every cut, so "
    "the hops inside the node are charged the NIC's share too: an upper bound (p2p_exact false)",
)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` devices: ``inside`` joins the devices of a node, ``between`` the nodes."""

    nodes: int
    per_node: int
    inside: Link
    between: Link

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"a cluster needs >= 1 node of >= 1 device, got {self.nodes} x {self.per_node}")

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node


def hierarchical_allreduce_s(inside: Link, between: Link, nbytes: float, per_node: int, nodes: int,
                             buckets: int = 1, nic_share: float = 1.0) -> float:
    """Seconds of a hierarchical all-reduce of ``nbytes`` over ``per_node`` devices in each of ``nodes`` nodes.

    Reduce-scatter and all-gather inside a node are each a ring over the
    fast link; across nodes, each device's shard goes round its own ring of
    the nodes, all of them through the node's NIC, of which this group gets
    ``nic_share`` (the rest carries other groups' traffic at the same time).
    Each of ``buckets`` messages pays every phase's latency.
    """
    if per_node < 1 or nodes < 1:
        raise ValueError(f"a group needs >= 1 device on >= 1 node, got {per_node} x {nodes}")
    _check_share(nic_share)
    if per_node * nodes <= 1 or nbytes <= 0:
        return 0.0
    latency, per_byte = _alpha_beta(inside, between, per_node, nodes, nic_share)
    return latency * max(buckets, 1) + per_byte * nbytes


def _check_share(share: float) -> None:
    if not 0 < share <= 1:
        raise ValueError(f"nic_share must be in (0, 1], got {share}")


def _alpha_beta(inside: Link, between: Link, k: int, m: int, share: float) -> tuple[float, float]:
    """(seconds per bucket, seconds per byte) of the hierarchical all-reduce: ``k`` devices a node, ``m`` nodes."""
    latency = 2 * (k - 1) * inside.alpha_s + 2 * (m - 1) * between.alpha_s
    # Inside: reduce-scatter then all-gather, each (k-1)/k of the bytes over the device's fast link.
    # Across: the node's k rings carry 2(m-1)/m of the bytes through one NIC, ``share`` of its bandwidth.
    per_byte = 2 * (k - 1) / k / inside.bytes_per_s + 2 * (m - 1) / m / (between.bytes_per_s * share)
    return latency, per_byte


def flat_equivalent(inside: Link, between: Link, per_node: int, nodes: int, nic_share: float = 1.0) -> Link:
    """The link whose flat ring over ``per_node * nodes`` ranks costs what the hierarchical all-reduce does.

    Both costs have the form ``buckets * A + nbytes * G``: the flat ring's
    ``A = 2 (r - 1) alpha`` and ``G = 2 (r - 1) / (r beta)``, so
    ``alpha = A / (2 (r - 1))`` and ``beta = 2 (r - 1) / (r G)`` match both
    terms, for every size and bucket count (to rounding). Valid only for a
    ring over exactly ``r = per_node * nodes`` ranks. On one node (or for a
    group of one, with nothing to reduce) that is ``inside`` itself.
    """
    _check_share(nic_share)
    r = per_node * nodes
    if nodes == 1:
        return inside
    latency, per_byte = _alpha_beta(inside, between, per_node, nodes, nic_share)
    steps = 2 * (r - 1)
    return Link(f"{per_node}x{inside.name}+{nodes}x{between.name}" + (f"*{nic_share:.2g}" if nic_share < 1 else ""),
                latency / steps, steps / r / per_byte, source="hierarchical")


def shared(link: Link, senders: int) -> Link:
    """``link`` with its bandwidth split evenly between ``senders`` sending at once (latency unchanged)."""
    if senders < 1:
        raise ValueError(f"senders must be >= 1, got {senders}")
    if senders == 1:
        return link
    return Link(f"{link.name}/{senders}", link.alpha_s, link.bytes_per_s / senders, source=link.source)


@dataclass(frozen=True)
class Placement:
    """A layout ``dp x pp`` put on a cluster: the links :func:`~.layout.predict` charges and which cuts cross nodes.

    Each node holds ``stages`` consecutive stages of a pipeline, ``replicas``
    replicas of each; a pipeline spans ``span`` nodes, and ``groups`` such
    spans of nodes are data parallel with each other (``dp = replicas *
    groups``). ``allreduce``: the link of a flat ring over the ``dp``
    replicas costing what this placement's all-reduce costs; ``p2p``: the
    link every cut is charged; ``p2p_exact``: false where some cuts are
    charged the NIC but stay inside a node (an upper bound); ``crossing[c]``:
    cut ``c`` (after stage ``c``) crosses nodes.
    """

    kind: str
    dp: int
    pp: int
    stages: int
    replicas: int
    span: int
    groups: int
    allreduce: Link
    p2p: Link
    p2p_exact: bool
    crossing: tuple[bool, ...]


def _stages_per_node(cluster: Cluster, pp: int, kind: str) -> int | None:
    """Stages a node holds: all ``pp`` (the pipeline inside), or the fewest that fit with the pipeline across."""
    g, m = cluster.per_node, cluster.nodes
    if kind == "dp-across":
        return pp if g % pp == 0 else None
    # j stages a node, g / j replicas each, the pipeline over pp / j nodes, which must divide the nodes.
    fits = [j for j in range(1, min(g, pp) + 1) if g % j == 0 and pp % j == 0 and m % (pp // j) == 0]
    if not fits or (m > 1 and fits[0] == pp):  # no fit, or the pipeline inside one node: that is dp-across
        return None
    return fits[0]


def place(cluster: Cluster, dp: int, pp: int, kind: str, stage_bytes: Sequence[float] = ()) -> Placement | None:
    """``dp x pp`` on ``cluster`` as ``kind`` (one of :data:`PLACEMENTS`), or None where it does not fit.

    ``"dp-across"`` fits where a pipeline fits in one node (``pp`` divides
    ``per_node``). ``"pp-across"`` puts ``j`` consecutive stages on each
    node, the fewest that divide both ``per_node`` and ``pp`` with the
    ``pp / j`` nodes of a pipeline dividing the nodes; on more than one node
    it does not fit where that puts the whole pipeline in one node. On one
    node both are the same world. ``stage_bytes`` (each stage's gradients)
    sets the NIC's share of the syncs (equal stages where not given).
    """
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown placement {kind!r}: one of {', '.join(PLACEMENTS)}")
    if dp < 1 or pp < 1 or dp * pp != cluster.devices:
        raise ValueError(f"dp x pp = {dp} x {pp} does not fill {cluster.devices} devices")
    if stage_bytes and len(stage_bytes) != pp:
        raise ValueError(f"{pp} stages need {pp} gradient sizes, got {len(stage_bytes)}")
    j = _stages_per_node(cluster, pp, kind)
    if j is None:
        return None
    k, span = cluster.per_node // j, pp // j
    groups = cluster.nodes // span
    sizes = list(stage_bytes) or [1.0] * pp
    busiest = max(sum(sizes[q * j : q * j + j]) for q in range(span))
    share = max(sizes) / busiest if busiest > 0 else 1.0
    ar = flat_equivalent(cluster.inside, cluster.between, k, groups, nic_share=share)
    crossing = tuple((c + 1) % j == 0 for c in range(pp - 1))
    p2p = shared(cluster.between, k) if any(crossing) else cluster.inside
    return Placement(kind, dp, pp, j, k, span, groups, ar, p2p, all(crossing) or not any(crossing), crossing)


def node_link_bytes(placement: Placement, stage_bytes: Sequence[float],
                    cut_bytes: Sequence[float]) -> tuple[float, float]:
    """(bytes the busiest NIC sends in one step, bytes all NICs send in one step).

    ``stage_bytes[s]``: stage ``s``'s gradients; ``cut_bytes[c]``: the
    activation at cut ``c`` for the step's whole global batch (its gradient
    comes back the same size; each group of nodes carries its share).
    """
    pl = placement
    if len(stage_bytes) != pl.pp or len(cut_bytes) != pl.pp - 1:
        raise ValueError(f"{pl.pp} stages have {pl.pp} gradient sizes and {pl.pp - 1} cuts, got "
                         f"{len(stage_bytes)} and {len(cut_bytes)}")
    g, j = pl.groups, pl.stages
    sent = [2 * (g - 1) / g * sum(stage_bytes[q * j : q * j + j]) for q in range(pl.span)]  # all-reduce
    for c, (crosses, n) in enumerate(zip(pl.crossing, cut_bytes)):
        if crosses:  # node c // j sends the activation forward, the next node its gradient back
            sent[c // j] += n / g
            sent[c // j + 1] += n / g
    return max(sent), g * sum(sent)
