"""Each stage's optimizer update started after its last backward (pipedp/pipeline/early_update.py)."""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.partition import Block, Chain
from pipedp.pipeline.early_update import EarlyUpdate, narrowed
from pipedp.pipeline.executor import Executor
from pipedp.pipeline.schedule import one_f_one_b
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane
from tests import multiproc
from tests.pipeline.concurrency_reference import LoggingLane, OPTIMIZERS, engine_for, tiny_resnet, train_both
from tests.reference import clone, data, max_diff, sequential_cnn

TOL = 1e-5
CPU = torch.device("cpu")


def test_narrowed_shows_only_the_given_parameters_and_puts_everything_back():
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    groups, lists = opt.param_groups, [g["params"] for g in opt.param_groups]
    with narrowed(opt, [b]):
        assert len(opt.param_groups) == 1 and opt.param_groups[0] is groups[0]
        assert opt.param_groups[0]["params"] == [b]
    assert opt.param_groups is groups and [g["params"] for g in groups] == lists
    with pytest.raises(RuntimeError, match="boom"), narrowed(opt, [c]):
        raise RuntimeError("boom")
    assert opt.param_groups is groups and [g["params"] for g in groups] == lists


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_engine_with_early_update_equals_plain_training(optimizer, schedule, stages):
    engine, model, ref, ref_opt = train_both(seed=stages, steps=3, optimizer=optimizer, stages=stages,
                                             schedule=schedule, early_update=True)
    assert max_diff(model, ref) <= TOL
    # The optimizer's own state: per-parameter step counts and buffers, the same keys.
    got, want = engine.optimizer.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k, st in want["state"].items():
        assert got["state"][k].keys() == st.keys()
        assert all((got["state"][k][n].double() - t.double()).abs().max().item() <= TOL for n, t in st.items())


def test_bf16_with_early_update_equals_plain_autocast():
    _, model, ref, _ = train_both(optimizer="adam", stages=3, early_update=True, dtype=torch.bfloat16)
    assert max_diff(model, ref) <= TOL


@pytest.mark.parametrize("early", [True, False])
def test_later_stages_are_updated_before_the_first_stage_finishes_its_backward(early):
    torch.manual_seed(0)
    model = sequential_cnn()
    # Planned at wrap: planning runs the model's backward too (the chain check), and the hook below counts steps.
    engine = engine_for(model, stages=[2, 2, 5], microbatches=4, early_update=early, sample=(8, 3, 8, 8))
    last = model[-1].weight
    before = last.detach().clone()
    seen = []  # at each backward of the middle stage: was the last stage updated yet?
    model[2].register_full_backward_pre_hook(lambda m, g: seen.append(not torch.equal(last, before)))
    x, y = data(n=8, size=8, steps=1)[0]
    engine.train_step(x, y)
    assert len(seen) == 4 and not seen[0]
    # At the middle stage's last backward the last stage's update is done only with early_update.
    assert seen[-1] == early
    assert not torch.equal(last, before)


def test_a_parameter_of_several_stages_is_updated_after_its_last_stage():
    shared = nn.Linear(4, 4)
    stages = [Stage(i, Chain([Block(str(i), m)]), CPU, new_lane(CPU, f"s{i}"))
              for i, m in enumerate([shared, nn.Linear(4, 4), nn.Sequential(shared, nn.ReLU())])]
    ex = Executor(stages, one_f_one_b(3, 2))
    opt = torch.optim.SGD(list({id(p): p for st in stages for p in st.chain.parameters()}.values()), lr=0.1)
    early = EarlyUpdate(opt, ex.stages, ex.train_order)
    # Stage 0's last backward comes last: the shared layer is updated there, not after stage 2.
    assert [len(p) for p in early.parts] == [2, 2, 0]
    assert {id(p) for p in early.parts[0]} == {id(p) for p in shared.parameters()}
    assert early.rest == []
    extra = nn.Parameter(torch.ones(3))  # a parameter of no local stage (another pipeline rank's, say)
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.ones(3)
    early.begin(None)
    for pos in range(3):
        early.stage_done(pos)
    assert torch.equal(extra, torch.ones(3))  # not a stage's: left to the end of the step
    early.finish()
    assert torch.allclose(extra, torch.full((3,), 0.9)) and early.done == [0, 1]


