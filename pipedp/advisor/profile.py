"""Short profiling runs on this machine: seconds per step of a configuration, accuracy of a short training.

The advisor takes its measurements from callables (:class:`StepTimer`,
:class:`~.accuracy.AccuracyRun`), so its logic is tested on synthetic laws;
the ones here measure for real, on the CPU, with ``resources`` = torch's
intra-op threads (cores). Each call sets the thread count for its own
duration only and restores it, leaving no process-wide setting changed.

Ranks under torchrun are resources too: :class:`~.ranks.TorchrunStepTimer`
launches ``torchrun --nproc-per-node R`` per configuration and returns the
slowest rank's median; the accuracy runs train at the global batch, here.
Nothing in the advisor assumes cores.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from ..api import wrap
from ..checks import positive_int, positive_number
from .space import Config

__all__ = ["StepTimer", "Task", "CpuStepTimer", "TrainAccuracy", "threads"]


class StepTimer(Protocol):
    """Seconds per training step of ``config`` (a median over a few steps after a warm-up)."""

    def __call__(self, config: Config) -> float: ...


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, restored after it."""
    cores = os.cpu_count() or 1
    if n > cores:
        raise ValueError(f"{n} cores asked for, this machine has {cores}: drop resources above {cores}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Task:
    """What is trained: a model factory, the data as tensors, and the optimizer recipe (SGD with momentum).

    The learning rate is the same at every batch size: the accuracy model's
    assumption (a larger batch is never better after the same epochs) is
    about a fixed recipe.
    """

    model: Callable[[], nn.Module]
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.train_x) != len(self.train_y) or len(self.test_x) != len(self.test_y) or not len(self.train_x):
            raise ValueError(f"the task's data must pair each image with a label: {len(self.train_x)} training "
                             f"images with {len(self.train_y)} labels, {len(self.test_x)} test images with "
                             f"{len(self.test_y)} labels")
        positive_number("lr", self.lr)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``size`` training examples (repeated when the set is smaller)."""
        idx = torch.arange(size) % len(self.train_x)
        return self.train_x[idx], self.train_y[idx]


@dataclass(frozen=True)
class CpuStepTimer:
    """Times ``steps`` pipedp training steps (after ``warmup``) of a fresh model on ``resources`` cores."""

    task: Task
    steps: int = 5
    warmup: int = 2

    def __post_init__(self) -> None:
        positive_int("steps", self.steps)
        positive_int("warmup", self.warmup)

    def __call__(self, config: Config) -> float:
        x, y = self.task.batch(config.batch)
        with threads(config.resources):
            torch.manual_seed(self.task.seed)
            model = self.task.model()
            engine = wrap(model, optimizer=self.task.optimizer(model), loss_fn=nn.CrossEntropyLoss(),
                          microbatches=config.microbatches, stages=1, devices="cpu", profile=False, progress=False,
                          distributed=False, sample=x)
            for _ in range(self.warmup):
                engine.train_step(x, y)
            times = []
            for _ in range(self.steps):
                t0 = time.perf_counter()
                engine.train_step(x, y)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


@dataclass(frozen=True)
class TrainAccuracy:
    """Plain PyTorch training from the task's seed at a batch size; the test accuracy after each epoch.

    Stops after the first epoch that reaches ``target`` (see :class:`~.accuracy.AccuracyRun`).
    Each epoch shuffles the training set (seeded by the epoch) and drops the
    last partial batch, as :func:`~.choose.steps_per_epoch` counts.
    """

    task: Task
    resources: int = 1

    def __call__(self, batch: int, epochs: int, target: float | None = None) -> list[float]:
        return self.phases([(batch, epochs)], target)

    def phases(self, phases: Sequence[tuple[int, int]], target: float | None = None) -> list[float]:
        """One run through ``(batch, epochs)`` phases in turn (a staged plan); the accuracy after each epoch."""
        n = len(self.task.train_x)
        for batch, epochs in phases:
            positive_int("batch", batch)
            positive_int("epochs", epochs)
            if batch > n:
                raise ValueError(f"batch {batch} is larger than the training set ({n} examples)")
        accs: list[float] = []
        with threads(self.resources):
            torch.manual_seed(self.task.seed)
            model = self.task.model()
            opt, loss_fn = self.task.optimizer(model), nn.CrossEntropyLoss()
            for batch in (b for b, epochs in phases for _ in range(epochs)):
                model.train()
                e = len(accs)
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.task.seed * 1009 + e))
                for k in range(n // batch):
                    idx = order[k * batch:(k + 1) * batch]
                    opt.zero_grad(set_to_none=True)
                    loss_fn(model(self.task.train_x[idx]), self.task.train_y[idx]).backward()
                    opt.step()
                accs.append(self._test(model))
                if target is not None and accs[-1] >= target:
                    break
        return accs

    @torch.no_grad()
    def _test(self, model: nn.Module) -> float:
        model.eval()
        right = sum(int((model(x).argmax(1) == y).sum()) for x, y in zip(self.task.test_x.split(256),
                                                                          self.task.test_y.split(256), strict=True))
        return right / len(self.task.test_y)
