"""Test-time augmentation (Page part 7: flip TTA took 94% from 33.5 s to 26 s, the largest single effect).

What: the logits are averaged over views of each test image.
  level 0: the image itself.
  level 1: the image and its mirror, weighted equally.
  level 2: level 1 (weight 0.5) plus the mirror pairs of the image shifted by one pixel up-left and
           down-right with reflect padding (0.25 each): six forward passes (airbench94).
Why: the net was trained on flipped and translated images, so those views are in-distribution and their
average has lower variance. Costs 2x / 6x the evaluation forward passes, all inside the timed region.

Selective TTA (Hiverge's 2025 record, hiverge/cifar10-speedrun README "Selective test time augmentation"; a
fraction here where Hiverge sets a confidence threshold): one plain forward pass for every image, then the level's
views, with the same weights, only for the `fraction` of each evaluation batch whose plain prediction is least
confident (lowest max-softmax); the others keep their plain logits. The plain pass is reused as the identity
view, so a batch costs 1 + fraction * (views - 1) passes instead of `views`: at level 2 and fraction 0.25,
2.25 instead of 6. Why it keeps most of the gain: a confident prediction is rarely changed by averaging views.
fraction >= 1 is full TTA exactly (the same code path).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from speedrun.data.augment import translate


def _mirror(model: nn.Module, x: torch.Tensor, plain: torch.Tensor | None = None) -> torch.Tensor:
    return 0.5 * (model(x) if plain is None else plain) + 0.5 * model(x.flip(-1))


def tta_logits(model: nn.Module, x: torch.Tensor, level: int, plain: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, K) for inputs x (B, C, H, W) averaged over the level's views.

    plain: model(x) when the caller has it already (selective TTA), used as the identity view.
    """
    if level == 0:
        return model(x) if plain is None else plain
    if level == 1:
        return _mirror(model, x, plain)
    if level == 2:
        ones = torch.ones(len(x), dtype=torch.int64, device=x.device)
        shifted = [_mirror(model, translate(x, s * ones, s * ones, 1)) for s in (-1, 1)]
        return 0.5 * _mirror(model, x, plain) + 0.25 * shifted[0] + 0.25 * shifted[1]
    raise ValueError(f"tta_level must be 0, 1 or 2, got {level}")


def least_confident(logits: torch.Tensor, fraction: float) -> torch.Tensor:
    """Indices (k,) of the ceil(fraction * B) rows of logits (B, K) with the lowest max-softmax, at least one."""
    k = min(len(logits), max(1, math.ceil(round(fraction * len(logits), 6))))
    confidence = logits.float().softmax(1).amax(1)  # (B,)
    return confidence.topk(k, largest=False).indices


def selective_tta_logits(model: nn.Module, x: torch.Tensor, level: int, fraction: float) -> torch.Tensor:
    """Logits (B, K): the level's TTA for the least confident `fraction` of x (B, C, H, W), plain logits for the
    rest. fraction >= 1 (or level 0) is tta_logits itself."""
    if level == 0 or fraction >= 1:
        return tta_logits(model, x, level)
    plain = model(x)  # (B, K)
    pick = least_confident(plain, fraction)
    return plain.index_copy(0, pick, tta_logits(model, x[pick], level, plain[pick]).to(plain.dtype))


class SelectiveTTA(nn.Module):
    """`model` whose forward is selective_tta_logits: what an evaluation that runs a module at TTA level 0 takes to
    score with selective TTA instead (engine.loop.evaluate)."""

    def __init__(self, model: nn.Module, level: int, fraction: float):
        super().__init__()
        self.model, self.level, self.fraction = model, level, fraction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return selective_tta_logits(self.model, x, self.level, self.fraction)
