"""Loading a checkpoint into an engine whole or not at all.

``nn.Module.load_state_dict`` copies every entry that fits before it reports
the ones that do not, and an optimizer accepts the state of another
optimizer kind and fails only at its next step. So a checkpoint is first
checked against the engine it goes into — model keys and shapes, the
optimizer's kind and parameter counts, the engine entry (the model it was
saved for among them), every RNG state, the fp16 loss scale and the
gradients of an accumulation window — and only then applied; if applying
still fails, everything it touched is put back (:func:`undo_on_failure`).
What a load warns about is warned before anything changes
(:func:`warn_run_state`), so a warning turned into an error changes nothing.

A save inside an accumulation window (``train_step(..., update=False)``)
keeps the gradients the window holds, by parameter name, beside the number
of calls so far (:class:`Window`); a checkpoint without them is at a
window's boundary, and loading it ends any window the engine was in.

An optimizer state dict names parameters by position only, so state saved
for another parameter order with the same counts would load and make every
step fail with a size error: each per-parameter state tensor is checked
against the parameter it lands on. Adam and AdamW share every group key and
differ in how weight decay is applied; loading one into the other would
switch it silently, so the optimizer's class (recorded at save) and the
groups' ``decoupled_weight_decay`` must match.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from .decide.config import Config
from .decide.record import RecordError, from_record
from .precision import LossScaler, check_scaler_state
from .snapshot import rng_state, set_rng_state

__all__ = ["EngineEntry", "Window", "check_checkpoint", "check_run_state", "warn_run_state", "apply_run_state",
           "model_identity", "held_window", "apply_window", "undo_on_failure"]

_RNG_KEYS = {"torch", "cuda", "python", "numpy"}
_LIST = 4  # differences named in one message


@dataclass(frozen=True)
class Window:
    """An accumulation window in progress: the calls with ``update=False`` so far and the gradients they hold."""

    calls: int
    grads: Mapping[str, torch.Tensor]  # by parameter name; a parameter without a gradient is absent


@dataclass(frozen=True)
class EngineEntry:
    """The engine's own part of a checkpoint, checked."""

    steps: int
    rng: list[dict[str, Any]] | None  # one per rank, by global rank
    scaler: dict[str, Any] | None = None  # fp16 loss scaling's state (None: saved in another precision)
    plan: Config | None = None  # the configuration the saved run trained with (None: saved before a plan)
    window: Window | None = None  # None: saved at a window's boundary


def model_identity(module: nn.Module) -> dict[str, str]:
    """What a run state names its model by: the class and a digest of the state dict's names and shapes.

    The same entries a checkpoint's model is checked on (:func:`_check_model`),
    so a run state saved beside a script's own weights can be checked too.
    """
    entries = [[k, list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__]
               for k, v in module.state_dict().items()]
    digest = hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()[:16]
    return {"class": type(module).__qualname__, "digest": digest}


def _check_identity(saved: Any, module: nn.Module) -> None:
    if saved is None:  # saved before run states named their model
        return
    if not isinstance(saved, Mapping) or not isinstance(saved.get("digest"), str):
        raise ValueError(f"the checkpoint's engine entry names its model malformed ('model': {saved!r:.80}): it "
                         f"is damaged or not written by pipedp")
    mine = model_identity(module)
    if saved["digest"] != mine["digest"]:
        raise ValueError(
            f"the run state was saved by another model than this engine's {mine['class']}: it was saved with a "
            f"{saved.get('class', 'model')!s:.60} whose parameters and buffers differ in names or shapes (digest "
            f"{saved['digest']:.16} vs {mine['digest']}). Nothing was loaded; load the run state saved with this "
            f"model, or leave it out to start its steps and RNG afresh")


def held_window(module: nn.Module, calls: int) -> dict[str, Any] | None:
    """The engine entry's record of a window ``calls`` calls in: each parameter's gradient by name (None: none).

    The tensors are the live ``.grad`` tensors, detached, as a state dict's
    are the live parameters: save them before the next call.
    """
    if calls == 0:
        return None
    grads = {n: p.grad.detach() for n, p in module.named_parameters() if p.grad is not None}
    return {"calls": calls, "grads": grads}


