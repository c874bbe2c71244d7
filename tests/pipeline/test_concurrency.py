"""All concurrent pieces together (pipedp/pipeline/concurrency.py): exact, joined, refused where they cannot run."""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.models import resnet18
from pipedp.decide.rules import check_rules
from pipedp.options import ConcurrencyOptions, PipelineOptions, TrainingOptions
from tests.pipeline.concurrency_reference import engine_for, plain_train, tiny_resnet
from tests.reference import clone, data, max_diff, sequential_cnn

CPU = [torch.device("cpu")]

TOL = 1e-5
ALL = dict(branches=True, split_grads=True, early_update=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_all_pieces_together_equal_plain_training(optimizer, schedule, stages):
    torch.manual_seed(stages)
    model = tiny_resnet()
    ref = clone(model)
    batches = data(n=6, size=8, steps=3, seed=stages)
    engine = engine_for(model, optimizer=optimizer, stages=stages, schedule=schedule, **ALL)
    for x, y in batches:
        engine.train_step(x, y)
    plain_train(ref, batches, microbatches=2, optimizer=optimizer)
    assert max_diff(model, ref) <= TOL


@pytest.mark.parametrize("extra", [dict(precision="bf16"), dict(recompute=True), dict(batchnorm="batch")])
def test_all_pieces_with_bf16_recompute_and_deferred_batchnorm(extra):
    torch.manual_seed(0)
    model = tiny_resnet()
    ref = clone(model)
    reference = clone(model)
    batches = data(n=6, size=8, steps=2)
    engine = engine_for(model, optimizer="adam", stages=3, **ALL, **extra)
    plain = engine_for(ref, optimizer="adam", stages=3, **extra)  # the same engine without the pieces
    for x, y in batches:
        engine.train_step(x, y)
        plain.train_step(x, y)
    assert max_diff(model, ref) <= TOL
    if "precision" in extra:  # and plain autocast training
        plain_train(reference, batches, microbatches=2, optimizer="adam", dtype=torch.bfloat16)
        assert max_diff(model, reference) <= TOL


def test_the_pieces_are_joined_at_the_end_of_a_step_and_undone():
    model = resnet18(width=4)
    engine = engine_for(model, stages=2, sample=torch.randn(4, 3, 8, 8), **ALL)
    pipe = engine._pipe
    lanes = {id(lane) for st in pipe.executor.stages for lane in pipe.executor.lanes.of_stage(st.index)}
    assert {lane.name for lane in pipe.executor.lanes.side} == {"wgrad0", "wgrad1", "branch0"}  # one CPU stand-in
    assert {id(lane) for lane in pipe.executor.lanes.side} == lanes
    notes = "\n".join(engine.plan.notes)
    assert "3 residual block(s)" in notes and "split_grads=True" in notes and "early_update=True" in notes
    keys = list(model.state_dict())
    pipe.concurrency.undo()
    assert "forward" not in model.layer2[0].__dict__
    assert list(model.state_dict()) == keys


def test_nothing_is_installed_when_all_are_off():
    engine = engine_for(tiny_resnet(), stages=2, sample=torch.randn(4, 3, 8, 8))
    assert engine._pipe.concurrency is None and engine._pipe.executor.lanes.side == []


def test_side_lanes_a_model_never_uses_are_forked_before_they_are_joined(monkeypatch):
    # MobileNetV2's residual blocks have identity shortcuts: branches=True makes none concurrent, so the branch lanes
    # get no work. The step still joins them; on the H100 that made every captured step (and trial) fail with
    # cudaErrorStreamCaptureInvalidated. A lane joined at the end of a step must have been forked at its start.
    from pipedp.pipeline.stream import Lane

    log = []
    monkeypatch.setattr(Lane, "wait_lane", lambda self, other: log.append((self.name, other.name)))
    engine = engine_for(sequential_cnn(), stages=2, sample=torch.randn(4, 3, 8, 8), branches=True, split_grads=True)
    assert engine._pipe.concurrency.branches.count == 0  # nothing forks: the branch lanes stay idle
    x, y = data(n=4, size=8, steps=1)[0]
    log.clear()
    engine.train_step(x, y)
    joined = {other for lane, other in log if lane == "current"}
    assert {"stage0", "stage1", "branch0", "wgrad0"} <= joined  # on a CPU the stages share one lane of each kind
    for name in joined:
        assert (name, "current") in log and log.index((name, "current")) < log.index(("current", name)), name


def test_compile_with_branches_or_split_grads_is_refused_with_the_fix():
    for kw, why in ((dict(branches=True), "the swapped blocks order streams by events"),
                    (dict(split_grads=True), "a compiled stage's backward computes its weight gradients")):
        with pytest.raises(ValueError, match=f"with compile=True: {why}.*Use compile=False"):
            check_rules(PipelineOptions(), TrainingOptions(compile=True), ConcurrencyOptions(**kw), CPU)
    check_rules(PipelineOptions(), TrainingOptions(compile=True), ConcurrencyOptions(early_update=True), CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph", [False, True])
def test_on_cuda_all_pieces_match_plain_training_eager_and_captured(graph):
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = resnet18(width=8).cuda()
        ref = clone(model)
        batches = [(x.cuda(), y.cuda()) for x, y in data(n=16, size=16, steps=4)]
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph)

        engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=3,
                             devices="cuda", cuda_graph=graph, profile=False, progress=False, **ALL)
        for x, y in batches:
            engine.train_step(x, y)
        torch.cuda.synchronize()
        plain_train(ref, batches, microbatches=2, optimizer="adam")
        assert max_diff(model, ref) <= 1e-4
        if graph:
            assert engine._runner.graph.replays >= 1
    finally:
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32) = saved
