"""ResNets for ImageNet-class training, written from He et al. 2015, "Deep Residual Learning for Image
Recognition" (arXiv 1512.03385, table 1), in the v1.5 convention.

    stem: conv7x7 stride 2 (in -> w) -> BN -> ReLU -> maxpool3x3 stride 2        (B, w, H/4, W/4)
    4 stages of residual blocks, widths w x (1, 2, 4, 8) (x 4 at the output of a bottleneck); the first block
    of stages 2-4 halves the side through a projection shortcut (He et al.'s option B)     (B, C, H/32, W/32)
    global average pool -> linear (with bias)

    depth  block       blocks per stage  params at 1000 classes  conv + linear MACs at 224 px
    18     basic       2 2 2 2           11,689,512              1.814 G
    34     basic       3 4 6 3           21,797,672              3.664 G
    50     bottleneck  3 4 6 3           25,557,032              4.089 G
    101    bottleneck  3 4 23 3          44,549,160              7.801 G
    152    bottleneck  3 8 36 3          60,192,808              11.514 G
    (torch.utils.flop_counter, batch 1; tests/test_resnet.py asserts the ResNet-18/50 rows. blurpool keeps the
    parameters and adds 0.006 G (ResNet-18) or 0.019 G (ResNet-50) of depthwise blur.)

v1.5: a bottleneck's stride 2 is on its 3x3 conv, not on its first 1x1 as in He et al.; a strided 1x1 reads only
a quarter of its input positions. torchvision and FFCV build ResNet-50 this way; NVIDIA's DeepLearningExamples
README for ResNet-50 v1.5 reports ~+0.5% top-1 for ~5% lower throughput. Basic blocks are the same in both.

Any side >= 32 px works (progressive resizing at 128-256 px; CIFAR's 32 px ends on a 1x1 map), and so does
channels_last: the net has no view or reshape before the global pool.

Init: Kaiming-normal fan_out for convs (He et al. 2015, "Delving Deep into Rectifiers", arXiv 1502.01852),
BN scale 1 and shift 0, PyTorch's default for the linear head. zero_init_residual sets the last BN scale of each
residual branch to 0 (Goyal et al. 2017, "Accurate, Large Minibatch SGD", arXiv 1706.02677, sec. 5.1), so every
block starts as the identity (or as its projection shortcut).

blurpool (Zhang 2019, "Making Convolutional Networks Shift-Invariant Again", arXiv 1904.11486): every stride-2
conv inside the blocks, branch and shortcut, reads its input through a fixed depthwise [1,2,1]x[1,2,1]/16 low-pass
filter (class Blur). The stem is left alone. Where the blur goes, and why:
- Zhang's rule is: strided conv -> conv at stride 1, then blur at stride 2. Blur and conv are both linear and
  shift-invariant, so they commute: blurring at stride 1 and then running the original stride-2 conv computes the
  same values away from the borders (exactly, borders included, for the 1x1 shortcut convs) while every conv keeps
  its stride-2 cost; Zhang's literal order runs every strided conv at 4x its MACs, +1.97 GMACs (+48%) on
  ResNet-50 at 224 px (+0.58 G, +32%, on ResNet-18). tests/test_resnet.py checks the equivalence. The same order
  is FFCV's (libffcv/ffcv-imagenet, train_imagenet.py) and the default
  of Composer's BlurPool (blur_first=True).
- Every blur reads a post-ReLU tensor (the block's input, or a bottleneck's conv1 output), so it low-passes after
  the nonlinearity, as Zhang does.
- Zero padding, not Zhang's default reflect: it is the padding of every conv in the net, it is one conv2d call
  (no separate pad copy), and with it the 1x1 shortcut equivalence above is exact at the borders too. Its cost is
  border pixels dimmed to 3/4 (edges) or 9/16 (corners) of a constant input, the same kind of border effect every
  zero-padded conv here already has.
- No minimum channel count: FFCV skips convs with < 16 input channels, which in a ResNet is only the 3-channel
  stem; at width >= 16 the two rules choose the same convs.
The filter is a non-persistent buffer: never trained, never in the optimizer, never in a state_dict, so
checkpoints load the same with and without blurpool. Off (the default), no Blur module exists at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv(c_in: int, c_out: int, kernel_px: int, stride: int = 1) -> nn.Conv2d:
    """A bias-free conv with 'same' padding at stride 1 (the BN after it has a shift)."""
    return nn.Conv2d(c_in, c_out, kernel_px, stride=stride, padding=kernel_px // 2, bias=False)


class Blur(nn.Module):
    """Fixed depthwise [1,2,1]x[1,2,1]/16 low-pass at stride 1, zero padding 1: (B, C, H, W) -> (B, C, H, W)."""

    def __init__(self, channels: int):
        super().__init__()
        taps = torch.tensor([1.0, 2.0, 1.0])
        kernel = torch.outer(taps, taps) / 16  # (3, 3), sums to 1: a constant interior passes unchanged
        self.register_buffer("kernel", kernel.expand(channels, 1, 3, 3).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.kernel, padding=1, groups=self.kernel.shape[0])


def _blur_or_identity(channels: int, stride: int, blurpool: bool) -> nn.Module:
    return Blur(channels) if blurpool and stride > 1 else nn.Identity()


class Shortcut(nn.Module):
    """Projection shortcut (He et al.'s option B): [blur ->] 1x1 conv at the block's stride -> BN."""

    def __init__(self, c_in: int, c_out: int, stride: int, blurpool: bool):
        super().__init__()
        self.blur = _blur_or_identity(c_in, stride, blurpool)
        self.conv = _conv(c_in, c_out, 1, stride)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.blur(x)))


def _shortcut(c_in: int, c_out: int, stride: int, blurpool: bool) -> nn.Module:
    return Shortcut(c_in, c_out, stride, blurpool) if stride > 1 or c_in != c_out else nn.Identity()


class BasicBlock(nn.Module):
    """[blur ->] conv3x3 (stride s) -> BN -> ReLU -> conv3x3 -> BN, + shortcut, ReLU (ResNet-18/34)."""

    expansion = 1

    def __init__(self, c_in: int, planes: int, stride: int, blurpool: bool):
        super().__init__()
        self.blur = _blur_or_identity(c_in, stride, blurpool)
        self.conv1 = _conv(c_in, planes, 3, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv(planes, planes, 3)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(c_in, planes, stride, blurpool)
        self.relu = nn.ReLU(inplace=True)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(self.blur(x))))  # (B, planes, H/s, W/s)
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """conv1x1 -> BN -> ReLU -> [blur ->] conv3x3 (stride s, v1.5) -> BN -> ReLU -> conv1x1 (x4) -> BN,
    + shortcut, ReLU (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int, blurpool: bool):
        super().__init__()
        c_out = planes * self.expansion
        self.conv1 = _conv(c_in, planes, 1)
        self.bn1 = nn.BatchNorm2d(planes)
        self.blur = _blur_or_identity(planes, stride, blurpool)
        self.conv2 = _conv(planes, planes, 3, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv(planes, c_out, 1)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.shortcut = _shortcut(c_in, c_out, stride, blurpool)
        self.relu = nn.ReLU(inplace=True)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))  # (B, planes, H, W)
        out = self.relu(self.bn2(self.conv2(self.blur(out))))  # (B, planes, H/s, W/s)
        out = self.bn3(self.conv3(out))  # (B, 4 * planes, H/s, W/s)
        return self.relu(out + self.shortcut(x))