def _check_window(raw: Any, module: nn.Module) -> Window | None:
    if raw is None:
        return None
    calls = raw.get("calls") if isinstance(raw, Mapping) else None
    grads = raw.get("grads") if isinstance(raw, Mapping) else None
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1 or not isinstance(grads, Mapping):
        raise ValueError("the checkpoint's engine entry holds a malformed accumulation window ('window' needs "
                         "'calls', a positive count, and 'grads', gradients by parameter name): it is damaged or "
                         "not written by pipedp. Nothing was loaded")
    params = dict(module.named_parameters())
    bad = [f"'{n}'" + (" (no such parameter)" if n not in params else
                       f" {tuple(g.shape)} vs {tuple(params[n].shape)}" if isinstance(g, torch.Tensor) else
                       f" ({type(g).__name__})")
           for n, g in grads.items()
           if n not in params or not isinstance(g, torch.Tensor) or not g.is_floating_point()
           or g.shape != params[n].shape]
    if bad:
        raise ValueError(
            f"the checkpoint's held gradients (an accumulation window's, 'window') do not fit this model: "
            f"{_some(bad)}. Nothing was loaded; load a checkpoint of this model")
    return Window(calls, dict(grads))


def apply_window(module: nn.Module, window: Window | None) -> int:
    """Put a checked window's gradients on the parameters (the others' ``.grad`` None); returns its call count.

    Every gradient is placed first and assigned after, so a failure (out of
    memory) assigns none. None: a boundary, every ``.grad`` is cleared.
    """
    named = list(module.named_parameters())
    held = window.grads if window is not None else {}
    new = [held[n].to(device=p.device, dtype=p.dtype, copy=True) if n in held else None for n, p in named]
    for (_, p), g in zip(named, new):
        p.grad = g
    return window.calls if window is not None else 0


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
    return ", ".join(names[:_LIST]) + more


def _check_model(module: nn.Module, state: Any) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(f"the checkpoint's 'model' entry is a {type(state).__name__}, not a state dict")
    mine = module.state_dict()
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in mine.items()
        if k in state and isinstance(v, torch.Tensor)
        and (not isinstance(state[k], torch.Tensor) or state[k].shape != v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"it lacks {_some(missing)}")
    if unexpected:
        problems.append(f"it has entries the model has not: {_some(unexpected)}")
    if shapes:
        problems.append(f"shapes differ (checkpoint vs model): {_some(shapes)}")
    if problems:
        raise ValueError(
            f"the checkpoint is of another model than {type(module).__name__}: {'; '.join(problems)}. "
            f"Nothing was loaded; load a checkpoint of this model"
        )


def _group_keys(groups: list[dict[str, Any]]) -> list[str]:
    return sorted({k for g in groups for k in g if k != "params"})


def _check_optimizer(optimizer: torch.optim.Optimizer | None, state: Any, names: Mapping[int, str],
                     saved_class: str | None = None) -> None:
    if state is None:
        return
    if optimizer is None:
        raise ValueError("the checkpoint has optimizer state but this engine has no optimizer: wrap with optimizer=...")
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), Mapping):
        raise ValueError("the checkpoint's 'optimizer' entry is not an optimizer state dict (state, param_groups)")
    kind = type(optimizer).__name__
    saved, mine = state["param_groups"], optimizer.param_groups
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in saved):
        raise ValueError("the checkpoint's optimizer param_groups are malformed (each needs a 'params' list)")
    if _group_keys(saved) != _group_keys(mine):
        raise ValueError(
            f"the checkpoint's optimizer state is of another optimizer than this engine's {kind}: its groups hold "
            f"{_group_keys(saved)}, a {kind} has {_group_keys(mine)}. Nothing was loaded; wrap with the optimizer "
            f"the checkpoint was saved with, or load only the model (engine.module.load_state_dict(ckpt['model']))"
        )
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in mine]:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of {[len(g['params']) for g in saved]} parameters, this "
            f"engine's {kind} has {[len(g['params']) for g in mine]}: build the optimizer's groups as when it was saved"
        )
    ids = {i for g in saved for i in g["params"]}
    stray = [i for i in state["state"] if i not in ids]
    if stray:
        raise ValueError(f"the checkpoint's optimizer state names parameters {stray[:_LIST]} that no group holds")
    _check_weight_decay(optimizer, saved, saved_class)
    _check_state_shapes(optimizer, state, names)


def _adam_kind(decoupled: Any) -> str:
    return "AdamW (decoupled weight decay)" if decoupled else "Adam (L2 weight decay)"


