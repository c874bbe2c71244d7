"""The model each experiment of the paper trains: the zoo's CIFAR-style nets on 32x32 inputs, ImageNet-style ones on larger."""

from __future__ import annotations

from torch import nn

from pipedp.models import MODELS, mobilenet_v2

__all__ = ["paper_model"]


def paper_model(name: str, num_classes: int, image_size: int = 32, width: int = 64) -> nn.Module:
    """The model the paper trains on inputs of ``image_size``.

    32x32 (CIFAR-shaped) inputs get the CIFAR-style ResNet (3x3 stem, no
    max-pool); larger ones (Caltech-101 at 224x224) the ImageNet-style ResNet:
    torchvision's own class when torchvision is installed at the standard width,
    the same structure from this zoo otherwise. ``mobilenet_v2`` follows the
    same rule.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS)}")
    cifar = image_size <= 64
    if name == "mobilenet_v2":
        return mobilenet_v2(num_classes, width=width / 64, cifar=cifar)
    if not cifar and width == 64:
        try:
            import torchvision.models as tv

            return getattr(tv, name)(num_classes=num_classes)
        except ImportError:
            pass
    return MODELS[name](num_classes, width=width, cifar=cifar)
