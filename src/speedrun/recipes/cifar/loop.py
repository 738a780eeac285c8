"""The cifar family's network and optimizers, and what it adds to the shared in-memory run (in_memory/loop.py,
whose loop a run of this family is): the whitening conv, frozen, and its bias's learning window; Muon; the
brightness/contrast jitter; the summed loss with lrs per 1024 examples (airbench's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.data.loader import DeviceLoader
from speedrun.engine.flops import RunFlops
from speedrun.engine.system import System
from speedrun.models import CifarNet
from speedrun.recipes.cifar.config import CifarConfig
from speedrun.recipes.in_memory import loop as in_memory
from speedrun.recipes.in_memory.data import flops_of
from speedrun.recipes.in_memory.loop import Amp, Hooks, train_step, with_initial_lr
from speedrun.recipes.in_memory.network import user_network
from speedrun.tricks.color_jitter import JitterTable
from speedrun.tricks.decoupled_sgd import decoupled_sgd
from speedrun.tricks.muon import Muon
from speedrun.tricks.optimizer_kernel import optimizer_kernel_kwargs
from speedrun.tricks.whitening import patch_whitening_init_, whitenable_first_conv


def build_model(cfg: CifarConfig, in_channels: int, num_classes: int, image_px: int | None = None) -> nn.Module:
    """The recipe's network, or the user's (cfg.model: in_memory.network.user_network), which needs the images'
    side."""
    if cfg.model:
        return user_network(cfg, in_channels, num_classes, image_px)
    return CifarNet(in_channels, num_classes, cfg.widths, cfg.convs_per_group, cfg.whiten_kernel_px, cfg.bn_momentum,
                    cfg.bn_eps, cfg.bn_scale_frozen, cfg.dirac_init, cfg.logit_scale, cfg.activation,
                    cfg.index_free_eval_pool)


def whitening_conv(cfg: CifarConfig, model: nn.Module, in_channels: int) -> nn.Conv2d | None:
    """The conv patch whitening initializes: the recipe's `whiten`, or the user's network's first conv where it has
    the whitening's shape (tricks/whitening.py); None where it has not: whiten_init and whiten_bias_epochs then do
    nothing (data.idle_tricks says so)."""
    return whitenable_first_conv(model, in_channels) if cfg.model else cast(CifarNet, model).whiten


def flops(cfg: CifarConfig, data: Dataset) -> RunFlops:
    """What one run computes (in_memory.data.flops_of), the network counted on the meta device."""
    return flops_of(cfg, data, build_model)


def _parameter_groups(cfg: CifarConfig, model: nn.Module, whiten: nn.Conv2d | None) -> tuple[list, list, list, list]:
    """(whitening bias, norms, filters, head): the recipe's network by its parts' names; the user's by shape (the
    bias lr multiplier's parameters are those of fewer than 2 dimensions, biases and norms, as BatchNorm's in the
    recipe's; Muon takes the conv filters, 4-dimensional; the rest, linear layers and embeddings, the head's lr)."""
    if not cfg.model:  # the recipe's own network: build_model made a CifarNet
        net = cast(CifarNet, model)
        return ([net.whiten.bias], [p for n, p in model.named_parameters() if "norms" in n and p.requires_grad],
                [p for n, p in model.named_parameters() if "convs" in n], [net.head.weight])
    first = [] if whiten is None or whiten.bias is None else [whiten.bias]
    taken = {id(p) for p in first}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return (first, [p for p in rest if p.dim() < 2], [p for p in rest if p.dim() == 4],
            [p for p in rest if p.dim() in (2, 3) or p.dim() > 4])


def build_optimizers(cfg: CifarConfig, model: nn.Module, in_channels: int = 3) -> list[torch.optim.Optimizer]:
    """Parameter groups as airbench. SGD (airbench94): BN parameters get the bias lr multiplier; the whitening
    bias, conv filters and head the base lr. Muon (airbench94_muon): Muon on the conv filters; SGD with one lr
    for the whitening and BN biases and another for the head. The user's network: by shape (_parameter_groups)."""
    whiten_bias, norms, filters, head = _parameter_groups(cfg, model, whitening_conv(cfg, model, in_channels))
    if cfg.optimizer == "sgd":
        return [decoupled_sgd([{"params": norms, "lr_mult": cfg.bias_lr_mult},
                               {"params": whiten_bias + filters + head, "lr_mult": 1.0}],
                              lr_per_1024=cfg.lr_per_1024, weight_decay_per_1024=cfg.weight_decay_per_1024,
                              momentum=cfg.momentum, batch_size=cfg.batch_size,
                              kernel=optimizer_kernel_kwargs(cfg.optimizer_kernel))]
    wd = cfg.muon_weight_decay_per_example * cfg.batch_size
    biases = whiten_bias + norms
    sgd = torch.optim.SGD([{"params": biases, "lr": cfg.muon_bias_lr, "weight_decay": wd / cfg.muon_bias_lr},
                           {"params": head, "lr": cfg.muon_head_lr, "weight_decay": wd / cfg.muon_head_lr}],
                          momentum=cfg.momentum, nesterov=True, **optimizer_kernel_kwargs(cfg.optimizer_kernel))
    muon = Muon(filters, lr=cfg.muon_lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps, batched=cfg.muon_ns_batched,
                renorm_every_steps=cfg.muon_renorm_every_steps, compiled=cfg.muon_ns_compile)
    return with_initial_lr(sgd, muon)


