"""Fetching raw dataset files: stream, verify the MD5, write atomically, safely beside concurrent fetches.

Nothing here knows about particular datasets; `sources.py` holds the URL and checksum table. Extraction is
`archive.py`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from speedrun.data import limits
from speedrun.paths import in_the_way

try:
    import fcntl  # POSIX advisory locks for concurrent downloads; absent on Windows
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_CHUNK = 1 << 20  # 1 MiB: big enough to keep urllib and hashlib overhead negligible


@dataclass(frozen=True)
class Remote:
    """A named dataset's published files. The file name on disk is the last part of each URL."""

    kind: str  # "cifar" (one python-pickle archive) or "idx" (four IDX files)
    files: tuple[tuple[str, str], ...]  # (url, md5)
    classes: tuple[str, ...] = ()  # empty: the class names come from the data (CIFAR meta)


def _no_log(_: str) -> None:
    pass


def md5_file(path: str | os.PathLike) -> str:
    """Hex MD5 of a file, read in chunks so a 170 MB archive never sits in memory twice."""
    # usedforsecurity=False: MD5 is only an integrity check against published values, and FIPS builds
    # refuse plain hashlib.md5().
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _reuse(dest: Path, md5: str, log: Callable[[str], None]) -> Path:
    """`dest` if its MD5 is right; it is never deleted or overwritten, so a wrong one is the user's to decide."""
    try:
        actual = md5_file(dest)
    except OSError as e:
        raise ValueError(f"cannot read {dest} ({e}); fix its permissions or delete it to download it again") from None
    if actual != md5:
        raise ValueError(
            f"{dest} exists but its md5 is {actual}, expected {md5}; delete {dest} to download it again "
            f"or pass data_dir (--data-dir) with a good copy"
        )
    log(f"using {dest} (md5 ok)")
    return dest


@contextlib.contextmanager
def _download_lock(dest: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an advisory lock on `.<dest name>.lock` beside `dest`, so one process downloads and others wait.

    The lock file is removed by its holder before unlocking. A waiter may then hold a lock on a file that is no
    longer at that path (or has been replaced), so after locking it checks that the path still names the file it
    locked, and starts over if not: whoever proceeds holds the lock on the one current lock file. Where there is
    no fcntl (Windows) or the file system refuses locks, this does nothing: publishing stays safe (see fetch),
    at worst two processes both download.
    """
    fd = _lock_file(dest.with_name(f".{dest.name}.lock"), dest.name, log) if fcntl is not None else None
    try:
        yield
    finally:
        if fd is not None:
            try:
                os.unlink(dest.with_name(f".{dest.name}.lock"))  # while still holding it: see above
            except OSError:
                pass
            os.close(fd)


def _lock_file(lock_path: Path, name: str, log: Callable[[str], None]) -> int | None:
    """An open descriptor holding an exclusive flock on the file now at `lock_path`; None where locks fail."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # an unwritable directory: the download itself will say so
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting for another process downloading {name}")
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. ENOLCK on some network file systems
            os.close(fd)
            return None
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            return fd
        os.close(fd)  # the holder before us removed this file; lock the one there now


def fetch(
    url: str,
    dest: str | os.PathLike,
    md5: str,
    log: Callable[[str], None] | None = None,
    *,
    timeout: float = 60.0,
    max_bytes: int = limits.MAX_DOWNLOAD_BYTES,
) -> Path:
    """Make `dest` a verified copy of `url`, downloading only if it is not already there.

    Safe for concurrent callers (several ranks or jobs sharing one cache): each process streams into its own
    temporary `.<name>.*.part` beside `dest` and publishes it only after the MD5 matches, with a hard link that
    fails rather than replace an existing `dest`; so a crash, a truncated transfer or a wrong file never leaves
    something at `dest` that looks finished, and two writers never share a file. An advisory lock makes a
    second process wait and reuse the first one's file instead of downloading it again. An existing `dest` is
    never deleted or overwritten: with the right MD5 it is reused, with the wrong one this raises and the user
    decides. A response longer than `max_bytes` is cut off and refused as it arrives (the MD5 is known only at
    the end), so a server sending without end cannot fill the disk.
    """
    log = log or _no_log
    dest = Path(dest)
    if dest.exists():
        return _reuse(dest, md5, log)
    offline_fix = f"put {dest.name} (md5 {md5}) in {dest.parent} or pass data_dir (--data-dir)"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocked = in_the_way(dest.parent)
        if blocked:  # "File exists" / "Not a directory": no permission would help
            raise ValueError(f"cannot create {dest.parent} ({blocked}); remove or rename it, or set SPEEDRUN_DATA "
                             f"to another folder, or {offline_fix}") from None
        raise ValueError(f"cannot create {dest.parent} ({e}); fix its permissions or {offline_fix}") from None
    with _download_lock(dest, log):
        if dest.exists():  # another process published it while we waited
            return _reuse(dest, md5, log)
        try:
            fd, part_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        except OSError as e:
            raise ValueError(f"cannot write in {dest.parent} ({e}); fix its permissions or {offline_fix}") from None
        part = Path(part_name)
        try:
            with os.fdopen(fd, "wb") as out:
                if hasattr(os, "fchmod"):  # mkstemp makes it private; a download is as readable as its folder
                    os.fchmod(out.fileno(), 0o644)
                start = time.perf_counter()
                received = _download(url, out, md5, dest, offline_fix, timeout, max_bytes, log)
            if publish(part, dest):
                log(f"downloaded {dest.name}: {received / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s, "
                    f"md5 ok")
                return dest
            log(f"another process published {dest.name} first")
            return _reuse(dest, md5, log)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"cannot write {dest} ({e}); free space or fix permissions, or {offline_fix}") from None
        finally:
            # On success `part` was linked to `dest` and is only a second name; on failure a useless fragment.
            part.unlink(missing_ok=True)


