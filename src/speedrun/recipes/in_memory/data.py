"""The answers to the runner (recipes/family.py's Family) that the in-memory families give alike: the data (a whole
dataset in memory, from data.sources), its description and signature, step counts, the smoke test, the notes
before a run, a saved model's card and the FLOPs of a run; the check before a run, around each family's data checks,
and the parts of those that are alike (the augmentations' fit, the memory, the batch against the data)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from speedrun import dist
from speedrun.data import limits
from speedrun.data.dataset import Dataset
from speedrun.data.loader import channel_stats
from speedrun.data.loader import epochs_for_steps as loader_epochs
from speedrun.data.loader import steps_for
from speedrun.data.sources import load_dataset
from speedrun.engine import flops as run_flops
from speedrun.engine.flops import RunFlops
from speedrun.engine.loop import run_notes
from speedrun.errors import counted
from speedrun.recipes.in_memory import network
from speedrun.recipes.in_memory.config import C, InMemoryConfig
from speedrun.tricks.tta import selected_count

# --smoke: a check that the whole pipeline runs (loader, whitening, steps, evaluation, result file), in seconds on
# a 2-core CPU; its accuracy means nothing. At cifar10-94's batch (1024) one step of its network takes about 10 s
# on such a CPU in fp32, so the smoke test takes smaller batches: the code path is the same at any batch.
SMOKE_STEPS = 4
SMOKE_BATCH = 32  # divides any power-of-two number of processes up to 32
SMOKE_TEST_IMAGES = 256
SMOKE_TRAIN_IMAGES = SMOKE_STEPS * SMOKE_BATCH  # a smoke test trains on these alone: one epoch of its steps


# The tricks of every in-memory family as entries of a family's TRICKS (config key, its "off" value, what it is), the
# list `speedrun ablate` reads: each family places them in its own list.
LABEL_SMOOTHING = ("label_smoothing", 0.0, "label smoothing (tricks/label_smoothing.py)")
FLIP = ("flip", "random", "alternating flip instead of random flip (data/augment.py)")
LOOKAHEAD = ("lookahead", False, "Lookahead / EMA of the weights (tricks/lookahead.py)")
TTA = ("tta_level", 0, "test-time augmentation (tricks/tta.py)")
CHANNELS_LAST = ("channels_last", "off", "channels_last memory layout (speed)")
COMPILE = ("compile", False, "torch.compile (speed)")


def load_data(dataset: str, *, data_dir, image_size, log, smoke: bool = False) -> Dataset:
    """smoke: only the images a smoke test uses (an image folder decodes those alone)."""
    return load_dataset(dataset, data_dir=data_dir, image_size=image_size, log=log,
                        sample=(SMOKE_TRAIN_IMAGES, SMOKE_TEST_IMAGES) if smoke else None)


def describe(data: Dataset) -> str:
    return data.describe()


def with_epochs(cfg: C, epochs: float) -> C:
    """cfg with `epochs`, whatever else its family scales with them (InMemoryConfig.with_epochs)."""
    return cfg.with_epochs(epochs)


def run_steps(cfg: InMemoryConfig, num_train: int) -> int:
    return steps_for(cfg.epochs, num_train, cfg.batch_size, cfg.drop_last_batch)


def epochs_for_steps(cfg: InMemoryConfig, num_train: int, steps: int) -> float:
    return loader_epochs(steps, num_train, cfg.batch_size, cfg.drop_last_batch)


def smoke(cfg: C, data: Dataset) -> tuple[C, Dataset]:
    """SMOKE_STEPS steps of at most SMOKE_BATCH images, no TTA, no per-epoch evaluation, on a fixed random sample
    of SMOKE_TRAIN_IMAGES train and SMOKE_TEST_IMAGES test images (Dataset.sample; folders are class-ordered)."""
    cfg = dataclasses.replace(cfg, tta_level=0, eval_each_epoch=False, batch_size=min(cfg.batch_size, SMOKE_BATCH),
                              eval_batch_size=min(cfg.eval_batch_size, SMOKE_TEST_IMAGES))
    data = data.sample(SMOKE_TRAIN_IMAGES, SMOKE_TEST_IMAGES)
    return cfg.with_epochs(min(cfg.epochs, SMOKE_STEPS * cfg.batch_size / len(data.train_labels))), data


def notes(cfg: InMemoryConfig, data: Dataset, smoke: bool = False) -> list[str]:
    steps = steps_for(cfg.epochs, len(data.train_labels), cfg.batch_size, cfg.drop_last_batch)
    views: float = {0: 1, 1: 2, 2: 6}[cfg.tta_level]  # forward passes per test image (tricks/tta.py)
    share = cfg.tta_fraction()
    if cfg.tta_level and share and share < 1:  # the plain pass, then the rest for the selected
        n = len(data.test_labels)
        views = round(1 + selected_count(n, share) * (views - 1) / max(n, 1), 2)
    return run_notes(smoke=smoke, steps=steps, batch_size=cfg.batch_size, n_test=len(data.test_labels), views=views,
                     table_evaluations=math.floor(cfg.epochs) if cfg.eval_each_epoch else 0)


def own_data(named: str, dataset: str, data: Dataset) -> bool:
    """The published data set `named` (cifar10): loaded by that name, downloaded with its published checksums or
    a --data-dir copy that matches them (not Dataset.unofficial). A folder or archive given by its path is not:
    nothing checks it against the published files, and a re-encoded copy (JPEG) scores points below them."""
    return bool(named) and dataset.strip().lower() == named.lower() and not data.unofficial


def data_signature(data: Dataset) -> dict:
    """What a checkpoint must have been trained on to be resumed with this data: sizes, and a SHA-256 of every
    image and label (the same counts of other images must not pass; 0.1 s for CIFAR-10's 184 MB)."""
    h = hashlib.sha256()
    for t in (data.train_images, data.train_labels, data.test_images, data.test_labels):
        h.update(t.contiguous().numpy().data)
    return {"name": data.name, "image_shape": list(data.image_shape), "num_train": len(data.train_labels),
            "num_test": len(data.test_labels), "num_classes": data.num_classes, "sha256": h.hexdigest()}


def model_card(cfg: InMemoryConfig, data: Dataset) -> dict:
    """What a saved model needs besides its weights to take images and name classes (run/export.py): the training
    set's channel statistics, which the loop standardizes with, and the TTA it was scored with."""
    mean, std = channel_stats(data.train_images)
    return {"classes": list(data.classes), "image_shape": list(data.image_shape), "mean": mean.tolist(),
            "std": std.tolist(), "tta_level": cfg.tta_level}


def flops_of(cfg: C, data: Dataset, build_model: Callable[[C, int, int, int], nn.Module]) -> RunFlops:
    """What one run of the family's network (build_model(cfg, in_channels, num_classes, image_px), built on the meta
    device) computes (engine/flops.py): every step's batch forward and backward, and the final evaluation; with
    selective TTA, the plain pass for every image and the other views for the selected ones (tricks/tta.py)."""
    c, side = data.image_shape[0], data.image_shape[1]
    try:
        model = run_flops.on_meta(lambda: build_model(cfg, c, data.num_classes, side))
    except Exception as e:  # the user's code may not build on the meta device: the run goes on without a count
        if not cfg.model:
            raise
        raise ValueError(f"--model {cfg.model} does not build on the meta device ({type(e).__name__})") from None
    run = run_flops.in_memory_run(model, data.image_shape, cfg.batch_size, run_steps(cfg, data.num_train),
                                  len(data.test_labels), cfg.tta_level)
    share = cfg.tta_fraction()
    if not (cfg.tta_level and share and share < 1):
        return run
    n = len(data.test_labels)
    plain = run_flops.evaluation(model, data.image_shape, n, 0)
    views = (run.evaluation - plain) * selected_count(n, share) // n if n else 0
    return dataclasses.replace(run, evaluation=plain + views,
                               counted=f"{run.counted}; the views beyond the plain pass for "
                                       f"{selected_count(n, share):,} of the {n:,} test images (tta_select)")


# A family's check_data(cfg, image_shape, num_train, num_test, num_classes, device): its refusals and warnings
CheckData = Callable[[C, tuple[int, int, int], int, int, int, torch.device], list[str]]


def check_run(cfg: C, data: Dataset, device: torch.device, world: dist.World, check_data: CheckData[C],
              idle_tricks: Callable[[C, nn.Module, int], list[str]]) -> list[str]:
    """A family's check before a run: what running under torchrun needs (the batch splits evenly, SyncBatchNorm has
    CUDA); the user's network (cfg.model) built and run on two images, and its note naming the tricks that do
    nothing for it (network.notes; idle_tricks(cfg, net, in_channels)); then the family's check_data."""
    dist.check(cfg.batch_size, world, device, cfg.sync_bn)
    c = data.image_shape[0]
    return network.notes(cfg, data, lambda net: idle_tricks(cfg, net, c)) + check_data(
        cfg, data.image_shape, len(data.train_labels), len(data.test_labels), data.num_classes, device)


def check_augmentation(cfg: InMemoryConfig, h: int, w: int) -> None:
    """Refuse (ValueError) an augmentation that does not fit h x w images: reflect padding narrower than the
    image, the cutout and cutmix squares inside it (data/augment.py)."""
    aug, side = cfg.augmentation(), min(h, w)
    for name, px, limit in (("translate_px", aug.translate_px, side - 1), ("cutout_px", aug.cutout_px, side),
                            ("cutmix_px", aug.cutmix_px, side)):
        if px > limit:
            raise ValueError(f"{name}={px} does not fit {h}x{w} images; use at most {limit}")


def check_memory(cfg: InMemoryConfig, image_shape: tuple[int, int, int], device: torch.device | None, fix: str,
                 param_bytes: int, *work_bytes: int) -> None:
    """Refuse (limits.check_memory) a network whose parameters, and on the host the largest of its working sets
    (activations of a training or an evaluation batch, the whitening's patches), cannot fit; fix: what to lower."""
    # The net is built on the host first; on an accelerator the activations live there, and its allocator reports
    # running out with an error of its own (a one-line message from the CLI), unlike the host's OOM killer.
    on_host = device is None or device.type == "cpu"
    limits.check_memory(param_bytes + (max(work_bytes) if on_host else 0),
                        f"this net ({cfg.widths}, batch {cfg.batch_size}, eval batch {cfg.eval_batch_size}, "
                        f"{image_shape[1]}x{image_shape[2]} images)", fix)


def batch_note(cfg: InMemoryConfig, num_train: int) -> list[str]:
    """A warning when a batch is larger than the training set (every step repeats images)."""
    if cfg.batch_size <= num_train:
        return []
    return [f"batch_size {cfg.batch_size} is larger than the {num_train} training images: every step repeats "
            f"images, and {counted(math.ceil(cfg.epochs * num_train / cfg.batch_size), 'step')} will not train a "
            "network; lower batch_size (--set batch_size=...)"]
