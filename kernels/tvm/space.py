"""Search spaces as data: named knobs with finite choices, and configs that pick one of each.

A schedule template (:class:`~.template.Template`: ``cpu.py``,
``cpu_nhwc.py``, ``cuda.py``) declares the knobs it reads for a problem; a
:class:`Config` is a plain mapping from knob name to choice, so it is JSON
in the records, a feature vector for the cost model, and the only input
(besides the problem) of the template's pure ``apply``. Constraints
that depend on several knobs at once (threads per block, shared memory) are
checked by the template's ``validate`` before anything is compiled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

__all__ = ["Knob", "Space", "Config", "InvalidConfig", "divisors"]


class InvalidConfig(ValueError):
    """A config that breaks a template constraint; rejected before compiling."""


_REQUIRED = object()


@dataclass(frozen=True)
class Knob:
    """One named choice of a template. ``since`` is the choice that configs recorded before the knob
    existed made implicitly, so old tuning records stay valid when a template grows a knob."""

    name: str
    choices: tuple[Any, ...]
    doc: str = ""
    since: Any = _REQUIRED

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError(f"knob {self.name} has no choices")


Config = dict[str, Any]


@dataclass(frozen=True)
class Space:
    """The knobs of one template for one problem."""

    template: str
    knobs: tuple[Knob, ...] = field(default=())

    def __len__(self) -> int:
        n = 1
        for k in self.knobs:
            n *= len(k.choices)
        return n

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def complete(self, config: Mapping[str, Any]) -> Config:
        """``config`` with the knobs it predates set to what it did then (see :attr:`Knob.since`)."""
        out = dict(config)
        for k in self.knobs:
            if k.name not in out and k.since is not _REQUIRED:
                out[k.name] = k.since
        return out

    def check(self, config: Mapping[str, Any]) -> None:
        """Every knob present with one of its choices (nothing else)."""
        extra = sorted(set(config) - set(self.names))
        if extra:
            raise InvalidConfig(f"{self.template}: unknown knob(s) {extra}; knobs are {self.names}")
        for k in self.knobs:
            if k.name not in config:
                raise InvalidConfig(f"{self.template}: knob {k.name} missing")
            if config[k.name] not in k.choices:
                raise InvalidConfig(f"{self.template}: {k.name}={config[k.name]!r} is not one of {list(k.choices)}")

    def sample(self, rng: random.Random) -> Config:
        return {k.name: rng.choice(k.choices) for k in self.knobs}

    def neighbours(self, config: Mapping[str, Any], rng: random.Random, moves: int = 1) -> Config:
        """``config`` with ``moves`` knobs stepped to an adjacent choice (a local move for annealing)."""
        out = dict(config)
        for k in rng.sample(list(self.knobs), min(moves, len(self.knobs))):
            i = k.choices.index(out[k.name])
            step = rng.choice([-1, 1]) if 0 < i < len(k.choices) - 1 else (1 if i == 0 else -1)
            if len(k.choices) > 1:
                out[k.name] = k.choices[i + step]
        return out

    def features(self, config: Mapping[str, Any]) -> list[float]:
        """Numeric features: each knob's value (or choice index when not a number)."""
        out = []
        for k in self.knobs:
            v = config[k.name]
            numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
            out.append(float(v) if numeric else float(k.choices.index(v)))
        return out

    def all(self) -> Iterator[Config]:
        """Every config (for small spaces and tests)."""
        def rec(i: int, cur: Config) -> Iterator[Config]:
            if i == len(self.knobs):
                yield dict(cur)
                return
            for c in self.knobs[i].choices:
                cur[self.knobs[i].name] = c
                yield from rec(i + 1, cur)
        yield from rec(0, {})


def divisors(n: int, limit: int | None = None) -> tuple[int, ...]:
    """Divisors of ``n`` (up to ``limit``): tile sizes that need no boundary checks."""
    out = tuple(d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit))
    return out or (1,)