DEPTHS: dict[int, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}


class ResNet(nn.Module):
    def __init__(self, block: type[nn.Module], blocks_per_stage: tuple[int, ...], num_classes: int, width: int,
                 zero_init_residual: bool, blurpool: bool, in_channels: int):
        super().__init__()
        self.stem = nn.Sequential(_conv(in_channels, width, 7, 2), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        stages, c_in = [], width
        for i, n in enumerate(blocks_per_stage):
            planes = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(c_in, planes, 2 if i > 0 and j == 0 else 1, blurpool))
                c_in = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, num_classes)

        # Every conv draws from the RNG here whatever the switches say, and nothing below draws again: the
        # switches change no other value (the no-op tests in tests/test_resnet.py rely on this).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, C, ceil(H/32), ceil(W/32))
        return self.head(x.mean(dim=(2, 3)))  # global average pool -> (B, num_classes)


def resnet(depth: int, num_classes: int, *, width: int = 64, zero_init_residual: bool = True,
           blurpool: bool = False, in_channels: int = 3) -> ResNet:
    """A ResNet of `depth` layers; `width` is the stem's and first stage's width (64 in He et al.; 8 or 16 makes
    a debug net that trains in seconds on CPU)."""
    if depth not in DEPTHS:
        raise ValueError(f"ResNet depth must be one of {sorted(DEPTHS)}, got {depth!r}")
    for name, value in (("num_classes", num_classes), ("width", width), ("in_channels", in_channels)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    block, blocks_per_stage = DEPTHS[depth]
    return ResNet(block, blocks_per_stage, num_classes, width, zero_init_residual, blurpool, in_channels)


_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm)


def norm_and_bias_params(model: nn.Module) -> list[nn.Parameter]:
    """Every normalization layer's parameters and every other module's `bias`, each once, in module order.

    These are the parameters fast ImageNet recipes exempt from weight decay (FFCV's configs, libffcv/ffcv-imagenet;
    cybertronai/imagenet18; Jia et al. 2018, arXiv 1807.11205). Works on any model, including one whose BatchNorms
    dist.py has converted to SyncBatchNorm; frozen parameters are included, callers filter on requires_grad.
    """
    seen: set[int] = set()
    params = []
    for module in model.modules():
        is_norm = isinstance(module, _NORMS)
        for name, p in module.named_parameters(recurse=False):
            if (is_norm or name == "bias") and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params
