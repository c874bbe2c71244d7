"""Loading a checkpoint into an engine whole or not at all.

``nn.Module.load_state_dict`` copies every entry that fits before it reports
the ones that do not, and an optimizer accepts the state of another
optimizer kind and fails only at its next step. So a checkpoint is first
checked against the engine it goes into — model keys and shapes, the
optimizer's kind and parameter counts, the engine entry, every RNG
state and the fp16 loss scale — and only then applied; if applying still fails, everything it
touched is put back (:func:`undo_on_failure`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from .precision import check_scaler_state
from .snapshot import rng_state, set_rng_state

__all__ = ["EngineEntry", "check_checkpoint", "undo_on_failure"]

_RNG_KEYS = {"torch", "cuda", "python", "numpy"}
_LIST = 4  # differences named in one message


@dataclass(frozen=True)
class EngineEntry:
    """The engine's own part of a checkpoint, checked."""

    steps: int
    rng: list[dict[str, Any]] | None  # one per rank, by global rank
    scaler: dict[str, Any] | None = None  # fp16 loss scaling's state (None: saved in another precision)


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


def _check_optimizer(optimizer: torch.optim.Optimizer | None, state: Any) -> None:
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
    entry = state["engine"]
    if not isinstance(entry, Mapping):
        raise ValueError(f"the checkpoint's 'engine' entry is a {type(entry).__name__}, not a dict")
    steps, fmt = entry.get("steps", 0), entry.get("format", newest_format)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"the checkpoint's engine entry has steps={steps!r}, not a count of steps")
    if not isinstance(fmt, int) or fmt > newest_format:
        raise ValueError(f"the checkpoint is in format {fmt!r}, this pipedp reads up to {newest_format}: "
                         f"upgrade pipedp to load it")
    rng = _check_rng(entry.get("rng"))
    scaler = check_scaler_state(entry.get("scaler"))
    _check_model(module, state["model"])
    _check_optimizer(optimizer, state["optimizer"])
    return EngineEntry(steps=steps, rng=rng, scaler=scaler)


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
