"""CIFAR-10 / CIFAR-100 "python version" batches (https://www.cs.toronto.edu/~kriz/cifar.html).

Each batch is a pickled dict written by Python 2: b"data" is a (N, 3072) uint8 array whose rows hold
the red, green and blue 32x32 planes one after the other (so a row reshapes straight to (3, 32, 32)),
and b"labels" (CIFAR-10) or b"fine_labels" (CIFAR-100) is a list of N ints.
"""

from __future__ import annotations

import contextvars
import importlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Callable

import numpy as np

from speedrun.data import limits
from speedrun.data.dataset import stored_class_names
from speedrun.data.download import Remote, md5_file

_KRIZ = "https://www.cs.toronto.edu/~kriz/"
# Archive MD5s as published by the authors; the same values torchvision checks (datasets/cifar.py).
REMOTES = {
    "cifar10": Remote("cifar", ((_KRIZ + "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),)),
    "cifar100": Remote("cifar", ((_KRIZ + "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),)),
}
ARCHIVE_NAMES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}
SUBDIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
# The MD5 of every file read_batches reads, as the archives extract (the values torchvision checks): a folder of
# batches is the named dataset only when it holds exactly these files, each unchanged.
PUBLISHED_BATCHES = {
    "cifar10": {"data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
                "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
                "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
                "batches.meta": "5ff9c542aee3614f3951f8cda6e48888"},
    "cifar100": {"train": "16019d7e3df5f24257cddd939b257f8d", "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
                 "meta": "7973b15100ade9c7d40fb424638fde48"},
}


def _numpy_attr(submodule: str, name: str) -> object:
    # numpy 2 moved `numpy.core` to `numpy._core` (the old path still imports but warns).
    for prefix in ("numpy._core", "numpy.core"):
        try:
            return getattr(importlib.import_module(f"{prefix}.{submodule}"), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"numpy has no {submodule}.{name}")


# Plain numeric dtypes only: no objects, no structured or void/str types whose item size the file would choose.
_NUMERIC_KINDS = "biuf"


def _plain_dtype(d: object) -> bool:
    return isinstance(d, np.dtype) and d.kind in _NUMERIC_KINDS and d.fields is None and d.subdtype is None \
        and not d.hasobject and d.itemsize <= 8


class _CheckedArray(np.ndarray):
    """What the unpickler builds instead of an ndarray: its state is checked before numpy applies it.

    numpy's __setstate__ trusts the dtype it is given, and a pickle may first BUILD that dtype into a structured
    one with object fields (which numpy would then fill from raw bytes). Here the dtype must be plain numeric and
    the data raw bytes, whose length numpy checks against shape x item size.
    """

    def __setstate__(self, state: object) -> None:
        ok = isinstance(state, tuple) and len(state) in (4, 5)
        if ok:
            shape, dtype, raw = state[-4], state[-3], state[-1]
            ok = isinstance(shape, tuple) and all(type(n) is int for n in shape) and _plain_dtype(dtype) \
                and isinstance(raw, bytes)
        if not ok:
            raise pickle.UnpicklingError("an array in the file is not a plain numeric array")
        # One bytes object in the pickle's memo can fill any number of arrays, each a copy: 400 arrays from one
        # 10 MB string made a 10 MB file take 4 GB. The arrays of one file may hold no more bytes than the file.
        left = _ARRAY_BYTES_LEFT.get() - len(raw)
        if left < 0:
            raise pickle.UnpicklingError("its arrays hold more bytes than the file itself")
        _ARRAY_BYTES_LEFT.set(left)
        super().__setstate__(state)


# Bytes the arrays of the batch being loaded may still hold (load_batch sets it to the file's size).
_ARRAY_BYTES_LEFT: contextvars.ContextVar[int] = contextvars.ContextVar("cifar_array_bytes_left", default=0)


def _reconstruct(subtype: object, shape: object, typecode: object) -> np.ndarray:
    """numpy's _reconstruct, for exactly the call numpy's own ndarray.__reduce__ emits: (ndarray, (0,), b"b")."""
    if subtype is not _NDARRAY or shape != (0,) or typecode not in (b"b", "b"):
        raise pickle.UnpicklingError("numpy _reconstruct is called with other arguments than numpy writes")
    return _NUMPY_RECONSTRUCT(_CheckedArray, (0,), b"b")


def _dtype(spec: object, align: object = False, copy: object = True) -> np.dtype:
    """np.dtype for plain numeric type codes only ("u1", "<i8" ...), always a fresh copy.

    A copy, because the pickle then BUILDs (__setstate__) the dtype it got: on numpy's shared uint8 instance
    that would change uint8 for the whole process.
    """
    text = spec.decode("ascii", "replace") if isinstance(spec, bytes) else spec
    if not isinstance(text, str) or len(text) > 4:
        raise pickle.UnpicklingError(f"dtype {spec!r} is not a plain numeric type")
    try:
        d = np.dtype(text, bool(align), True)
    except TypeError:
        raise pickle.UnpicklingError(f"dtype {spec!r} is not a plain numeric type") from None
    if not _plain_dtype(d):
        raise pickle.UnpicklingError(f"dtype {spec!r} is not a plain numeric type")
    return d


def _latin1(text: object, encoding: object = "latin1") -> bytes:
    """_codecs.encode as Python 3 writes bytes in pickle protocols 0-2: (str, "latin1") -> bytes of the same length."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is called with other arguments than pickle writes")
    return text.encode("latin-1")


class _NdarrayName:
    """Stands for numpy.ndarray in a pickle: only a marker for _reconstruct, not callable (ndarray(shape) would
    allocate whatever shape the file names)."""


_NDARRAY = _NdarrayName()
_NUMPY_RECONSTRUCT: Callable = _numpy_attr("multiarray", "_reconstruct")  # type: ignore[assignment]


def _allowed_globals() -> dict[tuple[str, str], object]:
    """The only globals a CIFAR pickle may name: what numpy writes for an array (found by tracing find_class on
    the official-style batches, and on arrays pickled by Python 3 with protocols 0-4), each wrapped to accept only
    the arguments numpy writes. No builtins: dicts, lists, ints and bytes are pickle opcodes of their own.
    """
    allowed: dict[tuple[str, str], object] = {("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _dtype,
                                              ("_codecs", "encode"): _latin1}
    for prefix in ("numpy._core", "numpy.core"):  # official files name numpy 1's path, numpy 2 writes the other
        allowed[(f"{prefix}.multiarray", "_reconstruct")] = _reconstruct
    return allowed


class _CifarUnpickler(pickle.Unpickler):
    """An Unpickler that refuses every global outside `_allowed_globals`.

    A plain pickle.load runs whatever callable the file names, so a tampered batch could execute code or
    allocate any size it names (builtins.bytes(500000000)). Downloads are MD5-checked before we get here and
    local files are the user's own, but this closes the hole for both at the cost of a dictionary lookup.
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
    """Unpickle one batch with bytes keys (encoding="bytes" keeps Python 2 str as bytes, as the format needs).

    The file's size is checked first and the pickle is read from memory: io.BytesIO returns only the bytes
    there are, so a length the file claims for a string (BINBYTES8, BINUNICODE8) cannot make a read allocate it.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            limits.check_size(size, limits.MAX_CIFAR_MEMBER_BYTES, f"CIFAR batch {path}",
                              "replace it with a good copy of the official batch")
            data = f.read(size + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"CIFAR batch {path} does not exist; copy the complete batches folder") from None
    except OSError as e:
        raise ValueError(f"cannot read CIFAR batch {path} ({e}); check the file and its permissions") from None
    # A file that grew after fstat: still never more than the limit in memory.
    limits.check_size(len(data), limits.MAX_CIFAR_MEMBER_BYTES, f"CIFAR batch {path}", "replace it with a good copy")
    budget = _ARRAY_BYTES_LEFT.set(len(data))
    try:
        obj = _CifarUnpickler(io.BytesIO(data), encoding="bytes").load()
    # Broad on purpose: a damaged pickle fails in many ways (UnpicklingError, EOFError, KeyError on a bad
    # memo, struct.error, MemoryError for an absurd length ...) and each means the same thing to the user:
    # this file is not a good batch.
    except Exception as e:  # noqa: BLE001
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a readable CIFAR python batch ({reason}); replace it with a good copy") \
            from None
    finally:
        _ARRAY_BYTES_LEFT.reset(budget)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a CIFAR batch dict; replace it with a good copy")
    # Hand out plain ndarrays: the checking subclass has done its work.
    return {k: v.view(np.ndarray) if isinstance(v, np.ndarray) else v for k, v in obj.items()}


def _get(batch: dict, key: str, path: Path) -> object:
    # Official files have bytes keys; a batch re-pickled under Python 3 may have str keys.
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise ValueError(f"{path} has no {key!r} entry (keys: {sorted(map(str, batch))}); is it a CIFAR batch?")


def _labels(value: object, n: int, num_classes: int, key: str, path: Path) -> np.ndarray:
    """The labels as int64, refusing what is not integers in [0, num_classes): np.asarray would truncate 3.7 to 3."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        y = value
    # type() is int: bool is an int subclass, and True is not a label.
    elif isinstance(value, list) and all(type(v) is int for v in value):
        y = value
    else:
        if isinstance(value, np.ndarray):
            what = f"{value.dtype} array of shape {value.shape}"
        elif isinstance(value, list):
            bad = next(v for v in value if type(v) is not int)
            what = f"list holding {repr(bad)[:40]} ({type(bad).__name__})"
        else:
            what = type(value).__name__
        raise ValueError(f"{path}: {key!r} must be a list of integer labels, found a {what}; "
                         f"replace it with a good copy")
    if len(y) != n:
        raise ValueError(f"{path}: {n} images but {len(y)} labels in {key!r}; replace it with a good copy")
    # Range first, in the labels' own type: converting a huge Python int to int64 would overflow.
    if not n:
        low = high = 0
    elif isinstance(y, list):
        low, high = min(y), max(y)
    else:
        low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        raise ValueError(f"{path}: labels must lie in [0, {num_classes}), found {low}..{high}")
    return np.asarray(y, dtype=np.int64)


def _images_labels(paths: list[Path], label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for path in paths:
        batch = load_batch(path)
        data = _get(batch, "data", path)
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
                and data.shape[1] == 3 * 32 * 32 and data.shape[0] > 0):
            what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
            raise ValueError(f"{path}: expected 'data' as uint8 array of shape (N, 3072), N >= 1, got {what}; "
                             f"replace it with a good copy")
        images.append(data)
        labels.append(_labels(_get(batch, label_key, path), data.shape[0], num_classes, label_key, path))
    # (N, 3072) rows are R, G, B planes of 32x32 each -> (N, 3, 32, 32); concatenate copies, so the
    # result owns writable memory (arrays rebuilt by the unpickler can be read-only views).
    x = np.concatenate(images).reshape(-1, 3, 32, 32)
    return x, np.concatenate(labels)


def _class_names(meta_path: Path, key: str) -> list[str]:
    names = _get(load_batch(meta_path), key, meta_path)
    if not isinstance(names, list) or not names:
        raise ValueError(f"{meta_path}: {key!r} should be a non-empty list of class names")
    if len(names) > limits.MAX_CLASSES:  # before any is decoded: a damaged list may be millions long
        raise ValueError(f"{meta_path}: {key!r} holds {len(names):,} class names, over the limit of "
                         f"{limits.MAX_CLASSES:,}; replace it with a good copy")
    decoded = []
    for i, n in enumerate(names):
        if not isinstance(n, (bytes, str)):  # type(n): str() of a huge int is slow, or refused by Python itself
            raise ValueError(f"{meta_path}: class {i} in {key!r} is a {type(n).__name__}, not a name; replace "
                             "it with a good copy")
        # Bytes that are not UTF-8 keep their bytes (as os.fsdecode keeps a folder name's), so stored_class_names
        # writes them \xNN, as it writes an image folder's.
        decoded.append(n.decode("utf-8", "surrogateescape") if isinstance(n, bytes) else n)
    return stored_class_names(decoded, f"{meta_path} ({key!r})",
                              fix=f"fix the names in {meta_path.name} or replace it with a good copy")


def find_batches(root: Path) -> tuple[str, Path] | None:
    """Where extracted CIFAR batches are under `root` (itself or the official subfolder), and which kind."""
    for kind in ("cifar10", "cifar100"):
        for d in (root, root / SUBDIRS[kind]):
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


def unpublished(kind: str, d: Path) -> str:
    """How the batches `read_batches(kind, d)` reads differ from the published ones (PUBLISHED_BATCHES): a file
    more or less, or another MD5; empty when they are those. Reads every file once (180 MB: about 0.3 s)."""
    published = PUBLISHED_BATCHES[kind]
    files = {p.name: p for p in source_files(kind, d)}
    extra = sorted(set(files) - set(published))
    missing = sorted(n for n in published if n not in files or not files[n].is_file())
    if extra or missing:
        return (f"{d} holds {', '.join(extra)}, which the published batches do not" if extra else
                f"{d} lacks {', '.join(missing)} of the published batches")
    for name, md5 in published.items():
        actual = md5_file(files[name])
        if actual != md5:
            return f"{name} has md5 {actual}, not the published {md5}"
    return ""


def read_batches(kind: str, d: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(train_x, train_y, test_x, test_y, classes) from the extracted batches in `d`; x is (N, 3, 32, 32) uint8."""
    # The pixels are most of each batch file, so the files' sizes bound the decoded dataset before any is read.
    sizes = sum(p.stat().st_size for p in source_files(kind, d) if p.is_file())
    limits.check_dataset_bytes(sizes, f"the CIFAR batches in {d}")
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
