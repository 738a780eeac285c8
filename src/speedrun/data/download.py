"""Fetching raw dataset files: stream, verify the MD5, write atomically; and extract tar archives safely.

Nothing here knows about particular datasets; `sources.py` holds the URL and checksum table.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import stat
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


def fetch(
    url: str,
    dest: str | os.PathLike,
    md5: str,
    log: Callable[[str], None] | None = None,
    *,
    timeout: float = 60.0,
) -> Path:
    """Make `dest` a verified copy of `url`, downloading only if it is not already there.

    The bytes stream into `dest + ".part"` and are renamed onto `dest` only after the MD5 matches, so a
    crash, a truncated transfer or a wrong file never leaves something at `dest` that looks finished.
    An existing `dest` is never deleted or overwritten: with the right MD5 it is reused, with the wrong
    one this raises and the user decides.
    """
    log = log or _no_log
    dest = Path(dest)
    if dest.exists():
        actual = md5_file(dest)
        if actual == md5:
            log(f"using {dest} (md5 ok)")
            return dest
        raise ValueError(
            f"{dest} exists but its md5 is {actual}, expected {md5}; delete {dest} to download it again "
            f"or pass --data-dir with a good copy"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    offline_fix = f"put {dest.name} (md5 {md5}) in {dest.parent} or pass --data-dir"
    log(f"downloading {url} -> {dest}")
    start = time.perf_counter()
    h = hashlib.md5(usedforsecurity=False)
    received = 0
    expected_len: int | None = None
    try:
        try:
            response = urllib.request.urlopen(url, timeout=timeout)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise FileNotFoundError(f"cannot download {url} ({reason}); {offline_fix}") from None
        with response, open(part, "wb") as out:
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
        os.replace(part, dest)
    finally:
        # On success `part` was renamed away; on any failure it is a useless fragment.
        if part.exists():
            part.unlink()
    log(f"downloaded {dest.name}: {received / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s, md5 ok")
    return dest


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


def safe_extract(tar_path: str | os.PathLike, target_dir: str | os.PathLike) -> Path:
    """Extract a (possibly compressed) tar archive into `target_dir`, refusing anything that escapes it.

    Each member is checked and then extracted one at a time (so the checks see earlier symlinks on disk).
    Python's own `filter="data"` is passed as a second line of defence where it exists (3.10.12+,
    3.11.4+), but not relied on: its rules have changed between releases.
    """
    tar_path = Path(tar_path)
    target = Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(target)
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    try:
        with tarfile.open(tar_path, "r:*") as tf:
            for member in tf:
                _check_member(member, root, tar_path.name)
                if member.isreg() or member.islnk():
                    # Strip permission bits we do not want (setuid, group/other write) on older Pythons too.
                    member.mode = stat.S_IMODE(member.mode) & 0o755 | 0o600
                tf.extract(member, root, **kwargs)
    except getattr(tarfile, "FilterError", ()) as e:  # only reached if Python's filter is stricter than ours
        raise ValueError(f"archive {tar_path.name} member {e.tarinfo.name!r} refused: {e}") from None
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise ValueError(f"{tar_path} is not a readable tar archive ({e}); delete it and download it again") from None
    except gzip.BadGzipFile as e:
        raise ValueError(f"{tar_path} is not a valid gzip file ({e}); delete it and download it again") from None
    except FileNotFoundError:
        if not tar_path.exists():
            raise FileNotFoundError(f"archive {tar_path} does not exist; check the path") from None
        raise
    return target
