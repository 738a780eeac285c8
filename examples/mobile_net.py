"""A small MobileNet-style network to train through a speedrun recipe with `--model`, written for this example:
inverted residual blocks of depthwise-separable convolutions (MobileNetV2: Sandler et al. 2018, arXiv 1801.04381;
the separable convolution of MobileNet: Howard et al. 2017, arXiv 1704.04861).

    speedrun train cifar10-94 --model examples/mobile_net.py:build --epochs 1
    speedrun ablate cifar10-94 --model examples/mobile_net.py:build --epochs 1   # which tricks transfer?

Shapes for CIFAR (3x32x32): stem 2x2 conv 3 -> 24, no padding (31x31: the shape patch whitening initializes, so
whiten_init applies); two blocks at each width, the first with stride 2: 64 (16x16), 128 (8x8), 256 (4x4); global
average pool; linear head, its logits scaled by 1/9: 0.98 M parameters, 87 MFLOP a 32x32 image forward. The
recipes' SGD sums the loss over the batch and takes a large lr (airbench's lr_per_1024 = 11.5), which its own
network meets with logits scaled by 1/9 (logit_scale); a network without the scale diverged under it within 20
steps here, so this one has it, as a fixed part of the head.
"""

from __future__ import annotations

from torch import nn


class InvertedResidual(nn.Module):
    """1x1 expand -> 3x3 depthwise (stride s) -> 1x1 project, BatchNorm after each, ReLU6 after the first two; the
    input added back where the shape is unchanged."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int = 4):
        super().__init__()
        hidden = c_in * expand
        self.body = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...] = (64, 128, 256),
                 logit_scale: float = 1 / 9):
        super().__init__()
        stem = 2 * in_channels * 2 * 2  # 2x2 patches and their negatives, as patch whitening lays them out
        self.stem = nn.Sequential(nn.Conv2d(in_channels, stem, 2, bias=True), nn.GELU())
        blocks, c = [], stem
        for width in widths:
            blocks += [InvertedResidual(c, width, 2), InvertedResidual(width, width, 1)]
            c = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)
        self.logit_scale = logit_scale

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3))) * self.logit_scale


def build(in_channels: int, num_classes: int, image_px: int) -> nn.Module:
    """The builder `--model examples/mobile_net.py:build` names: any image size of at least 16 px."""
    if image_px < 16:
        raise ValueError(f"MobileNet here needs images of at least 16 px, got {image_px}")
    return MobileNet(in_channels, num_classes)
