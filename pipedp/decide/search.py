"""The timed search of ``stages="auto"``: the strongest alternative is the bar, a plan must beat it.

A user who wants speed runs their own step in the faster memory layout,
compiled where it pays: that, not plain eager, is the bar. The search times
those alternatives first, then pipedp's plans (stages, microbatches) in the
winning layout, then compiled and concurrent finalists, and takes a plan
only if it beats the bar by ``margin`` (more than trial noise); otherwise the
bar's own configuration is the plan. Where the user fixed the microbatches
the plain step is not a choice, and the fastest plan with them is kept.

Where plans are timed on one microbatch (one stage on a CPU) a plan trial
costs a fraction of a whole step, and the user's own step is the dearest
trial: there the cheap trials come first. Each layout is timed at the most
microbatches; then the own step in the faster of the two (the bar: it must
be timed, and once it is, what is left of the budget is known rather than
guessed; its first call is an upper bound, timed once more, warm,
wherever a plan beats it); then each layout's plans from the most
microbatches down while fewer pay and the budget lasts, and the other
layout's own step while it still does. Where one step takes seconds, that
lets the budget reach the plans and keeps the planning within it.

Tuned depthwise kernels are a finalist's lever under ``kernels="auto"``:
the two fastest eager plans (and the plain step run by the engine, where no
plan beats the bar) are timed again on them, and they are kept only where
that step runs faster (a kernel trial that fails leaves torch's). Under
``kernels="tvm"`` every plan runs them, the plain step on them is timed
too, and the fastest of those is the plan. The user's own step, the bar,
always runs torch's.

Planning time is part of the cost, so the search has a budget: each trial's
steps are sized from the first step's time so that the trials fit, finalists
are timed only while time is left, and a compile (seconds to minutes) only
when its estimate fits what is left, unless the user asked for one. The
decision takes its clocks as arguments, so it is tested without a device.

What was timed is kept in :mod:`~pipedp.decide.timings`; the choice among
the timings is made in :mod:`~pipedp.decide.verdict`, and the hints (timed,
never applied) in :mod:`~pipedp.decide.hints`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from ..ops.worker import breaks_process
from .config import Config
from .decision import Choice
from .hints import accumulation_hint, precision_hint
from .timings import Timings, bar_of, steps_for
from .verdict import distance, verdict

__all__ = ["Space", "Measure", "Budget", "search", "allowed", "MIN_TRIAL_GAIN"]

MIN_TRIAL_GAIN = 0.02  # a plan must beat the bar by this share (more than trial noise)
COMPILE_FINALISTS = 2  # the fastest plans also timed compiled (or with the concurrency pieces)
KERNEL_FINALISTS = 2  # the fastest eager plans also timed on tuned depthwise kernels
PRUNE_SLACK = 0.05  # a plan this much slower than the one with fewer microbatches ends that stage count's row
RETIME_WITHIN = 0.10  # the fastest plan and the bar are timed again side by side only when this close (a bar
# known only by its first call is timed again, warm, wherever a plan beats it: at once where by more than this)
SETTLE_ROUNDS = 3  # alternating windows of a nearer own step and the bar before the bar may change the model
WINDOW_STEPS = 3  # steps per window of those
RETIME_PLANS = 0.30  # a plan timed once and this close to the fastest plan is timed again (one CPU step spreads ~20%)


class Measure(Protocol):
    """The clock of the trials: a configuration made ready, then timed.

    ``warm(config)`` makes it and runs it once (allocates, compiles,
    captures): the search reads that cost off its own clock before it
    decides how many steps to time. Where the first call needs no warming
    (the user's own eager step on a CPU: no compile, no capture, no
    autotuning, shapes of the whole batch) ``warm`` returns its ms, so that
    it counts as the trial's first timed step - where a step takes seconds
    that halves a trial's cost; it is an upper bound (first touches of
    memory), timed again where a plan beats it; elsewhere it returns None.
    ``measure(config, steps)`` gives ms per forward+backward step over
    ``steps`` timed steps.
    """

    def warm(self, config: Config) -> float | None: ...

    def measure(self, config: Config, steps: int) -> float: ...

    def share(self, config: Config) -> float:
        """What one trial step of ``config`` costs, as a share of a whole step (below 1 when sampled)."""
        ...


@dataclass(frozen=True)
class Space:
    """What the search may vary, resolved from the user's options.

    ``cut(S)``: the balanced cut into S stages; ``stages``: stage counts to
    try (1 where stages run one after another); ``microbatches``: the counts
    allowed; ``layouts``: channels_last values; ``compile``: (False,), (True,)
    or both for ``"auto"``; ``concurrent``: also time finalists with the
    concurrency pieces; ``kernels``: tuned depthwise kernels off, on (every
    plan runs them), or both (the plans are walked on torch's, and the two
    fastest, and the plain step where no plan beats the bar, are timed on
    them too); ``hint``: a precision to time for the hint, or None;
    ``accumulate``: a microbatch count to time once for a hint where the
    user's math keeps one microbatch (a BatchNorm model, ``microbatches=None``).
    """

    cut: Callable[[int], tuple[int, ...]]
    blocks: int
    stages: tuple[int, ...]
    microbatches: tuple[int, ...]
    layouts: tuple[bool, ...] = (False,)
    compile: tuple[bool, ...] = (False,)
    concurrent: bool = False
    kernels: tuple[bool, ...] = (False,)
    hint: str | None = None
    accumulate: int | None = None  # microbatches timed once for a hint where the user's math keeps one
    compile_estimate_s: float = 0.0  # seconds a first compile is expected to take (before one is measured)

    @property
    def walk_kernels(self) -> bool:
        """Do the plans run the tuned kernels throughout (they must: ``kernels="tvm"``)?"""
        return self.kernels == (True,)

    def plan(self, stages: int, microbatches: int, channels_last: bool, compiled: bool) -> Config:
        """pipedp's plan of ``stages`` balanced stages, on the kernels every plan walked here runs."""
        return Config(self.cut(stages), microbatches, channels_last, compiled, kernels=self.walk_kernels)


