"""Model files for the command-line tools' ``path/to/file.py:factory`` (tune-kernels, bench_kernels_train)."""

import textwrap

# Two depthwise convs: 3x3 stride 1, and 5x5 stride 2 with channel multiplier 2.
DEPTHWISE_NET = textwrap.dedent("""
    from torch import nn
    def build():
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
            nn.Conv2d(8, 16, 5, stride=2, padding=2, groups=8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
""")
