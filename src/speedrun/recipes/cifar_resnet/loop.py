"""The cifar_resnet family's network and optimizer, and what it adds to the shared in-memory run (in_memory/loop.py,
whose loop a run of this family is): SGD on every parameter, the published step schedule beside airbench's
triangle, patch whitening of the stem (model.whiten_stem_) or of the user's first conv, and the mean loss over the
global batch. The user's network (--model) is built as every in-memory family builds it (in_memory/network.py).

The loss each process differentiates is its share's summed cross-entropy divided by the global batch, so the
gradients dist.py sums over processes are those of the mean loss over the global batch: lr and weight_decay are
PyTorch's, as kuangliu/pytorch-cifar states them, at any number of processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.engine.flops import RunFlops
from speedrun.recipes.cifar_resnet.config import ResnetConfig
from speedrun.recipes.cifar_resnet.model import CifarResNet, whiten_stem_
from speedrun.recipes.in_memory import loop as in_memory
from speedrun.recipes.in_memory.data import flops_of
from speedrun.recipes.in_memory.network import user_network
from speedrun.tricks.optimizer_kernel import optimizer_kernel_kwargs
from speedrun.tricks.schedule import triangle
from speedrun.tricks.whitening import patch_whitening_init_, whitenable_first_conv


def build_model(cfg: ResnetConfig, in_channels: int, num_classes: int, image_px: int | None = None) -> nn.Module:
    """ResNet-18 (model.py), or the user's network (cfg.model: in_memory.network.user_network), its BatchNorm at
    the builder's momentum as ResNet-18's is at PyTorch's default."""
    if cfg.model:
        return user_network(cfg, in_channels, num_classes, image_px)
    return CifarResNet(in_channels, num_classes, cfg.widths)


def flops(cfg: ResnetConfig, data: Dataset) -> RunFlops:
    """What one run computes (in_memory.data.flops_of), the network counted on the meta device."""
    return flops_of(cfg, data, build_model)


def build_optimizers(cfg: ResnetConfig, model: nn.Module) -> list[torch.optim.Optimizer]:
    """One SGD over every parameter with the same weight decay, as kuangliu/pytorch-cifar (BN and biases
    included), the schedule's base lr kept in "initial_lr"."""
    return in_memory.with_initial_lr(torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
        **optimizer_kernel_kwargs(cfg.optimizer_kernel)))


def lr_mult(cfg: ResnetConfig, step: int, total_steps: int) -> float:
    """The lr multiplier at `step`: airbench's triangle, or the published step schedule (x lr_drop_factor at each
    drop, the drops at fractions of the run as 150 and 250 are of 350 epochs)."""
    if cfg.lr_schedule == "triangle":
        return triangle(step, total_steps, cfg.lr_start_mult, cfg.lr_peak_frac, cfg.lr_end_mult)
    drops = sum(step >= frac * total_steps for frac in (cfg.lr_drop1_frac, cfg.lr_drop2_frac))
    return cfg.lr_drop_factor ** drops


class ResnetHooks(in_memory.Hooks[ResnetConfig, in_memory.TrainState]):
    """ResNet-18, or the user's network, in the shared run: its optimizer and schedule and the stem's whitening (its
    step, the shared one on the mean loss: ResnetConfig.MEAN_LOSS)."""

    state_type = in_memory.TrainState

    def build(self, data: Dataset) -> nn.Module:
        self.in_channels = data.image_shape[0]
        return build_model(self.cfg, self.in_channels, data.num_classes, data.image_shape[1])

    def optimizers(self, model: nn.Module) -> list[torch.optim.Optimizer]:
        return build_optimizers(self.cfg, model)

    def lr_setting(self) -> tuple[str, float]:
        return "lr", self.cfg.lr

    def lr_mult(self, step: int, total_steps: int) -> float:
        return lr_mult(self.cfg, step, total_steps)

    def whiten(self, model: nn.Module, sample: Callable[[], torch.Tensor]) -> None:
        """The stem's whitening (model.whiten_stem_), or the user's first conv's where it has the whitening's shape
        (tricks/whitening.py); trained from there on, as the stem."""
        if not self.cfg.model:
            whiten_stem_(cast(CifarResNet, model).stem, sample(), self.cfg.whiten_eps)  # build's network, prepared
        elif (conv := whitenable_first_conv(model, self.in_channels)) is not None:
            patch_whitening_init_(conv, sample(), self.cfg.whiten_eps)


# train_run(cfg, data, device, seed, *, shuffle_labels, world, hooks, resume): one run of the shared loop
# (in_memory.loop.train_run) with ResnetHooks
train_run = in_memory.FamilyRun(ResnetHooks).train_run


def warmup(cfg: ResnetConfig, data: Dataset, device: torch.device, world: dist.World | None = None) -> float:
    """An untimed run of this module's train_run on shuffled labels before the timed ones (in_memory.loop.warmup);
    its seconds."""
    return in_memory.warmup(train_run, cfg, data, device, world)
