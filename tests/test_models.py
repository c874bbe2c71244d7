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


def test_efficientnet_b0_has_torchvisions_size():
    # torchvision's efficientnet_b0 (1000 classes): 5,288,548 parameters
    assert sum(p.numel() for p in get_model("efficientnet_b0", num_classes=1000, cifar=False).parameters()) == 5_288_548


def _depthwise_outputs(model, size):
    """(kernel, stride, output side) of every depthwise conv of ``model`` on one ``size`` x ``size`` image."""
    seen = []
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and m.groups == m.in_channels > 1:
            m.register_forward_hook(lambda mod, i, o: seen.append((mod.kernel_size[0], mod.stride[0], o.shape[-1])))
    model.eval()(torch.randn(1, 3, size, size))
    return seen


@pytest.mark.parametrize("cifar, size, last", [(True, 32, 4), (False, 224, 7)])
def test_efficientnet_b0_depthwise_convs_and_squeeze_excite(cifar, size, last):
    model = get_model("efficientnet_b0", cifar=cifar)
    convs = _depthwise_outputs(model, size)
    assert len(convs) == 16
    assert {(k, s) for k, s, _ in convs} == {(3, 1), (3, 2), (5, 1), (5, 2)}
    assert convs[0][2] == (32 if cifar else 112) and convs[-1][2] == last
    se = [m for m in model.modules() if type(m).__name__ == "SqueezeExcite"]
    assert len(se) == 16 and all(isinstance(m.activation, torch.nn.SiLU) for m in se)
