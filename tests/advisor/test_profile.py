"""The real profilers: step time of a configuration on CPU cores, accuracy of a short run; no global change left."""

import math

import pytest
import torch
from torch import nn

from pipedp.advisor.profile import CpuStepTimer, Task, TrainAccuracy, threads
from pipedp.advisor.space import Config


def _task(n=96):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.randn(n, 1, 4, 4, generator=g) * 0.3 + (y.float() * 2 - 1).view(-1, 1, 1, 1)  # separable classes

    def model():
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))

    return Task(model, x[:64], y[:64], x[64:], y[64:], lr=0.05)


def test_step_timer_measures_and_restores_the_thread_count():
    before = torch.get_num_threads()
    t = CpuStepTimer(_task(), steps=2, warmup=1)(Config(1, 8, 2))
    assert math.isfinite(t) and t > 0
    assert torch.get_num_threads() == before


def test_threads_are_restored_after_an_error_and_more_than_the_machine_is_refused():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="this machine has"):
        with threads(10_000):
            pass


def test_short_training_learns_and_stops_at_the_target():
    run = TrainAccuracy(_task())
    accs = run(8, 3)
    assert len(accs) == 3 and all(0 <= a <= 1 for a in accs) and accs[-1] > 0.8
    stopped = run(8, 3, target=0.5)
    assert stopped[-1] >= 0.5 and len(stopped) <= 3 and stopped == accs[:len(stopped)]  # same seed, same run
    with pytest.raises(ValueError, match="larger than the training set"):
        run(128, 1)
    staged = run.phases([(8, 2), (16, 1)])
    assert len(staged) == 3 and staged[:2] == accs[:2]  # the first phase is the plain run's first two epochs


def test_a_task_pairs_images_with_labels():
    t = _task()
    with pytest.raises(ValueError, match="must pair each image with a label"):
        Task(t.model, t.train_x, t.train_y[:3], t.test_x, t.test_y)
