"""The in-memory form every data source produces: uint8 images and int64 labels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Dataset:
    """A labelled image dataset held as whole tensors.

    train_images, test_images: (N, C, H, W) uint8, contiguous, on the CPU.
    train_labels, test_labels: (N,) int64 in [0, num_classes).
    Channels and resolution come from the data (1x28x28 for MNIST, 3x32x32 for CIFAR).
    """

    name: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    classes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x = getattr(self, f"{split}_images")
            y = getattr(self, f"{split}_labels")
            assert x.dtype == torch.uint8 and x.ndim == 4, (split, x.dtype, x.shape)
            assert y.dtype == torch.int64 and y.shape == (x.shape[0],), (split, y.dtype, y.shape)
        assert self.train_images.shape[1:] == self.test_images.shape[1:]
        if not self.classes:
            self.classes = [str(i) for i in range(int(self.train_labels.max()) + 1)]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W)."""
        c, h, w = self.train_images.shape[1:]
        return int(c), int(h), int(w)
