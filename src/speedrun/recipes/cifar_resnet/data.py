"""The cifar_resnet family's answers to the runner (recipes/family.py's Family): data, checks, the smoke test,
notes, what a checkpoint and a saved model must agree on, and the tricks `speedrun ablate` switches off. The data
is the cifar family's kind: a whole dataset in memory, from data.sources, trained from data.loader.DeviceLoader."""

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
from speedrun.recipes.cifar_resnet.config import ResnetConfig
from speedrun.recipes.cifar_resnet.model import memory_lower_bound

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


def with_epochs(cfg: ResnetConfig, epochs: float) -> ResnetConfig:
    """cfg with `epochs`; nothing else needs scaling: the lr schedule (either) and Lookahead's ramp are defined
    in fractions of the run."""
    return dataclasses.replace(cfg, epochs=epochs)


def run_steps(cfg: ResnetConfig, num_train: int) -> int:
    return steps_for(cfg.epochs, num_train, cfg.batch_size, cfg.drop_last_batch)


def epochs_for_steps(cfg: ResnetConfig, num_train: int, steps: int) -> float:
    return loader_epochs(steps, num_train, cfg.batch_size, cfg.drop_last_batch)


def smoke(cfg: ResnetConfig, data: Dataset) -> tuple[ResnetConfig, Dataset]:
    """SMOKE_STEPS steps of at most SMOKE_BATCH images, no TTA, no per-epoch evaluation, on a fixed random sample
    of SMOKE_TRAIN_IMAGES train and SMOKE_TEST_IMAGES test images (Dataset.sample; folders are class-ordered)."""
    cfg = dataclasses.replace(cfg, tta_level=0, eval_each_epoch=False, batch_size=min(cfg.batch_size, SMOKE_BATCH),
                              eval_batch_size=min(cfg.eval_batch_size, SMOKE_TEST_IMAGES))
    data = data.sample(SMOKE_TRAIN_IMAGES, SMOKE_TEST_IMAGES)
    return with_epochs(cfg, min(cfg.epochs, SMOKE_STEPS * cfg.batch_size / len(data.train_labels))), data


def notes(cfg: ResnetConfig, data: Dataset, smoke: bool = False) -> list[str]:
    steps = steps_for(cfg.epochs, len(data.train_labels), cfg.batch_size, cfg.drop_last_batch)
    views = {0: 1, 1: 2, 2: 6}[cfg.tta_level]  # forward passes per test image (tricks/tta.py)
    return run_notes(smoke=smoke, steps=steps, batch_size=cfg.batch_size, n_test=len(data.test_labels), views=views,
                     table_evaluations=math.floor(cfg.epochs) if cfg.eval_each_epoch else 0)


def check(cfg: ResnetConfig, data: Dataset, device: torch.device, world: dist.World) -> list[str]:
    """check_data, and what running under torchrun adds: the batch splits evenly, SyncBatchNorm has CUDA."""
    dist.check(cfg.batch_size, world, device, cfg.sync_bn)
    return check_data(cfg, data.image_shape, len(data.train_labels), len(data.test_labels), data.num_classes, device)


