"""Test-time augmentation (Page part 7: flip TTA took 94% from 33.5 s to 26 s, the largest single effect).

What: the logits are averaged over views of each test image.
  level 0: the image itself.
  level 1: the image and its mirror, weighted equally.
  level 2: level 1 (weight 0.5) plus the mirror pairs of the image shifted by one pixel up-left and
           down-right with reflect padding (0.25 each): six forward passes (airbench94).
Why: the net was trained on flipped and translated images, so those views are in-distribution and their
average has lower variance. Costs 2x / 6x the evaluation forward passes, all inside the timed region.

Selective TTA (Hiverge's 2025 record, hiverge/cifar10-speedrun README "Selective test time augmentation"; a
fraction here where Hiverge sets a confidence threshold): one plain forward pass for every image of the set scored,
then the level's views, with the same weights, only for the ceil(fraction * N) of the N images whose plain
prediction is least confident (lowest max-softmax); the others keep their plain logits. The selection is over the
whole set (selective_tta_logits takes it in batches, two passes), so a score does not depend on the evaluation
batch size. The plain pass is reused as the identity view, so the set costs N + ceil(fraction * N) * (views - 1)
passes instead of N * views: at level 2 and fraction 0.25, 2.25 per image instead of 6. Why it keeps most of the
gain: a confident prediction is rarely changed by averaging views. fraction >= 1 is full TTA exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def selected_count(n: int, fraction: float) -> int:
    """How many of n images selective TTA gives the views: ceil(fraction * n), at least one, at most n (0 for none);
    the fraction's product is rounded to 6 places first, so 0.29 * 100 is 29, not 30."""
    return min(n, max(1, math.ceil(round(fraction * n, 6)))) if n else 0


# Forward passes per image at each level: the image; and its mirror; and the mirrors of two shifted copies.
VIEWS = {0: 1, 1: 2, 2: 6}


def passes(n: int, level: int, fraction: float = 1.0) -> int:
    """Forward passes of one image that selective_tta_logits makes to score n images: n per view, or with a
    fraction < 1 the plain pass of all and the other views of the selected (progress and its estimate count
    these, the unit of an evaluation's work)."""
    views = VIEWS[level]
    if views == 1 or fraction >= 1:
        return n * views
    return n + selected_count(n, fraction) * (views - 1)


def least_confident(logits: torch.Tensor, fraction: float) -> torch.Tensor:
    """Indices (k,) of the selected_count(N, fraction) rows of logits (N, K) with the lowest max-softmax."""
    confidence = logits.float().softmax(1).amax(1)  # (N,)
    return confidence.topk(selected_count(len(logits), fraction), largest=False).indices


def selective_tta_logits(model: nn.Module, inputs: Callable[[torch.Tensor], torch.Tensor], n: int, level: int,
                         fraction: float, batch_size: int,
                         on_batch: Callable[[int], object] | None = None) -> torch.Tensor:
    """Logits (n, K) of a set of n images: plain for all, the level's TTA for the least confident `fraction` of the
    whole set. inputs(idx) gives the model's inputs for the images at the indices idx (k,), normalized, (k, C, H, W):
    the set is read in batches of batch_size, twice (the plain pass, then the selected images). fraction >= 1 (or
    level 0) is tta_logits over the set, batch by batch. on_batch(p) after each batch: the forward passes of one
    image it made (they sum to passes(n, level, fraction))."""
    done = on_batch or (lambda count: None)
    batches = [torch.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    if level == 0 or fraction >= 1:
        scored = []
        for idx in batches:
            scored.append(tta_logits(model, inputs(idx), level).float())
            done(len(idx) * VIEWS[level])
        return torch.cat(scored)
    scored = []
    for idx in batches:
        scored.append(model(inputs(idx)).float())
        done(len(idx))
    plain = torch.cat(scored)  # (n, K)
    pick = least_confident(plain, fraction).sort().values.cpu()
    for i in range(0, len(pick), batch_size):
        idx = pick[i:i + batch_size]
        on = idx.to(plain.device)
        plain[on] = tta_logits(model, inputs(idx), level, plain[on]).float()
        done(len(idx) * (VIEWS[level] - 1))
    return plain
