"""ResNet-18 for 32-px images, written from He et al. 2016, "Deep Residual Learning for Image Recognition"
(arXiv 1512.03385) in the CIFAR form of kuangliu/pytorch-cifar (models/resnet.py there):

    stem: conv3x3 stride 1 (C -> w0, padding 1) -> BN -> ReLU, no max-pool                (B, w0, 32, 32)
    4 stages of 2 BasicBlocks, widths w0..w3, strides 1, 2, 2, 2                         (B, w3, 4, 4)
        BasicBlock: conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN, + shortcut, ReLU
        shortcut: identity, or conv1x1(stride) -> BN where the shape changes (He et al.'s option B)
    global average pool -> linear (with bias)                                             (B, K)

Convs have no bias (the BN after each has a shift). Init is PyTorch's default, as in kuangliu/pytorch-cifar.
At widths 64-128-256-512 and 10 classes: 11,173,962 parameters (tests/test_cifar_resnet.py asserts it).

The stem's 3x3 kernel sees C*9 = 27 values per position; whiten_stem_ (the whiten_init trick) fills the stem
with airbench's patch-whitening filters (tricks/whitening.py) where it has room for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.engine.flops import on_meta
from speedrun.tricks.whitening import patch_whitening_init_

STRIDES = (1, 2, 2, 2)
BLOCKS_PER_STAGE = 2


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = _conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()  # identity: the input already has the output's shape
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # (B, c_out, H/stride, W/stride)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-18 for CIFAR-sized images: (B, C, H, W) -> logits (B, K). Any side works: a stride-2 3x3 conv with
    padding 1 maps 1 px to 1 px, and the global average pool takes whatever side the last stage leaves."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256, 512)):
        super().__init__()
        if len(widths) != len(STRIDES):
            raise ValueError(f"widths must be {len(STRIDES)} numbers (one per stage), got {widths}")
        self.stem = _conv3x3(in_channels, widths[0])
        self.stem_bn = nn.BatchNorm2d(widths[0])
        blocks, c_in = [], widths[0]
        for c_out, stride in zip(widths, STRIDES):
            for i in range(BLOCKS_PER_STAGE):
                blocks.append(BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))  # (B, w0, H, W)
        x = self.blocks(x)  # (B, w3, H/8, W/8)
        return self.head(x.mean(dim=(2, 3)))  # global average pool, (B, w3) -> (B, K)


@torch.no_grad()
def whiten_stem_(stem: nn.Conv2d, images: torch.Tensor, eps: float) -> int:
    """Fill the stem with patch-whitening filters of `images` (standardized (N, C, H, W)); returns how many of its
    output channels were filled.

    tricks.patch_whitening_init_ fills a conv of exactly 2*C*k*k outputs (54 for RGB at k = 3): the C*k*k whitening
    filters, largest eigenvalue first, then their negatives. The stem has w0 outputs instead (64 in ResNet-18), so
    the filters are made in a conv of that shape and the stem takes the leading min(w0 // 2, C*k*k) filters with
    their negatives: at w0 = 64 all 27 pairs (54 channels); in a narrow stem the pairs of the largest eigenvalues.
    The channels left over (10 at w0 = 64) keep PyTorch's default init: the BN right after the stem normalizes every
    channel's scale, so random filters sit beside the whitening ones, whatever their scales, as ordinary channels.
    Zero filters would not do: a channel of zero variance is 0 after BN and its gradient is scaled by
    1/sqrt(BN eps). Unlike airbench's whitening layer the stem is not frozen: in ResNet-18 it is an ordinary,
    trained conv and this is only its starting point. Because BN follows, a filter's scale does not change the
    stem's output, only how fast the filter learns (under BN a weight's effective step shrinks as 1/|w|^2): the
    filters of the smallest eigenvalues, the largest ones, move least. The covariance is that of the images' whole
    3x3 patches; the stem's padding adds border patches with zeros in them, a small share at 32 px (124 of 1024).
    """
    c, k = stem.in_channels, stem.kernel_size[0]
    dims = c * k * k
    # The shape patch_whitening_init_ fills (filters, then negatives); skip_init: no draw from the global RNG.
    full = nn.utils.skip_init(nn.Conv2d, c, 2 * dims, k, bias=False)
    patch_whitening_init_(full, images, eps)
    pairs = min(stem.out_channels // 2, dims)
    pick = list(range(pairs)) + list(range(dims, dims + pairs))
    stem.weight[:2 * pairs].copy_(full.weight[pick])
    return 2 * pairs


def parameter_count(in_channels: int, num_classes: int, widths: tuple[int, ...]) -> int:
    """What CifarResNet(in_channels, num_classes, widths) holds, counted on the meta device (no memory taken)."""
    return sum(p.numel() for p in on_meta(lambda: CifarResNet(in_channels, num_classes, widths)).parameters())


def memory_lower_bound(image_shape: tuple[int, int, int], num_classes: int, widths: tuple[int, ...],
                       batch_size: int, eval_batch_size: int) -> tuple[int, int, int]:
    """(parameter bytes, training activation bytes, evaluation activation bytes): less than this fp32 net
    certainly needs.

    Parameters count four times (weights, gradients, momentum, Lookahead's copy). Training keeps every conv's output
    for the backward pass, (B, c_out, H', W'); evaluation keeps no graph, but a block's input and its first conv's
    output are alive together. Real use is higher (BN outputs, ReLU masks): this refuses settings that cannot fit,
    never ones that might.
    """
    c, h, w = image_shape
    acts = widths[0] * h * w  # the stem
    eval_acts = 2 * widths[0] * h * w
    for c_out, stride in zip(widths, STRIDES):
        h, w = -(-h // stride), -(-w // stride)  # ceil: padding 1 keeps a last partial window
        acts += 2 * BLOCKS_PER_STAGE * c_out * h * w
    return 4 * 4 * parameter_count(c, num_classes, widths), 4 * batch_size * acts, 4 * eval_batch_size * eval_acts
