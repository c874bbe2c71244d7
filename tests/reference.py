"""Plain PyTorch training that pipedp must reproduce, and small models for the tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipedp.pipeline import microbatch


def plain_steps(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    microbatches: int,
    loss_fn=None,
    lr: float = 0.05,
    momentum: float = 0.9,
) -> nn.Module:
    """SGD-momentum steps with gradient accumulation over the same microbatches pipedp uses."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        xs, ys = microbatch.split(x, microbatches), microbatch.split(y, microbatches)
        for xi, yi, w in zip(xs, ys, microbatch.shares([t.shape[0] for t in xs])):
            (loss_fn(model(xi), yi) * w).backward()
        opt.step()
    return model


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference over all floating-point parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(
        ((sa[k].double() - sb[k].double()).abs().max().item() for k in sa if sa[k].is_floating_point()),
        default=0.0,
    )


def sequential_cnn(classes: int = 10) -> nn.Sequential:
    """A CNN without BatchNorm: pipelined training must equal full-batch training."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes),
    )


def bn_cnn(classes: int = 10) -> nn.Sequential:
    """A small CNN with two BatchNorms (seeded): for tests of the statistics a step updates or puts back."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes),
    )


def data(n: int = 10, size: int = 16, classes: int = 10, seed: int = 0, steps: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))
        for _ in range(steps)
    ]


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class TwoPaths(nn.Module):
    """Two branches side by side for six layers each (as HRNet's), joined at the end: no one-tensor point."""

    def __init__(self, layers: int = 6):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                for _ in range(layers)])
        self.b = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU(inplace=True)) for _ in range(layers)])
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        a = b = self.stem(x)
        for la, lb in zip(self.a, self.b):
            a, b = la(a), lb(b)
        return self.head((a + b).mean((2, 3)))


class TwoConvs(nn.Module):
    """Two conv-ReLU parts and a classifier head, for tests whose forward does something around them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
