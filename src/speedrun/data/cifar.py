"""CIFAR-10 / CIFAR-100 "python version" batches (https://www.cs.toronto.edu/~kriz/cifar.html).

Each batch is a pickled dict written by Python 2: b"data" is a (N, 3072) uint8 array whose rows hold
the red, green and blue 32x32 planes one after the other (so a row reshapes straight to (3, 32, 32)),
and b"labels" (CIFAR-10) or b"fine_labels" (CIFAR-100) is a list of N ints.
"""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path

import numpy as np

from speedrun.data.download import Remote

_KRIZ = "https://www.cs.toronto.edu/~kriz/"
# Archive MD5s as published by the authors; the same values torchvision checks (datasets/cifar.py).
REMOTES = {
    "cifar10": Remote("cifar", ((_KRIZ + "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),)),
    "cifar100": Remote("cifar", ((_KRIZ + "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),)),
}
ARCHIVE_NAMES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}
_SUBDIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def _allowed_globals() -> dict[tuple[str, str], object]:
    """The only callables a CIFAR pickle may name: plain containers and numpy array reconstruction.

    Python 2 pickles name builtins as `__builtin__`; numpy 2 moved `numpy.core` to `numpy._core` (the
    old path still imports but warns), so both spellings map to whichever exists here.
    """
    def numpy_attr(submodule: str, name: str) -> object:
        for prefix in ("numpy._core", "numpy.core"):
            try:
                return getattr(importlib.import_module(f"{prefix}.{submodule}"), name)
            except (ImportError, AttributeError):
                continue
        raise ImportError(f"numpy has no {submodule}.{name}")

    allowed: dict[tuple[str, str], object] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for prefix in ("numpy._core", "numpy.core"):
        allowed[(f"{prefix}.multiarray", "_reconstruct")] = numpy_attr("multiarray", "_reconstruct")
    for module in ("builtins", "__builtin__"):
        for name, obj in (("dict", dict), ("list", list), ("bytes", bytes), ("str", str), ("int", int)):
            allowed[(module, name)] = obj
    return allowed


class _CifarUnpickler(pickle.Unpickler):
    """An Unpickler that refuses every global outside `_allowed_globals`.

    A plain pickle.load runs whatever callable the file names, so a tampered batch could execute code.
    Downloads are MD5-checked before we get here and local files are the user's own, but this closes
    the hole for both at the cost of a dictionary lookup.
    """

    _allowed: dict[tuple[str, str], object] | None = None

    def find_class(self, module: str, name: str) -> object:
        if _CifarUnpickler._allowed is None:
            _CifarUnpickler._allowed = _allowed_globals()
        try:
            return _CifarUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch") from None


def load_batch(path: Path) -> dict:
    """Unpickle one batch with bytes keys (encoding="bytes" keeps Python 2 str as bytes, as the format needs)."""
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, encoding="bytes").load()
    # Broad on purpose: a damaged pickle fails in many ways (UnpicklingError, EOFError, KeyError on a bad
    # memo, struct.error ...) and each means the same thing to the user: this file is not a good batch.
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path} is not a readable CIFAR python batch ({e}); replace it with a good copy") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a CIFAR batch dict; replace it with a good copy")
    return obj


def _get(batch: dict, key: str, path: Path) -> object:
    # Official files have bytes keys; a batch re-pickled under Python 3 may have str keys.
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise ValueError(f"{path} has no {key!r} entry (keys: {sorted(map(str, batch))}); is it a CIFAR batch?")


def _images_labels(paths: list[Path], label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for path in paths:
        batch = load_batch(path)
        data = np.asarray(_get(batch, "data", path))
        y = np.asarray(_get(batch, label_key, path), dtype=np.int64)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or y.shape != (data.shape[0],):
            raise ValueError(
                f"{path}: expected uint8 data of shape (N, 3072) and N labels, got {data.dtype} {data.shape} "
                f"and {y.shape[0]} labels; replace it with a good copy"
            )
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{path}: labels must lie in [0, {num_classes}), found {y.min()}..{y.max()}")
        images.append(data)
        labels.append(y)
    # (N, 3072) rows are R, G, B planes of 32x32 each -> (N, 3, 32, 32); concatenate copies, so the
    # result owns writable memory (arrays rebuilt by the unpickler can be read-only views).
    x = np.concatenate(images).reshape(-1, 3, 32, 32)
    return x, np.concatenate(labels)


def _class_names(meta_path: Path, key: str) -> list[str]:
    names = _get(load_batch(meta_path), key, meta_path)
    if not isinstance(names, list) or not names:
        raise ValueError(f"{meta_path}: {key!r} should be a non-empty list of class names")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]


def find_batches(root: Path) -> tuple[str, Path] | None:
    """Where extracted CIFAR batches are under `root` (itself or the official subfolder), and which kind."""
    for kind in ("cifar10", "cifar100"):
        for d in (root, root / _SUBDIRS[kind]):
            if kind == "cifar10" and (d / "test_batch").is_file() and _train_batches(d):
                return kind, d
            if kind == "cifar100" and (d / "train").is_file() and (d / "test").is_file() and (d / "meta").is_file():
                return kind, d
    return None


def find_archive(root: Path) -> tuple[str, Path] | None:
    for kind, name in ARCHIVE_NAMES.items():
        if (root / name).is_file():
            return kind, root / name
    return None


def _train_batches(d: Path) -> list[Path]:
    found = [p for p in d.iterdir() if re.fullmatch(r"data_batch_\d+", p.name) and p.is_file()]
    return sorted(found, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def source_files(kind: str, d: Path) -> list[Path]:
    """Every file `read_batches` reads, for cache fingerprints."""
    if kind == "cifar10":
        return [*_train_batches(d), d / "test_batch", d / "batches.meta"]
    return [d / "train", d / "test", d / "meta"]


def read_batches(kind: str, d: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(train_x, train_y, test_x, test_y, classes) from the extracted batches in `d`; x is (N, 3, 32, 32) uint8."""
    if kind == "cifar10":
        meta = d / "batches.meta"
        if not meta.is_file():
            raise FileNotFoundError(f"{meta} is missing; copy the complete cifar-10-batches-py folder")
        classes = _class_names(meta, "label_names")
        train = _images_labels(_train_batches(d), "labels", len(classes))
        test = _images_labels([d / "test_batch"], "labels", len(classes))
    else:
        classes = _class_names(d / "meta", "fine_label_names")
        train = _images_labels([d / "train"], "fine_labels", len(classes))
        test = _images_labels([d / "test"], "fine_labels", len(classes))
    return train[0], train[1], test[0], test[1], classes
