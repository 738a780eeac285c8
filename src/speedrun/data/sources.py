"""Where datasets come from: `load_dataset(spec)` turns a name or a path into a `Dataset`.

Named datasets are downloaded once (MD5-verified) into `<cache_dir>/downloads/`; every decoded dataset
except `synthetic` is then saved as one torch file in `<cache_dir>/cache/` and read from there next time.
The cache file name carries a fingerprint of the source (published MD5s, or path + names + sizes +
mtimes of local files), so editing an image folder or swapping files in --data-dir rebuilds it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from speedrun.data import cifar, folder, idx, synthetic
from speedrun.data.dataset import Dataset
from speedrun.data.download import Remote, fetch, safe_extract

CACHE_FORMAT = 1  # bump when the cache layout changes: old files then simply stop matching


# Every named dataset's published files; tests point the entries at local file:// archives.
SOURCES: dict[str, Remote] = {**cifar.REMOTES, **idx.REMOTES}

Log = Callable[[str], None]


def _no_log(_: str) -> None:
    pass


def load_dataset(
    spec: str,
    *,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    log: Log | None = None,
) -> Dataset:
    """Load a dataset by name (cifar10, cifar100, mnist, fashion-mnist, kmnist, synthetic[:k=v,...]) or path.

    A path may be an image folder (ROOT/{train,test}/<class>/<image>), a folder of CIFAR python batches,
    a cifar-*-python.tar.gz (or a folder holding one), or a folder of IDX files.
    data_dir: where a named dataset's raw files already are; looked at before downloading.
    cache_dir: downloads and caches go here; default $SPEEDRUN_DATA, else ~/.cache/speedrun.
    download: False never touches the network (cache, data_dir or files already in downloads/ only).
    log: receives progress lines (downloads, first-read decoding, cache hits).
    """
    log = log or _no_log
    text = os.fspath(spec).strip()
    lowered = text.lower()
    if lowered == "synthetic" or lowered.startswith("synthetic:"):
        return synthetic.make(text)
    cache_root = Path(cache_dir or os.environ.get("SPEEDRUN_DATA") or "~/.cache/speedrun").expanduser()
    if lowered in SOURCES:
        return _load_named(lowered, data_dir, cache_root, download, log)
    path = Path(text).expanduser()
    if text and path.exists():
        return _load_path(path, cache_root, log)
    raise ValueError(
        f"unknown dataset {text!r}: use one of {', '.join(SOURCES)}, synthetic or synthetic:key=val,..., "
        f"or a path that exists (image folder with train/ and test/, CIFAR batches or .tar.gz, IDX files)"
    )


# ---- named datasets ---------------------------------------------------------------------------------------------


def _load_named(name: str, data_dir: str | os.PathLike | None, cache_root: Path, download: bool, log: Log) -> Dataset:
    remote = SOURCES[name]
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        if root.is_file():  # --data-dir may name the archive itself
            return _load_found(_detect(root), cache_root, log, name=name, classes=remote.classes)
        if not root.is_dir():
            raise FileNotFoundError(f"data dir {root} does not exist; create it or fix --data-dir")
        found = _find_local(name, remote, root)
        if found is not None:
            return _load_found(found, cache_root, log, name=name, classes=remote.classes)
        log(f"no {name} files in {root}; using {cache_root / 'downloads'}")
    downloads = cache_root / "downloads" / ("" if remote.kind == "cifar" else name)

    def build() -> Dataset:
        paths = []
        for url, md5 in remote.files:
            dest = downloads / url.rsplit("/", 1)[-1]
            if not download and not dest.exists():
                raise FileNotFoundError(
                    f"{dest.name} is not in {downloads} and downloading is off; put {dest.name} (md5 {md5}) "
                    f"there or pass --data-dir"
                )
            paths.append(fetch(url, dest, md5, log))
        if remote.kind == "cifar":
            return _dataset(name, *_read_archive(paths[0], cache_root, log, expect=name)[1])
        return _dataset(name, *_read_idx(dict(zip(idx.FILES, paths)), remote.classes))

    md5s = "\n".join(md5 for _, md5 in remote.files)
    return _cached(_cache_path(cache_root, name, "official", md5s), build, log)


@dataclass(frozen=True)
class _Found:
    kind: str  # "cifar10" / "cifar100" (extracted batches), "archive", "idx" or "folder"
    path: Path
    files: tuple[Path, ...] = ()  # what the cache fingerprint covers (folders list their own)
    idx_files: tuple[tuple[str, Path], ...] = ()


def _find_local(name: str, remote: Remote, root: Path) -> _Found | None:
    """The raw files for `name` in a --data-dir, if there."""
    if remote.kind == "cifar":
        batches = cifar.find_batches(root)
        if batches is not None and batches[0] == name:
            return _Found(batches[0], batches[1], tuple(cifar.source_files(*batches)))
        archive = root / cifar.ARCHIVE_NAMES[name]
        return _Found("archive", archive, (archive,)) if archive.is_file() else None
    for d in (root, root / name):
        files = idx.find_files(d)
        if files is not None:
            return _Found("idx", d, tuple(files.values()), tuple(files.items()))
    return None


def _detect(path: Path) -> _Found:
    """What kind of dataset lives at a user-given path; raises with the accepted layouts if none."""
    if path.is_file():
        if path.name.endswith((".tar.gz", ".tgz", ".tar")):
            return _Found("archive", path, (path,))
        raise ValueError(f"{path} is a file but not a .tar.gz archive; pass a CIFAR archive or a dataset folder")
    if folder.is_image_folder(path):
        return _Found("folder", path)
    batches = cifar.find_batches(path)
    if batches is not None:
        return _Found(batches[0], batches[1], tuple(cifar.source_files(*batches)))
    archive = cifar.find_archive(path)
    if archive is not None:
        return _Found("archive", archive[1], (archive[1],))
    files = idx.find_files(path)
    if files is not None:
        return _Found("idx", path, tuple(files.values()), tuple(files.items()))
    raise ValueError(
        f"{path} holds no dataset: expected train/ and test/ class folders, CIFAR python batches "
        f"(data_batch_N + test_batch, or train + test + meta), a cifar-*-python.tar.gz, or IDX files"
    )


def _load_path(path: Path, cache_root: Path, log: Log) -> Dataset:
    found = _detect(path)
    # Extracted CIFAR batches are named by kind; other sources by their folder or archive name (an
    # archive's kind is known only after extraction, and build() names the Dataset then).
    base = path.resolve().name
    base = base[: -len(".tar.gz")] if base.endswith(".tar.gz") else Path(base).stem if path.is_file() else base
    name = found.kind if found.kind in cifar.ARCHIVE_NAMES else base or "dataset"
    return _load_found(found, cache_root, log, name=name, classes=())


def _load_found(found: _Found, cache_root: Path, log: Log, *, name: str, classes: tuple[str, ...]) -> Dataset:
    source_id = f"{name}@{found.path.resolve()}"
    if found.kind == "folder":
        class_names, splits = folder.list_images(found.path)
        content = folder.fingerprint(found.path, splits)

        def build() -> Dataset:
            n = sum(len(files) for files in splits.values())
            log(f"decoding {n} images from {found.path} (first read; cached afterwards)")
            start = time.perf_counter()
            train, test = splits["train"], splits["test"]
            # One decode for both splits, so they agree on the channel count (1 only if every image is grey).
            x = folder.decode([f.path for f in train + test])
            log(f"decoded {n} images in {time.perf_counter() - start:.1f} s")
            labels = [np.array([f.label for f in files], np.int64) for files in (train, test)]
            return _dataset(name, x[: len(train)], labels[0], x[len(train) :], labels[1], class_names)
    else:
        content = _fingerprint(found.files)

        def build() -> Dataset:
            if found.kind == "archive":
                expect = name if name in SOURCES else None
                kind, arrays = _read_archive(found.path, cache_root, log, expect=expect)
                return _dataset(expect or kind, *arrays)
            if found.kind == "idx":
                return _dataset(name, *_read_idx(dict(found.idx_files), classes))
            log(f"reading CIFAR batches from {found.path} (first read; cached afterwards)")
            return _dataset(name, *cifar.read_batches(found.kind, found.path))

    return _cached(_cache_path(cache_root, name, source_id, content), build, log)


# ---- readers -----------------------------------------------------------------------------------------------------


def _read_archive(archive: Path, cache_root: Path, log: Log, *, expect: str | None) -> tuple[str, tuple]:
    """Extract a CIFAR archive next to the downloads, read its batches, and delete the extracted copy."""
    scratch = cache_root / "downloads"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".extract-", dir=scratch) as tmp:
        log(f"extracting {archive} (first read; cached afterwards)")
        safe_extract(archive, tmp)
        found = cifar.find_batches(Path(tmp))
        if found is None:
            raise ValueError(
                f"{archive} holds no CIFAR python batches; use cifar-10-python.tar.gz or cifar-100-python.tar.gz"
            )
        if expect is not None and found[0] != expect:
            raise ValueError(f"{archive} holds {found[0]} batches, not {expect}; use {cifar.ARCHIVE_NAMES[expect]}")
        return found[0], cifar.read_batches(*found)


def _read_idx(files: dict[str, Path], classes: tuple[str, ...]) -> tuple:
    train_x, train_y = idx.read_split(files["train_images"], files["train_labels"])
    test_x, test_y = idx.read_split(files["test_images"], files["test_labels"])
    if train_x.shape[1:] != test_x.shape[1:]:
        raise ValueError(f"train images are {train_x.shape[1:]} but test images {test_x.shape[1:]}; mixed datasets?")
    top = int(max(train_y.max(initial=0), test_y.max(initial=0)))
    if classes and top >= len(classes):
        raise ValueError(f"{files['train_labels']}: label {top} but the dataset has {len(classes)} classes")
    return train_x, train_y, test_x, test_y, list(classes) or [str(i) for i in range(top + 1)]


def _dataset(name: str, train_x, train_y, test_x, test_y, classes: list[str]) -> Dataset:
    def t(a: np.ndarray, dtype: np.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))

    return Dataset(name, t(train_x, np.uint8), t(train_y, np.int64), t(test_x, np.uint8), t(test_y, np.int64), classes)


# ---- cache -------------------------------------------------------------------------------------------------------


def _fingerprint(files: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for f in files:
        # A missing file (say batches.meta) is the reader's error to report, with its fix; not ours.
        st = f.stat() if f.exists() else None
        h.update(f"{f.resolve()}\t{st and st.st_size}\t{st and st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _cache_path(cache_root: Path, name: str, source_id: str, content: str) -> Path:
    """<name>-<source>-<content>.pt: one source keeps one file, the content part changes with the data."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:48]
    source = hashlib.sha256(f"{CACHE_FORMAT}\n{source_id}".encode()).hexdigest()[:8]
    return cache_root / "cache" / f"{slug}-{source}-{hashlib.sha256(content.encode()).hexdigest()[:16]}.pt"


