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
        # torch holds lr and weight_decay as float32 in its step: 0 here divides by zero, and a shrink over an lr
        # near 0 passes float32's 3.4e38 (a RuntimeError mid-step). The recipe's config refuses such settings first.
        if not (group_lr > 0 and decay_per_step / group_lr <= 3.4e38):
            raise ValueError(f"lr_per_1024={lr_per_1024:g} with an lr multiplier of {g['lr_mult']:g} and momentum "
                             f"{momentum:g} gives the lr {group_lr:g}, too small for float32 weight decay over lr; "
                             "give lr_per_1024 and the multiplier in [1e-06, 10000]")
        param_groups.append({"params": g["params"], "lr": group_lr, "initial_lr": group_lr,
                             "weight_decay": decay_per_step / group_lr})
    return torch.optim.SGD(param_groups, momentum=momentum, nesterov=True, **(kernel or {}))
