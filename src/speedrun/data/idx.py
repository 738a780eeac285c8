"""IDX files, the format of MNIST, Fashion-MNIST and KMNIST (http://yann.lecun.com/exdb/mnist/).

Header: two zero bytes, a dtype code (0x08 = unsigned byte), the number of dimensions, then one
big-endian uint32 per dimension; the data follows in C order. We only accept 0x08: every dataset we
load stores pixels and labels as bytes, and anything else means the wrong file.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from speedrun.data import limits
from speedrun.data.download import Remote

# Role -> base file name as published (MNIST's own site spelled some with a dot: "t10k-images.idx3-ubyte").
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_UBYTE = 0x08


def _remote(base: str, md5s: tuple[str, str, str, str], classes: tuple[str, ...]) -> Remote:
    return Remote("idx", tuple((f"{base}{name}.gz", md5) for name, md5 in zip(FILES.values(), md5s)), classes)


# Published gzipped files and MD5s (the mirrors and values torchvision uses in datasets/mnist.py).
REMOTES = {
    "mnist": _remote(
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        ("f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432",
         "9fb629c4189551a2d022fa330f9573f3", "ec29112dd5afa0611ce80d1b7f02629c"),
        tuple("0123456789"),
    ),
    "fashion-mnist": _remote(
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe",
         "bef4ecab320f06d8554ea6380940ec79", "bb300cfdad3c16e7a12a480ee83cd310"),
        ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    ),
    "kmnist": _remote(
        "http://codh.rois.ac.jp/kmnist/dataset/kmnist/",
        ("bdb82020997e1d708af4cf47b453dcf7", "e144d726b3acfaa3e44228e80efcd344",
         "5c965bf0a639b31b8f53240b1b52f4d7", "7320c461ea6c1c855c0b718fb2a4b134"),
        ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"),
    ),
}


_CHUNK = 1 << 20  # read 1 MiB at a time: pages of the output are touched only as real data arrives


def _read_exact(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes (fewer only at end of file); gzip's read() may return less than asked mid-stream."""
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_idx(path: Path, *, shape: tuple[int | None, ...] | None = None) -> np.ndarray:
    """The array in one IDX file (gzipped if the name ends in .gz), shape from its header, dtype uint8.

    The header is read and checked first (magic, dimension count, and the byte count its dimensions promise,
    against `limits`), then exactly that many bytes are read into a preallocated array and the file must end
    there. So a small file claiming a huge shape, or a small .gz inflating to far more than its header says,
    fails after reading at most what the header legitimately promises. `shape`: what the caller expects, None
    for any size along that axis (checked against the header before any data is read).
    """
    try:
        with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
            return _read_idx_stream(f, path, shape)
    # BadGzipFile is an OSError; EOFError is a .gz cut short; zlib.error is a damaged deflate stream. Reading
    # to the end makes gzip check its CRC-32 and length, so a flipped byte lands here too.
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"IDX file {path} does not exist; check the path") from None
        raise ValueError(f"{path} is not a readable IDX or gzip file ({e}); replace it with a good copy") from None


