"""The in-memory form every data source produces: uint8 images and int64 labels."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from speedrun.data import limits
from speedrun.errors import printable

# The longest class name a saved model's card keeps (run/model_files.py parse_card holds it to this): a folder name
# of 255 bytes that are not UTF-8 is 1,020 characters once errors.printable writes each byte as \xNN.
MAX_CLASS_NAME_CHARS = 1024


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
    # A named dataset's copy from data_dir (--data-dir) whose files are not the published ones: how they differ
    # ("cifar-10-python.tar.gz has md5 ..., not the published ..."); empty for the published files and for datasets
    # named by their path. Cached with the pixels (the check reads every byte once), said by describe().
    unofficial: str = ""
    # (train, test) images of the source a sample was drawn from (Dataset.sample), None for the whole source: said by
    # describe(), never cached (a sample is not the dataset).
    sampled_from: tuple[int, int] | None = None
    # content_fingerprint()'s answer, once computed (a cache hit hands over the one its checksum pass made).
    # init=False: dataclasses.replace (sample, test_sample) starts it empty, as the pixels it keeps may differ.
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

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

    def fingerprint(self) -> str:
        """What this data set is, whatever path it was read from: content_fingerprint of its classes and tensors.
        The same folder by a relative or an absolute path, or a copy of it elsewhere, gives one fingerprint; one
        changed pixel or label gives another. Results are keyed by it (records/db.py), not by the path typed."""
        if not self._fingerprint:
            self._fingerprint = content_fingerprint(self.classes, {k: getattr(self, k) for k in TENSORS})
        return self._fingerprint

    def noted(self, **notes: str) -> Dataset:
        """The same data with what describe() says of it changed (test_from, left_out): its fingerprint kept, as
        the pixels and labels are the same tensors (dataclasses.replace alone would start it empty)."""
        noted = replace(self, **notes)
        noted._fingerprint = self._fingerprint
        return noted

    def describe(self) -> str:
        """One line: the name, the splits' sizes, the image shape and the classes."""
        c, h, w = self.image_shape
        test_from = f" (from {self.test_from})" if self.test_from else ""
        left_out = f"; {self.left_out}" if self.left_out else ""
        unofficial = f"; not the published files: {self.unofficial}" if self.unofficial else ""
        sampled = "" if self.sampled_from is None else (
            f"; a fixed sample of its {self.sampled_from[0]} train / {self.sampled_from[1]} test images")
        return (f"{self.name}: {len(self.train_labels)} train / {len(self.test_labels)} test{test_from}, "
                f"{c}x{h}x{w}, {self.num_classes} classes{left_out}{unofficial}{sampled}")

    def test_sample(self, n: int) -> Dataset:
        """The dataset with the first n test images of a fixed random order (a test folder is class-ordered, so
        its first n would be one class); itself when the test set has n or fewer."""
        return self.sample(len(self.train_labels), n)

    def sample(self, n_train: int, n_test: int) -> Dataset:
        """The dataset with the first n_train train and n_test test images of each split's fixed random order
        (sample_order); a split with no more images than asked is kept whole, and nothing asked is itself."""
        picks = [sample_order(len(y), n) for y, n in ((self.train_labels, n_train), (self.test_labels, n_test))]
        if picks == [None, None]:
            return self
        ((train_x, train_y), (test_x, test_y)) = [
            (x, y) if pick is None else (x[pick], y[pick])
            for (x, y), pick in zip(((self.train_images, self.train_labels), (self.test_images, self.test_labels)),
                                    picks)]
        whole = self.sampled_from or (len(self.train_labels), len(self.test_labels))
        return replace(self, train_images=train_x, train_labels=train_y, test_images=test_x, test_labels=test_y,
                       sampled_from=whole)


TENSORS = ("train_images", "train_labels", "test_images", "test_labels")


def content_fingerprint(classes: Sequence[str], tensors: dict[str, torch.Tensor]) -> str:
    """"sha256:<hex>" over a JSON header (the class names, each tensor's dtype and shape) and then each tensor's raw
    bytes in TENSORS order; the shapes fix where one tensor's bytes end and the next begin. The name, the path and
    the files' times are not in it: it is what the data holds. One pass over the pixels, 2.0 GB/s with SHA-NI
    (0.09 s for CIFAR-10's 184 MB); the cache's checksum is built on it (cache.checksum), so a cache hit pays it
    once."""
    header = {"classes": list(classes), "tensors": [[k, str(tensors[k].dtype), list(tensors[k].shape)]
                                                    for k in TENSORS]}
    h = hashlib.sha256(json.dumps(header).encode())  # ensure_ascii: any str, surrogates included, encodes
    for k in TENSORS:
        h.update(tensors[k].contiguous().numpy().reshape(-1).view("uint8"))  # native byte order, as saved
    return "sha256:" + h.hexdigest()


