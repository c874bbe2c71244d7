"""Swapping depthwise layers: same objects and keys; clear errors when kernels are demanded but absent."""

import pytest
import torch
from torch import nn

import pipedp
from pipedp.ops.swap import TunedDepthwiseConv2d, is_depthwise, swap_depthwise


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1, groups=8),
                         nn.Conv2d(16, 16, 3, groups=4), nn.Flatten())


def test_only_depthwise_layers_qualify():
    net = _net()
    assert [is_depthwise(m) for m in net] == [False, True, False, False]


def test_tvm_without_exported_kernels_names_the_command(tmp_path):
    with pytest.raises(RuntimeError, match="tune-kernels --model"):
        swap_depthwise(_net(), "tvm", str(tmp_path), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="tune-kernels"):
        pipedp.wrap(_net(), kernels="tvm", kernel_db=str(tmp_path))


def test_auto_and_torch_leave_a_model_without_kernels_alone(tmp_path):
    net = _net()
    keys = list(net.state_dict())
    assert swap_depthwise(net, "auto", str(tmp_path), torch.device("cpu")) == 0
    assert swap_depthwise(net, "torch", None, torch.device("cpu")) == 0
    assert type(net[1]) is nn.Conv2d and list(net.state_dict()) == keys
    with pytest.raises(ValueError, match="kernels must be one of"):
        swap_depthwise(net, "fast", None, torch.device("cpu"))


def test_a_swapped_layer_is_the_same_module_computing_the_same_values():
    net = _net()
    layer = net[1]
    keys = list(net.state_dict())
    x = torch.randn(2, 3, 8, 8)
    ref = net(x)
    layer.__class__ = TunedDepthwiseConv2d  # what swap_depthwise does when kernels exist
    assert net[1] is layer and isinstance(layer, nn.Conv2d) and list(net.state_dict()) == keys
    assert torch.allclose(net(x), ref, atol=1e-6)
