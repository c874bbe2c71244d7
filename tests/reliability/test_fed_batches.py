"""Issue 58, items 4, 7 and 8: ranks fed apart, and a rank that falls behind.

Real torch.distributed (gloo on loopback, 2 ranks), a tiny CNN. Each world runs
several cases one after another (a world costs seconds to start):

- the ranks of a pipeline fed as DDP feeds replicas (each its own shard, the
  same size), and fed x and y of different sample counts: every rank refuses
  the step before any activation travels, naming the cause and the fix, and
  the step trains nothing; the same engine then trains exactly on correctly fed
  batches;
- a data-parallel rank whose step fails (a label out of range) and that goes
  on: both ranks raise ``DistributedError`` at the next step, naming the rank
  that is behind, well before any timeout, and no rank aborts inside gloo
  (multiproc fails the test on an abnormal exit).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import pipedp
from tests import multiproc
from tests.reference import data, plain_steps, sequential_cnn

TIMEOUT_S = 30  # pipedp's timeout: every error here must come well before it
TOL = 1e-5
LOCAL = 8  # samples per rank


def _engine(**kw) -> pipedp.Engine:
    torch.manual_seed(0)
    model = sequential_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=2, profile=False,
                       progress=False, timeout=TIMEOUT_S, **kw)


def _state(engine: pipedp.Engine) -> dict[str, torch.Tensor]:
    opt = engine.optimizer.state_dict()["state"]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {**params, **{f"momentum {k}": v["momentum_buffer"].clone() for k, v in opt.items()
                         if v.get("momentum_buffer") is not None}}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _error(fn) -> tuple[str, str, float] | None:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the test checks the type)
        return type(e).__name__, str(e), time.monotonic() - t0
    return None


def _pipeline_feeds(rank: int, world: int) -> dict:
    engine = _engine(pp=2, stages=2)
    assert engine.layout.pp == 2 and engine.layout.dp == 1
    batches = data(n=2 * LOCAL, steps=2)
    x, y = batches[0]
    out: dict = {}
    # Each rank its own shard, as DistributedSampler(dataset) gives DDP's replicas: the first rank's images,
    # the last rank's labels. The first step also builds the engine.
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    out["shards"] = _error(lambda: engine.train_step(x[mine], y[mine]))
    before = _state(engine)
    # The first rank 8 samples, the last 6: torch's batch-size error inside the last stage used to be all.
    n = LOCAL if rank == 0 else LOCAL - 2
    out["counts"] = _error(lambda: engine.train_step(x[:n], y[:n]))
    out["untouched"] = _same(before, _state(engine))
    # Fed alike: trains as one process on the same batches (the refused steps trained nothing).
    out["losses"] = [engine.train_step(bx[:LOCAL], by[:LOCAL]).item() for bx, by in batches]
    out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()
                     if any(p is q for st in engine.executor.stages for q in st.chain.parameters())}
    return out


def test_pipeline_ranks_fed_other_batches_refuse_on_every_rank_then_train_exactly():
    """Items 4 and 8: a pipeline fed shards, or x and y of other sample counts, is refused on both ranks with
    the cause and the fix (engine.layout, the sampler); nothing trains, and correctly fed steps stay exact."""
    results = multiproc.run(_pipeline_feeds, 2, timeout_s=120)
    for rank, res in enumerate(results):
        kind, msg, secs = res["shards"]
        assert kind == "ValueError", msg
        assert "were not fed the same batch" in msg and "targets (y) differ" in msg, msg
        assert "engine.layout.dp_rank" in msg and "DistributedSampler(dataset, num_replicas=" in msg, msg
        assert secs < TIMEOUT_S / 2, secs
        kind, msg, secs = res["counts"]
        assert kind == "ValueError", msg
        assert "pipeline rank 0 got 8 samples" in msg and "pipeline rank 1 got 6 samples" in msg, msg
        assert "engine.layout" in msg and secs < TIMEOUT_S / 2, (msg, secs)
        assert res["untouched"], f"rank {rank}: a refused step changed parameters or optimizer state"
    assert results[0]["losses"] == results[1]["losses"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks
    try:
        torch.manual_seed(0)
        ref = plain_steps(sequential_cnn(), [(bx[:LOCAL], by[:LOCAL]) for bx, by in data(n=2 * LOCAL, steps=2)],
                          microbatches=2)
    finally:
        torch.set_num_threads(threads)
    expected = dict(ref.named_parameters())
    covered = set()
    for res in results:
        for name, p in res["params"].items():
            covered.add(name)
            assert (p - expected[name].detach()).abs().max().item() <= TOL, name
    assert covered == set(expected)


def _skips_a_failed_step(rank: int, world: int, precision: str) -> list:
    engine = _engine(stages=1, precision=precision)
    assert engine.layout.dp == 2
    out: list = []
    for k, (x, y) in enumerate(data(n=2 * LOCAL, steps=4)):
        x, y = x[rank * LOCAL : (rank + 1) * LOCAL], y[rank * LOCAL : (rank + 1) * LOCAL]
        if rank == 0 and k == 1:
            y = y.clone()
            y[0] = 99  # a label out of range: cross_entropy raises IndexError
        t0 = time.monotonic()
        try:
            engine.train_step(x, y)
        except IndexError:
            out.append("skipped")  # the user's loop skips the bad batch and goes on
            continue
        except Exception as e:  # noqa: BLE001 (the test checks the type)
            out.append((isinstance(e, pipedp.DistributedError), str(e), time.monotonic() - t0))
            break
        out.append("ok")
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_rank_that_skips_a_failed_step_makes_every_rank_raise_naming_it(precision):
    """Item 7: rank 0 catches its step's IndexError and goes on; at the next step both ranks raise
    DistributedError naming rank 0 as behind, at once (no timeout), and neither aborts inside gloo. fp16 adds
    the overflow agreement to the step's collectives."""
    results = multiproc.run(_skips_a_failed_step, 2, precision, timeout_s=120)
    assert results[0][:2] == ["ok", "skipped"] and results[1][:2] == ["ok", "ok"], results
    for rank, res in enumerate(results):
        distributed, msg, secs = res[-1]
        assert distributed, msg
        assert "not at the same step" in msg and "rank(s) [0] behind" in msg, msg
        assert "rank 0 at step 1, rank 1 at step 2" in msg, msg
        assert "restart every rank from the last checkpoint" in msg, msg
        assert secs < TIMEOUT_S / 2, secs  # agreed on at once, not waited out
        assert "did not report" not in msg, msg  # no rank is gone
