"""The model keeps changing after wrap (issue 25, items 1-5): each step trains what the model holds now.

Layers frozen or unfrozen between steps, dtypes changed (``model.double()``),
buffers replaced: every case is compared with plain PyTorch doing the same
change at the same step. The data-parallel and pipeline cases run in real
processes (gloo on loopback, 2 ranks). What cannot be followed (a parameter
or module replaced by another object) is refused with an error naming it.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import pipedp
from pipedp.pipeline import microbatch
from tests import multiproc
from tests.reference import bn_cnn, clone, data, max_diff, sequential_cnn

TOL = 1e-5
TIMEOUT_S = 10
Change = Callable[[nn.Module], None]


def _plain(model: nn.Module, batches, *, changes: dict[int, Change] | None = None, microbatches: int = 2,
           lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0, clip: float | None = None,
           fp16: bool = False) -> list[float]:
    """Plain training with ``changes[k](model)`` applied before step ``k``; the total gradient norms if ``clip``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    norms = []
    for k, (x, y) in enumerate(batches):
        if changes and k in changes:
            changes[k](model)
        opt.zero_grad(set_to_none=True)
        xs, ys = microbatch.split(x, microbatches), microbatch.split(y, microbatches)
        for xi, yi, w in zip(xs, ys, microbatch.shares([t.shape[0] for t in xs])):
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = nn.functional.cross_entropy(model(xi), yi) * w
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return norms


def _wrap(model: nn.Module, *, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0,
          **kw) -> pipedp.Engine:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    kw.setdefault("microbatches", 2)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), profile=False, progress=False, **kw)


def _train(engine: pipedp.Engine, batches, changes: dict[int, Change]) -> None:
    for k, (x, y) in enumerate(batches):
        if k in changes:
            changes[k](engine.module)
        engine.train_step(x, y)


def _freeze_first(model: nn.Module) -> None:
    model[0].requires_grad_(False)


def _unfreeze_first(model: nn.Module) -> None:
    model[0].requires_grad_(True)


# -- item 1: fp16 loss scaling and clipping act on the layers that train now ------------------------------------


def test_fp16_unscales_a_layer_unfrozen_after_the_first_step():
    """Item 1: the unfrozen layer's gradients are unscaled like GradScaler's (they were 65536x too large)."""
    torch.manual_seed(0)
    model = sequential_cnn()
    _freeze_first(model)
    ref = clone(model)
    batches = data(n=8, size=8, steps=4)
    engine = _wrap(model, stages=2, precision="fp16", sample=batches[0][0])
    _train(engine, batches, {1: _unfreeze_first})
    _plain(ref, batches, changes={1: _unfreeze_first}, fp16=True)
    assert max_diff(model, ref) <= TOL


def test_clipping_covers_a_layer_unfrozen_after_the_first_step():
    """Item 1: clip_grad_norm's total norm and scaling include the unfrozen layer, as clip_grad_norm_ does."""
    torch.manual_seed(0)
    model = sequential_cnn()
    _freeze_first(model)
    ref = clone(model)
    batches = data(n=8, size=8, steps=4)
    engine = _wrap(model, stages=2, clip_grad_norm=0.05, sample=batches[0][0])
    norms = []
    for k, (x, y) in enumerate(batches):
        if k == 1:
            _unfreeze_first(model)
        engine.train_step(x, y)
        norms.append(engine._runner.grads.last_norm.item())
    want = _plain(ref, batches, changes={1: _unfreeze_first}, clip=0.05)
    assert norms == pytest.approx(want, rel=1e-6)
    assert max_diff(model, ref) <= TOL


# -- item 5: a failed step puts back the buffers the model holds now ------------------------------------------------


class FailingLoss:
    """Cross-entropy that raises once armed: after every forward ran (BatchNorm statistics updated)."""

    def __init__(self) -> None:
        self.armed = False
        self.calls = 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.calls % 2 == 0:  # the step's last microbatch
            raise RuntimeError("loss blew up")
        return nn.functional.cross_entropy(out, y)


def _to_double(model: nn.Module) -> None:
    model.double()


def _assign_state(model: nn.Module) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _assign_buffers(model: nn.Module) -> None:
    """``load_state_dict(..., assign=True)`` of the statistics only (a new parameter would be refused)."""
    state = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    model.load_state_dict(state, assign=True, strict=False)


