"""The on-device loader: the whole training set lives on the device, and each epoch is shuffled and augmented
there in whole tensors (the lesson of Page's "How to train your ResNet" part 3: GPU augmentation took the
record from 79 s to 70 s, and of airbench's loader).

Epochs form one continuous stream: epoch e is a fresh permutation of all N examples, and batches are cut from
the concatenation of epochs 0, 1, 2, ... . So every epoch visits every example exactly once, every batch is full
(static shapes for torch.compile and CUDA graphs), and a fractional epoch count gives exactly
ceil(epochs * N / batch_size) steps. (airbench instead drops each epoch's last partial batch: 9.9 epochs of
50,000 at batch 1024 are 476 steps there, 484 here.)

All randomness comes from CPU generators seeded by (seed, epoch) and is moved to the device, so a run is
deterministic under its seed and draws the same augmentations on CPU, CUDA and MPS.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

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
    """uint8 (N, C, H, W) -> standardized `dtype` (N, C, H, W), optionally in channels_last memory order."""
    mean = mean.to(images.device).view(1, -1, 1, 1)
    std = std.to(images.device).view(1, -1, 1, 1)
    x = ((images.float() / 255 - mean) / std).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def steps_for(epochs: float, num_examples: int, batch_size: int) -> int:
    """Exact step count for a (possibly fractional) number of epochs: ceil(epochs * N / batch_size).

    epochs * N is rounded to 6 decimals first so that 1.1 * 100 counts as 110, not 110.00000000000001 (111 steps).
    """
    if epochs <= 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    return max(1, math.ceil(round(epochs * num_examples, 6) / batch_size))


def _generator(seed: int, stream: int) -> torch.Generator:
    # Distinct streams per (seed, epoch); the multiplier is a large prime so nearby seeds do not collide.
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % (2**63))


class DeviceLoader:
    """Iterates `steps` training batches of (inputs, targets), all on `device`.

    images: (N, C, H, W) uint8; labels: (N,) int64. inputs: (B, C, H, W) `dtype`, standardized by the training
    set's channel statistics. targets: (B,) int64 labels, or (B, K) float probabilities when cutmix is on.
    share: under torchrun, this process's slice of every global batch (dist.share): every process cuts the same
    global batches from the same permutation and keeps its part, so K processes see exactly the examples, and the
    augmentations, of one process.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, batch_size: int, epochs: float,
                 num_classes: int, device: torch.device, mean: torch.Tensor, std: torch.Tensor,
                 dtype: torch.dtype = torch.float32, channels_last: bool = False, flip: str = "none",
                 translate_px: int = 0, cutout_px: int = 0, cutmix_px: int = 0, seed: int = 0,
                 share: slice | None = None):
        n, _, h, w = images.shape
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if flip not in augment.FLIP_MODES:
            raise ValueError(f"flip must be one of {augment.FLIP_MODES}, got {flip!r}")
        for name, px in (("translate_px", translate_px), ("cutout_px", cutout_px), ("cutmix_px", cutmix_px)):
            limit = min(h, w) - 1 if name == "translate_px" else min(h, w)
            if not 0 <= px <= limit:
                raise ValueError(f"{name} must be in [0, {limit}] for {h}x{w} images, got {px}")
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.batch_size, self.num_classes, self.device = batch_size, num_classes, device
        self.mean, self.std, self.dtype, self.channels_last = mean, std, dtype, channels_last
        self.flip, self.translate_px, self.cutout_px, self.cutmix_px = flip, translate_px, cutout_px, cutmix_px
        self.seed, self.share = seed, share
        self.steps = steps_for(epochs, n, batch_size)
        # One coin per image for the whole run: alternating flip derives every epoch's flips from it.
        self._flip_base = torch.rand(n, generator=_generator(seed, -1)) < 0.5

    @property
    def num_examples(self) -> int:
        return self.images.shape[0]

    def epoch_at(self, step: int) -> float:
        """Epochs completed after `step` steps (fractional)."""
        return step * self.batch_size / self.num_examples

    def _epoch(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One epoch's shuffled, geometrically augmented uint8 images, labels, and cutout/cutmix corners."""
        n, _, h, w = self.images.shape
        g = _generator(self.seed, epoch)
        perm = torch.randperm(n, generator=g)
        base = self._flip_base if self.flip == "alternating" else torch.rand(n, generator=g) < 0.5
        mask = augment.flip_mask(base, epoch, self.flip)
        p = self.translate_px
        dy, dx = torch.randint(-p, p + 1, (2, n), generator=g)
        # (4, N): cutout top, left; cutmix top, left. Each square lies wholly inside the image.
        corners = torch.stack([torch.randint(0, dim - size + 1, (n,), generator=g)
                               for size in (self.cutout_px, self.cutmix_px) for dim in (h, w)])
        perm_d = perm.to(self.device)
        x = self.images[perm_d]  # (N, C, H, W) uint8, in this epoch's order
        x = augment.hflip(x, None if mask is None else mask[perm].to(self.device))
        x = augment.translate(x, dy.to(self.device), dx.to(self.device), p)
        return x, self.labels[perm_d], corners.to(self.device)

    def _finish(self, x: torch.Tensor, y: torch.Tensor, corners: torch.Tensor):
        """Per batch: standardize, then cutout and cutmix (which act on standardized values)."""
        x = normalize(x, self.mean, self.std, self.dtype, self.channels_last)
        x = augment.cutout(x, corners[0], corners[1], self.cutout_px)
        if self.cutmix_px == 0:
            return x, y
        targets = F.one_hot(y, self.num_classes).float()
        # Partner of each image: its neighbour in the (already random) batch order.
        partner = torch.roll(torch.arange(len(x), device=x.device), 1)
        return augment.cutmix(x, targets, partner, corners[2], corners[3], self.cutmix_px)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches from step `start_step` on: each is a pure function of (seed, step), so a resumed run
        continues with exactly the batches an uninterrupted one would have seen."""
        epoch, pos = divmod(start_step * self.batch_size, self.num_examples)
        x, y, corners = self._epoch(epoch)
        for _ in range(start_step, self.steps):
            parts = []
            need = self.batch_size
            while need > 0:  # a batch may straddle epochs (more than two when batch_size > N)
                if pos == len(x):
                    epoch, pos = epoch + 1, 0
                    x, y, corners = self._epoch(epoch)
                take = min(need, len(x) - pos)
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
            elif self.cutmix_px == 0:  # per-image work: only this process's share is standardized
                yield self._finish(bx[s], by[s], bc[:, s])
            else:  # cutmix pairs each image with its neighbour in the global batch, across shares
                inputs, targets = self._finish(bx, by, bc)
                yield inputs[s], targets[s]
