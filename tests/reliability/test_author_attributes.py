"""Plain attributes the author's forward reads, changed between steps (issue 58, case 1).

A temperature annealed from 1 to 1/8, a drop rate changed by a schedule:
torch.fx bakes such values into a traced graph. A plan that is the user's
step runs the user's own forward (and so reads them live); a cut whose
traced blocks read them refuses a change by name, with nothing changed, and
a buffer (the fix the error names) is followed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp
from pipedp.partition import blocks_of
from pipedp.partition.reads import baked_reads

from ..reference import TwoConvs, clone, max_diff
from ..stock import timm

LR = 0.05


class Tempered(TwoConvs):
    """Logits over a temperature the script anneals (a plain float attribute, as distillation code keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x))) / self.temp


class BufferTempered(TwoConvs):
    """The same temperature kept in a buffer, which the graph reads at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("temp", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x))) / self.temp


def _batches(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(steps)]


def _anneal(model: nn.Module, step: int) -> None:
    value = 1.0 / 2 ** (step + 1)
    if isinstance(model.temp, torch.Tensor):
        model.temp.fill_(value)
    else:
        model.temp = value


def _wrap(model: nn.Module, **options) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                       loss_fn=nn.CrossEntropyLoss(), progress=False, plan_budget_s=2, **options)


def _plain(model: nn.Module, batches) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        _anneal(model, i)
    return model


@pytest.mark.parametrize("stages", ["auto", 1])
def test_a_plan_that_is_the_users_step_reads_the_attribute_live(stages) -> None:
    torch.manual_seed(0)
    model = Tempered()
    ref = _plain(clone(model), _batches())
    engine = _wrap(model, stages=stages)
    for i, (x, y) in enumerate(_batches()):
        engine.train_step(x, y)
        _anneal(model, i)
    assert len(engine.executor.stages) == 1
    assert engine.executor.stages[0].chain.parts[0] is model  # the user's own forward, not a trace of it
    assert max_diff(model, ref) <= 1e-5


def test_a_cut_refuses_a_changed_attribute_by_name_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = Tempered()
    engine = _wrap(model, stages=2)
    (x, y), *_ = _batches()
    engine.train_step(x, y)
    model.temp = 0.5
    before = clone(model)
    with pytest.raises(ValueError, match=r"temp changed from 1\.0 to 0\.5.*register_buffer\('temp'"):
        engine.train_step(x, y)
    assert max_diff(model, before) == 0.0
    with pytest.raises(ValueError, match="temp changed"):
        engine(x)  # inference runs the same traced blocks
    model.temp = 1.0  # put back, the cut trains on
    assert torch.isfinite(engine.train_step(x, y))


def test_a_buffer_the_forward_reads_is_followed_by_a_cut() -> None:
    torch.manual_seed(0)
    model = BufferTempered()
    ref = _plain(clone(model), _batches())
    engine = _wrap(model, stages=2)
    for i, (x, y) in enumerate(_batches()):
        engine.train_step(x, y)
        _anneal(model, i)
    assert len(engine.executor.stages) == 2
    assert max_diff(model, ref) <= 1e-5  # no BatchNorm: microbatches keep the full batch's math


def test_timms_drop_rate_read_by_the_root_forward_is_a_baked_read() -> None:
    model = timm().create_model("resnet18", num_classes=10, drop_rate=0.25)  # as users build it
    reads = baked_reads(model, blocks_of(model))
    assert "drop_rate" in {r.attribute for r in reads.reads}
    reads.check()  # unchanged: passes
    model.drop_rate = 0.0
    with pytest.raises(ValueError, match=r"drop_rate changed from 0\.25 to 0\.0"):
        reads.check()


def test_modules_that_run_their_own_forward_read_live() -> None:
    # A Sequential's entries run their own forwards at every step: nothing of theirs is baked in.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5), nn.Flatten())
    assert not baked_reads(model, blocks_of(model))
    model[1].p = 0.1  # read live by Dropout.forward


def test_a_list_changed_in_place_is_a_change() -> None:
    class Scales(TwoConvs):
        def __init__(self) -> None:
            super().__init__()
            self.scales = [1.0, 2.0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.b(self.a(x) * self.scales[0]) * self.scales[1])

    model = Scales()
    reads = baked_reads(model, blocks_of(model))
    model.scales[1] = 3.0
    with pytest.raises(ValueError, match=r"scales changed from \[1\.0, 2\.0\] to \[1\.0, 3\.0\]"):
        reads.check()
