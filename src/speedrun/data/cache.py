"""The dataset cache: one torch file per decoded source, written atomically, checksummed, read with weights_only.

The cache file name carries a fingerprint of the source (published MD5s, or path + names + sizes + mtimes of
local files), so editing an image folder or swapping files in --data-dir rebuilds it. Every file carries a SHA-256
of its contents, verified on load: a corrupt file is rebuilt from the source with a warning, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

import torch

from speedrun.data import limits
from speedrun.data.dataset import TENSORS, Dataset, check_data_limit, check_dataset, content_fingerprint
from speedrun.errors import warn
from speedrun.paths import in_the_way

# Bump when the cache layout changes (this layout's "sha256" is built on the content fingerprint): the number is part
# of every cache file's name and payload, so files of another layout simply stop matching.
CACHE_FORMAT = 4
# What a cache file holds besides the pixels: the zip's headers, the pickled index, int64 labels (0.5 MB for 60,000
# images) and class names. A file larger than the data limit by more than this holds too many pixels.
_CACHE_OVERHEAD_BYTES = 2**20

Log = Callable[[str], None]
# What a build says of its first read, given to it by `cached`: true only when the cache folder can be written.
CACHED_AFTERWARDS = "first read; cached afterwards"
NOT_CACHED = "not cached: the cache folder cannot be written"


def fingerprint_files(files: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for f in files:
        # A missing file (say batches.meta) is the reader's error to report, with its fix; not ours.
        st = f.stat() if f.exists() else None
        # fsencode: a path that is not UTF-8 hashes as its bytes (a strict .encode() would raise on it).
        h.update(os.fsencode(f.resolve()) + f"\t{st and st.st_size}\t{st and st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cache_path(cache_root: Path, name: str, source_id: str, content: str) -> Path:
    """<name>-<source>-<content>.pt: one source keeps one file, the content part changes with the data."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:48]
    # surrogateescape: source_id holds the resolved path, whose bytes need not be UTF-8.
    source = hashlib.sha256(f"{CACHE_FORMAT}\n{source_id}".encode("utf-8", "surrogateescape")).hexdigest()[:8]
    digest = hashlib.sha256(content.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return cache_root / "cache" / f"{slug}-{source}-{digest}.pt"


class _ChecksumMismatch(ValueError):
    pass


def cached(path: Path, build: Callable[[str], Dataset], log: Log, *, source: str | None = None) -> Dataset:
    """The dataset from the cache file at `path`, else from build(note), checked and then cached there.

    `note` is what build's first-read line says in its parentheses: CACHED_AFTERWARDS, or NOT_CACHED when the cache
    folder cannot be written (a warning then says why), so that line is true either way.
    A cache file that fails in any way (unreadable, wrong layout, checksum, labels) is rebuilt with a warning: the
    source is still there, so nothing is lost but time. `source` names the data in check_dataset's messages.
    """
    shown = str(path)
    if path.exists():
        start = time.perf_counter()
        try:
            size = os.stat(path).st_size
        except OSError:
            size = 0  # _read_cache below reports it
        if size > limits.max_dataset_bytes() + _CACHE_OVERHEAD_BYTES:
            # Not read (a file is hostile until checked), and not warned about: either the data is over the limit,
            # which the rebuild's reader refuses in one line before reading it, or the file is damaged and the
            # rebuild replaces it.
            log(f"cache {shown} is over the data limit; reading the source instead")
            return _build_and_write(path, build, log, source)
        try:
            ds = _read_cache(path)
        except _ChecksumMismatch:
            warn(f"cache {shown} is corrupt (checksum mismatch); rebuilding it from the source")
        # Broad on purpose: a truncated or foreign file can fail inside torch.load in many ways
        # (RuntimeError, EOFError, UnpicklingError, zipfile errors ...); every one means "rebuild".
        except Exception as e:  # noqa: BLE001
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:160]
            warn(f"cache {shown} is unreadable ({reason}); rebuilding it from the source")
        else:
            log(f"loaded {ds.name} from cache {shown} in {time.perf_counter() - start:.2f} s")
            return ds
    return _build_and_write(path, build, log, source)


def _build_and_write(path: Path, build: Callable[[str], Dataset], log: Log, source: str | None) -> Dataset:
    # Asked before the build, whose first line says whether it is cached; warned about after it, so a source that
    # is refused is one line.
    blocked = _unwritable(path.parent)
    ds = build(NOT_CACHED if blocked else CACHED_AFTERWARDS)
    # Before writing: a cache never holds a dataset we would refuse.
    check_data_limit(check_dataset(ds, source or ds.name), source or ds.name)
    if blocked:
        _not_written(path, blocked)
    else:
        _write_cache(path, ds, log)
    return ds


