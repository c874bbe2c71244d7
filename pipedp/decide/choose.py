"""The one planning step: options, model and batch in; block profiles and one frozen decision out.

Three ways to decide, by what the user left open:

* concurrent CPU stages (``threads`` set): :mod:`pipedp.decide.cpu`;
* ``stages="auto"`` on one device and one pipeline rank: timed trials
  (:mod:`pipedp.decide.search`) of the user's strongest alternative (layouts,
  compiled where allowed, graphed where asked) and pipedp's plans;
* otherwise (a given cut, several devices, pipeline ranks): predictions from
  the block profiles (:mod:`pipedp.decide.cut`); levers left ``"auto"`` keep
  the model as it is (no layout change, no compile).

Planning seconds (profiling included) are measured and kept in the decision.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from ..ops.swap import Swap
from ..options import ConcurrencyOptions, PipelineOptions, TrainingOptions
from ..partition.blocks import module_mode
from ..partition.parts import Parts, measurable
from ..partition.balance import balance
from ..partition.profile import BlockProfile, estimate_blocks, profile_blocks
from ..pipeline import microbatch
from ..snapshot import preserved_state
from .config import Config
from .coupling import Resolved, resolve_microbatches
from .cut import AUTO_MICROBATCHES, MAX_TRIAL_STAGES, resolve_counts, untimed_microbatches
from .decision import Choice, Decision
from .schedules import AUTO, choose_schedule, fixed
from .hazards import channels_last_hazard
from .layout import Layout
from .measuring import Clock, Trials, World
from .search import Budget, Measure, Space, allowed, search

__all__ = ["decide", "microbatch_choices", "timed", "COMPILE_S_PER_LEAF"]

# A first torch.compile (forward and backward) per leaf module, by device type: C++ kernels built on a 2-core CPU;
# Triton kernels built by the parallel compile workers of a GPU host (ResNet-18, 52 leaves: 12-22 s on the H100
# host's 16 cores, where 0.5 s kept compile from every 30 s budget).
COMPILE_S_PER_LEAF = {"cpu": 0.5, "cuda": 0.35}
SERIAL_PROFILE = (1, 1)  # warm-up and timed calls per block where the profile decides no cut


def microbatch_choices(spec: Resolved, batch: int) -> list[int]:
    """The microbatch counts the plan may have: the resolved request's one, or all of AUTO_MICROBATCHES that fit.

    ``spec``: :func:`~pipedp.decide.coupling.resolve_microbatches` of the
    user's request. Both as a step of this batch runs them
    (:func:`~pipedp.pipeline.microbatch.count`): a first batch too small for
    the count plans with fewer.
    """
    if spec == "auto":
        return [m for m in AUTO_MICROBATCHES if microbatch.count(batch, m) == m]
    return [microbatch.count(batch, int(spec))]


def timed(options: PipelineOptions, devices: Sequence[torch.device], pp: int, world: int = 1) -> bool:
    """Is the plan chosen by timed trials? ``stages="auto"`` on one device, one pipeline rank.

    On a CPU only in one process: data-parallel ranks on one host share its
    cores, and a trial the deciding rank times alone would not be the step
    they run together. A GPU is each rank's own, so its trials hold there.
    """
    return (options.stages == "auto" and pp == 1 and len(devices) == 1
            and (devices[0].type == "cuda" or world == 1))


def _compile_estimate_s(model: nn.Module, device: torch.device) -> float:
    """Seconds a first compile of the model's step is expected to take on ``device``, before one is measured."""
    per_leaf = COMPILE_S_PER_LEAF.get(device.type, COMPILE_S_PER_LEAF["cpu"])
    return per_leaf * sum(1 for m in model.modules() if next(m.children(), None) is None)


def _hint_precision(training: TrainingOptions, model: nn.Module, device: torch.device) -> str | None:
    """The precision worth timing for a hint: bf16 for an fp32 user where the device computes in it.

    Not where depthwise layers must run tuned kernels (``kernels="tvm"``): those are tuned per precision, so
    the hint's advice would need kernels tuned in the other one.
    """
    if training.precision != "fp32" or any(getattr(getattr(m, "kernels", None), "strict", False)
                                           for m in model.modules()):
        return None
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else None
    # A CPU without bf16 instructions (AVX-512 BF16, AMX) emulates it, many times slower: nothing to hint at.
    return "bf16" if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


