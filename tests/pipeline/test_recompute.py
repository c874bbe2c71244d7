"""Per-stage activation recompute (pipedp/pipeline/recompute.py): less kept, same training, buffers updated once."""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.pipeline.recompute import Recompute
from tests.reference import clone, data, max_diff, plain_steps

TOL = 1e-5


def bn_dropout_model(p: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(p),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),  # cumulative: counts matter
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def engine_for(model, **kw):
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=2, profile=False, progress=False, **kw)


@pytest.mark.parametrize("stages, dropout", [(1, 0.5), (2, 0.0), (3, 0.0), (4, 0.0)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_equals_plain_training_and_updates_buffers_once(stages, dropout, schedule):
    # Dropout masks equal plain training's on one stage only (see README, "Random layers"); with p=0.5 there
    # the recomputed forward must draw the very same masks.
    model = bn_dropout_model(dropout)
    ref = clone(model)
    batches = data(n=8, size=8, steps=3)
    engine = engine_for(model, stages=stages, schedule=schedule, recompute=True)
    torch.manual_seed(1)
    for x, y in batches:
        engine.train_step(x, y)
    assert all(isinstance(st.body, Recompute) for st in engine.executor.stages)
    torch.manual_seed(1)
    plain_steps(ref, batches, microbatches=2)
    assert model[1].num_batches_tracked.item() == model[5].num_batches_tracked.item() == 6  # 3 steps x 2
    assert max_diff(model, ref) <= TOL  # parameters and running statistics


def _recomputed_vs_plain(**kw) -> tuple[nn.Module, nn.Module]:
    """Two steps of a 2-stage engine with recompute and of one without, from the same weights: their models."""
    model = bn_dropout_model(0.0)
    twin = clone(model)
    recomputed = engine_for(model, stages=2, recompute=True, **kw)
    plain = engine_for(twin, stages=2, **kw)
    for x, y in data(n=8, size=8, steps=2):
        recomputed.train_step(x, y)
        plain.train_step(x, y)
    return model, twin


def test_deferred_statistics_are_recorded_once():
    model, twin = _recomputed_vs_plain(batchnorm="batch")
    assert model[1].num_batches_tracked.item() == 2
    assert max_diff(model, twin) <= TOL


def _saved_bytes(stage, x):
    """Bytes autograd keeps for the backward of one forward of ``stage`` (outside any checkpoint)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return total[-1]  # a size, not the tensor: a saved output kept by its own graph would leak that graph

    def unpack(_):
        raise RuntimeError("this graph only counts saved bytes")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        stage(x)
    return sum(total)


def test_only_the_listed_stages_recompute_and_they_keep_less():
    model = bn_dropout_model(0.0)
    engine = engine_for(model, stages=[4, 6], recompute=[1], sample=(8, 3, 16, 16))
    first, second = engine.executor.stages
    assert first.body is None and isinstance(second.body, Recompute)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    kept = _saved_bytes(second, x)
    second.body = None
    plain = _saved_bytes(second, x)
    assert kept <= x.numel() * x.element_size() < plain / 3  # it keeps its input, not its activations


def test_inference_with_recompute_equals_the_model():
    model = bn_dropout_model(0.0).eval()
    engine = engine_for(model, stages=2, recompute=True)
    x = torch.randn(6, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(engine(x), model(x), atol=1e-6)


def test_recompute_of_a_stage_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"recompute names stage\(s\) \[3\] but the pipeline has 2 stage\(s\)"):
        engine_for(bn_dropout_model(0.0), stages=2, recompute=[0, 3], sample=(4, 3, 8, 8))


def test_recompute_replays_autocast_in_backward():
    # Backward runs outside autocast; the recomputed forward must still run in bf16, as the first one did.
    model, twin = _recomputed_vs_plain(precision="bf16")
    assert max_diff(model, twin) <= TOL