def _check_weight_decay(optimizer: torch.optim.Optimizer, saved: list[Mapping[str, Any]],
                        saved_class: str | None) -> None:
    """Refuse optimizer state of another class, or of the Adam family with the other kind of weight decay."""
    kind = type(optimizer).__name__
    if saved_class is not None and saved_class != kind:
        raise ValueError(
            f"the checkpoint's optimizer state was saved by {saved_class}, this engine's optimizer is {kind}: "
            f"loading it would put {saved_class}'s hyper-parameters (its weight decay among them) into {kind}. "
            f"Nothing was loaded; wrap with {saved_class} to resume, or load only the model "
            f"(engine.module.load_state_dict(ckpt['model']))")
    for i, (g, mine) in enumerate(zip(saved, optimizer.param_groups)):
        if "decoupled_weight_decay" in g and "decoupled_weight_decay" in mine \
                and bool(g["decoupled_weight_decay"]) != bool(mine["decoupled_weight_decay"]):
            raise ValueError(
                f"the checkpoint's optimizer state is {_adam_kind(g['decoupled_weight_decay'])} state, this "
                f"engine's {kind} is set up as {_adam_kind(mine['decoupled_weight_decay'])} (param group {i}): "
                f"loading it would switch the weight decay. Nothing was loaded; wrap with the optimizer the "
                f"checkpoint was saved with, or load only the model (engine.module.load_state_dict(ckpt['model']))")


def _fits(saved: torch.Tensor, param: torch.Tensor, own: Any) -> bool:
    """Whether per-parameter state ``saved`` can serve ``param``: the shape of the optimizer's own state of that
    kind where it has one, else the parameter's shape or (factored statistics such as Adafactor's) that shape
    with some sizes reduced to 1."""
    if saved.dim() == 0:
        return True
    if isinstance(own, torch.Tensor):
        return saved.shape == own.shape
    return saved.dim() == param.dim() and all(a in (b, 1) for a, b in zip(saved.shape, param.shape))


