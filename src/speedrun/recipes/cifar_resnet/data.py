"""The cifar_resnet family's own answers to the runner (recipes/family.py's Family): its checks of the data and the
tricks `speedrun ablate` switches off. The data is the in-memory families' kind, a whole dataset in memory trained
from data.loader.DeviceLoader; the answers given alike with the cifar family are in_memory/data.py's."""

from __future__ import annotations

import torch

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.recipes.cifar_resnet.config import ResnetConfig
from speedrun.recipes.cifar_resnet.model import memory_lower_bound
from speedrun.recipes.in_memory.data import (CHANNELS_LAST, COMPILE, FLIP, LABEL_SMOOTHING, LOOKAHEAD, TTA, batch_note,
                                             check_augmentation, check_memory)


def check(cfg: ResnetConfig, data: Dataset, device: torch.device, world: dist.World) -> list[str]:
    """check_data, and what running under torchrun adds: the batch splits evenly, SyncBatchNorm has CUDA."""
    dist.check(cfg.batch_size, world, device, cfg.sync_bn)
    return check_data(cfg, data.image_shape, len(data.train_labels), len(data.test_labels), data.num_classes, device)


def check_data(cfg: ResnetConfig, image_shape: tuple[int, int, int], num_train: int, num_test: int,
               num_classes: int, device: torch.device | None = None) -> list[str]:
    """Refuse (ValueError) a config that cannot train on data of this shape; return warnings for odd but valid ones.
    Any image side fits the network (model.CifarResNet); the crop and the memory are what can fail."""
    c, h, w = image_shape
    check_augmentation(cfg, h, w)
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
    ("whiten_init", False, "patch-whitening init of the stem conv (model.whiten_stem_, tricks/whitening.py)"),
    LABEL_SMOOTHING, FLIP, LOOKAHEAD, TTA,
    ("lr_schedule", "step", "airbench's triangular schedule instead of the published step drops (tricks/schedule.py)"),
    ("nesterov", False, "Nesterov momentum instead of the published heavy-ball momentum"),
    CHANNELS_LAST, COMPILE,
    ("precision", "fp32", "bf16 autocast (speed; fp32 is already the CPU's)"),
]
