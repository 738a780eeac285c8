"""Image folders: `ROOT/{train,test}/<class>/<image>` with .jpg/.jpeg/.png files, decoded with Pillow.

Class indices follow the sorted folder names of train/. Channels come from the data: if every image
is grayscale the result has 1 channel, otherwise 3 (grayscale images are replicated into RGB).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
# Modes that carry no colour: decoded as one "L" channel. Everything else converts to RGB (alpha dropped).
_GRAY_MODES = {"L", "LA", "1"}
_CHUNK = 1024  # images per pool task: ~3 MB of pixels back per task, ~60 tasks for CIFAR-10 to balance cores
_PARALLEL_MIN = 4096  # below this, starting processes costs more than it saves


@dataclass(slots=True)
class ImageFile:
    path: str
    rel: str  # "<class>/<name>", relative to the split folder
    label: int
    size: int  # bytes, with mtime_ns: the cache fingerprint
    mtime_ns: int


def is_image_folder(root: Path) -> bool:
    return (root / "train").is_dir() and (root / "test").is_dir()


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def list_images(root: Path) -> tuple[list[str], dict[str, list[ImageFile]]]:
    """(classes, {"train": [...], "test": [...]}) in a deterministic order (class, then file name)."""
    classes = _class_dirs(root / "train")
    if not classes:
        raise ValueError(f"{root / 'train'} has no class folders; lay images out as train/<class>/<image>")
    test_classes = _class_dirs(root / "test")
    if test_classes != classes:
        only_train = sorted(set(classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(classes))
        raise ValueError(
            f"{root}: train/ and test/ must hold the same class folders; only in train: {only_train or 'none'}, "
            f"only in test: {only_test or 'none'}"
        )
    splits: dict[str, list[ImageFile]] = {}
    for split in ("train", "test"):
        files = []
        for label, name in enumerate(classes):
            entries = sorted(os.scandir(root / split / name), key=lambda e: e.name)
            for e in entries:
                if e.name.lower().endswith(IMAGE_EXTENSIONS) and e.is_file():
                    st = e.stat()
                    files.append(ImageFile(e.path, f"{name}/{e.name}", label, st.st_size, st.st_mtime_ns))
        if not files:
            raise ValueError(f"{root / split} has no .jpg/.jpeg/.png images in its class folders")
        splits[split] = files
    return classes, splits


def fingerprint(root: Path, splits: dict[str, list[ImageFile]]) -> str:
    """Changes whenever a file is added, removed, renamed, resized or touched (path, size, mtime)."""
    lines = [str(root.resolve())]
    for split, files in splits.items():
        lines += [f"{split}/{f.rel}\t{f.size}\t{f.mtime_ns}" for f in files]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _decode_into(paths: list[str], out: np.ndarray, gray: np.ndarray, ref: tuple[str, tuple[int, int]]) -> None:
    """Decode paths into out (n, H, W, 3); gray images fill channel 0 only and set their `gray` flag."""
    ref_path, ref_size = ref
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                if im.size != ref_size:
                    raise ValueError(
                        f"all images must have one size: {path} is {im.size[0]}x{im.size[1]} but {ref_path} is "
                        f"{ref_size[0]}x{ref_size[1]}; resize them first"
                    )
                if im.mode.startswith(("I", "F")):
                    raise ValueError(f"{path} has {im.mode} (16/32-bit) pixels; convert it to 8-bit first")
                if im.mode in _GRAY_MODES:
                    out[i, :, :, 0] = np.asarray(im if im.mode == "L" else im.convert("L"))
                    gray[i] = True
                else:
                    out[i] = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
        except (OSError, SyntaxError) as e:
            # Pillow reports unreadable/truncated files as OSError (UnidentifiedImageError) or SyntaxError.
            raise ValueError(f"cannot decode {path} ({e}); delete or replace it") from None


def _decode_chunk(paths: list[str], ref: tuple[str, tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    w, h = ref[1]
    out = np.empty((len(paths), h, w, 3), dtype=np.uint8)
    gray = np.zeros(len(paths), dtype=bool)
    _decode_into(paths, out, gray, ref)
    return out, gray


def default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cpus)


def decode(paths: list[str], workers: int | None = None) -> np.ndarray:
    """(N, C, H, W) uint8 from image files that must all share one size; C is 1 if all are grayscale, else 3.

    Large folders decode in a process pool. Measured on 2 cores with 32x32 JPEGs (warm page cache):
    serial 5-7 s per 60k images, 2 threads 10-11 s (slower: per-image Python work holds the GIL),
    2 processes 3.4-4.8 s. The pool uses fork, so children need no re-import and the caller's script
    needs no `if __name__ == "__main__"` guard; where fork does not exist we stay serial.
    """
    with Image.open(paths[0]) as im:
        ref = (paths[0], im.size)
    w, h = ref[1]
    out = np.empty((len(paths), h, w, 3), dtype=np.uint8)  # (N, H, W, 3): Pillow's layout
    gray = np.zeros(len(paths), dtype=bool)
    workers = default_workers() if workers is None else workers
    use_pool = workers > 1 and len(paths) >= _PARALLEL_MIN and "fork" in mp.get_all_start_methods()
    if use_pool:
        starts = range(0, len(paths), _CHUNK)
        with mp.get_context("fork").Pool(workers) as pool:
            chunks = pool.imap(partial(_decode_chunk, ref=ref), (paths[s : s + _CHUNK] for s in starts))
            for s, (o, g) in zip(starts, chunks):  # a worker's ValueError re-raises here
                out[s : s + len(o)] = o
                gray[s : s + len(g)] = g
    else:
        _decode_into(paths, out, gray, ref)
    if gray.all():
        return np.ascontiguousarray(out[:, None, :, :, 0])  # (N, 1, H, W)
    if gray.any():
        out[gray, :, :, 1:] = out[gray, :, :, :1]  # grey -> RGB by replication
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))  # (N, 3, H, W)
