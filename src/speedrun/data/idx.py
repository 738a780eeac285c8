"""IDX files, the format of MNIST, Fashion-MNIST and KMNIST (http://yann.lecun.com/exdb/mnist/).

Header: two zero bytes, a dtype code (0x08 = unsigned byte), the number of dimensions, then one
big-endian uint32 per dimension; the data follows in C order. We only accept 0x08: every dataset we
load stores pixels and labels as bytes, and anything else means the wrong file.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

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


def read_idx(path: Path) -> np.ndarray:
    """The array in one IDX file (gzipped if the name ends in .gz), shape from its header, dtype uint8."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"IDX file {path} does not exist; check the path") from None
        raise ValueError(f"{path} is not a readable gzip file ({e}); replace it with a good copy") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        magic = raw[:4].hex() or "empty"
        raise ValueError(f"{path} is not an IDX file (bad magic {magic}); replace it with a good copy")
    code, ndim = raw[2], raw[3]
    if code != _UBYTE:
        raise ValueError(f"{path}: IDX dtype code 0x{code:02x} is not supported (only 0x08, unsigned bytes)")
    if ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: IDX header claims {ndim} dimensions but the file is too short; replace it")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise ValueError(
            f"{path}: header says {dims} = {expected} bytes of data but the file has {len(raw) - offset}; "
            f"it is truncated or corrupt, replace it"
        )
    # bytearray -> writable, owned memory, so torch.from_numpy later needs no copy and gives no warning.
    return np.frombuffer(bytearray(raw[offset:]), dtype=np.uint8).reshape(dims)


def find_files(root: Path) -> dict[str, Path] | None:
    """Role -> path for the four IDX files in `root` (or its `raw/`), gzipped or not; None if none at all.

    Raises if only some are there, because then the user clearly meant this folder.
    """
    for d in (root, root / "raw"):
        found: dict[str, Path] = {}
        for role, base in FILES.items():
            dotted = base.replace("-idx", ".idx")
            for name in (base, base + ".gz", dotted, dotted + ".gz"):
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
    x = read_idx(images_path)
    y = read_idx(labels_path)
    if x.ndim != 3:
        raise ValueError(f"{images_path}: expected 3 dimensions (N, H, W), the header has {x.shape}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{labels_path}: expected {x.shape[0]} labels for {images_path.name}, got shape {y.shape}")
    return x[:, None], y.astype(np.int64)
