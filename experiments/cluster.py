"""An emulated cluster on one machine: nodes in network namespaces, joined through a bridge by shaped links.

Data parallelism waits on its links where they are slow next to compute:
several nodes over Ethernet, PCIe-only boxes, racks apart. To try a layout
on such a cluster without one, each node here is a network namespace with
one interface (``eth0``, 10.77.0.<node+1>) on a bridge that lives in a
namespace of its own; every node's egress is shaped by ``tc`` (an HTB class
at the link's rate, a netem delay under it where the kernel has netem), so
each direction of a node-to-node hop carries the link's rate and delay.
Processes of one node talk over its loopback, unshaped unless ``inside``
sets a rate (a node's fast link). Nothing touches the host's own network:
every interface is made inside namespaces this module made and goes with
them.

Namespaces are named ``pdp<pid>n<node>`` and ``pdp<pid>sw`` after the
process that made them; they are removed on every exit path of the
context manager (the processes in them killed first), and a new cluster
first removes those of makers that are gone (a run killed with SIGKILL).

    with Cluster(ClusterSpec(nodes=2, between=Link(rate_mbit=1000))) as c:
        c.torchrun(["-m", "experiments.train_dist", ...]).wait_all()

From the shell, torchrun's script and its arguments follow ``--``:

    python -m experiments.cluster --nodes 2 --rate-mbit 1000 -- -m experiments.train_dist --steps 5
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pipedp import console

__all__ = ["Link", "ClusterSpec", "Cluster", "ClusterError", "Launch", "sweep_stale", "SUBNET", "main"]

PROG = "python -m experiments.cluster"

SUBNET = "10.77.0"  # node i is SUBNET.(i + 1)/24
_NAME = re.compile(r"^pdp(\d+)(?:n\d+|sw)$")


class ClusterError(RuntimeError):
    """The machine cannot host the emulated cluster (not root, no iproute2, no netem for a delay)."""


@dataclass(frozen=True)
class Link:
    """One direction's rate (Mbit/s; None: unlimited) and one-way delay (ms) of a hop."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"a link's rate must be > 0 Mbit/s or None (unlimited), got {self.rate_mbit!r}")
        if not self.delay_ms >= 0:
            raise ValueError(f"a link's delay must be >= 0 ms, got {self.delay_ms!r}")

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or self.delay_ms > 0

    def describe(self) -> str:
        rate = "unlimited" if self.rate_mbit is None else (
            f"{self.rate_mbit / 1000:g} Gbit/s" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g} Mbit/s")
        return rate + (f", {self.delay_ms:g} ms" if self.delay_ms else "")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` namespaces joined by ``between`` links; ``inside``: a node's loopback (unshaped by default)."""

    nodes: int
    between: Link = field(default_factory=Link)
    inside: Link = field(default_factory=Link)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a positive int, got {self.nodes!r}")
        if self.inside.delay_ms:
            raise ValueError("inside= shapes a node's loopback by rate only; its delay must be 0")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove(ns: str) -> None:
    """Kill what runs in ``ns``, then delete it (its interfaces go with it)."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces of clusters whose maker is gone; the names removed."""
    gone = [ns for ns in _namespaces() if (m := _NAME.match(ns)) and not _alive(int(m.group(1)))]
    for ns in gone:
        _remove(ns)
    return gone


def check_host(spec: ClusterSpec) -> None:
    """A ClusterError naming what this machine lacks for ``spec``, before anything is made."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster makes network namespaces, which needs root (or CAP_NET_ADMIN and "
                           "CAP_SYS_ADMIN): run it as root, e.g. in a container you own")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs {' and '.join(missing)} (package iproute2): install it")
    if spec.between.delay_ms > 0 and not _has_netem():
        raise ClusterError(f"a delay of {spec.between.delay_ms:g} ms needs tc's netem, which this kernel lacks "
                           f"(module sch_netem): load it (modprobe sch_netem) or emulate the rate alone (delay 0)")


def _has_netem() -> bool:
    ns = f"pdp{os.getpid()}n999"
    _run("ip", "netns", "add", ns)
    try:
        return _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                    check=False).returncode == 0
    finally:
        _remove(ns)


def _shape(ns: str, dev: str, link: Link) -> None:
    """``dev``'s egress in ``ns`` at ``link``'s rate (an HTB class), delayed by a netem qdisc under it."""
    if not link.shaped:
        return
    tc = ("ip", "netns", "exec", ns, "tc")
    rate = f"{link.rate_mbit:g}mbit" if link.rate_mbit is not None else "100gbit"
    # r2q keeps HTB's quantum sane at high rates; the default class carries everything.
    _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate)
    if link.delay_ms > 0:
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem", "delay",
             f"{link.delay_ms:g}ms", "limit", "100000")


@dataclass
class Launch:
    """The processes started on the nodes, one per node (a torchrun, or any command)."""

    procs: list[subprocess.Popen[str]]

    def wait_all(self, timeout: float | None = None) -> list[int]:
        """Every process's exit code; the rest are killed when one times out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = []
        try:
            for p in self.procs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                codes.append(p.wait(timeout=left))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Cluster:
    """The namespaces, bridge and shaped links of ``spec``, made on enter and removed on exit."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.tag = f"pdp{os.getpid()}"
        self.made: list[str] = []
        self.launches: list[Launch] = []

    def node(self, i: int) -> str:
        """Node ``i``'s namespace."""
        return f"{self.tag}n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> "Cluster":
        check_host(self.spec)
        sweep_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        switch = f"{self.tag}sw"
        _run("ip", "netns", "add", switch)
        self.made.append(switch)
        _run("ip", "netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", switch, "ip", "link", "set", "br0", "up")
        for i in range(self.spec.nodes):
            ns = self.node(i)
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "add", f"{self.tag}h{i}"[-15:], "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                 "netns", switch)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", f"{self.tag}h{i}"[-15:], "name", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", switch, "ip", "link", "set", f"p{i}", "master", "br0")
            _run("ip", "netns", "exec", switch, "ip", "link", "set", f"p{i}", "up")
            _shape(ns, "eth0", self.spec.between)
            _shape(ns, "lo", self.spec.inside)

    def link_stats(self) -> list[dict[str, int]]:
        """Per node, what its shaped link's root qdisc sent, dropped and held back (``tc -s``): drops on an
        emulated link stall TCP for a retransmission timeout, so a run reports them beside its times."""
        out = []
        for i in range(self.spec.nodes):
            text = _run("ip", "netns", "exec", self.node(i), "tc", "-s", "qdisc", "show", "dev", "eth0").stdout
            found = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
            keys = ("sent_bytes", "sent_packets", "dropped", "overlimits")
            out.append(dict(zip(keys, map(int, found.groups()))) if found else {})
        return out

    def close(self) -> None:
        """Kill what was launched and remove every namespace made (safe to call twice)."""
        for launch in self.launches:
            launch.kill()
        for ns in reversed(self.made):
            _remove(ns)
        self.made = []

    def spawn(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen: object) -> subprocess.Popen[str]:
        """Run ``argv`` in node ``i``'s namespace, in a process group of its own (killed as one)."""
        full = dict(os.environ if env is None else env)
        return subprocess.Popen(["ip", "netns", "exec", self.node(i), *argv], env=full, text=True,
                                start_new_session=True, **popen)  # type: ignore[call-overload]

    def torchrun(self, script: Sequence[str], procs_per_node: int = 1, port: int = 29511,
                 env: Mapping[str, str] | None = None, **popen: object) -> Launch:
        """``torchrun`` on every node (node 0 hosts the rendezvous): ``script`` is what follows torchrun's flags."""
        base = dict(os.environ if env is None else env)
        base.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        procs = []
        for i in range(self.spec.nodes):
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.spec.nodes}",
                    f"--node-rank={i}", f"--nproc-per-node={procs_per_node}", f"--master-addr={self.address(0)}",
                    f"--master-port={port}", *script]
            procs.append(self.spawn(i, argv, base, **popen))
        launch = Launch(procs)
        self.launches.append(launch)
        return launch


def _parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--nodes", type=int, default=2, help="nodes: one network namespace each")
    p.add_argument("--procs-per-node", type=int, default=1, help="torchrun processes per node")
    p.add_argument("--rate-mbit", type=float, default=None, help="each node's link rate in Mbit/s (default unlimited)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="each node's one-way link delay (needs tc's netem)")
    p.add_argument("--inside-rate-mbit", type=float, default=None, help="a node's loopback rate (default unlimited)")
    p.add_argument("--port", type=int, default=29511, help="the rendezvous port on node 0")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before every process is killed")
    p.add_argument("script", nargs=argparse.REMAINDER, help="after --: torchrun's script and its arguments")
    return p


def launch(argv: Sequence[str] | None = None) -> int:
    """Run the script on an emulated cluster; its worst exit status."""
    args = _parser().parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise SystemExit("name the script after --, e.g. -- -m experiments.train_dist --steps 5")
    spec = ClusterSpec(args.nodes, between=Link(args.rate_mbit, args.delay_ms), inside=Link(args.inside_rate_mbit))
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still removes its links
    try:
        with Cluster(spec) as c:
            print(f"{PROG}: {args.nodes} node(s) x {args.procs_per_node} process(es), links {spec.between.describe()}",
                  file=sys.stderr, flush=True)
            codes = c.torchrun(script, args.procs_per_node, args.port).wait_all(args.timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return max(codes, default=0)


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.cluster: the script's worst exit status; a failure is one line on stderr."""
    return console.run(launch, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
