"""The in-memory form every data source produces: uint8 images and int64 labels."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from speedrun.data import limits


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
    # Where the test split came from when that is not test/ ("val/" for an image folder in ImageNet's layout),
    # and what the source's listing left out ("left out: 1 hidden (.DS_Store)"): said by describe(), not cached.
    test_from: str = ""
    left_out: str = ""

    def __post_init__(self) -> None:
        # Tensors often come from files (or from a user of the Python API): a wrong type or shape is bad input, so
        # it raises ValueError, not an assert. Content (empty splits, label range) is sources.check_dataset's job.
        for split in ("train", "test"):
            x = getattr(self, f"{split}_images")
            y = getattr(self, f"{split}_labels")
            if not (isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.ndim == 4):
                raise ValueError(f"dataset {self.name!r}: {split}_images must be a uint8 (N, C, H, W) tensor, got "
                                 f"{_describe(x)}")
            if not (isinstance(y, torch.Tensor) and y.dtype == torch.int64 and y.shape == (x.shape[0],)):
                raise ValueError(f"dataset {self.name!r}: {split}_labels must be an int64 ({x.shape[0]},) tensor, "
                                 f"got {_describe(y)}")
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError(f"dataset {self.name!r}: train images are {tuple(self.train_images.shape[1:])} but test "
                             f"images {tuple(self.test_images.shape[1:])}; both splits need one (C, H, W)")
        if not self.classes:
            # An empty split has no max: zero classes, which check_dataset then refuses with its own message.
            top = int(self.train_labels.max()) if self.train_labels.numel() else -1
            self.classes = [str(i) for i in range(top + 1)]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def num_train(self) -> int:
        """Training examples: the name every family's data has (imagenet's ShardData too), which the step
        arithmetic of shared code (instruments/to_target.py) reads."""
        return len(self.train_labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W)."""
        c, h, w = self.train_images.shape[1:]
        return int(c), int(h), int(w)

    def describe(self) -> str:
        """One line: the name, the splits' sizes, the image shape and the classes."""
        c, h, w = self.image_shape
        test_from = f" (from {self.test_from})" if self.test_from else ""
        left_out = f"; {self.left_out}" if self.left_out else ""
        return (f"{self.name}: {len(self.train_labels)} train / {len(self.test_labels)} test{test_from}, "
                f"{c}x{h}x{w}, {self.num_classes} classes{left_out}")

    def test_sample(self, n: int) -> Dataset:
        """The dataset with the first n test images of a fixed random order (a test folder is class-ordered, so
        its first n would be one class); itself when the test set has n or fewer."""
        if len(self.test_labels) <= n:
            return self
        pick = torch.randperm(len(self.test_labels), generator=torch.Generator().manual_seed(0))[:n]
        return replace(self, test_images=self.test_images[pick], test_labels=self.test_labels[pick])


def _describe(v: object) -> str:
    return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def check_dataset(ds: Dataset, source: str) -> Dataset:
    """Refuse, with one line naming `source`, a dataset that training could not use; return it unchanged.

    Applied to every dataset load_dataset returns (built, cached or synthetic) and to every build before it is
    cached: both splits hold images, at least 2 classes, C 1 or 3, labels in [0, num_classes).
    """
    for split in ("train", "test"):  # dtypes and shapes are Dataset.__post_init__'s check, on construction
        if len(getattr(ds, f"{split}_images")) == 0:
            raise ValueError(f"{source}: the {split} split has no images; a dataset needs images in both train and "
                             "test")
    if ds.num_classes < 2:
        count = f"{ds.num_classes} class{'' if ds.num_classes == 1 else 'es'}"
        raise ValueError(f"{source} has {count}; a classifier needs at least 2 (add a class)")
    if ds.num_classes > limits.MAX_CLASSES:
        raise ValueError(f"{source} has {ds.num_classes} classes, over the limit of {limits.MAX_CLASSES}; check its "
                         "class list (a damaged meta file?)")
    channels = ds.image_shape[0]
    if channels not in (1, 3):
        raise ValueError(f"{source} has {channels}-channel images; use 1 (grey) or 3 (RGB) channels")
    for split in ("train", "test"):
        y = getattr(ds, f"{split}_labels")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= ds.num_classes:
            raise ValueError(f"{source}: {split} label {low if low < 0 else high} is outside [0, {ds.num_classes}) "
                             f"for its {ds.num_classes} classes; fix the labels or the class list")
    return ds


def check_data_limit(ds: Dataset, source: str) -> Dataset:
    """Refuse a dataset over `limits.max_dataset_bytes()`, naming `source`; return it unchanged.

    Every reader checks what its files claim before reading; this bounds the sum over files and splits (two IDX
    files, each under the limit, are still refused together when over it). A policy, apart from check_dataset's
    integrity: a cache over the limit is not corrupt, and is not rebuilt.
    """
    limits.check_dataset_bytes(ds.train_images.numel() + ds.test_images.numel(), source)
    return ds
