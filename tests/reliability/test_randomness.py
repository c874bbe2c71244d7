"""The contract for random layers (dropout): exact with one stage, equal in distribution across stages (item 10).

Plain training draws the masks of microbatch 0 in every layer, then of
microbatch 1; a pipeline draws them in the order its schedule runs the
stages' forwards (stage 0 of several microbatches before stage 1 of the
first). So with random layers in more than one stage a step equals plain
training in distribution - every microbatch and layer gets a fresh mask from
the same seeded generator, and a run repeats exactly with the same seed -
but not bit for bit. With one stage the order is plain training's: exact.
"""

from __future__ import annotations

import torch
from torch import nn

import pipedp

from ..reference import clone, data, max_diff, plain_steps

P = 0.5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(P),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(P),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def _engine(model: nn.Module, stages: int, microbatches: int) -> pipedp.Engine:
    """Built now (``sample``), so that only training steps run the model afterwards."""
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), microbatches=microbatches, stages=stages, profile=False,
                       progress=False, sample=(8, 3, 16, 16))


def _record_masks(model: nn.Module) -> list[tuple[int, torch.Tensor]]:
    """(dropout layer index, mask) of every dropout call, in call order: 1 kept, 0 dropped, -1 input was 0."""
    seen: list[tuple[int, torch.Tensor]] = []

    def hook(i: int, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        seen.append((i, torch.where(args[0] == 0, -1, (out != 0).long())))

    for i, m in enumerate(m for m in model.modules() if isinstance(m, nn.Dropout)):
        m.register_forward_hook(lambda mod, args, out, i=i: hook(i, args, out))
    return seen


def _diff_from_plain(stages: int, steps: int) -> float:
    """Largest parameter difference between pipedp and plain training, both seeded alike before their steps."""
    model = _model()
    ref = clone(model)
    batches = data(n=8, steps=steps)
    engine = _engine(model, stages=stages, microbatches=2)
    torch.manual_seed(1)
    for x, y in batches:
        engine.train_step(x, y)
    torch.manual_seed(1)
    plain_steps(ref, batches, microbatches=2)
    return max_diff(model, ref)


def test_one_stage_with_dropout_equals_plain_training_exactly():
    """With one stage the masks are drawn in plain training's order: exact, dropout and all."""
    assert _diff_from_plain(stages=1, steps=3) <= 1e-6


def test_dropout_across_stages_is_reproducible_fresh_per_microbatch_and_unbiased():
    """Across stages: the same seed repeats the run exactly; every (layer, microbatch) has its own mask; rate p."""
    runs = []
    for _ in range(2):
        model = _model()
        engine = _engine(model, stages=2, microbatches=4)
        masks = _record_masks(model)
        torch.manual_seed(1)
        for x, y in data(n=16, steps=2):
            engine.train_step(x, y)
        runs.append((model, masks))
    (a, masks_a), (b, masks_b) = runs
    assert max_diff(a, b) == 0.0  # reproducible with the same seed
    assert len(masks_a) == len(masks_b) == 2 * 2 * 4  # layers x steps x microbatches, one mask per call
    assert all(i == j and torch.equal(m, n) for (i, m), (j, n) in zip(masks_a, masks_b))
    flat = [m.flatten() for _, m in masks_a]
    assert all(not torch.equal(flat[i], flat[j]) for i in range(len(flat)) for j in range(i))  # never reused
    known = torch.cat(flat)
    known = known[known >= 0]
    kept, n = known.float().mean().item(), known.numel()
    assert n > 10_000 and abs(kept - (1 - P)) < 4 * (P * (1 - P) / n) ** 0.5  # Bernoulli(1 - p) keep rate, 4 sigma


def test_dropout_across_stages_draws_in_schedule_order_not_plain_order():
    """The contract is 'equal in distribution', not exact: a pipeline's step with dropout in two stages differs."""
    assert _diff_from_plain(stages=2, steps=1) > 1e-4  # if this ever becomes exact, tighten the contract in README.md
