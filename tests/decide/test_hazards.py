import torch
from torch import nn

from pipedp.decide.hazards import channels_last_hazard
from pipedp.models import resnet18

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_strided_1x1_convolution_of_few_channels_keeps_a_cpu_model_in_nchw():
    why = channels_last_hazard(resnet18(width=4), CPU)  # layer2's downsample: 1x1, stride 2, 4 input channels
    assert why is not None and "'layer2.0.downsample.0'" in why and "4 input channels" in why
    assert channels_last_hazard(resnet18(width=8), CPU) is None  # 8 channels and more are fine
    assert channels_last_hazard(resnet18(width=4), CUDA) is None  # a CPU bug only


def test_only_strided_1x1_convolutions_with_2_to_7_channels_per_group_count():
    def one(c_in, k, s, groups=1):
        return channels_last_hazard(nn.Sequential(nn.Conv2d(c_in, 8, k, stride=s, groups=groups)), CPU)

    assert one(4, 1, 2) and one(2, 1, (1, 2)) and one(7, 1, 3)
    assert not one(1, 1, 2) and not one(8, 1, 2) and not one(4, 3, 2) and not one(4, 1, 1)
    assert not one(8, 1, 2, groups=8)  # one channel per group
