"""Label smoothing (Szegedy et al. 2016; Page part 5: 64 s -> 59 s).

What: the target distribution puts 1 - s on the true class and s / K on every class.
Why: it bounds the logits' growth late in training and regularizes the fast, high-lr schedules.
Suggested: 0.2 (airbench94, airbench94_muon); Hiverge's retuned record uses 0.09. 0 is plain cross-entropy.
Interactions: targets may be class indices (B,) or probabilities (B, K) (cutmix); both are smoothed.
The loss is summed over the batch, as airbench does, so the "per 1024 examples" lr sets the step size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Summed cross-entropy of logits (B, K) against targets (B,) int64 or (B, K) float, label-smoothed."""
    return F.cross_entropy(logits.float(), targets, label_smoothing=smoothing, reduction="sum")
