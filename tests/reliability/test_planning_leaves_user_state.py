"""Planning never touches the user's batch or random state (issue 43, cases 2, 10 and 12).

Planning runs the model on the first batch several times (the chain check,
the profiler, trials). A forward that changes its input in place would then
train on a batch changed once per planning run, and every dropout draw or
stand-in batch would move the user's generator, so that a seeded script gets
other masks and data order with pipedp than without. Planning works on
copies and forked generators: the first step sees the batch and the
generator exactly as plain PyTorch's first step would.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipedp

from ..reference import TwoConvs, clone, max_diff, plain_steps


class ScalesInput(TwoConvs):
    """A forward that changes its input in place first, as some preprocessing-in-the-model code does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.head(self.b(self.a(x)))


def _batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(steps)]


def _wrap(model: nn.Module, **kw: object) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                       progress=False, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [dict(stages=1, microbatches=2, profile=False), dict(stages=1, microbatches=2),
                                dict(stages=2, microbatches=2)], ids=["unprofiled", "profiled", "two-stages"])
def test_a_forward_that_changes_its_input_trains_on_the_batch_plain_pytorch_sees(kw):
    torch.manual_seed(0)
    model = ScalesInput()
    ref = clone(model)
    batches = _batches()
    mine = [(x.clone(), y) for x, y in batches]
    engine = _wrap(model, **kw)
    for x, y in mine:
        engine.train_step(x, y)
    plain_steps(ref, [(x.clone(), y) for x, y in batches], microbatches=2, lr=0.05)
    assert max_diff(model, ref) <= 1e-5
    # Planning ran on copies: the user's batch is changed at most as plain PyTorch's forward changes it, doubled
    # once (a model kept whole), or not at all (a cut model's first stage runs on copies of its microbatches: views
    # of one batch share a version counter, so a change to one would spoil what autograd saved of another).
    for (x, _), (x0, _) in zip(mine, batches):
        assert torch.equal(x, x0) or torch.equal(x, x0 * 2)


def test_the_chain_check_runs_the_model_and_its_blocks_on_copies():
    # Before: the check ran model(sample) first and then the blocks on the sample it had doubled, and refused the
    # model as "not the chain of its blocks".
    torch.manual_seed(0)
    model = ScalesInput()
    x = torch.randn(8, 3, 8, 8)
    before = x.clone()
    report = pipedp.inspect(model, x)
    assert report.reason is None or "chain" not in report.reason
    assert torch.equal(x, before)


def _next_draws() -> torch.Tensor:
    return torch.rand(4)


@pytest.mark.parametrize("planning", [
    lambda m: _wrap(m, stages=2, microbatches=2, sample=(8, 3, 8, 8)),
    lambda m: pipedp.inspect(m, (8, 3, 8, 8)),
], ids=["wrap-with-a-sample-shape", "inspect"])
def test_planning_on_a_shape_leaves_the_generator_as_it_was(planning):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Dropout(0.5), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10))
    torch.manual_seed(123)
    expected = _next_draws()
    torch.manual_seed(123)
    planning(model)
    assert torch.equal(_next_draws(), expected)


def test_the_first_step_draws_the_masks_plain_pytorch_draws():
    # Planning on the first batch (profiling, trials) runs dropout; the first step must still draw what plain
    # PyTorch's first step draws from the same seed.
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.5), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(8, 10))

    model, ref = build(), build()
    batches = _batches()
    engine = _wrap(model, stages=1, microbatches=1)
    torch.manual_seed(5)
    for x, y in batches:
        engine.train_step(x, y)
    after = _next_draws()
    torch.manual_seed(5)
    plain_steps(ref, batches, microbatches=1, lr=0.05)
    assert max_diff(model, ref) <= 1e-6
    assert torch.equal(_next_draws(), after)


def test_the_users_step_changes_the_users_batch_as_plain_pytorch_does():
    # Issue 58, case 13: the plan that is the user's step (stages="auto", one microbatch) runs their forward on
    # their batch, which it scales in place as plain PyTorch's step does (it ran a trace on a copy before).
    torch.manual_seed(0)
    model = ScalesInput()
    ref = clone(model)
    (x, y), = _batches(1)
    mine, theirs = x.clone(), x.clone()
    engine = _wrap(model, microbatches=1, channels_last=False, plan_budget_s=2)
    engine.train_step(mine, y)
    plain_steps(ref, [(theirs, y)], microbatches=1, lr=0.05)
    assert len(engine.executor.stages) == 1
    assert torch.equal(mine, x * 2) and torch.equal(mine, theirs)
    assert max_diff(model, ref) <= 1e-5


def _process_state() -> dict[str, object]:
    """What a plan could leave on the process and slow the user's own code beside it (issue 58, case 12)."""
    import gc
    import sys
    import threading

    return {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "anomaly": torch.is_anomaly_enabled(), "mkldnn": torch.backends.mkldnn.enabled,
            "dtype": torch.get_default_dtype(), "matmul": torch.get_float32_matmul_precision(),
            "autocast": torch.is_autocast_enabled("cpu"), "inference": torch.is_inference_mode_enabled(),
            "switch": sys.getswitchinterval(), "gc": (gc.isenabled(), gc.get_threshold()),
            "live threads": sorted(t.name for t in threading.enumerate())}


def test_a_timed_plan_leaves_the_process_settings_and_threads_as_it_found_them():
    # stages="auto" with progress off: trials, a profile and the step, and then the process is as before -
    # no thread left running (a disabled tqdm bar still started a monitor thread), no setting changed.
    torch.manual_seed(0)
    before = _process_state()
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    engine = _wrap(model, plan_budget_s=2)
    (x, y), = _batches(1)
    engine.train_step(x, y)
    assert _process_state() == before
