"""Measure the links of a running world: all-reduce over a group, point-to-point between two ranks.

The layout model needs the world's real link costs, not a datasheet's: gloo
over loopback, NCCL over PCIe or NVLink, a network between nodes. Each probe
times messages of growing sizes (median of repeats, after a warm-up, every
rank in step) until one is large enough to measure the bandwidth and fits the alpha-beta model (:func:`pipedp.decide.links.fit`).
Collective: every rank of the group calls the same probe at the same point.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..device import sync_devices
from .links import Link, fit

__all__ = ["probe_allreduce", "probe_p2p", "SIZES"]

SIZES = (1 << 16, 1 << 20, 4 << 20, 16 << 20)  # bytes: from latency-bound to bandwidth-bound
# A size whose message took this long already measures the bandwidth: larger ones are not sent. On a
# 100 Mbit/s link the 16 MiB messages took half a minute of probing (six round trips of 2.7 s).
ENOUGH_S = 0.05


def _median_s(fn: Any, device: torch.device, group: Any, repeats: int) -> float:
    fn()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        sync_devices([device])
        t0 = time.perf_counter()
        fn()
        sync_devices([device])
        times.append(time.perf_counter() - t0)
    # Every rank reports the slowest rank's median: a collective ends for all when it ends for the last.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def probe_allreduce(group: Any = None, device: torch.device | str = "cpu", sizes: Sequence[int] = SIZES,
                    repeats: int = 5) -> Link:
    """The link that explains ring all-reduce times over ``group`` (collective over the group)."""
    device = torch.device(device)
    ranks = dist.get_world_size(group)
    if ranks < 2:
        raise ValueError("an all-reduce probe needs a group of at least two ranks")
    steps, carried, secs = [], [], []
    for n in _enough(sizes, secs):
        buf = torch.zeros(n // 4, dtype=torch.float32, device=device)
        secs.append(_median_s(lambda: dist.all_reduce(buf, group=group), device, group, repeats))
        steps.append(2.0 * (ranks - 1))
        carried.append(2.0 * (ranks - 1) / ranks * n)
    return _fit(f"all-reduce over {ranks} ranks", carried, secs, steps)


def _enough(sizes: Sequence[int], secs: list[float]) -> Any:
    """``sizes`` in order until two were timed and the last took :data:`ENOUGH_S` (``secs``: the times so
    far; every rank holds the same, the slowest rank's, so every rank stops at the same size)."""
    for n in sizes:
        if len(secs) >= 2 and secs[-1] >= ENOUGH_S:
            return
        yield n


def probe_p2p(peer: int, group: Any = None, device: torch.device | str = "cpu", sizes: Sequence[int] = SIZES,
              repeats: int = 5) -> Link:
    """The link between this rank and ``peer`` (global ranks; both call it, naming each other).

    Collective over ``group`` (default: the world): every rank of it calls
    the probe at the same point, naming its own partner (the timings are
    synchronised with a barrier and the slowest rank's is kept).

    Each timing is a round trip (send and receive back) halved: one rank's
    clock times both directions, which is what a cut costs (an activation
    forward, its gradient back).
    """
    device = torch.device(device)
    me = dist.get_rank()
    if peer == me:
        raise ValueError(f"probe_p2p: peer {peer} is this rank: name another rank of the group")
    first = me < peer
    secs: list[float] = []
    for n in _enough(sizes, secs):
        buf = torch.zeros(n // 4, dtype=torch.float32, device=device)

        def round_trip() -> None:
            if first:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        secs.append(_median_s(round_trip, device, group, repeats) / 2)
    return _fit(f"point-to-point {min(me, peer)}<->{max(me, peer)}", list(sizes[: len(secs)]), secs,
                [1.0] * len(secs))


def _fit(name: str, carried: list[float], secs: list[float], steps: list[float]) -> Link:
    """The fitted link; where noise hides the growth with size (latency-bound sizes), a bound that holds:
    the smallest time per message as latency and the largest message's bytes over its whole time."""
    try:
        return fit(name, carried, secs, steps=steps)
    except ValueError:
        i = max(range(len(carried)), key=lambda j: carried[j])
        return Link(name, min(t / k for t, k in zip(secs, steps)), carried[i] / secs[i], source="measured")
