"""The cifar family's answers to the runner (recipes/__init__.py lists the questions): data, checks, the smoke
test, notes, what a checkpoint and a saved model must agree on. The training loop is in recipes/cifar.py."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from speedrun import dist
from speedrun.data import limits
from speedrun.data.dataset import Dataset
from speedrun.data.loader import channel_stats
from speedrun.data.loader import epochs_for_steps as loader_epochs
from speedrun.data.loader import steps_for
from speedrun.data.sources import load_dataset
from speedrun.engine.loop import run_notes
from speedrun.errors import counted
from speedrun.models import custom
from speedrun.models.cifar_net import memory_lower_bound, output_side
from speedrun.recipes.cifar.config import CifarConfig
from speedrun.tricks.tta import selected_count
from speedrun.tricks.whitening import whitenable_first_conv

# --smoke: a check that the whole pipeline runs (loader, whitening, steps, evaluation, result file), in seconds on
# a 2-core CPU; its accuracy means nothing. At the recipe's batch (1024) one step of the full network takes about
# 10 s on such a CPU in fp32, so the smoke test takes smaller batches: the code path is the same at any batch.
SMOKE_STEPS = 4
SMOKE_BATCH = 32  # divides any power-of-two number of processes up to 32
SMOKE_TEST_IMAGES = 256
SMOKE_TRAIN_IMAGES = SMOKE_STEPS * SMOKE_BATCH  # a smoke test trains on these alone: one epoch of its steps


def load_data(dataset: str, *, data_dir, image_size, log, smoke: bool = False) -> Dataset:
    """smoke: only the images a smoke test uses (an image folder decodes those alone)."""
    return load_dataset(dataset, data_dir=data_dir, image_size=image_size, log=log,
                        sample=(SMOKE_TRAIN_IMAGES, SMOKE_TEST_IMAGES) if smoke else None)


def describe(data: Dataset) -> str:
    return data.describe()


def with_epochs(cfg: CifarConfig, epochs: float) -> CifarConfig:
    """cfg with `epochs`, the whitening bias's window scaled by the same factor (the lr schedule and Lookahead are
    defined in fractions of the run already)."""
    scale = epochs / cfg.epochs
    return dataclasses.replace(cfg, epochs=epochs, whiten_bias_epochs=cfg.whiten_bias_epochs * scale)


def run_steps(cfg: CifarConfig, num_train: int) -> int:
    return steps_for(cfg.epochs, num_train, cfg.batch_size, cfg.drop_last_batch)


def epochs_for_steps(cfg: CifarConfig, num_train: int, steps: int) -> float:
    return loader_epochs(steps, num_train, cfg.batch_size, cfg.drop_last_batch)


def smoke(cfg: CifarConfig, data: Dataset) -> tuple[CifarConfig, Dataset]:
    """SMOKE_STEPS steps of at most SMOKE_BATCH images, no TTA, no per-epoch evaluation, on a fixed random sample
    of SMOKE_TRAIN_IMAGES train and SMOKE_TEST_IMAGES test images (Dataset.sample; folders are class-ordered)."""
    cfg = dataclasses.replace(cfg, tta_level=0, eval_each_epoch=False, batch_size=min(cfg.batch_size, SMOKE_BATCH),
                              eval_batch_size=min(cfg.eval_batch_size, SMOKE_TEST_IMAGES))
    data = data.sample(SMOKE_TRAIN_IMAGES, SMOKE_TEST_IMAGES)
    return with_epochs(cfg, min(cfg.epochs, SMOKE_STEPS * cfg.batch_size / len(data.train_labels))), data


def notes(cfg: CifarConfig, data: Dataset, smoke: bool = False) -> list[str]:
    steps = steps_for(cfg.epochs, len(data.train_labels), cfg.batch_size, cfg.drop_last_batch)
    views: float = {0: 1, 1: 2, 2: 6}[cfg.tta_level]  # forward passes per test image (tricks/tta.py)
    if cfg.tta_level and cfg.tta_select and cfg.tta_select < 1:  # the plain pass, then the rest for the selected
        n = len(data.test_labels)
        views = round(1 + selected_count(n, cfg.tta_select) * (views - 1) / max(n, 1), 2)
    return run_notes(smoke=smoke, steps=steps, batch_size=cfg.batch_size, n_test=len(data.test_labels), views=views,
                     table_evaluations=math.floor(cfg.epochs) if cfg.eval_each_epoch else 0)


def check(cfg: CifarConfig, data: Dataset, device: torch.device, world: dist.World) -> list[str]:
    """check_data, and what running under torchrun adds: the batch splits evenly, SyncBatchNorm has CUDA. The
    user's network (cfg.model) is built and run on two images first (models/custom.py), and a note names the
    tricks that do nothing for it."""
    dist.check(cfg.batch_size, world, device, cfg.sync_bn)
    notes = []
    if cfg.model:
        net = custom.check_network(cfg.model, data.image_shape, data.num_classes)
        idle = idle_tricks(cfg, net, data.image_shape[0])
        norms = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
        momentum = (f"its {counted(norms, 'BatchNorm layer')} take{'s' if norms == 1 else ''} bn_momentum="
                    f"{cfg.bn_momentum:g}; " if norms else "")
        notes.append(f"--model {cfg.model}: {sum(p.numel() for p in net.parameters()):,} parameters; {momentum}off "
                     f"for this network (they act inside the recipe's own): {', '.join(idle)}")
    return notes + check_data(cfg, data.image_shape, len(data.train_labels), len(data.test_labels),
                              data.num_classes, device)


# Settings that act inside the recipe's own network (models/cifar_net.py): with the user's network they do nothing.
NETWORK_SETTINGS = ("dirac_init", "bn_scale_frozen", "logit_scale", "activation", "index_free_eval_pool")


def idle_tricks(cfg: CifarConfig, net: torch.nn.Module | None = None, in_channels: int = 3) -> list[str]:
    """The TRICKS keys that do nothing for cfg's network: none for the recipe's own; for the user's (cfg.model),
    those acting inside the recipe's network, and, given the network built for the data (`net`), the whitening's
    two where its first conv cannot be whitened (tricks/whitening.py). ablate asks before any data is read, so
    without the network: whiten_init is then measured, and the warning of check() says where it does nothing."""
    if not cfg.model:
        return []
    idle = list(NETWORK_SETTINGS)
    if net is not None and whitenable_first_conv(net, in_channels) is None:
        idle += ["whiten_init", "whiten_bias_epochs"]
    return idle


def data_signature(data: Dataset) -> dict:
    """What a checkpoint must have been trained on to be resumed with this data: sizes, and a SHA-256 of every
    image and label (the same counts of other images must not pass; 0.1 s for CIFAR-10's 184 MB)."""
    h = hashlib.sha256()
    for t in (data.train_images, data.train_labels, data.test_images, data.test_labels):
        h.update(t.contiguous().numpy().data)
    return {"name": data.name, "image_shape": list(data.image_shape), "num_train": len(data.train_labels),
            "num_test": len(data.test_labels), "num_classes": data.num_classes, "sha256": h.hexdigest()}


def model_card(cfg: CifarConfig, data: Dataset) -> dict:
    """What a saved model needs besides its weights to take images and name classes (run/export.py)."""
    mean, std = channel_stats(data.train_images)
    return {"classes": list(data.classes), "image_shape": list(data.image_shape), "mean": mean.tolist(),
            "std": std.tolist(), "tta_level": cfg.tta_level}


def check_data(cfg: CifarConfig, image_shape: tuple[int, int, int], num_train: int, num_test: int,
               num_classes: int, device: torch.device | None = None) -> list[str]:
    """Refuse (ValueError) a config that cannot train on data of this shape; return warnings for odd but valid ones.

    Called before any step, so that no run starts that would fail or mean nothing later.
    """
    c, h, w = image_shape
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
    for name, px, limit in (("translate_px", cfg.translate_px, side - 1), ("cutout_px", cfg.cutout_px, side),
                            ("cutmix_px", cfg.cutmix_px, side)):
        if px > limit:
            raise ValueError(f"{name}={px} does not fit {h}x{w} images; use at most {limit}")
    if cfg.model:  # the user's network: its shape was checked on two images (check), its size is its own
        return _batch_note(cfg, num_train)
    param_bytes, train_bytes, eval_bytes = memory_lower_bound(image_shape, num_classes, cfg.widths,
                                                              cfg.convs_per_group, cfg.whiten_kernel_px,
                                                              cfg.batch_size, min(cfg.eval_batch_size, num_test))
    fix = "lower batch_size, eval_batch_size or widths (--set batch_size=... / eval_batch_size=... / widths=...)"
    # The net is built on the host first; on an accelerator the activations live there, and its allocator reports
    # running out with an error of its own (a one-line message from the CLI), unlike the host's OOM killer.
    on_host = device is None or device.type == "cpu"
    limits.check_memory(param_bytes + (max(train_bytes, eval_bytes) if on_host else 0),
                        f"this net ({cfg.widths}, batch {cfg.batch_size}, eval batch {cfg.eval_batch_size}, {h}x{w} "
                        "images)", fix)
    return _batch_note(cfg, num_train)


def _batch_note(cfg: CifarConfig, num_train: int) -> list[str]:
    notes = []
    if cfg.batch_size > num_train:
        notes.append(f"batch_size {cfg.batch_size} is larger than the {num_train} training images: every step "
                     f"repeats images, and {counted(math.ceil(cfg.epochs * num_train / cfg.batch_size), 'step')} will "
                     f"not train a network; lower batch_size (--set batch_size=...)")
    return notes


# Every trick of the family as (config key, its "off" value, what it is): the one place `speedrun ablate` reads.
# Each off value is the plain alternative the trick replaced (Page's ResNet-9 posts; airbench, arXiv 2404.00498).
TRICKS: list[tuple[str, object, str]] = [
    ("whiten_init", False, "patch-whitening init of the first conv (tricks/whitening.py)"),
    ("whiten_bias_epochs", 0.0, "the whitening conv's bias learns for the first epochs"),
    ("dirac_init", False, "identity init of the 3x3 convs (tricks/identity_init.py)"),
    ("bn_scale_frozen", False, "BatchNorm scales frozen at 1"),
    ("logit_scale", 1.0, "scaled logits"),
    ("label_smoothing", 0.0, "label smoothing (tricks/label_smoothing.py)"),
    ("lookahead", False, "Lookahead / EMA of the weights (tricks/lookahead.py)"),
    ("flip", "random", "alternating flip instead of random flip (data/augment.py)"),
    ("translate_px", 0, "random translation"),
    ("cutout_px", 0, "cutout"),
    ("tta_level", 0, "test-time augmentation (tricks/tta.py)"),
    # Hiverge's 2025 record (hiverge/cifar10-speedrun README), each against what airbench94_muon does instead.
    ("tta_select", 0.0, "TTA only for the least confident test images, not all (tricks/tta.py; speed)"),
    ("activation", "gelu", "SiLU (or another activation) instead of GELU (models/cifar_net.py)"),
    ("whiten_method", "eigh", "whitening basis by SVD instead of eigh (tricks/whitening.py)"),
    ("jitter_brightness", 0.0, "brightness jitter (tricks/color_jitter.py)"),
    ("jitter_contrast", 0.0, "contrast jitter (tricks/color_jitter.py)"),
    ("muon_ns_batched", False, "Newton-Schulz batched over all filter banks (tricks/muon.py; speed)"),
    ("muon_renorm_every_steps", 1, "Muon's renormalization every K steps, not every step (tricks/muon.py; speed)"),
    ("channels_last", "off", "channels_last memory layout (speed)"),
    ("compile", False, "torch.compile (speed)"),
    ("precision", "fp32", "bf16 autocast (speed; on a CPU too where it has native bf16)"),
    # The lean step (airbench's step count and half weights; tricks/pooling.py and Muon's compiled iteration)
    ("drop_last_batch", False, "each epoch's last partial batch dropped (data/loader.py; 476 steps, not 484)"),
    ("half_weights", "off", "weights and momentum in 16 bits, BatchNorm in fp32, no autocast (speed, CUDA)"),
    ("index_free_eval_pool", False, "max pooling without indices in evaluation (tricks/pooling.py; speed)"),
    ("muon_ns_compile", False, "Newton-Schulz compiled (tricks/muon.py; speed)"),
]
