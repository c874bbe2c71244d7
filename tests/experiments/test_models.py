"""The model each paper experiment trains."""

import pytest
import torch

from experiments.models import paper_model


def test_paper_model_picks_the_style_from_the_image_size():
    small = paper_model("resnet18", 10, image_size=32, width=4)
    large = paper_model("resnet34", 101, image_size=224, width=4)
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    assert large.conv1.kernel_size == (7, 7) and large(torch.randn(1, 3, 64, 64)).shape == (1, 101)
    assert paper_model("mobilenet_v2", 3, image_size=32, width=16)(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        paper_model("vgg", 10)
