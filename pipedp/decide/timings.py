"""What the timed search has measured: each configuration's timings, its first call's cost, its upper bounds.

Kept apart from the walk that decides what to time next
(:mod:`pipedp.decide.search`), which asks this table what a trial it has
not run would cost against the budget left. A trial that raises leaves
nothing behind, and a first call that counted as a step stays marked as an
upper bound until the configuration is timed warm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .config import Config

if TYPE_CHECKING:
    from .search import Budget, Measure

__all__ = ["Timings", "steps_for", "bar_of", "MIN_STEPS", "MAX_STEPS", "TRIAL_SHARE"]

MIN_STEPS, MAX_STEPS = 1, 9  # timed steps per trial, after its warm-up call (1 where steps take seconds)
TRIAL_SHARE = 0.8  # of the budget for the planned trials; the rest is slack for finalists and noise


class Timings:
    """Every timing of the search (in the order first taken), what each configuration's first call cost, and
    which are known only by a first call that counted as a step (``cold``: upper bounds)."""

    def __init__(self, measure: Measure, budget: Budget, report: Callable[[Config, float], None] | None = None,
                 ) -> None:
        self.measure, self.budget, self.report = measure, budget, report
        self.ms: dict[Config, list[float]] = {}
        self.extra_s: dict[Config, float] = {}  # a first call's cost beyond a timed step, per whole step
        self.cold: set[Config] = set()  # timed only by a first call that counts as a step: an upper bound
        self.steps = MIN_STEPS

    @property
    def order(self) -> list[Config]:
        return list(self.ms)

    def time(self, c: Config, steps: int | None = None) -> float:
        """ms per step of ``c`` (made ready first if new); a trial that raises leaves no timing behind."""
        fresh = c not in self.ms
        try:
            return self._time(c, steps)
        except BaseException:
            if fresh:
                self.ms.pop(c, None)
                self.extra_s.pop(c, None)
                self.cold.discard(c)
            raise

    def _time(self, c: Config, steps: int | None) -> float:
        n = steps or self.steps
        if c not in self.ms:
            t0 = self.budget.now()
            sample = self.measure.warm(c)
            first_s = (self.budget.now() - t0) / self.measure.share(c)
            self.ms[c] = [] if sample is None else [float(sample)]
            self.extra_s[c] = max(first_s - (float(sample) / 1e3 if sample is not None else 0.0), 0.0)
            if sample is not None:  # the first call was the first timed step
                self.cold.add(c)
                n -= 1
                if n < 1:
                    return self._heard(c, float(sample))
        # A configuration far slower than expected gets fewer steps (at least one), not the rest of the budget.
        step_s = (min(self.ms[c]) / 1e3 if self.ms[c] else self.extra_s[c]) * self.measure.share(c)
        n = max(1, min(n, int(0.5 * max(self.budget.left(), 0.0) / max(step_s, 1e-9))))
        ms = float(self.measure.measure(c, n))
        self.ms[c].append(ms)
        self.cold.discard(c)
        return self._heard(c, ms)

    def side_by_side(self, configs: tuple[Config, ...], rounds: int, steps: int, keep_s: float = 0.0) -> bool:
        """Time ``configs`` in ``rounds`` alternating windows of ``steps`` steps; those windows replace their
        earlier timings (a lucky window taken apart must not outweigh them). False, with nothing timed, where
        the budget could not pay for every round and still keep ``keep_s`` seconds."""
        cost_s = rounds * steps * sum(self.best(c) * self.measure.share(c) for c in configs) / 1e3
        if self.budget.left() < cost_s + keep_s:
            return False
        windows: dict[Config, list[float]] = {c: [] for c in configs}
        for _ in range(rounds):
            for c in configs:
                windows[c].append(self.time(c, steps))
        for c, ms in windows.items():
            self.ms[c] = ms
        return True

    def _heard(self, c: Config, ms: float) -> float:
        if self.report is not None:
            self.report(c, ms)
        return ms

    def best(self, c: Config) -> float:
        return min(self.ms[c])

    def first_s(self, compiled: bool, default: float = 0.0) -> float:
        """The most a first call beyond a step has cost (per whole step), among compiled or eager runs."""
        return max((s for k, s in self.extra_s.items() if k.compiled == compiled), default=default)

    def cost_s(self, c: Config, ms: float | None = None) -> float:
        """Expected seconds of a first trial of ``c``: its warm-up and timed steps, at ``ms`` per step where a
        like configuration was timed, else at the fastest rate timed.

        The warm-up is charged what eager first calls cost beyond a timed step (a compile is charged apart):
        next to nothing where a first call counts as a step.
        """
        step_s = self._step_s() if ms is None else ms / 1e3
        return (self.first_s(False) + self.steps * step_s) * self.measure.share(c)

    def reserve_s(self) -> float:
        """What the final side-by-side timing of the bar (and a sampled best plan) will take."""
        return 1.5 * self.steps * self._step_s()

    def _step_s(self) -> float:
        return min(min(v) for v in self.ms.values() if v) / 1e3 if any(self.ms.values()) else 0.0


def steps_for(step_ms: float, warm_s: float, planned: int, budget: Budget) -> int:
    """Timed steps per trial so that ``planned`` trials fit the budget (at least MIN_STEPS)."""
    if step_ms <= 0:
        return MAX_STEPS
    per_trial = TRIAL_SHARE * budget.left() / max(planned, 1) - warm_s - step_ms / 1e3
    return max(MIN_STEPS, min(MAX_STEPS, int(per_trial / (step_ms / 1e3))))


def bar_of(trials: Timings) -> Config:
    """The bar as the choice takes it: the fastest own step (eager or compiled) in the user's precision."""
    return min((c for c in trials.ms if c.own and c.precision is None), key=trials.best)
