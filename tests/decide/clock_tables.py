"""Clocks that read tables instead of a device: the search's trials with injected timings."""

from __future__ import annotations


class FakeTime:
    """A clock that moves only when a trial says it took time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TableClock:
    """ms per step from a table keyed by configuration label (``default`` for the rest).

    A value may be a list: successive timings of that configuration (drift).
    ``warm_s`` is what a first call costs (a compile costs ``compile_s``);
    timed steps advance ``time`` by their ms. ``warm_counts``: an eager first
    call is a timed step (``warm`` returns its ms, as on a CPU); ``"own"``:
    only the user's own step's is (as on a CPU, where a plan's first call
    also sets up its microbatch shapes).
    """

    def __init__(self, table: dict, default: float = 50.0, time: FakeTime | None = None, warm_s: float = 0.0,
                 compile_s: float = 0.0, warm_counts: bool | str = False) -> None:
        self.table, self.default = dict(table), default
        self.time = time if time is not None else FakeTime()
        self.warm_s, self.compile_s, self.warm_counts = warm_s, compile_s, warm_counts
        self.seen: list[str] = []  # labels in the order first warmed
        self.calls: dict[str, int] = {}
        self.shares: dict[str, float] = {}  # label -> a trial step's share of a whole step (sampled plans)

    def _ms(self, label: str) -> float:
        v = self.table.get(label, self.default)
        if isinstance(v, list):
            k = self.calls.get(label, 0)
            self.calls[label] = k + 1
            return float(v[min(k, len(v) - 1)])
        return float(v)

    def warm(self, config) -> float | None:
        self.seen.append(config.label)
        self.time.t += self.compile_s if config.compiled else self.warm_s
        counts = (self.warm_counts is True or (self.warm_counts == "own" and config.own)) and not config.compiled
        ms = self._ms(config.label) if counts else self._peek(config.label)
        self.time.t += ms / 1e3 * self.share(config)
        return ms if counts else None

    def _peek(self, label: str) -> float:
        v = self.table.get(label, self.default)
        return float(v[0] if isinstance(v, list) else v)

    def share(self, config) -> float:
        return self.shares.get(config.label, 1.0)

    def measure(self, config, steps: int) -> float:
        ms = self._ms(config.label)
        self.time.t += ms * steps / 1e3 * self.share(config)
        return ms
