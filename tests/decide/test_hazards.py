import torch
from torch import nn

from pipedp.decide.hazards import channels_last_hazard
from pipedp.models import resnet18

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
NCHW = torch.zeros(2, 3, 8, 8)


def test_a_strided_1x1_convolution_of_few_channels_keeps_a_cpu_model_in_nchw():
    why = channels_last_hazard(resnet18(width=4), CPU, NCHW)  # layer2's downsample: 1x1, stride 2, 4 input channels
    assert why is not None and "'layer2.0.downsample.0'" in why and "4 input channels" in why
    assert channels_last_hazard(resnet18(width=8), CPU, NCHW) is None  # 8 channels and more are fine
    assert channels_last_hazard(resnet18(width=4), CUDA, NCHW) is None  # a CPU bug only


def test_only_strided_1x1_convolutions_with_2_to_7_channels_per_group_count():
    def one(c_in, k, s, groups=1):
        return channels_last_hazard(nn.Sequential(nn.Conv2d(c_in, 8, k, stride=s, groups=groups)), CPU, NCHW)

    assert one(4, 1, 2) and one(2, 1, (1, 2)) and one(7, 1, 3)
    assert not one(1, 1, 2) and not one(8, 1, 2) and not one(4, 3, 2) and not one(4, 1, 1)
    assert not one(8, 1, 2, groups=8)  # one channel per group


def test_only_a_4d_input_is_tried_in_channels_last():
    video = nn.Sequential(nn.Conv3d(3, 8, 3))
    for device in (CPU, CUDA):
        why = channels_last_hazard(video, device, torch.zeros(2, 3, 4, 8, 8))
        assert why is not None and "5-d" in why and "channels_last=True" in why
        assert channels_last_hazard(nn.Sequential(nn.Conv1d(3, 8, 3)), device, torch.zeros(2, 3, 8)) is not None
    assert channels_last_hazard(resnet18(width=8), CPU, NCHW) is None
