"""What a speed benchmark trains: a model at an input shape, on one synthetic batch.

A model spec is ``name[@size][/classes]``: ``resnet18`` (CIFAR shape, 32x32,
10 classes), ``resnet18@32/100`` (CIFAR-100), ``resnet50@224/101``
(Caltech-101 / ImageNet shape: the ImageNet-style ResNet). Speed does not
depend on the pixel values, so the batch is random.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .models import paper_model

__all__ = ["Workload", "parse_workload", "parse_ints"]


@dataclass(frozen=True)
class Workload:
    model: str
    size: int = 32
    classes: int = 10

    @property
    def name(self) -> str:
        default = (self.size, self.classes) == (32, 10)
        return self.model if default else f"{self.model}@{self.size}/{self.classes}"

    def build(self, width: int = 64, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return paper_model(self.model, self.classes, image_size=self.size, width=width)

    def batch(self, n: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, self.size, self.size, generator=g)
        y = torch.randint(0, self.classes, (n,), generator=g)
        return x.to(device), y.to(device)


def parse_workload(text: str) -> Workload:
    """``name[@size][/classes]`` as a :class:`Workload` (clear error for anything else)."""
    name, _, rest = text.strip().partition("@")
    size, classes = "32", "10"
    if rest:
        size, _, c = rest.partition("/")
        classes = c or classes
    elif "/" in name:
        name, _, classes = name.partition("/")
    if not name or not size.isdigit() or not classes.isdigit() or int(size) < 8 or int(classes) < 2:
        raise ValueError(f"cannot read model spec {text!r}: use name[@size][/classes], e.g. resnet50@224/101")
    return Workload(name, int(size), int(classes))


def parse_ints(text: str, what: str) -> list[int]:
    """A comma list of positive ints (batch sizes, copies)."""
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{what} must be a comma list of positive ints, got {text!r}")
    return out