def _new_running_mean(model: nn.Module) -> None:
    model[1].running_mean = model[1].running_mean.clone()


@pytest.mark.parametrize("replace", [_to_double, _assign_buffers, _new_running_mean],
                         ids=["double", "load_state_dict_assign", "assign_buffer"])
def test_a_failed_step_restores_buffers_replaced_after_wrap(replace):
    """Item 5: statistics are restored into the tensors the model holds at the step, not those it held at wrap."""
    model = bn_cnn()
    loss_fn = FailingLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=loss_fn, microbatches=2, stages=2, profile=False,
                         progress=False)
    x, y = data(n=8, steps=1)[0]
    engine.train_step(x, y)
    replace(model)
    if replace is _to_double:
        x = x.double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn.armed = True
    with pytest.raises(RuntimeError, match="loss blew up"):
        engine.train_step(x, y)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed


# -- changes that cannot be followed are refused, naming what changed -------------------------------------------


def test_a_parameter_replaced_after_wrap_is_refused_naming_it():
    torch.manual_seed(0)
    model = sequential_cnn()
    batches = data(n=8, size=8, steps=2)
    engine = _wrap(model, stages=2)
    engine.train_step(*batches[0])
    _assign_state(model)
    with pytest.raises(ValueError, match=r"parameter '0\.weight'.*assign=True"):
        engine.train_step(*batches[1])


def test_a_module_replaced_after_wrap_is_refused_naming_it():
    torch.manual_seed(0)
    model = sequential_cnn()
    batches = data(n=8, size=8, steps=2)
    engine = _wrap(model, stages=2)
    engine.train_step(*batches[0])
    model[1] = nn.GELU()
    with pytest.raises(ValueError, match=r"module '1'.*wrap"):
        engine.train_step(*batches[1])


def test_single_process_follows_a_layer_frozen_after_a_step():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=8, size=8, steps=3)
    engine = _wrap(model, stages=3, weight_decay=0.1)
    _train(engine, batches, {1: _freeze_first})
    _plain(ref, batches, changes={1: _freeze_first}, weight_decay=0.1)
    assert max_diff(model, ref) <= TOL


# -- items 2-4: data parallel (2 real processes) --------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n: int = 8, steps: int = 3, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 8, generator=g).to(dtype), torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CHANGES: dict[str, dict[int, Change]] = {
    "unfreeze": {1: _unfreeze_first},
    "freeze": {1: _freeze_first},
    "double": {1: _to_double},
}


def _dp_train(rank: int, world: int, case: str, frozen: bool) -> dict:
    torch.manual_seed(0)
    model = _mlp()
    if frozen:
        _freeze_first(model)
    dtype = torch.float64 if case == "double" else torch.float32
    engine = _wrap(model, stages=1, weight_decay=0.1, timeout=TIMEOUT_S, sample=(4, 8))
    frozen_at: dict[str, torch.Tensor] = {}
    for k, (x, y) in enumerate(_batches()):
        if k in CHANGES[case]:
            CHANGES[case][k](model)
            frozen_at = _state(model[0])
        part = slice(rank * 4, rank * 4 + 4)
        engine.train_step(x[part].to(model[0].weight.dtype), y[part])
    return {"state": _state(model), "frozen_at": frozen_at}


@pytest.mark.parametrize("case,frozen", [
    ("unfreeze", True),
    pytest.param("freeze", False, marks=pytest.mark.slow),  # a process world each: one in the default run
    pytest.param("double", False, marks=pytest.mark.slow),
])
def test_data_parallel_follows_what_trains_now(case, frozen):
    """Items 2-3: unfrozen layers are averaged, frozen ones stay put, dtype changes follow; equal to plain."""
    results = multiproc.run(_dp_train, 2, case, frozen)
    torch.manual_seed(0)
    ref = _mlp()
    if frozen:
        _freeze_first(ref)
    batches = _batches()
    changes = CHANGES[case]
    if case == "double":
        batches = [(x.double() if k >= 1 else x, y) for k, (x, y) in enumerate(batches)]
    _plain(ref, batches, changes=changes, microbatches=1, weight_decay=0.1)
    want = _state(ref)
    for r, res in enumerate(results):
        got = res["state"]
        diff = {k: (got[k].double() - want[k].double()).abs().max().item() for k in want}
        assert max(diff.values()) <= TOL, (r, diff)
    assert all(torch.equal(results[0]["state"][k], results[1]["state"][k]) for k in want)  # replicas equal
    if case == "freeze":  # item 3: momentum and weight decay leave a frozen layer alone
        for res in results:
            assert all(torch.equal(res["state"][f"0.{k}"], v) for k, v in res["frozen_at"].items())


