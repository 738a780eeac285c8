"""Nesterov SGD with lr and weight decay expressed "per 1024 examples", decoupled from momentum and batch size
(Page, "How to train your ResNet" part 5; airbench's hyperparameter convention).

What: with a summed loss, Nesterov momentum mu multiplies the average step by 1 + 1/(1 - mu). So the lr a user
states, `lr_per_1024`, becomes PyTorch's lr = lr_per_1024 / (1024 * (1 + 1/(1 - mu))). Weight decay is meant
as a per-step shrink of wd_per_1024 * batch / (1024 * (1 + 1/(1 - mu))); PyTorch applies lr * weight_decay per
step, so it is given weight_decay = shrink / lr, which keeps the shrink independent of the lr and of a group's
lr multiplier (it still follows the lr schedule, which scales lr).
Why: each hyperparameter can then be tuned on its own; changing momentum or batch keeps the step size.
Suggested: airbench94 lr 11.5, wd 0.0153, momentum 0.85, BN-bias lr x64.
"""

from __future__ import annotations

import torch


def decoupled_sgd(groups: list[dict], *, lr_per_1024: float, weight_decay_per_1024: float, momentum: float,
                  batch_size: int, kernel: dict | None = None) -> torch.optim.SGD:
    """groups: [{"params": [...], "lr_mult": float}, ...]. Each group keeps its base lr in "initial_lr".
    kernel: torch.optim.SGD's implementation keywords (tricks/optimizer_kernel.py)."""
    scale = 1024 * (1 + 1 / (1 - momentum))
    lr = lr_per_1024 / scale
    decay_per_step = weight_decay_per_1024 * batch_size / scale
    param_groups = []
    for g in groups:
        group_lr = lr * g["lr_mult"]
        param_groups.append({"params": g["params"], "lr": group_lr, "initial_lr": group_lr,
                             "weight_decay": decay_per_step / group_lr})
    return torch.optim.SGD(param_groups, momentum=momentum, nesterov=True, **(kernel or {}))
