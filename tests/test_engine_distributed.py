"""pipedp.wrap under real torch.distributed (gloo, loopback): data parallel x pipeline.

Every rank feeds its own slice of a global batch; after a few steps the
parameters must be identical across data-parallel replicas and equal (fp32,
1e-5) to one process training on the global batch with the same microbatches.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipedp
from pipedp.models import resnet18
from tests import multiproc
from tests.reference import TwoPaths, clone, data, plain_steps, sequential_cnn

TOL = 1e-5  # 16x16 inputs: at 8x8 BatchNorm over 1x1 maps amplifies summation order to 5e-5
LOCAL_BATCH = 8
def _torchvision_resnet18() -> nn.Module:
    from tests.stock import torchvision_models

    return torchvision_models().resnet18(num_classes=10)


def _timm_dla() -> nn.Module:
    from tests.stock import timm

    return timm().create_model("dla46_c", num_classes=10)  # its trees pass tuples between blocks


MODELS = {"sequential": lambda: sequential_cnn(), "resnet18": lambda: resnet18(width=4), "two_paths": TwoPaths,
          "tv_resnet18": _torchvision_resnet18, "timm_dla": _timm_dla}
DLA_TUPLE_CUTS = {2: [16, 23], 4: [16, 7, 7, 9], 8: [8, 8, 4, 3, 4, 3, 5, 4]}  # dla46_c cut where blocks pass tuples


def _engine(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw.setdefault("profile", False)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), progress=False, **kw)


def _global_batches(world_dp: int, steps: int = 3, seed: int = 0, size: int = 16):
    return data(n=world_dp * LOCAL_BATCH, size=size, steps=steps, seed=seed)


def _local(batch, dp_rank: int):
    x, y = batch
    sl = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
    return x[sl], y[sl]


def _owned(engine) -> dict[str, torch.Tensor]:
    ids = {id(p) for st in engine.executor.stages for p in st.chain.parameters()}
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if id(p) in ids}


CASES = [  # (model, pp, stages, microbatches, schedule)
    ("sequential", 1, 1, 2, "1f1b"),
    ("resnet18", 1, 2, 2, "gpipe"),
    ("sequential", 2, "auto", 2, "1f1b"),
    ("resnet18", 2, 4, 2, "gpipe"),
    ("resnet18", 2, 2, 4, "1f1b"),
    ("two_paths", 2, [2, 3], 2, "gpipe"),  # the ranks pass the two branches, a tuple of tensors, both ways
    ("resnet18", 2, 4, 2, "interleaved"),  # stages 0 and 2 on rank 0, 1 and 3 on rank 1
    ("resnet18", 2, "auto", 4, "auto"),  # the fastest simulated schedule, with its cut
]


def _train_cases(rank: int, world: int, cases) -> list[dict]:
    out = []
    for name, pp, stages, m, schedule, *extra in cases:  # extra: wrap options, "size" the input's
        kw = dict(extra[0]) if extra else {}
        size = kw.pop("size", 16)
        torch.manual_seed(0)
        model = MODELS[name]()
        engine = _engine(model, pp=pp, stages=stages, microbatches=m, schedule=schedule, **kw)
        lay = engine.layout
        losses = [engine.train_step(*_local(b, lay.dp_rank)).item() for b in _global_batches(lay.dp, size=size)]
        out.append({
            "dp_rank": lay.dp_rank, "pp_rank": lay.pp_rank, "params": _owned(engine), "losses": losses,
            "plan": str(engine.plan), "stats": engine.sync_stats(), "schedule": engine.schedule,
        })
    return out


def _check_cases(results, world: int, cases) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: same kernels, same summation order
    try:
        _compare(results, world, cases)
    finally:
        torch.set_num_threads(threads)


def _compare(results, world: int, cases) -> None:
    for c, (name, pp, _stages, m, _schedule, *extra) in enumerate(cases):
        dp = world // pp
        torch.manual_seed(0)
        ref = MODELS[name]()
        plain_steps(ref, _global_batches(dp, size=extra[0].get("size", 16) if extra else 16), microbatches=dp * m)
        expected = dict(ref.named_parameters())
        per_rank = [r[c] for r in results]
        covered = set()
        for res in per_rank:
            covered |= set(res["params"])
            for n, p in res["params"].items():
                assert (p - expected[n].detach()).abs().max().item() <= TOL, (cases[c], res["dp_rank"], n)
        assert covered == set(expected), (cases[c], set(expected) - covered)
        for res in per_rank:  # replicas hold bit-identical parameters
            twin = next(o for o in per_rank if o["pp_rank"] == res["pp_rank"])
            for n in res["params"]:
                assert torch.equal(res["params"][n], twin["params"][n]), (cases[c], n)
            # Every rank of a pipeline reports the same loss (the last stage's).
            peer = next(o for o in per_rank if o["dp_rank"] == res["dp_rank"])
            assert res["losses"] == peer["losses"]
            st = res["stats"]
            assert st.buckets >= 1 and st.sync_ms >= 0 and 0 <= st.hidden_fraction <= 1
            assert "gradient sync:" in res["plan"] and f"pipeline rank {res['pp_rank']} of {pp}" in res["plan"]


def test_two_processes_equal_single_process_global_batch():
    results = multiproc.run(_train_cases, 2, CASES)
    _check_cases(results, 2, CASES)
    auto = [r[-1] for r in results]  # schedule="auto": one resolved schedule on both ranks, and why
    assert auto[0]["schedule"] == auto[1]["schedule"] in ("1f1b", "zb-h1", "interleaved")
    assert f"schedule=auto: {auto[0]['schedule']}, the fastest simulated step" in auto[0]["plan"]


def _stock_cases(ranks: int) -> list[tuple]:
    """Every schedule x BatchNorm mode on torchvision's ResNet-18 and timm's DLA-46-C (cut at tuples)."""
    out = []
    for schedule in ("gpipe", "1f1b", "zb-h1", "interleaved"):
        per_rank = 2 if schedule == "interleaved" else 1
        for bn in ("microbatch", "batch"):
            opts = {"batchnorm": bn, "size": 32}
            out.append(("tv_resnet18", ranks, per_rank * ranks, 4, schedule, opts))
            out.append(("timm_dla", ranks, DLA_TUPLE_CUTS[per_rank * ranks], 4, schedule, opts))
    return out


@pytest.mark.slow  # a minute on 2 cores
def test_every_schedule_on_stock_models_equals_plain_accumulation_over_two_ranks():
    cases = _stock_cases(2)
    results = multiproc.run(_train_cases, 2, cases, timeout_s=600)
    _check_cases(results, 2, cases)


@pytest.mark.slow  # a minute on 2 cores
def test_every_schedule_on_stock_models_equals_plain_accumulation_over_four_ranks():
    cases = _stock_cases(4)
    results = multiproc.run(_train_cases, 4, cases, timeout_s=900)
    _check_cases(results, 4, cases)


@pytest.mark.slow  # tens of seconds on 2 cores: the slow run (CI runs it) keeps the default suite short
def test_four_processes_dp_and_dp_x_pp():
    cases = [("sequential", 1, 2, 2, "1f1b"), ("resnet18", 2, 2, 2, "1f1b"), ("two_paths", 2, [2, 3], 2, "1f1b"),
             ("resnet18", 4, 8, 4, "interleaved"), ("two_paths", 2, 4, 2, "interleaved")]
    results = multiproc.run(_train_cases, 4, cases)
    _check_cases(results, 4, cases)


def _versus_ddp(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MODELS["resnet18"]()
    twin = clone(model)
    engine = _engine(model, stages=1, microbatches=1, bucket_mb=0.05)
    ddp = nn.parallel.DistributedDataParallel(twin, bucket_cap_mb=0.05, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for b in _global_batches(world, steps=4, seed=3):
        x, y = _local(b, rank)
        engine.train_step(x, y)
        opt.zero_grad()
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), twin.parameters()))
    return {"diff": diff, "buckets": engine.sync_stats().buckets}


def test_data_parallel_only_matches_ddp():
    for res in multiproc.run(_versus_ddp, 2):
        assert res["diff"] <= TOL
        assert res["buckets"] > 1  # small buckets: several all-reduces overlap the backward


def _resume(rank: int, world: int, path: str, pp: int) -> dict:
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(sequential_cnn(), nn.Dropout(0.3))  # dropout: resuming must restore RNG
        return _engine(model, pp=pp, stages=2 * pp, microbatches=2, depth=2)

    batches = _global_batches(world // pp, steps=4, seed=5)
    a = fresh()
    dp_rank = a.layout.dp_rank
    for b in batches[:2]:
        a.train_step(*_local(b, dp_rank))
    a.save(path)
    for b in batches[2:]:
        a.train_step(*_local(b, dp_rank))
    b_ = fresh()
    b_.load(path)
    for b in batches[2:]:
        b_.train_step(*_local(b, dp_rank))
    same = all(torch.equal(p, q) for p, q in zip(_owned(a).values(), _owned(b_).values()))
    saved = torch.load(path, weights_only=True)
    return {"same": same, "steps": b_.steps, "saved_steps": saved["engine"]["steps"], "keys": set(saved["model"])}


@pytest.mark.parametrize("pp", [1, 2])
def test_checkpoint_resume_is_bit_identical(tmp_path, pp):
    path = str(tmp_path / "ckpt.pt")
    results = multiproc.run(_resume, 2, path, pp)
    names = set(nn.Sequential(sequential_cnn(), nn.Dropout(0.3)).state_dict())
    for res in results:
        assert res["same"] and res["steps"] == 4 and res["saved_steps"] == 2
        assert res["keys"] == names  # one full model, merged from the pipeline ranks


def _dead_rank(rank: int, world: int, path: str, mode: str) -> dict:
    torch.manual_seed(0)
    engine = _engine(sequential_cnn(), stages=1, microbatches=2, timeout=5)
    batches = _global_batches(world, steps=4)
    engine.train_step(*_local(batches[0], rank))
    engine.save(path)
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        time.sleep(600)  # hangs; the test kills it
    t0 = time.monotonic()
    with pytest.raises(pipedp.DistributedError) as err:
        for b in batches[1:]:
            engine.train_step(*_local(b, rank))
    return {"message": str(err.value), "seconds": time.monotonic() - t0, "ckpt": torch.load(path, weights_only=True)}


@pytest.mark.slow  # each waits out a timeout (6-11 s): the slow run keeps the default suite short
@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_a_dead_or_hung_rank_fails_the_others_in_bounded_time(tmp_path, mode):
    path = str(tmp_path / "ckpt.pt")
    results = multiproc.run(_dead_rank, 2, path, mode, expect_dead={1}, timeout_s=60)
    res = results[0]
    assert res["seconds"] < 30
    msg = res["message"]
    assert "step 1" in msg and "rank 0" in msg and "[1]" in msg, msg
    assert res["ckpt"]["engine"]["steps"] == 1  # the last checkpoint is intact


def _hang_in_wrap(rank: int, world: int, phase: str) -> dict:
    import pipedp.build
    import pipedp.comm

    def hang(*_args, **_kw):
        time.sleep(600)  # the test kills this rank

    if phase == "comparing the model" and rank == 1:
        pipedp.comm.model_signature = hang
    if phase == "sharing the first rank's plan" and rank == 0:
        pipedp.build.decide = hang
    torch.manual_seed(0)
    try:
        _engine(sequential_cnn(), stages=2, microbatches=2, timeout=3, sample=(4, 3, 16, 16))
    except Exception as e:  # noqa: BLE001 (the test checks the type)
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


@pytest.mark.slow  # each waits out a timeout (about 9 s)
@pytest.mark.parametrize("phase, hung", [("comparing the model", 1), ("sharing the first rank's plan", 0)])
def test_a_hung_rank_fails_wrap_within_the_timeout(phase, hung):
    results = multiproc.run(_hang_in_wrap, 2, phase, expect_dead={hung}, timeout_s=60)
    res = results[1 - hung]
    assert res["error"] == "DistributedError", res
    msg = res["message"]
    assert msg.startswith(phase) and f"on rank {1 - hung} of 2" in msg and f": [{hung}] (dead or hung)" in msg, msg


def _layout_errors(rank: int, world: int) -> list[str]:
    msgs = []
    for kw in ({"pp": 3}, {"pp": 2, "stages": 3}, {"pp": 2, "dp_group": dist.group.WORLD}):
        try:
            e = _engine(sequential_cnn(), microbatches=2, **kw)
            e.train_step(*_local(_global_batches(1, steps=1)[0], 0))
        except ValueError as err:
            msgs.append(str(err))
    return msgs


def test_bad_layouts_are_clear_errors():
    msgs = multiproc.run(_layout_errors, 2)[0]
    assert len(msgs) == 3
    assert "does not divide the world size 2" in msgs[0]
    assert "multiple of 2" in msgs[1]
    assert "not both" in msgs[2]


def _mesh_layouts(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
    lay = _engine(sequential_cnn(), microbatches=2, mesh=mesh).layout
    try:
        _engine(sequential_cnn(), microbatches=2, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("x",)))
        err = ""
    except ValueError as e:
        err = str(e)
    return {"dp": lay.dp, "pp": lay.pp, "pp_rank": lay.pp_rank, "error": err}


def test_a_device_mesh_gives_the_layout():
    for rank, res in enumerate(multiproc.run(_mesh_layouts, 2)):
        assert (res["dp"], res["pp"], res["pp_rank"]) == (1, 2, rank)
        assert "mesh_dim_names=('dp', 'pp')" in res["error"]


def test_distributed_options_need_an_initialised_process_group():
    with pytest.raises(ValueError, match="torchrun"):
        _engine(sequential_cnn(), microbatches=2, pp=2)


def _accumulating(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    engine = _engine(sequential_cnn(), stages=1, microbatches=2)
    for i, batch in enumerate(_global_batches(world, steps=4)):
        engine.train_step(*_local(batch, rank), update=i % 2 == 1, loss_divisor=2)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_accumulating_over_batches_under_data_parallel_equals_one_process_accumulating():
    """Every call all-reduces what the replicas hold (linear: the held part is the same on each), so the window
    equals one process accumulating over the global batches, loss / 2 each, a step every second batch."""
    results = multiproc.run(_accumulating, 2)
    torch.manual_seed(0)
    ref = sequential_cnn()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(_global_batches(2, steps=4)):
        (nn.functional.cross_entropy(ref(x), y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    for name, p in ref.named_parameters():
        assert (results[0][name] - p.detach()).abs().max().item() <= TOL, name
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])