def _download(url: str, out, md5: str, dest: Path, offline_fix: str, timeout: float, max_bytes: int,
              log: Callable[[str], None]) -> int:
    """Stream `url` into `out`, check the MD5, and return the byte count."""
    h = hashlib.md5(usedforsecurity=False)
    received = 0
    try:
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise FileNotFoundError(f"cannot download {url} ({reason}); {offline_fix}") from None
    log(f"downloading {url} -> {dest}")  # once connected: offline, the error above is the only line
    with response:
        length = response.headers.get("Content-Length") if response.headers else None
        expected_len = int(length) if length and length.isdigit() else None
        while True:
            try:
                chunk = response.read(_CHUNK)
            except http.client.IncompleteRead as e:
                # The server closed early: keep what arrived so the checksum message below is honest.
                chunk = e.partial
                h.update(chunk)
                out.write(chunk)
                received += len(chunk)
                break
            except (urllib.error.URLError, OSError) as e:
                raise FileNotFoundError(
                    f"download of {url} broke off after {received} bytes ({e}); {offline_fix}"
                ) from None
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
            received += len(chunk)
            if received > max_bytes:
                raise ValueError(f"{url} sent more than {max_bytes} bytes, more than {dest.name} holds; the server "
                                 f"is not sending the published file: {offline_fix}")
    actual = h.hexdigest()
    if actual != md5:
        size_note = f", got {received} of {expected_len} bytes" if expected_len not in (None, received) else ""
        raise ValueError(
            f"downloaded {dest.name} has md5 {actual}, expected {md5}{size_note}; the download is "
            f"truncated or the file changed upstream: retry, or {offline_fix}"
        )
    return received


def publish(part: Path, dest: Path) -> bool:
    """Give the verified `part` the name `dest`; False, touching nothing, if a `dest` appeared meanwhile."""
    try:
        os.link(part, dest)  # atomic, and fails with FileExistsError instead of overwriting
    except FileExistsError:
        return False
    except OSError:
        # No hard links here (some FUSE or SMB mounts): rename under the lock. On Windows os.rename refuses an
        # existing target by itself; elsewhere the lock, and this check, keep it from replacing one.
        if dest.exists():
            return False
        os.rename(part, dest)
    return True