class Budget:
    """Seconds of planning left, on a clock tests may replace."""

    def __init__(self, seconds: float, now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds, self.now = float(seconds), now
        self.start = now()

    def spent(self) -> float:
        return self.now() - self.start

    def left(self) -> float:
        return self.seconds - self.spent()


def _plans(space: Space, channels_last: bool, compiled: bool) -> list[Config]:
    """pipedp's plans in one layout: S stages x M microbatches (S <= M), ordered by M then S.

    More stages than microbatches never fill the pipeline; on equal times the
    simpler plan, earlier in the order, wins. One stage x one microbatch is
    the plain step, which the bar covers.
    """
    out = []
    for m in sorted(set(space.microbatches)):
        for s in sorted(set(space.stages)):
            if s <= min(m, space.blocks) and not (s == 1 and m == 1):
                out.append(space.plan(s, m, channels_last, compiled))
    return out


def search(space: Space, measure: Measure, budget: Budget, *, margin: float = MIN_TRIAL_GAIN,
           where: str = "the device", report: Callable[[Config, float], None] | None = None) -> Choice:
    """Time the alternatives and plans of ``space`` within ``budget`` and choose one (see the module doc).

    ``report(config, ms)`` hears of every timing as it is taken (progress).
    """
    if not space.microbatches:
        raise ValueError("stages=auto has no microbatch count to try")
    trials, notes = Timings(measure, budget, report), []
    cheap = _cheap_plans(space, measure)
    if cheap:
        bar, ranked = _time_cheap_first(space, trials, budget, notes)
    else:
        bar = _time_own(space, trials, budget)
        ranked = _time_plans(space, trials, budget, bar, notes)
    bar, ranked = _time_finalists(space, trials, budget, bar, ranked, notes)
    # A bar known only by its first call is timed warm where a plan beats it (it may then be another layout's);
    # the kernel trials are judged against that, and a faster plan on the kernels may call for it again.
    early = _warm_bar(space, trials, budget, ranked, margin)
    before = len(trials.order)
    ranked = _time_kernels(space, trials, budget, ranked, margin, notes)
    late = _warm_bar(space, trials, budget, ranked, margin, owed=not early)
    warmed = late if len(trials.order) > before else early | late  # timed just before the final re-timing
    warmed |= _settle_own(space, trials, ranked, margin)
    bar = bar_of(trials)
    # Once more side by side, so that drift during the trials favours neither: the bar where it was timed
    # before the fastest plan (where no plan was timed its figure is a minimum, so timing it again alone
    # could change no choice, and costs a whole step), and both where the plan could still win: the faster
    # of two timings would favour a plan against a bar timed once. Where plans are sampled the bar is the
    # dearest trial by far and is timed again only then, or just now, warm, with no trial since (the walk kept
    # room for that).
    close = bool(ranked) and abs(trials.best(ranked[0]) / trials.best(bar) - 1) <= RETIME_WITHIN
    drifted = not cheap and bool(ranked) and trials.order.index(bar) < trials.order.index(ranked[0])
    if (close or drifted) and bar not in warmed:
        trials.time(bar)
    if close:
        trials.time(ranked[0])
        ranked = sorted(ranked, key=trials.best)
    chosen, bar = verdict(space, trials, ranked, margin, f"timed trials on {where}", notes)
    hint = precision_hint(space, trials, budget, replace(bar, compiled=space.compile == (True,)))
    more = accumulation_hint(space, trials, budget, chosen)
    hint = "\n".join(h for h in (hint, more) if h)
    return Choice(chosen, tuple(notes), tuple((c.label, trials.best(c)) for c in trials.order),
                  bar=bar.label, bar_ms=trials.best(bar), hint=hint)


def _warm_bar(space: Space, trials: Timings, budget: Budget, ranked: list[Config], margin: float,
              owed: bool = True) -> set[Config]:
    """Own steps known only by a first call, timed again warm while the fastest plan would win against them.

    A first call of the user's whole step pays what later ones do not
    (first touch of its activations' memory, one-off set-up): an upper bound
    (ResNet-50, bf16, 2-core EPYC: 6.1 s against 3.9 s a step later). A plan
    judged against it looks faster than it is; a bar that wins against it
    wins anyway, and where the plain step is no choice (fixed microbatches)
    none is needed. Each own step so timed may become the bar (lowest first
    call first); the first is owed (``owed``), others only while the budget
    lasts. Returns those timed.
    """
    timed: set[Config] = set()
    if not ranked or 1 not in space.microbatches:
        return timed
    while trials.best(ranked[0]) <= trials.best(bar_of(trials)) * (1 - margin):
        cold = sorted((c for c in trials.cold if c.own and c.precision is None), key=trials.best)
        if not cold or ((timed or not owed) and budget.left() < trials.steps * trials.best(cold[0]) / 1e3):
            break
        trials.time(cold[0])
        timed.add(cold[0])
    return timed


def _settle_own(space: Space, trials: Timings, ranked: list[Config], margin: float) -> set[Config]:
    """Own steps nearer the user's than the bar, known by a first call only or close to it, timed warm beside it.

    Where the plain step is to be the plan (no plan beats the bar by
    ``margin``), taking the bar's layout (or its compile) over a nearer own
    step changes the user's model, so that rests on warm timings side by
    side, never on a first call: a first call's spread is wider than the
    layouts' difference (ResNet-18, batch 32 of 32x32, 2-core EPYC: NCHW's
    first call 76-100 ms beside channels_last's warm 89-92 ms; channels_last
    then ran 1.08-1.35x NCHW's step in the ImageNet example's loop). Each is
    timed in SETTLE_ROUNDS windows alternating with the bar's, while the
    budget lasts beyond the final re-timing's room, and those windows alone
    then stand for the two, so that neither drift nor one lucky window taken
    apart decides. Under ``kernels="tvm"`` the plan is never the user's own
    step, so nothing is settled. Returns those timed (the bar among them).
    """
    timed: set[Config] = set()
    if 1 not in space.microbatches or space.walk_kernels:
        return timed
    bar = bar_of(trials)
    if ranked and trials.best(ranked[0]) <= trials.best(bar) * (1 - margin):
        return timed  # a plan wins: the bar's layout is the plan's, and a settled bar could not change that
    nearer = sorted((c for c in trials.ms if c.own and c.precision is None),
                    key=lambda c: (distance(c), trials.best(c)))
    steps = max(1, min(trials.steps, WINDOW_STEPS))
    for c in nearer:
        if c == bar or distance(c) >= distance(bar):
            continue  # the bar moved to it, or to one as near: nothing nearer to settle against
        if c not in trials.cold and trials.best(c) > trials.best(bar) * (1 + RETIME_WITHIN):
            continue  # timed warm and clearly slower: a second timing could not make it the plan
        if not trials.side_by_side((c, bar), SETTLE_ROUNDS, steps, keep_s=trials.reserve_s()):
            break
        timed |= {c, bar}
        bar = bar_of(trials)
    return timed


def _time_own(space: Space, trials: Timings, budget: Budget) -> Config:
    """The user's own step in each layout (compiled if asked); the fastest. Sizes the trials from the first."""
    forced = space.compile == (True,)
    own = [Config((space.blocks,), 1, cl, forced, own=True) for cl in space.layouts]
    trials.time(own[0], 1)
    planned = len(own) + len(_plans(space, own[0].channels_last, forced)) + 2 + (space.hint is not None)
    trials.steps = steps_for(trials.best(own[0]), trials.extra_s[own[0]], planned, budget)
    for c in own[1:]:
        trials.time(c)
    return min(own, key=trials.best)


def _cheap_plans(space: Space, measure: Measure) -> bool:
    """Are plan trials a fraction of a whole step (sampled on one microbatch), so that they go first?"""
    most = max(space.microbatches)
    return (space.stages == (1,) and most > 1
            and measure.share(space.plan(1, most, space.layouts[0], space.compile == (True,))) < 1)


def _time_cheap_first(space: Space, trials: Timings, budget: Budget, notes: list[str],
                      ) -> tuple[Config, list[Config]]:
    """Each layout at the most microbatches, the own step in the faster, then fewer microbatches: the bar and plans.

    The own step is the dearest trial and the bar, so it is timed as soon as
    its layout is known (that of the faster plan at the most microbatches),
    and once more at once where a probe beats its first call by more than
    RETIME_WITHIN; the walk then fits what is left, keeping room to time the
    bar again while its only timing is a first call or a plan comes within
    RETIME_WITHIN of it. Each layout's walk goes from the most microbatches
    down (the faster layout first: which layout is faster can change with
    the microbatch size) while fewer pay: once a count is slower than the
    one above it, fewer only lose more (larger microbatches fall out of
    cache); after each walk, close runners-up timed once are timed again.
    The other layout's own step is timed last, while the budget lasts.
    """
    forced = space.compile == (True,)
    counts = sorted((m for m in set(space.microbatches) if m > 1), reverse=True)
    probes = [space.plan(1, counts[0], cl, forced) for cl in space.layouts]
    trials.time(probes[0], 1)
    planned = len(space.layouts) * (len(counts) + 1) + (space.hint is not None)
    trials.steps = steps_for(trials.best(probes[0]), trials.extra_s[probes[0]], planned, budget)
    for c in probes[1:]:
        trials.time(c)
    probes = sorted(probes, key=trials.best)
    own = [Config((space.blocks,), 1, cl, forced, own=True) for cl in space.layouts]
    bar = own[space.layouts.index(probes[0].channels_last)]
    trials.time(bar)
    plain = 1 in space.microbatches  # may the plain step be the plan? (else the bar is only reported)
    # Its first call is an upper bound. Where a plan already beats it by more than RETIME_WITHIN, its warm step
    # is timed now (the walk is then judged against it); closer, the final side-by-side timing gives it one.
    if (plain and bar in trials.cold and trials.best(probes[0]) < trials.best(bar) * (1 - RETIME_WITHIN)
            and budget.left() >= trials.steps * trials.best(bar) / 1e3):
        trials.time(bar)

    def again_s(bar_ms: float, cold: bool) -> float:
        """Room for timing a bar of ``bar_ms`` again (beside the fastest plan while that is close).

        A bar timed only by its first call (``cold``) is timed again wherever a plan beats it: room is kept
        for it throughout. Plans only get faster: once one beats the bar by more than RETIME_WITHIN, the
        plan is not timed again, nor a warm bar.
        """
        fastest = min((p for p in trials.ms if not p.own), key=trials.best)
        if trials.best(fastest) < bar_ms * (1 - RETIME_WITHIN):
            return trials.steps * bar_ms / 1e3 if cold else 0.0
        return trials.steps * (bar_ms + trials.best(fastest) * trials.measure.share(fastest)) / 1e3

    def keep_s() -> float:
        return again_s(trials.best(bar), plain and bar in trials.cold)

    for probe in probes:
        last = trials.best(probe)
        for m in counts[1:]:
            c = space.plan(1, m, probe.channels_last, forced)
            if budget.left() < trials.cost_s(c, last) + keep_s():  # at the rate of its layout's last count
                notes.append(f"stages=auto: the budget ran out before {c.label} (plan_budget_s={budget.seconds:g})")
                break
            ms = trials.time(c)
            if ms > last * (1 + PRUNE_SLACK):
                break
            last = min(last, ms)
        # A second timing of a close runner-up of this layout settles a coin toss for less than a new plan
        # costs: before the other layout's walk, which is the longer shot (slower at the most microbatches).
        _retime_close(trials, budget, sorted((c for c in trials.ms if not c.own), key=trials.best), keep_s,
                      layout=probe.channels_last)
    ranked = sorted((c for c in trials.ms if not c.own), key=trials.best)
    for c in own:
        if c in trials.ms:
            continue
        # Its step, estimated as the bar's scaled by the two layouts' probes; the room to time it again
        # beside a close plan where it would be the faster bar.
        probe = next(p for p in probes if p.channels_last == c.channels_last)
        est_ms = trials.best(bar) * trials.best(probe) / trials.best(probes[0])
        cold = plain and trials.steps == 1 and not forced  # its first call would be its only timing
        if budget.left() < trials.steps * est_ms / 1e3 + max(keep_s(), again_s(est_ms, cold)):
            notes.append(f"stages=auto: {c.label} not timed: the budget ran out (plan_budget_s={budget.seconds:g}), "
                         f"and the plans of {counts[0]} microbatches ran faster in the other layout")
            continue
        trials.time(c)
    return min((c for c in own if c in trials.ms), key=trials.best), ranked


def _retime_close(trials: Timings, budget: Budget, ranked: list[Config], keep_s: Callable[[], float],
                  layout: bool | None = None) -> list[Config]:
    """Runners-up timed once and close to the fastest plan get a second timing while the budget lasts.

    Where a trial is one step, close plans are a coin toss (cheap where trials are sampled on one microbatch).
    A second timing costs its steps alone (the run is warm); ``keep_s()`` is the room kept for what follows;
    ``layout``: only runners-up in that layout (channels_last or not) are timed again.
    """
    for c in ranked[1:]:
        if layout is not None and c.channels_last != layout:
            continue
        again_s = trials.steps * trials.best(c) * trials.measure.share(c) / 1e3
        if (len(trials.ms[c]) == 1 and trials.best(c) <= trials.best(ranked[0]) * (1 + RETIME_PLANS)
                and budget.left() >= again_s + keep_s()):
            trials.time(c)
    return sorted(ranked, key=trials.best)


def _time_plans(space: Space, trials: Timings, budget: Budget, bar: Config, notes: list[str]) -> list[Config]:
    """pipedp's plans in the bar's layout while the budget lasts, fastest first."""
    plans = _plans(space, bar.channels_last, bar.compiled)
    last: dict[int, float] = {1: trials.best(bar)}  # per stage count, its latest time (M ascending)
    for c in plans:
        s = len(c.counts)
        if last.get(s) == float("inf"):
            continue  # more microbatches stopped paying for this stage count
        if budget.left() < trials.cost_s(c) + trials.reserve_s():
            notes.append(f"stages=auto: the budget ran out before {c.label} and later plans "
                         f"(plan_budget_s={budget.seconds:g})")
            break
        ms = trials.time(c)
        # Microbatches trade per-call efficiency for overlap (and cache reuse on a CPU): once a count is
        # slower than the one before it for the same stages, larger counts only lose more.
        last[s] = float("inf") if s in last and ms > last[s] * (1 + PRUNE_SLACK) else ms
    ranked = sorted((c for c in plans if c in trials.ms), key=trials.best)
    return _retime_close(trials, budget, ranked, trials.reserve_s)


def _time_finalists(space: Space, trials: Timings, budget: Budget, bar: Config, ranked: list[Config],
                    notes: list[str]) -> tuple[Config, list[Config]]:
    """Compiled (``compile="auto"``: the bar's step and the fastest plans) and concurrent finalists."""
    if space.compile == (False, True):
        alt = replace(bar, compiled=True)
        for c in [alt] + [replace(c, compiled=True) for c in ranked[:COMPILE_FINALISTS]]:
            known = trials.first_s(True, default=space.compile_estimate_s)
            if budget.left() < known + trials.cost_s(c) + trials.reserve_s():
                notes.append(f"compile=auto: {c.label} not tried: a compile takes about {known:.0f} s and "
                             f"{max(budget.left(), 0):.0f} s of plan_budget_s={budget.seconds:g} were left")
                break
            trials.time(c)
        if alt in trials.ms and trials.best(alt) < trials.best(bar):
            bar = alt
    if space.concurrent:
        # One stage with the fewest microbatches allowed: a count the user fixed is kept (another count trains
        # with other BatchNorm statistics).
        one = space.plan(1, min(space.microbatches), bar.channels_last, bar.compiled)
        base = list(dict.fromkeys([one, *ranked[:COMPILE_FINALISTS - 1]]))
        for c in (replace(b, concurrent=True) for b in base):
            if budget.left() < trials.cost_s(c) + trials.reserve_s():
                notes.append(f"stages=auto: the budget ran out before {c.label}")
                break
            trials.time(c)
    return bar, sorted((c for c in trials.ms if not c.own), key=trials.best)


def _time_kernels(space: Space, trials: Timings, budget: Budget, ranked: list[Config], margin: float,
                  notes: list[str]) -> list[Config]:
    """The tuned depthwise kernels as a finalist's lever; the plans, fastest first.

    Under ``kernels="auto"`` the fastest eager plans are timed again on them
    (and the plain step run by the engine, where no plan beats the bar);
    under ``"tvm"`` the plans ran on them throughout, and the plain step is
    timed on them too.
    Each kernel was kept per layer because it beat torch alone, yet a step
    can run slower with them (MobileNetV2 on a 2-core EPYC, kernels tuned at
    batch 32: slower at microbatches of 16, faster at 32). So they are a
    lever like the others, timed on more than one microbatch size and kept
    only where the step timed with them is the faster one. Compiled steps
    are not tried with them (a second compile).
    """
    if space.kernels == (False,):
        return ranked
    bar, mode = bar_of(trials), "tvm" if space.walk_kernels else "auto"
    base = [] if space.walk_kernels else [c for c in ranked if not c.compiled][:KERNEL_FINALISTS]
    beaten = bool(ranked) and trials.best(ranked[0]) <= trials.best(bar) * (1 - margin)
    if 1 in space.microbatches and not bar.compiled and (space.walk_kernels or not beaten):
        base.append(bar.run_by_pipedp())  # the plain step may win on the kernels
    for b in base:
        c = replace(b, kernels=True)
        torch_ms = trials.best(b) if b in trials.ms else trials.best(bar)  # its step on torch's kernels
        if budget.left() < trials.cost_s(c, torch_ms) + trials.reserve_s():
            notes.append(f"kernels={mode}: {c.label} not timed: the budget ran out (plan_budget_s="
                         f"{budget.seconds:g})")
            break
        try:
            trials.time(c)
        except Exception as e:  # noqa: BLE001 - an optimisation that fails is dropped, never the training
            if breaks_process(e):  # a CUDA error stays with the device's context: nothing more can run
                raise
            notes.append(f"kernels={mode}: {c.label} failed ({type(e).__name__}: {e})"
                         + ("; torch runs the depthwise layers" if mode == "auto" else ""))
            break
        notes.append(f"kernels={mode}: {b.label} ran {trials.best(c):.2f} ms per step on the tuned depthwise "
                     f"kernels, {torch_ms:.2f} ms on torch's")
    return sorted((c for c in trials.ms if not c.own), key=trials.best)


def allowed(value: bool | str) -> tuple[bool, ...]:
    """A boolean lever's values to try: ``"auto"`` tries both, a bool only itself."""
    return (False, True) if value == "auto" else (bool(value),)