def _unwritable(folder: Path) -> str | None:
    """Why no file can be written in `folder` (created with its parents if missing), else None: tried with a file
    created and removed at once. os.access cannot tell: it says yes to root, and knows nothing of /proc."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".speedrun-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return _why_not(folder, e)
    return None


def _why_not(folder: Path, e: OSError) -> str:
    blocked = in_the_way(folder)
    return (f"{blocked}: remove or rename it, or set SPEEDRUN_DATA to another folder" if blocked else
            e.strerror or str(e))


def _not_written(path: Path, why: str) -> None:
    # A read-only or full cache dir costs speed next time, not correctness now.
    warn(f"could not write cache {path} ({why}); continuing without it, so the next run decodes again")


def checksum(name: str, classes: list[str], tensors: dict[str, torch.Tensor], unofficial: str = "") -> str:
    """sha256 over the cache format, the name, Dataset.unofficial and the content's fingerprint
    (dataset.content_fingerprint: the classes, each tensor's dtype, shape and bytes).

    torch.load does not check the zip members' CRC-32, so without this a flipped byte in a label loads silently.
    Cost, measured on 60,000 x 3x32x32 images (184 MB, one AMD EPYC core with SHA-NI): 0.092 s per hash (2.0 GB/s),
    paid once per write and once per cache hit, which it takes from 0.045 s (torch.load alone) to 0.14 s; the
    fingerprint it computes is the dataset's identity too, so a hit hands it on rather than hashing again.
    """
    return _checksum(name, unofficial, content_fingerprint(classes, tensors))


def _checksum(name: str, unofficial: str, content: str) -> str:
    header = {"format": CACHE_FORMAT, "name": name, "unofficial": unofficial, "content": content}
    return hashlib.sha256(json.dumps(header).encode()).hexdigest()  # ensure_ascii: surrogates encode too


def _read_cache(path: Path) -> Dataset:
    # A cache is a file from disk like any other: a FIFO at its path would block the read forever, and no cache
    # can be larger than the dataset limit it was checked against when written (plus its small header).
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    # torch.save stores its zip members uncompressed; torch.load would inflate a deflated one whole before the
    # checksum could refuse it (a 3 MB file holding 3 GB). The central directory says so before anything is read.
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > st.st_size:
                raise ValueError(f"zip member {info.filename!r} is compressed or larger than the file")
    # weights_only=True: the file holds only tensors, strings and ints, so no pickle code can run.
    d = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(d, dict) or d.get("format") != CACHE_FORMAT:
        raise ValueError("not a speedrun cache file of this version")
    tensors = {k: d[k] for k in TENSORS}
    name, classes, digest = d["name"], d["classes"], d["sha256"]
    unofficial = d.get("unofficial", "")
    ok = (
        all(isinstance(v, torch.Tensor) for v in tensors.values())
        and isinstance(name, str) and isinstance(digest, str) and isinstance(unofficial, str)
        and isinstance(classes, list) and all(isinstance(c, str) for c in classes)
    )
    if not ok:
        raise ValueError("entries have the wrong types")
    content = content_fingerprint(classes, tensors)
    if _checksum(name, unofficial, content) != digest:
        raise _ChecksumMismatch("checksum mismatch")
    # Dataset checks dtypes and shapes, check_dataset the labels' range and class names: both raise ValueError,
    # so rebuild.
    ds = Dataset(name, *(tensors[k].contiguous() for k in TENSORS), classes, unofficial=unofficial)
    ds._fingerprint = content  # just computed over these very tensors
    return check_dataset(ds, str(path))


def _write_cache(path: Path, ds: Dataset, log: Log) -> None:
    """Write atomically (temp file in the same directory, then os.replace) and drop this source's old caches."""
    shown = str(path)
    payload = {"format": CACHE_FORMAT, "name": ds.name, "classes": list(ds.classes), "unofficial": ds.unofficial}
    payload.update({k: getattr(ds, k) for k in TENSORS})
    payload["sha256"] = _checksum(ds.name, ds.unofficial, ds.fingerprint())
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".speedrun-cache-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it private; a cache is as readable as its data
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:  # the folder took a probe file (_unwritable), but not this one: full, say
        _not_written(path, _why_not(path.parent, e))
        return
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    log(f"cached {ds.name} at {shown}")
    stem = path.name.rsplit("-", 1)[0]
    for old in path.parent.glob(f"{stem}-*.pt"):
        if old != path and old.name.rsplit("-", 1)[0] == stem:
            try:
                old.unlink()
            except OSError:
                pass  # another process may have removed it first
