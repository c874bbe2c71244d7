"""The emulated cluster: namespaces and shaped links made, measured and removed on every exit path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from experiments import cluster
from experiments.cluster import Cluster, ClusterError, ClusterSpec, Link


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs root with iproute2"
    probe = f"pdp{os.getpid()}n998"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "this machine refuses network namespaces"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


WHY = _can_make_namespaces()
needs_namespaces = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _mine() -> list[str]:
    return [ns for ns in cluster._namespaces() if ns.startswith(f"pdp{os.getpid()}")]


def test_without_root_the_error_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        Cluster(ClusterSpec(2)).__enter__()


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="rate"):
        Link(rate_mbit=0)
    with pytest.raises(ValueError, match="delay"):
        Link(delay_ms=-1)
    with pytest.raises(ValueError, match="loopback"):
        ClusterSpec(2, inside=Link(delay_ms=1))
    assert Link(rate_mbit=2500, delay_ms=1).describe() == "2.5 Gbit/s, 1 ms"


@needs_namespaces
def test_namespaces_are_made_and_removed_also_when_the_body_fails():
    with Cluster(ClusterSpec(2, between=Link(rate_mbit=100))) as c:
        assert sorted(_mine()) == sorted([c.node(0), c.node(1), f"{c.tag}sw"])
        shown = subprocess.run(["ip", "netns", "exec", c.node(0), "tc", "class", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "rate 100Mbit" in shown
    assert _mine() == []
    with pytest.raises(KeyError):
        with Cluster(ClusterSpec(1)):
            raise KeyError("the body failed")
    assert _mine() == []


@needs_namespaces
def test_a_killed_makers_namespaces_are_swept_by_the_next_cluster():
    code = ("import os, signal, sys; sys.path.insert(0, '.');"
            "from experiments.cluster import Cluster, ClusterSpec;"
            "c = Cluster(ClusterSpec(2)).__enter__(); print(c.tag, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    tag = done.stdout.strip()
    assert tag and any(ns.startswith(tag) for ns in cluster._namespaces())
    removed = cluster.sweep_stale()
    assert sorted(removed) == sorted(ns for ns in removed if ns.startswith(tag)) and len(removed) >= 3
    assert not any(ns.startswith(tag) for ns in cluster._namespaces())


RECEIVER = """
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5001)); s.listen()
print("ready", flush=True)
a, _ = s.accept(); n, t0 = 0, None
while True:
    b = a.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.perf_counter()
    n += len(b)
print(n * 8 / 1e6 / (time.perf_counter() - t0))
"""
SENDER = """
import socket
s = socket.create_connection(("{host}", 5001)); d = b"x" * (1 << 20)
for _ in range({mib}):
    s.sendall(d)
s.close()
"""


@needs_namespaces
def test_a_limited_link_carries_its_rate_between_nodes():
    with Cluster(ClusterSpec(2, between=Link(rate_mbit=200))) as c:
        rx = c.spawn(1, [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE)
        assert rx.stdout.readline().strip() == "ready"
        tx = c.spawn(0, [sys.executable, "-c", SENDER.format(host=c.address(1), mib=32)])
        assert tx.wait(timeout=120) == 0
        mbit = float(rx.communicate(timeout=120)[0])
    assert mbit == pytest.approx(200, rel=0.2)


@needs_namespaces
@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_two_nodes_through_a_limited_link_train_exactly_as_plain_training(pp, tmp_path):
    from torch import nn
    import torch

    from tests.experiments import cluster_worker as worker

    out = tmp_path / "weights.pt"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with Cluster(ClusterSpec(2, between=Link(rate_mbit=100))) as c:
        codes = c.torchrun(["-m", "tests.experiments.cluster_worker", "--pp", str(pp), "--out", str(out)],
                           port=29600 + pp, cwd=root).wait_all(timeout=300)
    assert codes == [0, 0]
    plain = worker.model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for x, y in worker.batches():
        opt.zero_grad()
        nn.CrossEntropyLoss()(plain(x), y).backward()
        opt.step()
    got = torch.load(out, weights_only=True)
    assert max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items()) <= 1e-5