def sample_order(total: int, n: int) -> torch.Tensor | None:
    """The indices of the first n of a fixed random order of `total` items (seed 0: every call, and every source
    of one dataset, whether decoded whole or in part, picks the same images), or None when n >= total. Random,
    not the first n: a split is listed class by class, so its first n would be one class."""
    if n >= total:
        return None
    return torch.randperm(total, generator=torch.Generator().manual_seed(0))[:n]


def _describe(v: object) -> str:
    return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def _same_name(names: Sequence[str]) -> tuple[int, int] | None:
    """The first (j, i), j < i, of two names that are one name after Unicode NFC normalisation ("café" composed,
    U+00E9, and decomposed, "e" + U+0301, print alike); None when all differ."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        key = unicodedata.normalize("NFC", name)
        if key in seen:
            return seen[key], i
        seen[key] = i
    return None


def stored_class_names(names: Sequence[str], where: str, *, noun: str = "class names",
                       fix: str = "rename one of them") -> list[str]:
    """Class names read from outside (folder names, a CIFAR meta file) as a dataset, its cache and a saved model's
    card store them: escaped by errors.printable. Refused, one line naming `where` and ending in `fix`, when a name
    is empty or longer than MAX_CLASS_NAME_CHARS once escaped, or when two are one name once escaped and NFC
    normalised (their classes would print alike, and a card's class index would name one class twice). `noun`
    names the pair in the message ("class folders")."""
    stored = [printable(name) for name in names]
    for i, name in enumerate(stored):
        if not 0 < len(name) <= MAX_CLASS_NAME_CHARS:
            what = "is empty" if not name else f"is {len(name):,} characters long once escaped ({name[:40]!r}...)"
            raise ValueError(f"{where}: class {i}'s name {what}; a class name is 1 to {MAX_CLASS_NAME_CHARS:,} "
                             f"characters (a saved model's card keeps it): {fix}")
    pair = _same_name(stored)
    if pair is not None:
        j, i = pair
        first, second = names[j], names[i]
        if first == second:
            why = f"{first!r} twice (classes {j} and {i})"
        elif stored[j] == stored[i]:
            why = (f"{first!r} and {second!r}, whose names are stored alike as {stored[i]!r} (control characters and "
                   "bytes that are not UTF-8 are escaped)")
        else:
            why = (f"{first!r} and {second!r}, one name in two Unicode spellings ({ascii(first)} and "
                   f"{ascii(second)}: equal after NFC normalisation)")
        raise ValueError(f"{where} has {noun} {why}; {fix}")
    return stored


def check_class_names(classes: Sequence[object], source: str) -> None:
    """Refuse, naming `source`, class names a saved model's card would refuse (run/model_files.py parse_card:
    printable strings of 1 to MAX_CLASS_NAME_CHARS characters) or that are one name after NFC normalisation.
    Every reader stores its names through stored_class_names, which meets this; here the rule holds for every
    dataset (a cache written by another version, a Dataset built in Python) before any training."""
    for i, name in enumerate(classes):
        if not (isinstance(name, str) and 0 < len(name) <= MAX_CLASS_NAME_CHARS and name.isprintable()):
            raise ValueError(f"{source}: class {i} is {repr(name)[:80]}; class names are printable strings of 1 to "
                             f"{MAX_CLASS_NAME_CHARS:,} characters (a saved model's card keeps them): escape them "
                             "with speedrun.errors.printable or rename them")
    pair = _same_name(classes)  # type: ignore[arg-type]  # every one a str, above
    if pair is not None:
        j, i = pair
        first, second = classes[j], classes[i]
        same = (f"both {first!r}" if first == second else
                f"{first!r} and {second!r}, one name in two Unicode spellings ({ascii(first)} and {ascii(second)}: "
                "equal after NFC normalisation)")
        raise ValueError(f"{source}: classes {j} and {i} are {same}; give each class its own name")


def check_dataset(ds: Dataset, source: str) -> Dataset:
    """Refuse, with one line naming `source`, a dataset that training could not use; return it unchanged.

    Applied to every dataset load_dataset returns (built, cached or synthetic) and to every build before it is
    cached: both splits hold images, at least 2 classes, C 1 or 3, labels in [0, num_classes), class names a saved
    model's card keeps (check_class_names): so a run that trains can also be saved.
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
    check_class_names(ds.classes, source)
    return ds


def check_data_limit(ds: Dataset, source: str) -> Dataset:
    """Refuse a dataset over `limits.max_dataset_bytes()`, naming `source`; return it unchanged.

    Every reader checks what its files claim before reading; this bounds the sum over files and splits (two IDX
    files, each under the limit, are still refused together when over it). A policy, apart from check_dataset's
    integrity: a cache over the limit is not corrupt, and is not rebuilt.
    """
    limits.check_dataset_bytes(ds.train_images.numel() + ds.test_images.numel(), source)
    return ds
