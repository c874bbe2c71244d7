"""The reference models: standard sizes, CIFAR and ImageNet stems, clear errors."""

import pytest
import torch

from pipedp.models import MODELS, get_model, resnet18, resnet50


def test_cifar_resnets_have_the_standard_sizes():
    # CIFAR ResNet-18/50 with 10 classes: 11.17M and 23.52M parameters.
    assert sum(p.numel() for p in resnet18().parameters()) == 11_173_962
    assert sum(p.numel() for p in resnet50().parameters()) == 23_520_842


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo_models_map_cifar_batches_to_logits(name):
    model = get_model(name, num_classes=7, width=4)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_imagenet_stem_variant():
    model = resnet18(num_classes=5, width=4, cifar=False)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        get_model("vgg")
