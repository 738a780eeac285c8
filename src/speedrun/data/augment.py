"""Batch augmentations that run on the device, on whole tensors at once.

Each function takes its random draws as arguments (drawn by the loader from a seeded CPU generator), so an
augmentation is a pure function: the same draws give the same images on CPU and GPU, and each has an "off"
setting that returns its input unchanged (the identity tests in tests/test_augment.py rely on this).

All image tensors are (N, C, H, W), any dtype; shape and dtype are preserved.
"""

from __future__ import annotations

import torch

FLIP_MODES = ("none", "random", "alternating")


def flip_mask(base: torch.Tensor, epoch: int, mode: str) -> torch.Tensor | None:
    """Which images to mirror in `epoch`; None when flipping is off.

    base: (N,) bool, one coin per image, drawn once per run.
    "random": a fresh coin each epoch is the caller's job (pass a new `base` each epoch).
    "alternating" (airbench, arXiv 2404.00498 sec. 3.6): random on the first epoch, then each image is flipped
    on alternate epochs, so every pair of consecutive epochs sees both orientations of every image exactly once.
    Measured there: about 10% fewer epochs to 94% than random flipping.
    """
    if mode == "none":
        return None
    if mode == "random":
        return base
    if mode == "alternating":
        return base ^ bool(epoch % 2)
    raise ValueError(f"flip must be one of {FLIP_MODES}, got {mode!r}")


def hflip(images: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mirror left-right the images where mask (N,) is True; mask None returns the input itself."""
    if mask is None:
        return images
    return torch.where(mask.view(-1, 1, 1, 1), images.flip(-1), images)


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Map indices in [-size+1, 2*size-2] into [0, size) as reflect padding does (edge pixel not repeated)."""
    index = index.abs()
    return torch.where(index >= size, 2 * (size - 1) - index, index)


def translate(images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, pad_px: int) -> torch.Tensor:
    """Shift each image by (dy, dx) pixels with reflect padding: a random crop of the reflect-padded image.

    dy, dx: (N,) int64 in [-pad_px, pad_px]; output pixel (i, j) reads input pixel (i + dy, j + dx), reflected
    at the border. Equivalent to F.pad(reflect, pad_px) then cropping at (pad_px + dy, pad_px + dx), but done
    as one gather with reflected indices: no padded copy, and it works on uint8. pad_px == 0 is the identity.
    """
    if pad_px == 0:
        return images
    n, c, h, w = images.shape
    assert pad_px < min(h, w), "reflect padding must be smaller than the image"
    rows = _reflect(torch.arange(h, device=images.device) + dy.view(-1, 1), h)  # (N, H)
    cols = _reflect(torch.arange(w, device=images.device) + dx.view(-1, 1), w)  # (N, W)
    batch = torch.arange(n, device=images.device).view(n, 1, 1, 1)
    chan = torch.arange(c, device=images.device).view(1, c, 1, 1)
    return images[batch, chan, rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]


def square_mask(shape: torch.Size, top: torch.Tensor, left: torch.Tensor, size_px: int) -> torch.Tensor:
    """(N, 1, H, W) bool, True inside the size_px square whose corner is at (top, left) of each image."""
    n, _, h, w = shape
    ys = torch.arange(h, device=top.device).view(1, h, 1) - top.view(-1, 1, 1)
    xs = torch.arange(w, device=top.device).view(1, 1, w) - left.view(-1, 1, 1)
    inside = (ys >= 0) & (ys < size_px) & (xs >= 0) & (xs < size_px)
    return inside.view(n, 1, h, w)


def cutout(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size_px: int) -> torch.Tensor:
    """Zero a size_px square per image (DeVries & Taylor 2017). Applied after normalization, so zero is the
    dataset-mean colour. Used by airbench96 (12 px) and Page's ResNet-9 (8 px). size_px == 0 is the identity."""
    if size_px == 0:
        return images
    return images.masked_fill(square_mask(images.shape, top, left, size_px), 0)


def cutmix(images: torch.Tensor, targets: torch.Tensor, partner: torch.Tensor, top: torch.Tensor,
           left: torch.Tensor, size_px: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paste a size_px square from image `partner[i]` into image i and mix the labels by area (Yun et al. 2019).

    targets: (N, K) float class probabilities; partner: (N,) int64 indices into the same tensors.
    The square lies wholly inside the image, so the mixing weight is exactly size_px**2 / (H * W).
    hlb-CIFAR10 used small (3 px) patches late in training. size_px == 0 is the identity.
    """
    if size_px == 0:
        return images, targets
    _, _, h, w = images.shape
    mask = square_mask(images.shape, top, left, size_px)
    mixed = torch.where(mask, images[partner], images)
    weight = size_px * size_px / (h * w)
    return mixed, targets * (1 - weight) + targets[partner] * weight
