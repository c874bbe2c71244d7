import torch

from pipedp.comm import Local
from pipedp.decide import Config
from pipedp.trials.clock import DeviceClock
from pipedp.partition.parts import Parts
from pipedp.options import PipelineOptions, TrainingOptions
from pipedp.partition.blocks import blocks_of
from pipedp.partition.check import check_chain
from tests.reference import clone, max_diff, sequential_cnn

CPU = [torch.device("cpu")]


def _clock(model, x):
    blocks = blocks_of(model)
    return DeviceClock(model, Parts(blocks, check_chain(model, blocks, x[:2])), x, CPU, PipelineOptions(), Local(),
                       TrainingOptions())


def test_a_one_stage_cpu_plan_is_timed_on_one_microbatch_and_scaled_to_the_batch():
    model, x = sequential_cnn(), torch.randn(12, 3, 16, 16)
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    clock = _clock(model, x)
    one, four = Config((len(clock.parts.blocks),), 1, own=True), Config((len(clock.parts.blocks),), 4)
    assert clock.sampled(four) and not clock.sampled(one) and not clock.sampled(Config((4, 5), 4))
    seen.clear()
    assert clock.warm(four) is None  # a plan's first call on microbatch shapes is a warm-up
    ms = clock.measure(four, 2)
    assert set(seen) == {3} and ms > 0 and clock.scale[four] == 4.0  # microbatches of 3, x4 for the batch of 12
    seen.clear()
    first = clock.warm(one)  # the user's own eager step on a CPU: its first call is a timed step
    assert first is not None and first > 0
    clock.measure(one, 1)
    assert set(seen) == {12}  # the user's own step takes the whole batch


def test_trials_leave_parameters_gradients_and_layout_as_they_were():
    model, x = sequential_cnn(), torch.randn(8, 3, 16, 16)
    before = clone(model)
    clock = _clock(model, x)
    for c in (Config((9,), 1, True, own=True), Config((9,), 2, True), Config((9,), 1, False, own=True)):
        clock.warm(c)
        clock.measure(c, 1)
    clock.close()
    assert max_diff(model, before) == 0 and all(p.grad is None for p in model.parameters())
    assert model[0].weight.is_contiguous()  # back in NCHW after the last trial in that layout


class Switch:
    """A kernel switch (:class:`~pipedp.decide.measuring.KernelSwitch`) that remembers its position."""

    def __init__(self, on):
        self.on = on

    def use(self, on):
        self.on = on


def test_each_trial_runs_on_its_configurations_kernels_and_the_users_own_step_on_torchs():
    model, x = sequential_cnn(), torch.randn(8, 3, 16, 16)
    switch, seen = Switch(None), []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(switch.on))
    blocks = blocks_of(model)
    clock = DeviceClock(model, Parts(blocks, check_chain(model, blocks, x[:2])), x, CPU, PipelineOptions(), Local(),
                        TrainingOptions(), kernels=switch)
    n = len(clock.parts.blocks)
    for config, on in [(Config((n,), 2, kernels=True), True), (Config((n,), 1, own=True), False),
                       (Config((n,), 2), False), (Config((n,), 2, kernels=True), True)]:
        seen.clear()
        clock.warm(config)
        clock.measure(config, 1)
        assert seen and set(seen) == {on}, config.label


def test_closing_the_clock_puts_the_kernels_back_as_it_found_them():
    model, x = sequential_cnn(), torch.randn(8, 3, 16, 16)
    blocks = blocks_of(model)
    for found in (False, True):
        switch = Switch(found)
        clock = DeviceClock(model, Parts(blocks, check_chain(model, blocks, x[:2])), x, CPU, PipelineOptions(),
                            Local(), TrainingOptions(), kernels=switch)
        config = Config((len(blocks),), 2, kernels=not found)
        clock.warm(config)
        assert switch.on is (not found)
        clock.close()
        assert switch.on is found