def _space(parts: Parts, profiles: Sequence[BlockProfile], model: nn.Module, device: torch.device,
           choices: Sequence[int], training: TrainingOptions, concurrency: ConcurrencyOptions | None,
           hazard: str | None, kernels: tuple[bool, ...] = (False,), accumulate: int | None = None) -> Space:
    costs = [p.cost_ms for p in profiles]
    pieces = concurrency is not None and (concurrency.branches or concurrency.split_grads)
    return Space(
        cut=lambda s: tuple(balance(costs, s)) if len(costs) > 1 else (len(parts.blocks),),
        blocks=len(parts.blocks),
        # One CPU device runs stages one after another: more stages only add hand-offs.
        stages=tuple(range(1, MAX_TRIAL_STAGES + 1)) if device.type == "cuda" and len(costs) > 1 else (1,),
        microbatches=tuple(choices),
        layouts=(False,) if hazard else allowed(training.channels_last),
        # The concurrency pieces order streams by events inside a stage, which torch.compile does not trace (and a
        # compiled stage keeps its weight gradients in its compiled backward): never compiled with them.
        compile=(False,) if pieces and training.compile == "auto" else allowed(training.compile),
        concurrent=pieces and device.type == "cuda",
        kernels=kernels,
        hint=_hint_precision(training, model, device),
        accumulate=accumulate,
        compile_estimate_s=_compile_estimate_s(model, device),
    )


def decide(parts: Parts, model: nn.Module, sample: torch.Tensor, batch: torch.Tensor,
           devices: Sequence[torch.device], options: PipelineOptions, comm: World,
           training: TrainingOptions, concurrency: ConcurrencyOptions | None = None,
           measure: Measure | None = None, now: Callable[[], float] = time.perf_counter,
           warm: dict[Config, Sequence[object]] | None = None,
           given: Layout | None = None, kernels: Swap | None = None,
           coupled: str | None = None, trials: Trials | None = None) -> tuple[list[BlockProfile], Decision]:
    """Profile the blocks and choose everything (on the deciding rank; the others follow).

    ``trials``: the clocks that run a configuration as the build would
    (:mod:`pipedp.trials`), needed where the plan is timed (``stages="auto"``
    on one device, or ``threads`` set). ``measure`` replaces the device
    clock of the timed trials (tests), and
    ``now`` the clock of the budget and of the planning seconds. ``warm``
    receives the compiled stages the trials made, per configuration, so the
    build of a compiled plan compiles nothing again. ``given``: the layout
    ``pp="auto"`` chose for the world (its cut and microbatches are the plan's).
    ``kernels``: the depthwise layers wrap swapped onto tuned kernels; the
    trials choose whether the plan runs them (elsewhere it does).
    ``coupled``: the model's first layer that couples a batch's samples
    (:func:`~pipedp.decide.coupling.batch_coupled`), which keeps
    ``microbatches=None`` at one microbatch.
    """
    budget = Budget(options.plan_budget_s, now)
    spec = resolve_microbatches(options.microbatches, options.stages, coupled)
    choices = microbatch_choices(spec, batch.shape[0])
    small = [] if spec == "auto" or choices[0] == spec else [
        f"microbatches={spec}: {choices[0]}, as the planning batch has {batch.shape[0]} samples "
        f"(at least {microbatch.MIN_SAMPLES} per microbatch); plan on a full batch (wrap's sample=) for {spec}"]
    pieces = concurrency is not None and (concurrency.branches or concurrency.split_grads)
    levers = kernels.levers if kernels is not None else (False,)
    # Trials run backward: also when the plan is made by an inference call under no_grad.
    with preserved_state(model, devices), module_mode(model, training=True), torch.enable_grad():
        blocks = measurable(parts.blocks)
        # Which way decides (see the module doc); an injected clock times on any rank.
        threaded = False
        if given is None and options.threads is not None:  # CPU thread teams: an add-on, loaded where asked for
            from ..partition.threads import concurrent_cpu

            threaded = concurrent_cpu(options.threads, devices, comm.world)
        by_trials = (given is None and not threaded
                     and timed(options, devices, comm.pp, comm.world if measure is None else 1))
        # A given cut (block counts, one stage, the layout pp="auto" chose) outside trials and thread teams needs
        # no block times to be built: the cost model fills the plan table, the first steps measure it.
        given_cut = given is not None or options.stages == 1 or isinstance(options.stages, (list, tuple))
        measured = options.profile and (by_trials or threaded or not given_cut)
        if measured:
            # Where the trials time one-stage plans only (a CPU in one process) the cut is the whole model and
            # the profile decides nothing; a given stage count needs block costs only to place its cut points:
            # one pass after one warm-up gives either its figures.
            serial = (by_trials and devices[0].type != "cuda") or (isinstance(options.stages, int) and not threaded
                                                                    and not by_trials)
            rounds = dict(warmup=SERIAL_PROFILE[0], repeats=SERIAL_PROFILE[1]) if serial else {}
            profiles = profile_blocks(blocks, sample, progress=options.progress, copy_input=parts.copy_input,
                                      **rounds)
        else:
            profiles = estimate_blocks(blocks, sample)
        extra: tuple[str, ...] = ()  # notes of the timed trials, after the search's own
        if given is not None:
            if sum(given.counts) != len(parts.blocks):
                raise ValueError(f"pp=auto chose {given.label} over {sum(given.counts)} blocks, but the model is cut "
                                 f"into {len(parts.blocks)} here: pass pp=N and stages= by hand for this model")
            choice = Choice(Config(tuple(given.counts), given.microbatches, training.channels_last is True,
                                   training.compile is True),
                            (f"pp=auto: {given.label}, the world's layout (engine.world.table() says how it was "
                             f"chosen)",), schedule=given.schedule)
        elif threaded:
            from .cpu import decide_cpu

            profiles, choice = decide_cpu(parts, blocks, profiles, sample, batch, options,
                                          _needed(trials).thread_plan_ms, choices, training.channels_last is True,
                                          compiled=training.compile is True, schedule=fixed(options.schedule))
        elif by_trials:
            owned = None if measure is not None else _needed(trials).clock(
                kernels if kernels is not None and levers != (False,) else None)
            hazard = channels_last_hazard(model, devices[0], batch) if training.channels_last == "auto" else None
            choice = _timed(_space(parts, profiles, model, devices[0], choices, training, concurrency, hazard,
                                   levers, _kept_whole(options, coupled, batch.shape[0])),
                            owned if owned is not None else measure, budget, options, devices[0], warm, owned,
                            fixed(options.schedule))
            extra = tuple(n for n in (hazard, _serial(devices[0])) if n)
        else:
            choice = _predicted(profiles, options, devices, comm, training, choices, batch.shape[0], spec)
    unprofiled = [] if measured or not options.profile else [
        f"profile: the cut is given (stages={options.stages!r}), so no block was profiled: the plan's predicted "
        f"times are the cost model's, its measured ones come from the first steps"]
    # What no trial timed runs as the user asked: the concurrency pieces (a CPU runs them in order; thread teams
    # run none), the swapped layers on their tuned kernels.
    untimed_pieces = pieces and not threaded and not (by_trials and devices[0].type == "cuda")
    config = replace(choice.config, concurrent=choice.config.concurrent or untimed_pieces,
                     kernels=choice.config.kernels or (not by_trials and True in levers))
    return list(profiles), Decision(config, (*small, *unprofiled, *choice.notes, *extra), choice.trials,
                                    bar=choice.bar, bar_ms=choice.bar_ms, hint=choice.hint, schedule=choice.schedule,
                                    planning_s=budget.spent(), source="profile" if measured else "cost model")


