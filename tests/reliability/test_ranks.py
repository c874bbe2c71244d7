"""Multi-rank contracts: ranks that disagree, peers that hang, ranks that feed unequal batches.

Real torch.distributed (gloo on loopback, 2 ranks), tiny models, timeouts of a
few seconds. A hung rank sleeps and is killed once the others are done.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import pipedp
from tests import multiproc
from tests.reference import plain_steps

TIMEOUT_S = 3  # pipedp's timeout for collectives
GROUP_TIMEOUT_S = 60  # the process group's own: a wait this long means ours was ignored
TOL = 1e-5


def _mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))


def _engine(model: nn.Module, **kw) -> pipedp.Engine:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), stages=1, microbatches=2,
                       profile=False, progress=False, timeout=TIMEOUT_S, **kw)


def _batches(n: int, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


def _wrap_error(rank: int, world: int) -> str:
    torch.manual_seed(0)
    try:
        engine = _engine(_mlp(16 if rank == 0 else 12))  # rank 1 built its model with another width
    except ValueError as e:
        return str(e)
    engine.train_step(*_batches(4)[0])  # where the mismatch used to surface: gloo aborts the process
    return "no error at wrap"


def test_ranks_with_different_models_fail_at_wrap_naming_the_difference():
    """Item 4: a rank whose model differs in shape gets a clear ValueError at wrap on every rank, not an abort."""
    messages = multiproc.run(_wrap_error, 2)
    assert messages[0] == messages[1]
    msg = messages[0]
    assert "rank(s) [1] differ from rank 0" in msg, msg
    assert "parameter '0.weight' is shape (16, 8)" in msg and "shape (12, 8), torch.float32, trainable on rank 1" in msg


def _save_with_a_hung_peer(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(0)
    engine = _engine(_mlp())
    x, y = _batches(8)[0]
    engine.train_step(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
    if rank == 1:
        time.sleep(600)  # hangs; the test kills it
    t0 = time.monotonic()
    try:
        engine.save(path)
    except Exception as e:  # noqa: BLE001 (the test checks the type)
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "written": os.path.exists(path)}
    return {"error": None}


@pytest.mark.slow  # waits out a rank timeout (10 s)
def test_save_with_a_hung_peer_fails_within_the_timeout_naming_the_missing_rank(tmp_path):
    """Item 5: engine.save() honours timeout= and raises DistributedError naming the rank, the work and who hung."""
    path = str(tmp_path / "ckpt.pt")
    res = multiproc.run(_save_with_a_hung_peer, 2, path, expect_dead={1}, timeout_s=GROUP_TIMEOUT_S)[0]
    assert res["error"] == "DistributedError", res
    msg = res["message"]
    assert "saving a checkpoint" in msg and "on rank 0 of 2" in msg and ": [1] (dead or hung)" in msg, msg
    assert res["seconds"] < GROUP_TIMEOUT_S  # our timeout, not the process group's
    assert not res["written"]


def _unequal_batches(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    engine = _engine(_mlp())
    losses = []
    for x, y in _batches(12):
        part = slice(0, 8) if rank == 0 else slice(8, 12)  # 8 and 4 samples
        losses.append(engine.train_step(x[part], y[part]).item())
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}, "losses": losses}


def test_unequal_batches_train_as_one_process_on_the_global_batch():
    """Item 8: per-rank batches of 8 and 4 give the parameters of one process trained on all 12 samples."""
    results = multiproc.run(_unequal_batches, 2)
    torch.manual_seed(0)
    ref = plain_steps(_mlp(), _batches(12), microbatches=1, lr=0.1)
    for res in results:
        for name, p in ref.named_parameters():
            assert (res["params"][name] - p.detach()).abs().max().item() <= TOL, name
    assert all(torch.equal(results[0]["params"][n], results[1]["params"][n]) for n in results[0]["params"])


def _small_first_batch(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    engine = _engine(_mlp())  # 2 microbatches, planned on a first batch rank 1 has 1 sample of
    for x, y in _batches(9, steps=2):
        part = slice(0, 8) if rank == 0 else slice(8, 9)
        engine.train_step(x[part], y[part])
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_a_first_batch_too_small_for_the_microbatches_on_one_rank_trains_as_later_steps_do():
    """Issue 43, case 7: a first batch split 8 + 1 planned with 2 microbatches: rank 1 used to refuse it at
    planning (and rank 0 then failed its all-reduce); it runs 1 microbatch there, as a later step would."""
    results = multiproc.run(_small_first_batch, 2)
    torch.manual_seed(0)
    ref = plain_steps(_mlp(), _batches(9, steps=2), microbatches=1, lr=0.1)  # no BatchNorm: the global batch
    for name, p in ref.named_parameters():
        assert (results[0][name] - p.detach()).abs().max().item() <= TOL, name
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])
