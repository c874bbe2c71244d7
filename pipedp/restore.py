"""Loading a checkpoint into an engine whole or not at all.

``nn.Module.load_state_dict`` copies every entry that fits before it reports
the ones that do not, and an optimizer accepts the state of another
optimizer kind and fails only at its next step. So a checkpoint is first
checked against the engine it goes into — model keys and shapes, the
optimizer's kind and parameter counts, the engine entry, every RNG
state and the fp16 loss scale — and only then applied; if applying still fails, everything it
touched is put back (:func:`undo_on_failure`).

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
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from .decide.config import Config
from .decide.record import RecordError, from_record
from .precision import LossScaler, check_scaler_state
from .snapshot import rng_state, set_rng_state

__all__ = ["EngineEntry", "check_checkpoint", "check_run_state", "apply_run_state", "undo_on_failure"]

_RNG_KEYS = {"torch", "cuda", "python", "numpy"}
_LIST = 4  # differences named in one message


@dataclass(frozen=True)
class EngineEntry:
    """The engine's own part of a checkpoint, checked."""

    steps: int
    rng: list[dict[str, Any]] | None  # one per rank, by global rank
    scaler: dict[str, Any] | None = None  # fp16 loss scaling's state (None: saved in another precision)
    plan: Config | None = None  # the configuration the saved run trained with (None: saved before a plan)


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
    checked = check_run_state(state["engine"], newest_format)
    _check_model(module, state["model"])
    saved_class = state["engine"].get("optimizer_class")
    if saved_class is not None and not isinstance(saved_class, str):
        raise ValueError(f"the checkpoint's engine entry has optimizer_class={saved_class!r:.60}, not a class name")
    names = {id(p): n for n, p in module.named_parameters()}
    _check_optimizer(optimizer, state["optimizer"], names, saved_class)
    return checked


def check_run_state(entry: Any, newest_format: int) -> EngineEntry:
    """Check the engine's own entry (``state_dict()["engine"]``, or ``run_state()``); changes nothing."""
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
    return EngineEntry(steps=steps, rng=_check_rng(entry.get("rng")), scaler=check_scaler_state(entry.get("scaler")),
                       plan=plan)


def apply_run_state(entry: EngineEntry, rank: int, world: int, scaler: LossScaler | None,
                    running: Config | None) -> int:
    """Put a checked entry's RNG states (this rank's) and loss scale back; returns its step count.

    ``running``: the plan the engine runs, warned about when the checkpoint
    was trained with another.
    """
    if entry.rng is not None and len(entry.rng) == world:
        set_rng_state(entry.rng[rank])
    if scaler is not None:  # checked; a checkpoint without one starts from the initial scale
        scaler.load_state_dict(entry.scaler)
    if entry.plan is not None and running is not None and entry.plan != running:
        warnings.warn(
            f"the checkpoint was trained with the plan {entry.plan.label}, this engine runs "
            f"{running.label}: to resume with the saved plan, pass "
            f"decision=checkpoint['engine']['decision'] to wrap()", stacklevel=4)
    if entry.rng is not None and len(entry.rng) != world:
        warnings.warn(
            f"the checkpoint holds RNG states of {len(entry.rng)} rank(s), this run has {world}: RNG states "
            f"are not restored, so random augmentation/dropout will not continue the saved streams",
            stacklevel=4,
        )
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