def _different_starts(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # every rank built its model from another seed
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    model[1].running_mean.fill_(float(rank))
    engine = _wrap(model, stages=1, microbatches=1, timeout=TIMEOUT_S)
    at_wrap = _state(model)
    for x, y in _batches(steps=2):
        engine.train_step(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
    return {"at_wrap": at_wrap, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_data_parallel_starts_every_rank_from_rank_0s_weights_and_buffers():
    """Item 4: as DDP does, wrap broadcasts rank 0's parameters and buffers; training equals plain from those."""
    results = multiproc.run(_different_starts, 2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    ref[1].running_mean.fill_(0.0)
    start = _state(ref)
    for res in results:
        assert all(torch.equal(res["at_wrap"][k], v) for k, v in start.items())
    # BatchNorm normalises each replica's own samples (as DDP without SyncBatchNorm): compare with per-rank
    # microbatches, i.e. plain training on the global batch split into the ranks' halves.
    _plain(ref, _batches(steps=2), microbatches=2)
    for res in results:
        for n, p in ref.named_parameters():
            assert (res["params"][n] - p.detach()).abs().max().item() <= TOL, n


# -- pipeline ranks (2 real processes, one stage each) -------------------------------------------------------------


def _pp_train(rank: int, world: int, case: str) -> dict:
    torch.manual_seed(0)
    model = _mlp()
    if case == "unfreeze":
        _freeze_first(model)  # stage 0 trains nothing at first: no gradient crosses the boundary
    engine = _wrap(model, stages=[2, 3], pp=2, timeout=TIMEOUT_S)
    for k, (x, y) in enumerate(_batches()):
        if k in CHANGES[case]:
            CHANGES[case][k](model)
        engine.train_step(x.to(model[0].weight.dtype), y)
    sd = engine.state_dict()["model"]
    return {k: v.detach().clone() for k, v in sd.items()}


@pytest.mark.parametrize("case", ["unfreeze", "double"])
def test_pipeline_ranks_follow_what_trains_now(case):
    """The boundary's messages follow: stage 0's output now needs a gradient back, or is float64."""
    results = multiproc.run(_pp_train, 2, case)
    torch.manual_seed(0)
    ref = _mlp()
    if case == "unfreeze":
        _freeze_first(ref)
    batches = _batches()
    if case == "double":
        batches = [(x.double() if k >= 1 else x, y) for k, (x, y) in enumerate(batches)]
    _plain(ref, batches, changes=CHANGES[case])
    for res in results:
        for k, v in ref.state_dict().items():
            assert res[k].dtype == v.dtype and (res[k] - v).abs().max().item() <= TOL, k


def _unfrozen_on_one_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _mlp()
    _freeze_first(model)
    engine = _wrap(model, stages=1, timeout=TIMEOUT_S, sample=(4, 8))
    (x, y), (x2, y2) = _batches(steps=2)
    engine.train_step(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
    if rank == 1:
        _unfreeze_first(model)  # a change made on one rank only
    before = _state(model)
    try:
        engine.train_step(x2[rank * 4 : rank * 4 + 4], y2[rank * 4 : rank * 4 + 4])
    except ValueError as e:
        after = _state(model)
        return {"error": str(e), "unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    return {"error": None}


def test_a_change_made_on_some_ranks_only_fails_the_step_on_every_rank():
    """The layout stamp sent with the batch count: both ranks raise before any bucket travels; nothing changed."""
    results = multiproc.run(_unfrozen_on_one_rank, 2)
    for res in results:
        assert res["error"] is not None and "do not train the same parameters" in res["error"], res
        assert res["unchanged"]
