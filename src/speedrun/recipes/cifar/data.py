"""The cifar family's own answers to the runner (recipes/family.py's Family): its checks of the data (the network's
shape and memory, the user's network), the tricks that do nothing for the user's network, and the tricks `speedrun
ablate` switches off. The answers it gives alike with the other in-memory families are in_memory/data.py's."""

from __future__ import annotations

import torch

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.models.cifar_net import memory_lower_bound, output_side
from speedrun.recipes.cifar.config import CifarConfig
from speedrun.recipes.in_memory import network
from speedrun.recipes.in_memory.data import (CHANNELS_LAST, COMPILE, FLIP, LABEL_SMOOTHING, LOOKAHEAD, TTA, batch_note,
                                             check_augmentation, check_memory, check_run)


def check(cfg: CifarConfig, data: Dataset, device: torch.device, world: dist.World) -> list[str]:
    """check_data, after what every in-memory family checks before a run (in_memory.data.check_run: torchrun's
    needs; the user's network, cfg.model, run on two images, and a note naming the tricks that do nothing for it)."""
    return check_run(cfg, data, device, world, check_data, idle_tricks)


# Settings that act inside the recipe's own network (models/cifar_net.py): with the user's network they do nothing.
NETWORK_SETTINGS = ("dirac_init", "bn_scale_frozen", "logit_scale", "activation", "index_free_eval_pool")
WHITENING = ("whiten_init", "whiten_bias_epochs")  # nothing to do where the user's first conv cannot be whitened


def idle_tricks(cfg: CifarConfig, net: torch.nn.Module | None = None, in_channels: int = 3) -> list[str]:
    """The TRICKS keys that do nothing for cfg's network (in_memory.network.idle_tricks): none for the recipe's own;
    for the user's, NETWORK_SETTINGS, and the whitening's two where its first conv cannot be whitened."""
    return network.idle_tricks(cfg, NETWORK_SETTINGS, WHITENING, net, in_channels)


def check_data(cfg: CifarConfig, image_shape: tuple[int, int, int], num_train: int, num_test: int,
               num_classes: int, device: torch.device | None = None) -> list[str]:
    """Refuse (ValueError) a config that cannot train on data of this shape; return warnings for odd but valid ones.

    Called before any step, so that no run starts that would fail or mean nothing later.
    """
    _, h, w = image_shape
    side = min(h, w)
    if not cfg.model and output_side(side, cfg.widths, cfg.whiten_kernel_px) < 1:
        fits = [n for n in range(1, len(cfg.widths) + 1)
                if output_side(side, cfg.widths[:n], cfg.whiten_kernel_px) >= 1]
        need = 2 ** len(cfg.widths) + cfg.whiten_kernel_px - 1  # the smallest side these groups leave 1 px of
        fix = (f"use at most {max(fits)} widths (--set widths=...) or images of at least {need} px" if fits else
               f"use images of at least {need} px")
        raise ValueError(
            f"{h}x{w} images are too small for {len(cfg.widths)} groups: the whitening conv ({cfg.whiten_kernel_px} "
            f"px) and {len(cfg.widths)} 2x2 pools leave nothing; {fix} (image_size / --image-size for image "
            "folders)")
    check_augmentation(cfg, h, w)
    if cfg.model:  # the user's network: its shape was checked on two images (check), its size is its own
        return batch_note(cfg, num_train)
    check_memory(cfg, image_shape, device, "lower batch_size, eval_batch_size or widths (--set batch_size=... / "
                 "eval_batch_size=... / widths=...)",
                 *memory_lower_bound(image_shape, num_classes, cfg.widths, cfg.convs_per_group, cfg.whiten_kernel_px,
                                     cfg.batch_size, min(cfg.eval_batch_size, num_test)))
    return batch_note(cfg, num_train)


# Every trick of the family as (config key, its "off" value, what it is): the one place `speedrun ablate` reads.
# Each off value is the plain alternative the trick replaced (Page's ResNet-9 posts; airbench, arXiv 2404.00498).
TRICKS: list[tuple[str, object, str]] = [
    ("whiten_init", False, "patch-whitening init of the first conv (tricks/whitening.py)"),
    ("whiten_bias_epochs", 0.0, "the whitening conv's bias learns for the first epochs"),
    ("dirac_init", False, "identity init of the 3x3 convs (tricks/identity_init.py)"),
    ("bn_scale_frozen", False, "BatchNorm scales frozen at 1"),
    ("logit_scale", 1.0, "scaled logits"),
    LABEL_SMOOTHING, LOOKAHEAD, FLIP,
    ("translate_px", 0, "random translation"),
    ("cutout_px", 0, "cutout"),
    TTA,
    # Hiverge's 2025 record (hiverge/cifar10-speedrun README), each against what airbench94_muon does instead.
    ("tta_select", 0.0, "TTA only for the least confident test images, not all (tricks/tta.py; speed)"),
    ("activation", "gelu", "SiLU (or another activation) instead of GELU (models/cifar_net.py)"),
    ("whiten_method", "eigh", "whitening basis by SVD instead of eigh (tricks/whitening.py)"),
    ("jitter_brightness", 0.0, "brightness jitter (tricks/color_jitter.py)"),
    ("jitter_contrast", 0.0, "contrast jitter (tricks/color_jitter.py)"),
    ("muon_ns_batched", False, "Newton-Schulz batched over all filter banks (tricks/muon.py; speed)"),
    ("muon_renorm_every_steps", 1, "Muon's renormalization every K steps, not every step (tricks/muon.py; speed)"),
    CHANNELS_LAST, COMPILE,
    ("precision", "fp32", "bf16 autocast (speed; on a CPU too where it has native bf16)"),
    # The lean step (airbench's step count and half weights; tricks/pooling.py and Muon's compiled iteration)
    ("drop_last_batch", False, "each epoch's last partial batch dropped (data/loader.py; 476 steps, not 484)"),
    ("half_weights", "off", "weights and momentum in 16 bits, BatchNorm in fp32, no autocast (speed, CUDA)"),
    ("index_free_eval_pool", False, "max pooling without indices in evaluation (tricks/pooling.py; speed)"),
    ("muon_ns_compile", False, "Newton-Schulz compiled (tricks/muon.py; speed)"),
]
