"""The models people train, from code no one here wrote: torchvision's CNNs and a sample of timm's families.

Each is built as users build it, random layers on (:mod:`experiments.zoo`),
wraps with default options (``stages="auto"``: cut where it can be cut, one
stage with the reason where not) and trains a step. Where a cut exists, its
blocks in one stage train exactly as plain PyTorch with the same
microbatches and seed, dropout masks included; and two stages do, with the
dropout and drop-path rates set to 0 (across stages masks are drawn in the
schedule's order: the README's contract). fp32, <= 1e-5. The small and fast
models run by default; the rest are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp
from experiments import zoo
from pipedp.partition.blocks import CutError, blocks_of
from pipedp.partition.check import check_chain
from tests.reference import clone, max_diff, plain_steps

TOL = 1e-5
FAST_TV = ("shufflenet_v2_x0_5", "mobilenet_v3_small", "squeezenet1_1", "mnasnet0_5")  # the rest: slow
FAST_TIMM = ("mobilenetv3_small_050", "mixnet_s", "regnetx_002", "ghostnet_050")


def _lib(library: str):
    try:
        return zoo.torchvision_models() if library == "torchvision" else zoo.timm()
    except ImportError as e:
        pytest.skip(str(e))


def _params(names, fast):
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


def _steps(model: nn.Module, batches, **options) -> None:
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), microbatches=2, profile=False, progress=False, **options)
    torch.manual_seed(5)
    for xb, yb in batches:
        engine.train_step(xb, yb)


def _step_and_compare(make, quiet, size: int, *, classes: int) -> None:
    """Defaults wrap and train; one stage of blocks (random layers on) and two stages (off) equal plain training."""
    torch.manual_seed(0)
    # 8 images: the default 4 microbatches of 2 (a BatchNorm over one 1x1 map, as at the end of Inception or in
    # ReXNet's squeeze-excitation, cannot train on one image - in plain PyTorch either).
    x, y = torch.randn(8, 3, size, size), torch.randint(0, classes, (8,))
    model = make()
    # Defaults but for the time spent planning (the block profile, the trials' budget): bench_zoo runs the
    # defaults whole and reports their planning seconds.
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=nn.CrossEntropyLoss(),
                         progress=False, profile=False, plan_budget_s=1.0)
    assert torch.isfinite(engine.train_step(x, y)).all()
    torch.manual_seed(0)
    model = make()
    try:
        blocks = blocks_of(model)
        check_chain(model, blocks, x[:2])
    except CutError as e:  # one stage, as the defaults trained it: the reason is the plan's first note
        assert engine.plan.notes[0] == f"stages=auto: one stage ({e.reason}); to cut it, {e.fix}"
        pytest.skip(f"not cut: {e.reason}")
    batches = [(x, y), (torch.randn_like(x), y.flip(0))]
    for build, stages in ((make, [len(blocks)]), (quiet, 2)):
        torch.manual_seed(0)
        model = build()
        ref = clone(model)
        _steps(model, batches, stages=stages)
        torch.manual_seed(5)
        plain_steps(ref, batches, microbatches=2)
        assert max_diff(model, ref) <= TOL, f"stages={stages}"


def test_torchvision_resnet_is_cut_at_its_stem_blocks_and_head():
    model = _lib("torchvision").resnet18(num_classes=10)
    blocks = blocks_of(model)
    assert [b.name for b in blocks][:4] == ["conv1", "bn1", "relu", "maxpool"] and blocks[-1].name == "fc"
    check_chain(model, blocks, torch.randn(2, 3, 64, 64))


def test_the_list_covers_every_torchvision_cnn_builder():
    models = _lib("torchvision")
    cnns = {n for n in models.list_models(module=models) if not n.startswith(zoo.TRANSFORMERS)}
    assert cnns == set(zoo.TORCHVISION), cnns ^ set(zoo.TORCHVISION)


@pytest.mark.parametrize("name", _params([n for n in zoo.TORCHVISION if n not in zoo.TOO_BIG], FAST_TV))
def test_torchvision_cnn_wraps_with_defaults_and_two_stages_are_exact(name):
    _lib("torchvision")
    _step_and_compare(zoo.build("torchvision", name), zoo.build("torchvision", name, random_layers=False),
                      zoo.input_size("torchvision", name), classes=10)


@pytest.mark.parametrize("name", _params(zoo.TIMM, FAST_TIMM))
def test_timm_model_wraps_with_defaults_and_two_stages_are_exact(name):
    if name not in _lib("timm").list_models():
        pytest.skip(f"this timm has no {name}")
    _step_and_compare(zoo.build("timm", name), zoo.build("timm", name, random_layers=False),
                      zoo.input_size("timm", name), classes=10)