def _check_state_shapes(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: Mapping[int, str]) -> None:
    """Each saved per-parameter state tensor against the parameter it will land on (by position, as torch maps)."""
    saved_ids = [i for g in state["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    bad = []
    for pos, (i, p) in enumerate(zip(saved_ids, params)):
        entry = state["state"].get(i)
        if not isinstance(entry, Mapping):
            continue
        own = optimizer.state.get(p, {})
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and not _fits(v, p, own.get(k)):
                bad.append(f"{k} {tuple(v.shape)} for {names.get(id(p), f'parameter {pos}')} {tuple(p.shape)}")
    if bad:
        raise ValueError(
            f"the checkpoint's optimizer state does not fit this engine's parameters: {_some(bad)} (state vs "
            f"parameter shape). The optimizer was built on the parameters in another order or grouping when it "
            f"was saved. Nothing was loaded; build the optimizer's param groups in that order, or load only the "
            f"model (engine.module.load_state_dict(ckpt['model']))")


def _check_rng(rng: Any) -> list[dict[str, Any]] | None:
    if rng is None or rng == []:
        return None
    ok = isinstance(rng, list) and all(
        isinstance(r, Mapping) and _RNG_KEYS <= set(r) and isinstance(r["torch"], torch.Tensor)
        and isinstance(r["python"], (list, tuple)) and len(r["python"]) == 3
        and isinstance(r["numpy"], (list, tuple)) and len(r["numpy"]) == 5
        for r in rng
    )
    if not ok:
        raise ValueError("the checkpoint's engine entry holds malformed RNG states ('rng'): it is damaged or not "
                         "written by pipedp; load only the model with engine.module.load_state_dict(ckpt['model'])")
    return list(rng)


def check_checkpoint(state: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                     newest_format: int) -> EngineEntry:
    """Check ``state`` (an engine state dict) against the engine's model and optimizer; changes nothing."""
    if not isinstance(state, Mapping) or not {"model", "optimizer", "engine"} <= set(state):
        raise ValueError(
            "not an engine checkpoint (needs keys 'model', 'optimizer', 'engine'); "
            "to load plain model weights use engine.module.load_state_dict(...)"
        )
    _check_model(module, state["model"])
    checked = check_run_state(state["engine"], newest_format, module)
    saved_class = state["engine"].get("optimizer_class")
    if saved_class is not None and not isinstance(saved_class, str):
        raise ValueError(f"the checkpoint's engine entry has optimizer_class={saved_class!r:.60}, not a class name")
    names = {id(p): n for n, p in module.named_parameters()}
    _check_optimizer(optimizer, state["optimizer"], names, saved_class)
    return checked


def check_run_state(entry: Any, newest_format: int, module: nn.Module) -> EngineEntry:
    """Check the engine's own entry (``state_dict()["engine"]``, or ``run_state()``) against ``module``; changes
    nothing. An entry that names another model is refused (its steps and RNG streams are another run's)."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"the checkpoint's 'engine' entry is a {type(entry).__name__}, not a dict: pass what "
                         f"engine.run_state() or engine.state_dict()['engine'] returned")
    steps, fmt = entry.get("steps", 0), entry.get("format", newest_format)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"the checkpoint's engine entry has steps={steps!r}, not a count of steps")
    if not isinstance(fmt, int) or fmt > newest_format:
        raise ValueError(f"the checkpoint is in format {fmt!r}, this pipedp reads up to {newest_format}: "
                         f"upgrade pipedp to load it")
    plan = None
    if entry.get("decision") is not None:
        try:
            plan = from_record(entry["decision"])[1].config
        except RecordError as e:
            raise ValueError(f"the checkpoint's engine entry holds a damaged plan decision ('decision'): {e}") from e
    _check_identity(entry.get("model"), module)
    return EngineEntry(steps=steps, rng=_check_rng(entry.get("rng")), scaler=check_scaler_state(entry.get("scaler")),
                       plan=plan, window=_check_window(entry.get("window"), module))


def _plan_names(saved: Config, running: Config) -> tuple[str, str]:
    """The two plans as a warning names them: their labels, with the cut where the labels alone are equal."""
    if saved.label != running.label:
        return saved.label, running.label
    return (f"{saved.label} (blocks per stage {'+'.join(map(str, saved.counts))})",
            f"{running.label} (blocks per stage {'+'.join(map(str, running.counts))})")


def _cuda_states_apply(rng: Mapping[str, Any]) -> bool:
    cuda = rng.get("cuda") or []
    return not cuda or (torch.cuda.is_available() and len(cuda) == torch.cuda.device_count())


def warn_run_state(entry: EngineEntry, rank: int, world: int, running: Config | None, stacklevel: int = 3) -> None:
    """Warn about what a checked entry will not restore as saved; call before anything is applied.

    ``running``: the plan the engine runs, warned about when the checkpoint
    was trained with another. Warned first so that, with warnings turned
    into errors, the load raises with steps, RNG and loss scale untouched.
    """
    if entry.plan is not None and running is not None and entry.plan != running:
        saved_name, running_name = _plan_names(entry.plan, running)
        warnings.warn(
            f"the checkpoint was trained with the plan {saved_name}, this engine runs {running_name}: to "
            f"resume with the saved plan, pass decision=checkpoint['engine']['decision'] to wrap()",
            stacklevel=stacklevel)
    if entry.rng is not None and len(entry.rng) != world:
        warnings.warn(
            f"the checkpoint holds RNG states of {len(entry.rng)} rank(s), this run has {world}: RNG states "
            f"are not restored, so random augmentation/dropout will not continue the saved streams",
            stacklevel=stacklevel,
        )
    elif entry.rng is not None and not _cuda_states_apply(entry.rng[rank]):
        cuda = entry.rng[rank]["cuda"]
        warnings.warn(
            f"the checkpoint has CUDA RNG states for {len(cuda)} device(s), this process sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: CUDA RNG not restored",
            stacklevel=stacklevel)


def apply_run_state(entry: EngineEntry, rank: int, world: int, scaler: LossScaler | None) -> int:
    """Put a checked entry's RNG states (this rank's) and loss scale back; returns its step count.

    Warns nothing: :func:`warn_run_state` said beforehand what is not restored.
    """
    if entry.rng is not None and len(entry.rng) == world:
        mine = entry.rng[rank]
        set_rng_state(mine if _cuda_states_apply(mine) else {**mine, "cuda": []})
    if scaler is not None:  # checked; a checkpoint without one starts from the initial scale
        scaler.load_state_dict(entry.scaler)
    return entry.steps


@contextlib.contextmanager
def undo_on_failure(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Put model, optimizer and RNG state back if the block raises (a copy of each is held meanwhile)."""
    with torch.no_grad():
        model = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                 for k, v in module.state_dict().items()}
    optim = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    rng = rng_state()
    try:
        yield
    except BaseException:
        module.load_state_dict(model)
        if optimizer is not None and optim is not None:
            optimizer.load_state_dict(optim)
        set_rng_state(rng)
        raise