def _cached(path: Path, build: Callable[[], Dataset], log: Log) -> Dataset:
    if path.exists():
        start = time.perf_counter()
        try:
            ds = _read_cache(path)
        # Broad on purpose: a truncated or foreign file can fail inside torch.load in many ways
        # (RuntimeError, EOFError, UnpicklingError, zipfile errors ...); every one means "rebuild".
        except Exception as e:  # noqa: BLE001
            log(f"cache {path} is unreadable ({type(e).__name__}: {str(e)[:120]}); rebuilding it from the source")
        else:
            log(f"loaded {ds.name} from cache {path} in {time.perf_counter() - start:.2f} s")
            return ds
    ds = build()
    _write_cache(path, ds, log)
    return ds


_TENSORS = ("train_images", "train_labels", "test_images", "test_labels")


def _read_cache(path: Path) -> Dataset:
    # weights_only=True: the file holds only tensors, strings and ints, so no pickle code can run.
    d = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(d, dict) or d.get("format") != CACHE_FORMAT:
        raise ValueError("not a speedrun cache file of this version")
    x, y, tx, ty = (d[k] for k in _TENSORS)
    ok = (
        all(isinstance(v, torch.Tensor) for v in (x, y, tx, ty))
        and x.dtype == tx.dtype == torch.uint8 and x.ndim == tx.ndim == 4 and x.shape[1:] == tx.shape[1:]
        and y.dtype == ty.dtype == torch.int64 and y.shape == (len(x),) and ty.shape == (len(tx),)
        and isinstance(d["classes"], list) and all(isinstance(c, str) for c in d["classes"])
    )
    if not ok:
        raise ValueError("tensors have the wrong dtype or shape")
    return Dataset(d["name"], x.contiguous(), y.contiguous(), tx.contiguous(), ty.contiguous(), d["classes"])


def _write_cache(path: Path, ds: Dataset, log: Log) -> None:
    """Write atomically (temp file in the same directory, then os.replace) and drop this source's old caches."""
    payload = {"format": CACHE_FORMAT, "name": ds.name, "classes": list(ds.classes)}
    payload.update({k: getattr(ds, k) for k in _TENSORS})
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it private; a cache is as readable as its data
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        # A read-only or full cache dir costs speed next time, not correctness now.
        log(f"could not write cache {path} ({e}); continuing without it")
        return
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    log(f"cached {ds.name} at {path}")
    stem = path.name.rsplit("-", 1)[0]
    for old in path.parent.glob(f"{stem}-*.pt"):
        if old != path and old.name.rsplit("-", 1)[0] == stem:
            try:
                old.unlink()
            except OSError:
                pass  # another process may have removed it first