def _needed(trials: Trials | None) -> Trials:
    if trials is None:
        raise ValueError("this plan is chosen by timed trials: pass decide(..., trials=) (pipedp.trials.built)")
    return trials


def _timed(space: Space, clock: Measure, budget: Budget, options: PipelineOptions, device: torch.device,
           warm: dict[Config, Sequence[object]] | None, owned: Clock | None, schedule: str) -> Choice:
    """The search on ``clock``, with a progress bar; the stages the trials of ``owned`` (the clock this call
    made, not an injected one) made go to ``warm``, and it is closed."""
    # Made only when shown: a disabled tqdm still starts a monitor thread that outlives the wrap.
    bar = tqdm(desc=f"pipedp: timing plans (budget {options.plan_budget_s:g} s)", unit="trial", delay=1.0,
               leave=False) if options.progress else None

    def report(c: Config, ms: float) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{c.label}: {ms:.1f} ms", refresh=False)
            bar.update(1)

    try:
        return replace(search(space, clock, budget, where=str(device), report=report), schedule=schedule)
    finally:
        if bar is not None:
            bar.close()
        if owned is not None:
            if warm is not None:
                warm.update(owned.stages)
            owned.close()


def _kept_whole(options: PipelineOptions, coupled: str | None, batch: int) -> int | None:
    """The microbatches to time once for a hint where the default kept a BatchNorm model at one (else None)."""
    if options.microbatches is not None or coupled is None:
        return None
    fits = [m for m in AUTO_MICROBATCHES if m > 1 and microbatch.count(batch, m) == m]
    return min(fits, key=lambda m: abs(m - 4)) if fits else None


def _serial(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    return (f"stages=auto: {device} runs stages one after another, so only one-stage plans were timed (one of "
            f"M microbatches, times M); threads='auto' runs CPU stages concurrently")


def _predicted(profiles: Sequence[BlockProfile], options: PipelineOptions, devices: Sequence[torch.device],
               comm: World, training: TrainingOptions, choices: Sequence[int], batch: int,
               spec: Resolved) -> Choice:
    """The plan from the profiles alone (a given cut, several devices, pipeline ranks)."""
    if options.schedule == AUTO:
        schedule, counts, notes = choose_schedule(profiles, options.stages, devices, max(choices), comm.pp)
    else:
        schedule = options.schedule
        counts, notes = resolve_counts(profiles, options.stages, devices, max(choices), schedule, ranks=comm.pp)
    m = choices[0]
    if spec == "auto":
        m = untimed_microbatches(len(counts), batch)
        notes.append(f"microbatches=auto: {m} for {len(counts)} stage(s) (no timed trials on {devices[0]})")
    if training.compile == "auto":
        notes.append("compile=auto: off (only stages='auto' on one device times compiled plans)")
    config = Config(tuple(counts), m, training.channels_last is True, training.compile is True)
    return Choice(config, tuple(notes), schedule=schedule)