def _read_idx_stream(f: BinaryIO, path: Path, shape: tuple[int | None, ...] | None) -> np.ndarray:
    head = _read_exact(f, 4)
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic {head.hex() or 'empty'}); replace it with a good copy")
    code, ndim = head[2], head[3]
    if code != _UBYTE:
        raise ValueError(f"{path}: IDX dtype code 0x{code:02x} is not supported (only 0x08, unsigned bytes)")
    if not 1 <= ndim <= limits.MAX_IDX_DIMS:
        raise ValueError(f"{path}: IDX header claims {ndim} dimensions (1 to {limits.MAX_IDX_DIMS} are valid); "
                         f"replace it with a good copy")
    raw_dims = _read_exact(f, 4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise ValueError(f"{path}: IDX header claims {ndim} dimensions but the file is too short; replace it")
    dims = struct.unpack(f">{ndim}I", raw_dims)
    if shape is not None and (len(dims) != len(shape) or any(s not in (None, d) for s, d in zip(shape, dims))):
        want = ", ".join("NHWC"[i] if s is None else str(s) for i, s in enumerate(shape))
        want = f"({want},)" if len(shape) == 1 else f"({want})"
        raise ValueError(f"{path}: expected shape {want}, the header says {dims}; is it the right file?")
    expected = math.prod(dims)  # Python ints: no overflow, so an absurd claim is seen as absurd
    # Every IDX file we read becomes part of an in-memory dataset, so its claim is held to the dataset limit.
    limits.check_dataset_bytes(expected, f"IDX file {path} (header shape {dims})")
    # np.empty maps the pages lazily: a header that lies about its size on a short file costs only what is read.
    out = np.empty(expected, dtype=np.uint8)
    view, got = memoryview(out), 0
    while got < expected:
        n = f.readinto(view[got : got + _CHUNK])
        if not n:
            raise ValueError(
                f"{path}: header says {dims} = {expected} bytes of data but the file has {got}; "
                f"it is truncated or corrupt, replace it"
            )
        got += n
    if f.read(1):
        raise ValueError(
            f"{path}: header says {dims} = {expected} bytes of data but more follows; the file is corrupt or "
            f"not one IDX array, replace it"
        )
    return out.reshape(dims)  # owned and writable, so torch.from_numpy later needs no copy


def find_files(root: Path) -> dict[str, Path] | None:
    """Role -> path for the four IDX files in `root` (or its `raw/`), gzipped or not; None if none at all.

    A .gz file is taken before its uncompressed twin (torchvision's raw/ holds both): the published files are the
    gzipped ones, and only they have an MD5 to check a named dataset's copy against.
    Raises if only some are there, because then the user clearly meant this folder.
    """
    for d in (root, root / "raw"):
        found: dict[str, Path] = {}
        for role, base in FILES.items():
            dotted = base.replace("-idx", ".idx")
            for name in (base + ".gz", base, dotted + ".gz", dotted):
                if (d / name).is_file():
                    found[role] = d / name
                    break
        if len(found) == len(FILES):
            return found
        if found:
            missing = [FILES[r] for r in FILES if r not in found]
            raise FileNotFoundError(f"{d} has some IDX files but not {', '.join(missing)} (or .gz); add them")
    return None


def read_split(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(N, 1, H, W) uint8 images and (N,) int64 labels from an image file and its label file."""
    x = read_idx(images_path, shape=(None, None, None))
    if x.shape[0] == 0:
        raise ValueError(f"{images_path} holds no images (its header says {x.shape}); replace it with a good copy")
    # The label file's header must promise one byte per image, checked before its data is read.
    y = read_idx(labels_path, shape=(x.shape[0],))
    return x[:, None], y.astype(np.int64)


def check_inferred_classes(train_y: np.ndarray, test_y: np.ndarray, train_path: Path, test_path: Path) -> None:
    """Where the classes come from the data (0..largest label), require every one of them in the training labels.

    One stray byte (a 255 among digits) would otherwise silently make 256 classes, most never seen in training.
    """
    both = np.concatenate([train_y, test_y])
    empty = np.flatnonzero(np.bincount(train_y, minlength=int(both.max(initial=0)) + 1) == 0)
    if empty.size:
        first = int(empty[0])
        stray = np.unique(both[both > first])  # the labels beyond the first unused class
        path = train_path if int(train_y.max(initial=0)) > first else test_path
        raise ValueError(
            f"{path}: {_labels(stray.tolist(), 'label')} {'leaves' if stray.size == 1 else 'leave'} "
            f"{_labels(empty.tolist(), 'class', 'classes')} with no training "
            f"example (a stray label?); fix the label files so the classes are 0..K-1 and all occur in training"
        )


def _labels(values: list[int], one: str, many: str | None = None) -> str:
    """"label 7", "labels 7..9": the noun for as many values, then the values (_ranges)."""
    return f"{one if len(values) == 1 else many or one + 's'} {_ranges(values)}"


def _ranges(values: list[int], most: int = 6) -> str:
    """[1, 2, 3, 7, 200] -> '1..3, 7, 200', so label lists in messages stay one short line."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = [str(a) if a == b else f"{a}..{b}" for a, b in runs[:most]]
    return ", ".join(text) + (f" and {len(runs) - most} more" if len(runs) > most else "")
