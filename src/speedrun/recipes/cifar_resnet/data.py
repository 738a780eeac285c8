"""The cifar_resnet family's own answers to the runner (recipes/family.py's Family): its checks of the data, the
tricks that do nothing for the user's network, and the tricks `speedrun ablate` switches off. The data is the
in-memory families' kind, a whole dataset in memory trained from data.loader.DeviceLoader; the answers given alike
with the cifar family are in_memory/data.py's, and the user's network is in_memory/network.py's."""

from __future__ import annotations

import torch

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.recipes.cifar_resnet.config import ResnetConfig
from speedrun.recipes.cifar_resnet.model import memory_lower_bound
from speedrun.recipes.in_memory import network
from speedrun.recipes.in_memory.data import (CHANNELS_LAST, COMPILE, FLIP, LABEL_SMOOTHING, LOOKAHEAD, TTA, batch_note,
                                             check_augmentation, check_memory, check_run)


def check(cfg: ResnetConfig, data: Dataset, device: torch.device, world: dist.World) -> list[str]:
    """check_data, after what every in-memory family checks before a run (in_memory.data.check_run)."""
    return check_run(cfg, data, device, world, check_data, idle_tricks)


def idle_tricks(cfg: ResnetConfig, net: torch.nn.Module | None = None, in_channels: int = 3) -> list[str]:
    """The TRICKS keys that do nothing for cfg's network (in_memory.network.idle_tricks): none act inside ResNet-18
    alone; whiten_init, for the user's network whose first conv cannot be whitened."""
    return network.idle_tricks(cfg, (), ("whiten_init",), net, in_channels)


def check_data(cfg: ResnetConfig, image_shape: tuple[int, int, int], num_train: int, num_test: int,
               num_classes: int, device: torch.device | None = None) -> list[str]:
    """Refuse (ValueError) a config that cannot train on data of this shape; return warnings for odd but valid ones.
    Any image side fits the network (model.CifarResNet); the crop and the memory are what can fail."""
    c, h, w = image_shape
    check_augmentation(cfg, h, w)
    if cfg.model:  # the user's network: its shape was checked on two images (check), its size is its own
        return batch_note(cfg, num_train)
    if cfg.whiten_init and min(h, w) < 3:  # the whitening filters are the stem's 3x3 patches
        raise ValueError(f"whiten_init needs images of at least 3x3 px, got {h}x{w}; use --set whiten_init=false")
    # whiten_init: every 3x3 patch of the sample as a float64 row, copied out by the reshape (tricks/whitening.py)
    patch_bytes = 8 * min(cfg.whiten_images, num_train) * (h - 2) * (w - 2) * c * 9 if cfg.whiten_init else 0
    check_memory(cfg, image_shape, device, "lower batch_size, eval_batch_size, widths or whiten_images (--set "
                 "batch_size=... / eval_batch_size=... / widths=... / whiten_images=...)",
                 *memory_lower_bound(image_shape, num_classes, cfg.widths, cfg.batch_size,
                                     min(cfg.eval_batch_size, num_test)), patch_bytes)
    return batch_note(cfg, num_train)


# Every trick of the family as (config key, its "off" value, what it is): the one place `speedrun ablate` reads.
# Each off value is what kuangliu/pytorch-cifar's published run does instead (or, for the device-side settings,
# the plain fp32 / contiguous / eager way every family shares).
TRICKS: list[tuple[str, object, str]] = [
    ("whiten_init", False, "patch-whitening init of the stem conv, or of the user's first conv where it fits "
                           "(model.whiten_stem_, tricks/whitening.py)"),
    LABEL_SMOOTHING, FLIP, LOOKAHEAD, TTA,
    ("lr_schedule", "step", "airbench's triangular schedule instead of the published step drops (tricks/schedule.py)"),
    ("nesterov", False, "Nesterov momentum instead of the published heavy-ball momentum"),
    CHANNELS_LAST, COMPILE,
    ("precision", "fp32", "bf16 autocast (speed; fp32 is already the CPU's)"),
]
