"""Small models and plain training with any optimizer, for the tests of branches, split grads and early update."""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable

import torch
from torch import nn

import pipedp
from pipedp.models import BasicBlock
from pipedp.pipeline import microbatch
from pipedp.pipeline.stream import Lane

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def tiny_resnet(classes: int = 10) -> nn.Sequential:
    """A stem, three residual blocks (two with a downsample shortcut) and a head: 7 blocks to cut."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), BasicBlock(4, 8, 2), BasicBlock(8, 8), BasicBlock(8, 8, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes),
    )


def plain_train(model: nn.Module, batches, *, microbatches: int, optimizer: str, dtype: torch.dtype | None = None):
    """Gradient accumulation over the same microbatches, then one step of ``OPTIMIZERS[optimizer]``."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        xs, ys = microbatch.split(x, microbatches), microbatch.split(y, microbatches)
        for xi, yi, w in zip(xs, ys, microbatch.shares([t.shape[0] for t in xs])):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(xi), yi) * w
            loss.backward()
        opt.step()
    return opt


def engine_for(model: nn.Module, *, optimizer: str = "sgd", microbatches: int = 2, stages=2,
               schedule: str = "1f1b", **kw) -> pipedp.Engine:
    return pipedp.wrap(model, optimizer=OPTIMIZERS[optimizer](model.parameters()), loss_fn=nn.CrossEntropyLoss(),
                       microbatches=microbatches, stages=stages, schedule=schedule, profile=False, progress=False,
                       **kw)


class LoggingLane(Lane):
    """A CPU lane that pretends to be a stream: it logs its records, waits, kept tensors and uses."""

    counter = itertools.count()

    def __init__(self, name, log):
        super().__init__(torch.device("cpu"), None, name)
        self.log = log

    @contextlib.contextmanager
    def use(self):
        self.log.append(("enter", self.name))
        yield self
        self.log.append(("exit", self.name))

    def record(self):
        ev = next(self.counter)
        self.log.append(("record", self.name, ev))
        return ev

    def wait(self, event):
        self.log.append(("wait", self.name, event))

    def keep(self, tensor):
        self.log.append(("keep", self.name))


def train_both(*, seed: int = 0, steps: int = 2, optimizer: str = "sgd", dtype: torch.dtype | None = None,
               **engine_kw) -> tuple[pipedp.Engine, nn.Module, nn.Module, torch.optim.Optimizer]:
    """``tiny_resnet`` trained by an engine with ``engine_kw`` and, from the same start, by plain training.

    Returns the engine, its model, the plain model and the plain optimizer, for the caller's comparisons.
    """
    from tests.reference import clone, data

    torch.manual_seed(seed)
    model = tiny_resnet()
    ref = clone(model)
    batches = data(n=6, size=8, steps=steps, seed=seed)
    precision = {None: "fp32", torch.bfloat16: "bf16"}[dtype]
    engine = engine_for(model, optimizer=optimizer, precision=precision, **engine_kw)
    for x, y in batches:
        engine.train_step(x, y)
    ref_opt = plain_train(ref, batches, microbatches=2, optimizer=optimizer, dtype=dtype)
    return engine, model, ref, ref_opt