def test_failure_after_some_stages_were_updated_leaves_everything_as_it_was():
    torch.manual_seed(0)
    model = sequential_cnn()
    engine = engine_for(model, optimizer="adam", stages=[2, 2, 5], microbatches=2, early_update=True)
    x, y = data(n=6, size=8, steps=1)[0]
    engine.train_step(x, y)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {n: t.clone() for n, t in s.items()} for k, s in engine.optimizer.state_dict()["state"].items()}
    calls, updated = [], []

    def fail_at_the_last_backward(m, g):
        calls.append(1)
        if len(calls) == 2:
            updated.append(not torch.equal(model[-1].weight, params["8.weight"]))
            raise RuntimeError("stage 1 failed")

    handle = model[2].register_full_backward_pre_hook(fail_at_the_last_backward)
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        engine.train_step(x, y)
    assert updated == [True]  # the last stage had been updated before the failure
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    after = engine.optimizer.state_dict()["state"]
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k][n], t) for k, s in state.items() for n, t in s.items())
    handle.remove()
    engine.train_step(x, y)  # and training goes on


@pytest.mark.parametrize("kw, match", [
    (dict(clip_grad_norm=1.0), "early_update=True with clip_grad_norm"),
    (dict(precision="fp16"), "early_update=True with precision='fp16'"),
])
def test_what_needs_all_gradients_is_refused_with_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        engine_for(sequential_cnn(), early_update=True, **kw)


def test_lbfgs_is_refused():
    model = sequential_cnn()
    with pytest.raises(ValueError, match=r"LBFGS.step\(\) needs a closure"):
        pipedp.wrap(model, optimizer=torch.optim.LBFGS(model.parameters()), loss_fn=nn.CrossEntropyLoss(),
                    early_update=True, progress=False)


def test_lr_scheduler_steps_the_same_optimizer():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = clone(model)
    engine = engine_for(model, stages=3, early_update=True)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    ref_opt = OPTIMIZERS["sgd"](ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for x, y in data(n=6, size=8, steps=3):
        engine.train_step(x, y)
        sched.step()
        ref_opt.zero_grad()
        for xi, yi in zip(x.split(3), y.split(3)):
            (nn.functional.cross_entropy(ref(xi), yi) * 0.5).backward()
        ref_opt.step()
        ref_sched.step()
    assert engine.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 / 8
    assert max_diff(model, ref) <= TOL


def _distributed_case(rank: int, world: int) -> dict:
    out = {}
    for early in (False, True):
        torch.manual_seed(0)
        model = tiny_resnet()
        engine = engine_for(model, optimizer="adam", stages=2, early_update=early, split_grads=early)
        for x, y in data(n=6, size=8, steps=2, seed=rank):
            engine.train_step(x, y)
        out[early] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_data_parallel_early_update_waits_for_each_stages_sync():
    results = multiproc.run(_distributed_case, 2)
    for res in results:
        assert max((res[True][n] - res[False][n]).abs().max().item() for n in res[False]) <= TOL
    assert all(torch.equal(results[0][True][n], results[1][True][n]) for n in results[0][True])


def test_a_stages_update_waits_for_its_lanes_and_its_sync_by_events(monkeypatch):
    from pipedp.pipeline import early_update as early_module

    log = []
    layer = nn.Linear(2, 2)
    layer.weight.grad, layer.bias.grad = torch.ones(2, 2), torch.ones(2)
    bias = layer.bias.detach().clone()
    stage = Stage(0, Chain([Block("0", layer)]), CPU, new_lane(CPU, "s0"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    side = LoggingLane("wgrad", log)
    early = EarlyUpdate(opt, [stage], [(0, a) for a in one_f_one_b(1, 1)[0]], {0: [side]})
    early.lanes = [LoggingLane("update", log)]
    monkeypatch.setattr(early_module, "current_lane", lambda device: LoggingLane("stage", log))
    early.lanes[0].wait_lane = lambda other: log.append(("wait for", other.name))

    class Sync:
        def wait_stage(self, stage):
            log.append(("sync", stage))

    opt.register_step_post_hook(lambda *a: log.append(("step",)))
    early.begin(Sync())
    early.stage_done(0)
    assert log == [("wait for", "stage"), ("wait for", "wgrad"), ("enter", "update"), ("sync", 0), ("step",),
                   ("exit", "update")]
    assert torch.allclose(layer.bias, bias - 0.1) and early.done == [0]
