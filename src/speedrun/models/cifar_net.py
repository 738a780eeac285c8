"""The airbench-class CIFAR network, written from the published description (Jordan, arXiv 2404.00498;
Page, "How to train your ResNet" parts 4-8).

    whiten: conv k x k, C -> 2*C*k*k, no padding, frozen weights, learned bias   (N, 24, 31, 31) for CIFAR
    GELU
    3 x ConvGroup: conv3x3 -> maxpool2 -> BN -> GELU -> conv3x3 -> BN -> GELU [-> conv3x3 -> BN -> GELU, + skip]
    global max pool -> linear (no bias) -> x logit_scale

Pooling before BN (Page part 4: 64 s -> 59 s): BN and GELU then run on a quarter of the pixels.
"""

from __future__ import annotations

import torch
from torch import nn

from speedrun.tricks.identity_init import dirac_init_
from speedrun.tricks.pooling import IndexFreeEvalPool


class BatchNorm(nn.BatchNorm2d):
    """BatchNorm whose scale may be frozen at 1 (Page part 6: frozen scales, 46 s -> 43 s).

    momentum is PyTorch's convention (weight of the new batch's statistics); airbench's 0.6 is PyTorch's 0.4.
    """

    def __init__(self, channels: int, momentum: float, eps: float, scale_frozen: bool):
        super().__init__(channels, eps=eps, momentum=momentum)
        self.weight.requires_grad = not scale_frozen


class ConvGroup(nn.Module):
    def __init__(self, c_in: int, c_out: int, convs: int, bn_momentum: float, bn_eps: float,
                 bn_scale_frozen: bool, dirac: bool, act: type[nn.Module], index_free_eval_pool: bool = False):
        super().__init__()
        assert convs in (2, 3), "a group has 2 convs, or 3 with a residual over the last two (airbench96)"
        self.convs = nn.ModuleList([nn.Conv2d(c_in if i == 0 else c_out, c_out, 3, padding="same", bias=False)
                                    for i in range(convs)])
        self.norms = nn.ModuleList([BatchNorm(c_out, bn_momentum, bn_eps, bn_scale_frozen) for _ in range(convs)])
        self.pool = IndexFreeEvalPool(2, index_free_eval_pool)
        self.act = act()
        if dirac:
            for conv in self.convs:
                dirac_init_(conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norms[0](self.pool(self.convs[0](x))))  # (B, c_out, H/2, W/2)
        skip = x
        for conv, norm in zip(self.convs[1:], self.norms[1:]):
            x = self.act(norm(conv(x)))
        return x + skip if len(self.convs) == 3 else x


ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "celu": nn.CELU}


class CifarNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, widths: tuple[int, ...] = (64, 256, 256),
                 convs_per_group: int = 2, whiten_kernel_px: int = 2, bn_momentum: float = 0.4,
                 bn_eps: float = 1e-12, bn_scale_frozen: bool = True, dirac: bool = True,
                 logit_scale: float = 1 / 9, activation: str = "gelu", index_free_eval_pool: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        act = ACTIVATIONS[activation]
        whiten_width = 2 * in_channels * whiten_kernel_px**2  # eigenvectors and their negatives
        self.whiten = nn.Conv2d(in_channels, whiten_width, whiten_kernel_px, padding=0, bias=True)
        self.whiten.weight.requires_grad = False  # set by tricks.whitening; frozen (airbench)
        nn.init.zeros_(self.whiten.bias)
        self.act = act()
        chans = (whiten_width, *widths)
        self.groups = nn.Sequential(*[ConvGroup(chans[i], chans[i + 1], convs_per_group, bn_momentum, bn_eps,
                                                bn_scale_frozen, dirac, act, index_free_eval_pool)
                                      for i in range(len(widths))])
        self.head = nn.Linear(widths[-1], num_classes, bias=False)
        self.logit_scale = logit_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(self.act(self.whiten(x)))  # (B, widths[-1], 3, 3) for 32x32 input
        # Global max pool, (B, C, H, W) -> (B, C), as airbench's MaxPool2d(3) on its 3x3 map: the gradient goes to
        # one maximum. Not torch.amax, which splits it among ties: compiled by inductor in bf16/fp16 its backward
        # gives NaN (torch 2.11 on an H100, 2.13 on a CPU; benchmarks/repro_amax_compile.py).
        x = nn.functional.adaptive_max_pool2d(x, 1).flatten(1)
        return self.head(x) * self.logit_scale


def output_side(side_px: int, widths: tuple[int, ...], whiten_kernel_px: int) -> int:
    """The spatial side after the whitening conv (no padding) and one 2x2 max pool per group (floor)."""
    side = side_px - whiten_kernel_px + 1
    for _ in widths:
        side //= 2
    return side


def memory_lower_bound(image_shape: tuple[int, int, int], num_classes: int, widths: tuple[int, ...],
                       convs_per_group: int, whiten_kernel_px: int, batch_size: int,
                       eval_batch_size: int) -> tuple[int, int, int]:
    """(parameter bytes, training activation bytes, evaluation activation bytes): less than this fp32 net
    certainly needs.

    Parameters count three times (weights, gradients, momentum). Training keeps every conv output for the backward
    pass, at the resolution it is computed, (B, c_out, H, W); evaluation keeps no graph, but at least the whitened
    input and the first conv's output, (B, c, H, W) each, are alive together. Real use is higher: this is for
    refusing settings that cannot fit, never ones that might.
    """
    c, h, w = image_shape
    k = whiten_kernel_px
    whiten = 2 * c * k * k
    params = whiten * c * k * k + whiten + widths[-1] * num_classes
    pixels = (h - k + 1) * (w - k + 1)
    acts = whiten * pixels
    eval_acts = (whiten + widths[0]) * pixels
    c_in = whiten
    for c_out in widths:
        params += 9 * c_in * c_out + 9 * c_out * c_out * (convs_per_group - 1) + 2 * c_out * convs_per_group
        acts += c_out * pixels  # the first conv, before its 2x2 pool
        pixels //= 4
        acts += c_out * pixels * (convs_per_group - 1)
        c_in = c_out
    return 4 * 3 * params, 4 * batch_size * acts, 4 * eval_batch_size * eval_acts
