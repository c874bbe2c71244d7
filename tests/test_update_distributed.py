"""The update over several ranks (pipedp/update.py, gloo on loopback): one overflow decision, one global norm.

Two pipeline ranks hold different stages, so each sees only its own
parameters' gradients: an overflow on one rank must skip the step on both,
and clipping must use the norm over the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

import pipedp
from tests import multiproc
from tests.amp_reference import plain_amp_steps
from tests.reference import data, sequential_cnn

TOL = 1e-5
INF_STEP = 1


def _engine(model, **kw):
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=2, pp=2, profile=False,
                       progress=False, **kw)


def _owned(engine) -> dict[str, torch.Tensor]:
    ids = {id(p) for st in engine.executor.stages for p in st.chain.parameters()}
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if id(p) in ids}


def _ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = sequential_cnn()
    engine = _engine(model, precision="fp16")
    batches = data(n=8, size=16, steps=3)
    poison = {"on": False}
    if engine.layout.pp_rank == 1:  # the last stage's Linear: its gradient only, not the activation gradients
        model[-1].weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    fp16 = {"params": [], "scales": [], "skipped": []}
    for k, (x, y) in enumerate(batches):
        poison["on"] = k == INF_STEP
        engine.train_step(x, y)
        fp16["params"].append(_owned(engine))
        fp16["scales"].append(engine.scaler.get_scale())
        fp16["skipped"].append(engine._runner.grads.skipped)
    torch.manual_seed(0)
    clipped = _engine(sequential_cnn(), clip_grad_norm=0.05)
    norms = []
    for x, y in batches:
        clipped.train_step(x, y)
        norms.append(clipped._runner.grads.last_norm.item())
    return {"pp_rank": engine.layout.pp_rank, "fp16": fp16, "norms": norms, "clipped": _owned(clipped)}


def test_two_pipeline_ranks_agree_on_overflow_and_clip_by_the_global_norm():
    results = multiproc.run(_ranks, 2)
    assert sorted(r["pp_rank"] for r in results) == [0, 1]
    for r in results:
        fp16 = r["fp16"]
        # Only rank 1's gradients overflowed at INF_STEP; both ranks skipped it and backed off.
        assert fp16["skipped"] == [0, 1, 1]
        assert fp16["scales"] == [2.0**16, 2.0**15, 2.0**15]
        before, after = fp16["params"][INF_STEP - 1], fp16["params"][INF_STEP]
        assert before and all(torch.equal(before[n], after[n]) for n in before)
        assert not all(torch.equal(after[n], fp16["params"][-1][n]) for n in after)  # the next step trains
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: same kernels, same summation order
    try:
        torch.manual_seed(0)
        plain = sequential_cnn()
        expected = plain_amp_steps(plain, data(n=8, size=16, steps=3), microbatches=2, clip=0.05)
    finally:
        torch.set_num_threads(threads)
    want = dict(plain.named_parameters())
    covered = set()
    for r in results:
        assert all(abs(g - e["norm"].item()) <= 1e-6 * e["norm"].item() for g, e in zip(r["norms"], expected))
        assert all(e["norm"].item() > 0.05 for e in expected)  # clipping was active
        for n, p in r["clipped"].items():
            assert (p - want[n].detach()).abs().max().item() <= TOL, n
        covered |= set(r["clipped"])
    assert covered == set(want)


def _mismatched(rank: int, world: int) -> str:
    model = sequential_cnn()
    try:
        pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.CrossEntropyLoss(),
                    microbatches=2, profile=False, progress=False, precision="fp16" if rank == 0 else "fp32")
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_with_another_precision_are_refused_at_wrap():
    # A rank without loss scaling would never join the others' overflow all-reduce: refuse, do not hang.
    for message in multiproc.run(_mismatched, 2):
        assert "option 'TrainingOptions.precision' is 'fp16' on rank 0 but 'fp32' on rank 1" in message