def check_data(cfg: ResnetConfig, image_shape: tuple[int, int, int], num_train: int, num_test: int,
               num_classes: int, device: torch.device | None = None) -> list[str]:
    """Refuse (ValueError) a config that cannot train on data of this shape; return warnings for odd but valid ones.
    Any image side fits the network (model.CifarResNet); the crop and the memory are what can fail."""
    c, h, w = image_shape
    side = min(h, w)
    if cfg.translate_px > side - 1:  # reflect padding must be narrower than the image (data/augment.py)
        raise ValueError(f"translate_px={cfg.translate_px} does not fit {h}x{w} images; use at most {side - 1}")
    if cfg.whiten_init and side < 3:  # the whitening filters are the stem's 3x3 patches
        raise ValueError(f"whiten_init needs images of at least 3x3 px, got {h}x{w}; use --set whiten_init=false")
    param_bytes, train_bytes, eval_bytes = memory_lower_bound(image_shape, num_classes, cfg.widths, cfg.batch_size,
                                                              min(cfg.eval_batch_size, num_test))
    # whiten_init: every 3x3 patch of the sample as a float64 row, copied out by the reshape (tricks/whitening.py)
    patch_bytes = 8 * min(cfg.whiten_images, num_train) * (h - 2) * (w - 2) * c * 9 if cfg.whiten_init else 0
    fix = ("lower batch_size, eval_batch_size, widths or whiten_images (--set batch_size=... / eval_batch_size=... / "
           "widths=... / whiten_images=...)")
    # The net is built on the host first; on an accelerator the activations live there, and its allocator reports
    # running out with an error of its own (a one-line message from the CLI), unlike the host's OOM killer.
    on_host = device is None or device.type == "cpu"
    limits.check_memory(param_bytes + (max(train_bytes, eval_bytes, patch_bytes) if on_host else 0),
                        f"this net ({cfg.widths}, batch {cfg.batch_size}, eval batch {cfg.eval_batch_size}, {h}x{w} "
                        "images)", fix)
    notes = []
    if cfg.batch_size > num_train:
        notes.append(f"batch_size {cfg.batch_size} is larger than the {num_train} training images: every step "
                     f"repeats images, and {counted(math.ceil(cfg.epochs * num_train / cfg.batch_size), 'step')} will "
                     f"not train a network; lower batch_size (--set batch_size=...)")
    return notes


def data_signature(data: Dataset) -> dict:
    """What a checkpoint must have been trained on to be resumed with this data: sizes, and a SHA-256 of every
    image and label (the same counts of other images must not pass)."""
    h = hashlib.sha256()
    for t in (data.train_images, data.train_labels, data.test_images, data.test_labels):
        h.update(t.contiguous().numpy().data)
    return {"name": data.name, "image_shape": list(data.image_shape), "num_train": len(data.train_labels),
            "num_test": len(data.test_labels), "num_classes": data.num_classes, "sha256": h.hexdigest()}


def model_card(cfg: ResnetConfig, data: Dataset) -> dict:
    """What a saved model needs besides its weights to take images and name classes (run/export.py): the training
    set's channel statistics, which the loop normalizes with, and the TTA it was scored with."""
    mean, std = channel_stats(data.train_images)
    return {"classes": list(data.classes), "image_shape": list(data.image_shape), "mean": mean.tolist(),
            "std": std.tolist(), "tta_level": cfg.tta_level}


def idle_tricks(cfg) -> list[str]:
    """None: this family trains its own network only (--model is the cifar family's)."""
    return []


# Every trick of the family as (config key, its "off" value, what it is): the one place `speedrun ablate` reads.
# Each off value is what kuangliu/pytorch-cifar's published run does instead (or, for the device-side settings,
# the plain fp32 / contiguous / eager way every family shares).
TRICKS: list[tuple[str, object, str]] = [
    ("whiten_init", False, "patch-whitening init of the stem conv (model.whiten_stem_, tricks/whitening.py)"),
    ("label_smoothing", 0.0, "label smoothing (tricks/label_smoothing.py)"),
    ("flip", "random", "alternating flip instead of random flip (data/augment.py)"),
    ("lookahead", False, "Lookahead / EMA of the weights (tricks/lookahead.py)"),
    ("tta_level", 0, "test-time augmentation (tricks/tta.py)"),
    ("lr_schedule", "step", "airbench's triangular schedule instead of the published step drops (tricks/schedule.py)"),
    ("nesterov", False, "Nesterov momentum instead of the published heavy-ball momentum"),
    ("channels_last", "off", "channels_last memory layout (speed)"),
    ("compile", False, "torch.compile (speed)"),
    ("precision", "fp32", "bf16 autocast (speed; fp32 is already the CPU's)"),
]
