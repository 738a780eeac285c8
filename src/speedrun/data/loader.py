"""The on-device loader: the whole training set lives on the device, and each epoch is shuffled and augmented
there in whole tensors (the lesson of Page's "How to train your ResNet" part 3: GPU augmentation took the
record from 79 s to 70 s, and of airbench's loader).

Epochs form one continuous stream: epoch e is a fresh permutation of all N examples, and batches are cut from
the concatenation of epochs 0, 1, 2, ... . So every epoch visits every example exactly once, every batch is full
(static shapes for torch.compile and CUDA graphs), and a fractional epoch count gives exactly
ceil(epochs * N / batch_size) steps. With drop_last, as airbench, each epoch's last partial batch is dropped
instead: an epoch is N // batch_size batches, and 9.9 epochs of 50,000 at batch 1024 are 476 steps, not 484.

All randomness comes from CPU generators seeded by (seed, epoch) and is moved to the device in one copy an epoch,
so a run is deterministic under its seed and draws the same augmentations on CPU, CUDA and MPS.

The training set is standardized once, in the run's dtype and layout, at the first batch (inside the timed region,
as airbench does), and every epoch gathers its augmented images from that copy; a batch is then a slice of the
epoch, with no work of its own unless cutout or cutmix is on. Standardizing is elementwise and the augmentations
are gathers, so the batches are bit for bit those of standardizing each batch after augmenting it
(tests/test_loader.py). A training step thus copies nothing from the host and launches no kernel for its input
(tests/test_lean_step.py counts it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speedrun.data import augment


def channel_stats(images: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of uint8 images (N, C, H, W), in [0, 1] units, as float32 (C,).

    Sums are accumulated in float64 over chunks, so CIFAR-10 never becomes one 1.2 GB float64 copy.
    """
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, len(images), chunk):
        x = images[start:start + chunk].to(torch.float64).div_(255)
        total += x.sum((0, 2, 3)).cpu()
        squares += x.square().sum((0, 2, 3)).cpu()
    count = images.numel() // images.shape[1]
    mean = total / count
    var = (squares - count * mean.square()) / max(1, count - 1)  # unbiased, as torch.std
    return mean.float(), var.clamp_min(1e-12).sqrt().float()


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype,
              channels_last: bool = False) -> torch.Tensor:
    """uint8 (N, C, H, W) -> standardized `dtype` (N, C, H, W), optionally in channels_last memory order.

    mean, std: (C,) float32 on the images' device (a copy from the host here would synchronize a GPU each call)."""
    if mean.device != images.device or std.device != images.device:
        raise ValueError(f"images on {images.device} but the normalization constants on {mean.device}: move the "
                         "images to the model's device first")
    x = ((images.float() / 255 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def steps_for(epochs: float, num_examples: int, batch_size: int, drop_last: bool = False) -> int:
    """Exact step count for a (possibly fractional) number of epochs: ceil(epochs * N / batch_size), or with
    drop_last (each epoch's last partial batch dropped, as airbench) ceil(epochs * (N // batch_size)). An epoch
    smaller than one batch has no whole batch to keep: drop_last then counts as off, and batches straddle epochs.

    The product is rounded to 6 decimals first so that 1.1 * 100 counts as 110, not 110.00000000000001 (111 steps).
    """
    if epochs <= 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    if drop_last and num_examples >= batch_size:
        return max(1, math.ceil(round(epochs * (num_examples // batch_size), 6)))
    return max(1, math.ceil(round(epochs * num_examples, 6) / batch_size))


def epochs_for_steps(steps: int, num_examples: int, batch_size: int, drop_last: bool = False) -> float:
    """The epochs that steps_for maps to exactly `steps` (the inverse a schedule compressed to a step count needs)."""
    per_epoch = num_examples // batch_size if drop_last and num_examples >= batch_size else num_examples / batch_size
    epochs = steps / per_epoch
    while steps_for(epochs, num_examples, batch_size, drop_last) > steps:  # floating point may land a hair above
        epochs = math.nextafter(epochs, 0.0)
    return epochs


@dataclass(frozen=True)
class Normalization:
    """How a batch of uint8 images (N, C, H, W) reaches the network: standardized by the training set's channel
    statistics (mean, std: (C,) float32, [0, 1] units; channel_stats), in `dtype`, and in channels_last memory
    order when asked."""

    mean: torch.Tensor
    std: torch.Tensor
    dtype: torch.dtype = torch.float32
    channels_last: bool = False

    def to(self, device: torch.device) -> Normalization:
        """The statistics on `device`, copied there once (normalize refuses them anywhere else)."""
        return dataclasses.replace(self, mean=self.mean.to(device), std=self.std.to(device))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images, self.mean, self.std, self.dtype, self.channels_last)


@dataclass(frozen=True)
class Augmentation:
    """The training batches' augmentations (data/augment.py): flip ("none", "random", "alternating"), a random
    translation of up to translate_px with reflect padding, and the sides of cutout's zeroed and cutmix's pasted
    squares (0 = off)."""

    flip: str = "none"
    translate_px: int = 0
    cutout_px: int = 0
    cutmix_px: int = 0

    def check(self, h: int, w: int) -> None:
        """Refuse (ValueError, one line) a setting that cannot augment h x w images."""
        if self.flip not in augment.FLIP_MODES:
            raise ValueError(f"flip must be one of {augment.FLIP_MODES}, got {self.flip!r}")
        for name, px in (("translate_px", self.translate_px), ("cutout_px", self.cutout_px),
                         ("cutmix_px", self.cutmix_px)):
            limit = min(h, w) - 1 if name == "translate_px" else min(h, w)  # reflect padding: narrower than the image
            if not 0 <= px <= limit:
                raise ValueError(f"{name} must be in [0, {limit}] for {h}x{w} images, got {px}")


def _generator(seed: int, stream: int) -> torch.Generator:
    # Distinct streams per (seed, epoch); the multiplier is a large prime so nearby seeds do not collide.
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % (2**63))


class DeviceLoader:
    """Iterates `steps` training batches of (inputs, targets), all on `device`.

    images: (N, C, H, W) uint8; labels: (N,) int64. inputs: (B, C, H, W) as `normalization` makes them (its
    statistics kept on the device: `self.normalization`), augmented as `augmentation` says. targets: (B,) int64
    labels, or (B, K) float probabilities when cutmix is on.
    share: under torchrun, this process's slice of every global batch (dist.share): every process cuts the same
    global batches from the same permutation and keeps its part, so K processes see exactly the examples, and the
    augmentations, of one process.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, batch_size: int, epochs: float,
                 num_classes: int, device: torch.device, normalization: Normalization,
                 augmentation: Augmentation = Augmentation(), seed: int = 0, share: slice | None = None,
                 drop_last: bool = False):
        n, _, h, w = images.shape
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        augmentation.check(h, w)
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.batch_size, self.num_classes, self.device = batch_size, num_classes, device
        self.normalization = normalization.to(device)
        self._standardized: torch.Tensor | None = None  # the whole set in dtype and layout, made at the first batch
        self.augmentation = augmentation
        self.seed, self.share = seed, share
        self.drop_last = drop_last and n >= batch_size  # (steps_for: an epoch of no whole batch drops nothing)
        self.steps = steps_for(epochs, n, batch_size, drop_last)
        # One coin per image for the whole run: alternating flip derives every epoch's flips from it.
        self._flip_base = torch.rand(n, generator=_generator(seed, -1)) < 0.5

    @property
    def num_examples(self) -> int:
        return self.images.shape[0]

    def epoch_at(self, step: int) -> float:
        """Epochs completed after `step` steps (fractional)."""
        if self.drop_last:
            return step / (self.num_examples // self.batch_size)
        return step * self.batch_size / self.num_examples

    def standardized(self) -> torch.Tensor:
        """The training set standardized in the run's dtype and layout (N, C, H, W), made once."""
        if self._standardized is None:
            self._standardized = self.normalization(self.images)
        return self._standardized

    def _epoch(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One epoch's shuffled, geometrically augmented standardized images, labels, and cutout/cutmix corners."""
        n, _, h, w = self.images.shape
        g = _generator(self.seed, epoch)
        perm = torch.randperm(n, generator=g)
        aug = self.augmentation
        base = self._flip_base if aug.flip == "alternating" else torch.rand(n, generator=g) < 0.5
        mask = augment.flip_mask(base, epoch, aug.flip)
        p = aug.translate_px
        dy, dx = torch.randint(-p, p + 1, (2, n), generator=g)
        # (4, N): cutout top, left; cutmix top, left. Each square lies wholly inside the image.
        corners = torch.stack([torch.randint(0, dim - size + 1, (n,), generator=g)
                               for size in (aug.cutout_px, aug.cutmix_px) for dim in (h, w)])
        flips = torch.zeros(n, dtype=torch.int64) if mask is None else mask[perm].long()
        # (8, N) int64: every draw of the epoch in one copy to the device (one synchronization, not five)
        draws = torch.cat([perm.view(1, n), flips.view(1, n), dy.view(1, n), dx.view(1, n), corners])
        if self.device.type == "cuda":  # from pinned memory the copy does not wait for the device
            draws = draws.pin_memory()
        # non_blocking only from pinned memory on CUDA (MPS's non-blocking copy from pageable memory can read it freed)
        draws = draws.to(self.device, non_blocking=self.device.type == "cuda")
        perm_d, flips_d, dy_d, dx_d, corners_d = draws[0], draws[1], draws[2], draws[3], draws[4:]
        x = self.standardized()[perm_d]  # (N, C, H, W), in this epoch's order
        x = augment.hflip(x, None if mask is None else flips_d.bool())
        x = augment.translate(x, dy_d, dx_d, p)
        if self.normalization.channels_last:  # the gathers give NCHW; a batch is a slice of this, laid out here
            x = x.contiguous(memory_format=torch.channels_last)
        return x, self.labels[perm_d], corners_d

    def _finish(self, x: torch.Tensor, y: torch.Tensor, corners: torch.Tensor):
        """Per batch: cutout and cutmix (which act on standardized values); nothing when both are off."""
        x = augment.cutout(x, corners[0], corners[1], self.augmentation.cutout_px)
        if self.augmentation.cutmix_px == 0:
            return x, y
        targets = F.one_hot(y, self.num_classes).float()
        # Partner of each image: its neighbour in the (already random) batch order.
        partner = torch.roll(torch.arange(len(x), device=x.device), 1)
        return augment.cutmix(x, targets, partner, corners[2], corners[3], self.augmentation.cutmix_px)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches from step `start_step` on: each is a pure function of (seed, step), so a resumed run
        continues with exactly the batches an uninterrupted one would have seen."""
        if self.drop_last:  # whole batches from each epoch, the rest of it unused
            per_epoch = self.num_examples // self.batch_size
            epoch, pos = start_step // per_epoch, start_step % per_epoch * self.batch_size
        else:
            epoch, pos = divmod(start_step * self.batch_size, self.num_examples)
        x, y, corners = self._epoch(epoch)
        # where the current epoch's batches end: all of it, or its whole batches
        end = self.num_examples // self.batch_size * self.batch_size if self.drop_last else self.num_examples
        for _ in range(start_step, self.steps):
            parts = []
            need = self.batch_size
            while need > 0:  # a batch may straddle epochs (more than two when batch_size > N)
                if pos >= end:
                    epoch, pos = epoch + 1, 0
                    x, y, corners = self._epoch(epoch)
                take = min(need, end - pos)
                parts.append((x[pos:pos + take], y[pos:pos + take], corners[:, pos:pos + take]))
                pos, need = pos + take, need - take
            if len(parts) == 1:
                bx, by, bc = parts[0]
            else:
                bx, by, bc = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                              torch.cat([p[2] for p in parts], dim=1))
            s = self.share
            if s is None:
                yield self._finish(bx, by, bc)
            elif self.augmentation.cutmix_px == 0:  # per-image work (cutout): only this process's share gets it
                yield self._finish(bx[s], by[s], bc[:, s])
            else:  # cutmix pairs each image with its neighbour in the global batch, across shares
                inputs, targets = self._finish(bx, by, bc)
                yield inputs[s], targets[s]