@dataclass
class TrainState(in_memory.TrainState):
    """The shared training state (in_memory.loop.TrainState: the model, its optimizers, Lookahead's slow weights,
    the loop's bookkeeping) and the whitening bias's frozen flag."""

    whiten_bias_frozen: bool = False  # the whitening bias stopped learning (cfg.whiten_bias_epochs)

    def own_state(self) -> dict[str, Any]:
        return {"whiten_bias_frozen": self.whiten_bias_frozen}

    def load_own_state(self, state: dict[str, Any]) -> None:
        if type(state["whiten_bias_frozen"]) is not bool:
            raise ValueError("the whitening bias's frozen flag is not true or false")
        self.whiten_bias_frozen = state["whiten_bias_frozen"]


class CifarHooks(Hooks[CifarConfig, TrainState]):
    """The cifar family in the shared run: its network (the recipe's or the user's) with the whitening conv frozen,
    its optimizers (SGD, or Muon and SGD) and the tricks the shared loop does not know."""

    state_type = TrainState

    def build(self, data: Dataset) -> nn.Module:
        self.in_channels = data.image_shape[0]
        net = build_model(self.cfg, self.in_channels, data.num_classes, data.image_shape[1])
        self.conv = whitening_conv(self.cfg, net, self.in_channels)
        if self.conv is not None and self.cfg.whiten_init:  # frozen as the recipe's own (models/cifar_net.py)
            self.conv.weight.requires_grad_(False)
        self.jitter: JitterTable | None = None
        return net

    def optimizers(self, model: nn.Module) -> list[torch.optim.Optimizer]:
        return build_optimizers(self.cfg, model, self.in_channels)

    def lr_setting(self) -> tuple[str, float]:
        return ("lr_per_1024", self.cfg.lr_per_1024) if self.cfg.optimizer == "sgd" else ("muon_lr", self.cfg.muon_lr)

    def whiten(self, model: nn.Module, sample: Callable[[], torch.Tensor]) -> None:
        if self.conv is not None:
            patch_whitening_init_(self.conv, sample(), self.cfg.whiten_eps, self.cfg.whiten_method)

    def ready(self, state: TrainState, loader: DeviceLoader, system: System) -> None:
        """The whitening bias learns unless its window closed before a resume; the jitter's table is drawn."""
        # the prepared network's bias (a move to another device may have made new parameters); the user's first conv
        # may have none
        self.whiten_bias = None if self.conv is None else self.conv.bias
        if self.whiten_bias is not None:
            self.whiten_bias.requires_grad_(not state.whiten_bias_frozen)
        cfg = self.cfg
        if cfg.jitter_brightness or cfg.jitter_contrast:
            self.jitter = JitterTable(seed=loader.seed, steps=loader.steps, batch_size=cfg.batch_size,
                                      brightness=cfg.jitter_brightness, contrast=cfg.jitter_contrast,
                                      std=loader.normalization.std, device=loader.device, dtype=system.dtype,
                                      share=loader.share)

    def before_step(self, state: TrainState, epoch: float) -> bool:
        """The whitening bias stops learning after whiten_bias_epochs: True at that step, where it has one."""
        if state.whiten_bias_frozen or epoch < self.cfg.whiten_bias_epochs:
            return False
        state.whiten_bias_frozen = True
        if self.whiten_bias is None:
            return False
        self.whiten_bias.requires_grad_(False)
        return True

    def step(self, forward: nn.Module, state: TrainState, inputs: torch.Tensor, targets: torch.Tensor,
             amp: Amp) -> tuple[torch.Tensor, torch.Tensor]:
        """The brightness/contrast jitter (tricks/color_jitter.py), then train_step on the summed loss (airbench's;
        this module's name for it, which benchmarks/step_time.py times)."""
        if self.jitter is not None:
            inputs = self.jitter(inputs, state.step)
        return train_step(forward, state.optimizers, inputs, targets, self.cfg.label_smoothing, amp)


# train_run(cfg, data, device, seed, *, shuffle_labels, world, hooks, resume): one run of the shared loop
# (in_memory.loop.train_run) with CifarHooks
train_run = in_memory.FamilyRun(CifarHooks).train_run


def warmup(cfg: CifarConfig, data: Dataset, device: torch.device, world: dist.World | None = None) -> float:
    """An untimed run of this module's train_run on shuffled labels before the timed ones (in_memory.loop.warmup);
    its seconds."""
    return in_memory.warmup(train_run, cfg, data, device, world)
