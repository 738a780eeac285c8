"""Fetching raw dataset files: stream, verify the MD5, write atomically; and extract tar archives safely.

Nothing here knows about particular datasets; `sources.py` holds the URL and checksum table.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import http.client
import lzma
import os
import shutil
import stat
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from speedrun.data import limits

try:
    import fcntl  # POSIX advisory locks for concurrent downloads; absent on Windows
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_CHUNK = 1 << 20  # 1 MiB: big enough to keep urllib and hashlib overhead negligible
# The largest single read tarfile may make: a PAX or long-name header's payload (real ones are < 1 kB).
_MAX_TAR_READ = 1 << 20


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
) -> Path:
    """Make `dest` a verified copy of `url`, downloading only if it is not already there.

    Safe for concurrent callers (several ranks or jobs sharing one cache): each process streams into its own
    temporary `.<name>.*.part` beside `dest` and publishes it only after the MD5 matches, with a hard link that
    fails rather than replace an existing `dest`; so a crash, a truncated transfer or a wrong file never leaves
    something at `dest` that looks finished, and two writers never share a file. An advisory lock makes a
    second process wait and reuse the first one's file instead of downloading it again. An existing `dest` is
    never deleted or overwritten: with the right MD5 it is reused, with the wrong one this raises and the user
    decides.
    """
    log = log or _no_log
    dest = Path(dest)
    if dest.exists():
        return _reuse(dest, md5, log)
    offline_fix = f"put {dest.name} (md5 {md5}) in {dest.parent} or pass data_dir (--data-dir)"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
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
                received = _download(url, out, md5, dest, offline_fix, timeout, log)
            if _publish(part, dest):
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


def _download(url: str, out, md5: str, dest: Path, offline_fix: str, timeout: float,
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
    actual = h.hexdigest()
    if actual != md5:
        size_note = f", got {received} of {expected_len} bytes" if expected_len not in (None, received) else ""
        raise ValueError(
            f"downloaded {dest.name} has md5 {actual}, expected {md5}{size_note}; the download is "
            f"truncated or the file changed upstream: retry, or {offline_fix}"
        )
    return received


def _publish(part: Path, dest: Path) -> bool:
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


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _check_member(member: tarfile.TarInfo, root: str, tar_name: str) -> None:
    """Refuse a member that would write outside `root` once extracted, or that is not plain data.

    Paths are resolved with realpath against what is already on disk, so a symlink extracted earlier
    (say `d/s -> ..`) cannot be used by a later member (`d/s/x`) to climb out: a purely lexical check
    would miss that chain.
    """
    name = member.name
    where = f"archive {tar_name} member {name!r}"
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise ValueError(f"{where} is a device, fifo or other special file; refusing to extract this archive")
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        raise ValueError(f"{where} has an absolute path; refusing to extract this archive")
    target = os.path.realpath(os.path.join(root, name))
    if not _inside(target, root):
        raise ValueError(f"{where} would be written outside {root}; refusing to extract this archive")
    if member.issym():
        link_base = os.path.dirname(os.path.join(root, name))
        link_target = os.path.realpath(os.path.join(link_base, member.linkname))
        if os.path.isabs(member.linkname) or not _inside(link_target, root):
            raise ValueError(
                f"{where} is a symlink to {member.linkname!r}, outside the target; refusing to extract this archive"
            )
    if member.islnk():
        # Hard link names are relative to the archive root, not to the member's directory.
        link_target = os.path.realpath(os.path.join(root, member.linkname))
        if os.path.isabs(member.linkname) or not _inside(link_target, root):
            raise ValueError(
                f"{where} is a hard link to {member.linkname!r}, outside the target; refusing to extract this archive"
            )


class _Capped:
    """The decompressed tar stream, refusing any single read above `cap` bytes.

    tarfile reads a PAX or GNU long-name header's whole payload in one read() of the size the header claims,
    before it hands us the member, so a 3 GB claim would be allocated inside tarfile. A real one is a few
    hundred bytes; member data is copied in 16 KiB reads (tarfile.copyfileobj), header blocks are 512 bytes.
    """

    def __init__(self, f, cap: int, name: str):
        self._f, self._cap, self.name = f, cap, name

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self._cap:
            raise ValueError(f"archive {self.name} has a header or read of {n} bytes, over {self._cap}; "
                             f"it is not a plain tar archive, refusing to extract it")
        return self._f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def _open_decompressed(path: Path):
    """The archive's bytes as tar sees them: gzip, bzip2 and xz by their magic numbers, else plain."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    if magic.startswith(b"BZh"):
        return bz2.open(path, "rb")
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def safe_extract(
    tar_path: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    max_member_bytes: int = limits.MAX_CIFAR_MEMBER_BYTES,
    max_total_bytes: int = limits.MAX_CIFAR_ARCHIVE_BYTES,
    max_members: int = limits.MAX_ARCHIVE_MEMBERS,
) -> Path:
    """Extract a (possibly compressed) tar archive into `target_dir`, refusing anything that escapes it.

    Each member is checked and then extracted one at a time (so the checks see earlier symlinks on disk).
    The sizes each header claims are checked against the limits before that member is written (the defaults
    are those of the largest archives we read, CIFAR's), and once the members end the compressed stream is
    read to its end, at most `limits.MAX_ARCHIVE_TRAILER_BYTES` more: that is what makes gzip check its
    CRC-32 (tarfile stops at the end-of-archive blocks) and refuses a bomb hidden after them. If this call
    created `target_dir` and then refuses the archive, it removes `target_dir` again.
    Python's own `filter="data"` is passed as a second line of defence where it exists (3.10.12+,
    3.11.4+), but not relied on: its rules have changed between releases.
    """
    tar_path = Path(tar_path)
    target = Path(target_dir)
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(target)
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    fix = "delete it and download it again, or pass a good copy"
    try:
        with _open_decompressed(tar_path) as raw:
            stream = _Capped(raw, _MAX_TAR_READ, tar_path.name)
            # "r:" with our own decompressed stream: tarfile never reads more at once than _Capped allows.
            with tarfile.open(fileobj=stream, mode="r:") as tf:
                count = total = 0
                for member in tf:
                    count += 1
                    if count > max_members:
                        raise ValueError(f"archive {tar_path.name} has more than {max_members} members; {fix}")
                    _check_member(member, root, tar_path.name)
                    if member.isreg():
                        where = f"archive {tar_path.name} member {member.name!r}"
                        limits.check_size(member.size, max_member_bytes, where, fix)
                        total += member.size
                        limits.check_size(total, max_total_bytes, f"archive {tar_path.name} unpacked", fix)
                        # Strip permission bits we do not want (setuid, group/other write) on older Pythons too.
                        member.mode = stat.S_IMODE(member.mode) & 0o755 | 0o600
                    elif member.islnk():
                        member.mode = stat.S_IMODE(member.mode) & 0o755 | 0o600
                    tf.extract(member, root, **kwargs)
            # Drain what follows the end-of-archive blocks (padding to the 10,240-byte record): reading the
            # compressed stream to its end is what makes gzip, bzip2 and xz verify their checksums.
            left = limits.MAX_ARCHIVE_TRAILER_BYTES
            while chunk := raw.read(min(_CHUNK, left + 1)):
                left -= len(chunk)
                if left < 0:
                    raise ValueError(f"archive {tar_path.name} has more than {limits.MAX_ARCHIVE_TRAILER_BYTES} "
                                     f"bytes after its end-of-archive marker; {fix}")
    except BaseException as e:
        if created:
            shutil.rmtree(target, ignore_errors=True)  # nothing of a refused archive stays behind
        _raise_one_line(e, tar_path)
        raise
    return target


def _raise_one_line(e: BaseException, tar_path: Path) -> None:
    """Re-raise an extraction failure as the one-line error the user sees; return for anything else."""
    if isinstance(e, getattr(tarfile, "FilterError", ())):  # only if Python's filter is stricter than ours
        raise ValueError(f"archive {tar_path.name} member {e.tarinfo.name!r} refused: {e}") from None
    if isinstance(e, FileNotFoundError) and not tar_path.exists():
        raise FileNotFoundError(f"archive {tar_path} does not exist; check the path") from None
    # Data errors: a stream cut short (EOFError), damaged deflate/xz data, a CRC mismatch (gzip's BadGzipFile,
    # bz2's "Invalid data stream": OSErrors without an errno, unlike a real I/O failure).
    if isinstance(e, (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)) or (
            isinstance(e, OSError) and e.errno is None):
        raise ValueError(f"{tar_path} is not a readable tar archive ({e}); delete it and download it again") from None
    if isinstance(e, OSError):  # a full disk, a read-only target: the archive itself may be fine
        raise ValueError(f"cannot extract {tar_path} ({e}); free space or fix permissions, then retry") from None
