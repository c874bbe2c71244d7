"""What a link between devices costs: the alpha-beta model, named links, and a fit to measurements.

A message of ``n`` bytes takes ``alpha + n / beta`` seconds (latency plus
bytes over bandwidth). Ring all-reduce of ``n`` bytes over ``r`` ranks sends
``2 (r - 1) / r * n`` bytes through each rank's link in ``2 (r - 1)`` steps,
so it takes ``2 (r - 1) * alpha + 2 (r - 1) / r * n / beta``; the gradients of
a stage go as buckets, each paying its own latency. These are the costs the
layout model (:mod:`pipedp.decide.layout`) adds to the simulated compute.

Named links are nominal figures for a forecast of a machine nobody here has
measured: the bandwidth a collective achieves over them (bus bandwidth, about
70-90% of the wire's peak), stated in :data:`NAMED` and printed with every
forecast. A measured link (:func:`fit`) replaces them wherever the world can
be measured.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Link", "NAMED", "parse_link", "fit", "allreduce_s", "p2p_s"]


@dataclass(frozen=True)
class Link:
    """A link: ``alpha_s`` seconds of latency per message, ``bytes_per_s`` of bandwidth."""

    name: str
    alpha_s: float
    bytes_per_s: float
    source: str = "nominal"  # "nominal" (the table), "given" (by the user) or "measured" (fitted)

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"link {self.name!r}: latency must be >= 0 seconds, got {self.alpha_s}")
        if not (self.bytes_per_s > 0):
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bytes_per_s}")

    def describe(self) -> str:
        return (f"{self.name}: {self.bytes_per_s / 1e9:.3g} GB/s, {self.alpha_s * 1e6:.3g} us per message "
                f"({self.source})")


_GB, _US = 1e9, 1e-6
# Bus bandwidth a collective reaches (not the wire's peak) and per-message latency; nominal, for forecasts.
NAMED: dict[str, Link] = {link.name: link for link in (
    Link("pcie4", 10 * _US, 22 * _GB),      # PCIe 4.0 x16: 32 GB/s per direction peak
    Link("pcie5", 10 * _US, 44 * _GB),      # PCIe 5.0 x16: 64 GB/s per direction peak
    Link("nvlink3", 5 * _US, 230 * _GB),    # A100 NVLink 3: 300 GB/s per direction peak
    Link("nvlink4", 5 * _US, 360 * _GB),    # H100 NVLink 4: 450 GB/s per direction peak
    Link("eth10", 50 * _US, 1.1 * _GB),     # 10 Gb/s Ethernet
    Link("eth25", 30 * _US, 2.8 * _GB),     # 25 Gb/s Ethernet
    Link("eth100", 20 * _US, 11 * _GB),     # 100 Gb/s Ethernet
    Link("ib-hdr", 5 * _US, 22 * _GB),      # InfiniBand HDR, 200 Gb/s
    Link("ib-ndr", 5 * _US, 44 * _GB),      # InfiniBand NDR, 400 Gb/s
)}

_GIVEN = re.compile(r"^\s*([0-9.]+(?:e[+-]?\d+)?)\s*(GB/s|Gb/s|MB/s)\s*(?:,\s*([0-9.]+(?:e[+-]?\d+)?)\s*(us|ms))?\s*$")
_UNITS = {"GB/s": 1e9, "Gb/s": 1e9 / 8, "MB/s": 1e6}  # bytes per second of each (bits: Gb/s)


def parse_link(spec: str | Link) -> Link:
    """A link by name (:data:`NAMED`) or as ``"<bandwidth> GB/s|Gb/s|MB/s[, <latency> us|ms]"`` (latency 10 us
    when not given)."""
    if isinstance(spec, Link):
        return spec
    key = spec.strip().lower()
    if key in NAMED:
        return NAMED[key]
    m = _GIVEN.match(spec)
    if m is None:
        raise ValueError(f"unknown link {spec!r}: name one of {', '.join(NAMED)}, or give its bandwidth and "
                         f"latency, e.g. '25 GB/s, 10 us'")
    value, unit, lat, lat_unit = m.groups()
    alpha = float(lat) * (1e-6 if lat_unit == "us" else 1e-3) if lat else 10 * _US
    return Link(spec.strip(), alpha, float(value) * _UNITS[unit], source="given")


def fit(name: str, sizes: Sequence[int], seconds: Sequence[float], *, steps: Sequence[float] | None = None) -> Link:
    """The link whose ``alpha * steps + size / beta`` best fits measured ``seconds`` (least squares).

    ``sizes[i]`` is the bytes one rank's link carried in measurement i and
    ``steps[i]`` its messages (default 1 each: point-to-point). Latency is
    clamped at 0 (noise can make the intercept negative).
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fit needs at least two measurements of equal length (sizes {len(sizes)}, "
                         f"seconds {len(seconds)})")
    k = list(steps) if steps is not None else [1.0] * len(sizes)
    # seconds = alpha * k + size * g, g = 1 / beta: the normal equations of two unknowns.
    skk = sum(a * a for a in k)
    skn = sum(a * n for a, n in zip(k, sizes))
    snn = sum(float(n) * n for n in sizes)
    skt = sum(a * t for a, t in zip(k, seconds))
    snt = sum(n * t for n, t in zip(sizes, seconds))
    det = skk * snn - skn * skn
    if det <= 0:
        raise ValueError("fit needs measurements of at least two different sizes")
    alpha = (skt * snn - snt * skn) / det
    g = (skk * snt - skn * skt) / det
    if alpha < 0:  # refit the bandwidth alone through the origin
        alpha, g = 0.0, snt / snn
    if g <= 0:
        raise ValueError(f"link {name!r}: the measured times do not grow with the size (a bandwidth cannot be "
                         f"fitted): measure larger messages")
    return Link(name, alpha, 1.0 / g, source="measured")


def allreduce_s(link: Link, nbytes: float, ranks: int, buckets: int = 1) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks, sent as ``buckets`` messages."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.alpha_s * max(buckets, 1) + steps / ranks * nbytes / link.bytes_per_s


def p2p_s(link: Link, nbytes: float) -> float:
    """Seconds to send ``nbytes`` from one rank to another."""
    return link.alpha_s + nbytes / link.bytes_per_s if nbytes > 0 else 0.0
