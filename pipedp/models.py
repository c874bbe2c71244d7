"""Reference CNNs: what the paper's experiments, the benchmarks and ``tune-kernels --model NAME`` build.

CIFAR-style ResNets (3x3 stem, no max-pool, 32x32 input) written with
torchvision's structure and attribute names (``conv1, bn1, relu, maxpool,
layer1..4, avgpool, fc``), so pipedp cuts them exactly as it cuts torchvision's
own ResNets. ``width`` scales every layer's channels (64 is the standard
model; tests use narrow ones to stay fast). MobileNetV2 and EfficientNet-B0
(torchvision's layouts, ``width`` a channel multiplier there) are the
depthwise-convolution models; ``cifar=True`` gives them stems for 32x32
inputs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = [
    "BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50", "MobileNetV2", "mobilenet_v2",
    "SqueezeExcite", "MBConv", "EfficientNetB0", "efficientnet_b0", "MODELS", "get_model",
]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + idt)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ResNet with torchvision's layout; ``cifar=True`` gives the 3x3 stem without max-pool."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 10,
        *,
        width: int = 64,
        cifar: bool = True,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if cifar:
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        cin = width
        for i, (n, mult) in enumerate(zip(layers, (1, 2, 4, 8))):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, width * mult, stride))
                cin = width * mult * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, **kw) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, **kw)


def resnet34(num_classes: int = 10, **kw) -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, **kw)


def resnet50(num_classes: int = 10, **kw) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, **kw)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project (residual when shapes allow)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (torchvision's layout). ``cifar=True``: stride-1 stem and first stage for 32x32 inputs."""

    # (expansion, channels, blocks, stride)
    SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, num_classes: int = 10, width: float = 1.0, cifar: bool = True) -> None:
        super().__init__()
        cin = max(8, int(32 * width))
        stem_stride = 1 if cifar else 2
        layers: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(3, cin, 3, stem_stride, 1, bias=False), nn.BatchNorm2d(cin), nn.ReLU6(inplace=True))
        ]
        for k, (t, c, n, s) in enumerate(self.SETTINGS):
            cout = max(8, int(c * width))
            for i in range(n):
                stride = s if i == 0 and not (cifar and k == 1) else 1
                layers.append(InvertedResidual(cin, cout, stride, t))
                cin = cout
        last = max(1280, int(1280 * width)) if width > 1.0 else 1280
        layers.append(nn.Sequential(nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6(inplace=True)))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(last, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def mobilenet_v2(num_classes: int = 10, **kw) -> MobileNetV2:
    return MobileNetV2(num_classes, **kw)


def _divisible(channels: float, by: int = 8) -> int:
    """Channels rounded to a multiple of ``by``, never below 90% of ``channels`` (torchvision's rule)."""
    out = max(by, int(channels + by / 2) // by * by)
    return out + by if out < 0.9 * channels else out


class SqueezeExcite(nn.Module):
    """Channel gates from the block's pooled features: 1x1 squeeze, SiLU, 1x1 excite, sigmoid."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class MBConv(nn.Module):
    """EfficientNet's block: 1x1 expand, kxk depthwise, squeeze-excite, 1x1 project (residual when shapes allow).

    Stochastic depth (torchvision drops the residual branch at random in training) is left out: the
    benchmarks time steps, which it would make vary from step to step.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = _divisible(cin * expand)
        layers: list[nn.Module] = []
        if hidden != cin:
            layers.append(nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                        nn.SiLU(inplace=True)))
        layers += [
            nn.Sequential(nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
                          nn.BatchNorm2d(hidden), nn.SiLU(inplace=True)),
            SqueezeExcite(hidden, max(1, cin // 4)),
            nn.Sequential(nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)),
        ]
        self.block = nn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_res else self.block(x)


class EfficientNetB0(nn.Module):
    """EfficientNet-B0 (torchvision's layout). ``cifar=True``: stride-1 stem and second stage for 32x32 inputs,
    as :class:`MobileNetV2` does, so the last stage works on 4x4 planes rather than 1x1."""

    # (expansion, kernel, stride, channels, blocks)
    SETTINGS = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
                (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]

    def __init__(self, num_classes: int = 10, width: float = 1.0, cifar: bool = True, dropout: float = 0.2) -> None:
        super().__init__()
        cin = _divisible(32 * width)
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, cin, 3, 1 if cifar else 2, 1, bias=False),
                                                 nn.BatchNorm2d(cin), nn.SiLU(inplace=True))]
        for k, (t, kernel, s, c, n) in enumerate(self.SETTINGS):
            cout = _divisible(c * width)
            stage = []
            for i in range(n):
                stride = s if i == 0 and not (cifar and k == 1) else 1
                stage.append(MBConv(cin, cout, kernel, stride, t))
                cin = cout
            layers.append(nn.Sequential(*stage))
        last = 4 * cin
        layers.append(nn.Sequential(nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last), nn.SiLU(inplace=True)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout, inplace=True), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0(num_classes: int = 10, **kw) -> EfficientNetB0:
    return EfficientNetB0(num_classes, **kw)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18, "resnet34": resnet34, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2,
    "efficientnet_b0": efficientnet_b0,
}


def get_model(name: str, **kw) -> nn.Module:
    """A zoo model by name (clear error for an unknown one)."""
    try:
        return MODELS[name](**kw)
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS)}") from None
