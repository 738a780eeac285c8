"""Extracting tar archives from elsewhere: nothing escapes the target folder, nothing exceeds the limits.

Each member is checked (path, link target, kind, size from its header against `limits.py`) before it is
extracted, tarfile never makes a read larger than `_MAX_TAR_READ`, and the compressed stream is read to its end so
that its checksum is verified. A refused archive leaves nothing behind.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import shutil
import stat
import tarfile
import zlib
from pathlib import Path

from speedrun.data import limits
from speedrun.errors import clip
from speedrun.paths import quoted_name

# The largest single read tarfile may make: a PAX or long-name header's payload (real ones are < 1 kB). tarfile
# recurses once per extended header and each level keeps its payload, so this bounds that chain's memory too.
_MAX_TAR_READ = 64 << 10
# Reads of one 512-byte block that tarfile may make for one member, counted from the member before it: its
# header, a PAX or long-name header and its payload, the last block of the previous member's data. Two chains are
# read inside tarfile before we see the member: a GNU sparse member's extension blocks (21 entries a block kept in a
# list: 1,000,000 blocks, 21 kB of bzip2, took 1.7 GB) and chained PAX headers (tarfile recurses once per header).
# Counted per member, the cap trips at a chain of 16 blocks, long before the recursion limit, whatever depth of
# stack or limit the process has: one refusal, whatever the chain.
_BLOCK_READS_PER_MEMBER = 16
_BLOCK = 512
# Member names: CIFAR's are under 40 characters and 2 levels deep. A name of 20,000 levels made tarfile's
# os.makedirs recurse past Python's limit.
_MAX_NAME_CHARS = 1024
_MAX_NAME_DEPTH = 32
_DRAIN_CHUNK = 1 << 20


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _check_member(member: tarfile.TarInfo, root: str, tar_name: str) -> None:
    """Refuse a member that is not a plain file or folder, or that would be written outside `root`.

    Links are refused outright: no archive we read holds one (CIFAR's hold 6 or 8 files and a folder), and each
    link is a way around the checks here. A hard link repeats a member (40 links to one 30 MB batch made a 31 kB
    archive a 1.2 GB dataset) without counting against the size limits; a symlink checked while a folder on its
    path does not exist yet looks inside, and a later member can then make that folder a symlink that points
    elsewhere. The path is resolved with realpath against what is already on disk, as a second line.
    """
    name = member.name
    where = f"archive {tar_name} member {quoted_name(name, 120)}"
    if len(name) > _MAX_NAME_CHARS or name.count("/") + name.count("\\") >= _MAX_NAME_DEPTH:
        raise ValueError(f"{where} has a name of {len(name)} characters or {_MAX_NAME_DEPTH} or more levels; "
                         "refusing to extract this archive")
    if member.issym() or member.islnk():
        raise ValueError(f"{where} is a link to {member.linkname!r}; the archives speedrun reads hold only files "
                         "and folders, refusing to extract this one")
    if not (member.isreg() or member.isdir()):
        raise ValueError(f"{where} is a device, fifo or other special file; refusing to extract this archive")
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        raise ValueError(f"{where} has an absolute path; refusing to extract this archive")
    target = os.path.realpath(os.path.join(root, name))
    if not _inside(target, root):
        raise ValueError(f"{where} would be written outside {root}; refusing to extract this archive")


class _Capped:
    """The decompressed tar stream, refusing any single read above `cap` bytes.

    tarfile reads a PAX or GNU long-name header's whole payload in one read() of the size the header claims,
    before it hands us the member, so a 3 GB claim would be allocated inside tarfile. A real one is a few
    hundred bytes; member data is copied in 16 KiB reads (tarfile.copyfileobj), header blocks are 512 bytes.
    """

    def __init__(self, f, cap: int, name: str, max_block_reads: int):
        self._f, self._cap, self.name = f, cap, name
        self._block_reads, self._max_block_reads = 0, max_block_reads

    def next_member(self) -> None:
        """A member was handed to us: the count of header blocks starts again for the next one."""
        self._block_reads = 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self._cap:
            raise ValueError(f"archive {self.name} has a header or read of {n} bytes, over {self._cap}; "
                             f"it is not a plain tar archive, refusing to extract it")
        if n == _BLOCK:
            self._block_reads += 1
            if self._block_reads > self._max_block_reads:
                raise ValueError(_chain_refusal(self.name, self._max_block_reads))
        return self._f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def _chain_refusal(name: str, cap: int) -> str:
    return (f"archive {name} has more than {cap} header blocks for one member (chained extended headers or a GNU "
            "sparse chain); it is not a plain tar archive, refusing to extract it")


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

    Each member is checked and then extracted one at a time; only plain files and folders are extracted.
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
            stream = _Capped(raw, _MAX_TAR_READ, tar_path.name, _BLOCK_READS_PER_MEMBER)
            # "r:" with our own decompressed stream: tarfile never reads more at once than _Capped allows.
            with tarfile.open(fileobj=stream, mode="r:") as tf:
                count = total = 0
                for member in tf:
                    stream.next_member()
                    count += 1
                    if count > max_members:
                        raise ValueError(f"archive {tar_path.name} has more than {max_members} members; {fix}")
                    _check_member(member, root, tar_path.name)
                    if member.isreg():
                        where = f"archive {tar_path.name} member {quoted_name(member.name, 120)}"
                        limits.check_size(member.size, max_member_bytes, where, fix)
                        total += member.size
                        limits.check_size(total, max_total_bytes, f"archive {tar_path.name} unpacked", fix)
                        # Strip permission bits we do not want (setuid, group/other write) on older Pythons too.
                        member.mode = stat.S_IMODE(member.mode) & 0o755 | 0o600
                    tf.extract(member, root, **kwargs)
            # Drain what follows the end-of-archive blocks (padding to the 10,240-byte record): reading the
            # compressed stream to its end is what makes gzip, bzip2 and xz verify their checksums.
            left = limits.MAX_ARCHIVE_TRAILER_BYTES
            while chunk := raw.read(min(_DRAIN_CHUNK, left + 1)):
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
        raise ValueError(f"archive {tar_path.name} member {quoted_name(e.tarinfo.name, 120)} refused: "
                         f"{clip(str(e), 200)}") from None
    if isinstance(e, RecursionError):  # tarfile recurses once per chained header; the block cap trips first
        raise ValueError(_chain_refusal(tar_path.name, _BLOCK_READS_PER_MEMBER)) from None
    if isinstance(e, (IsADirectoryError, NotADirectoryError, FileExistsError)):
        raise ValueError(f"archive {tar_path.name} has members that clash (a file and a folder of one name: "
                         f"{e.strerror}); it is damaged or not a dataset archive, delete it") from None
    if isinstance(e, FileNotFoundError) and not tar_path.exists():
        raise FileNotFoundError(f"archive {tar_path} does not exist; check the path") from None
    # Data errors: a stream cut short (EOFError), damaged deflate/xz data, a CRC mismatch (gzip's BadGzipFile,
    # bz2's "Invalid data stream": OSErrors without an errno, unlike a real I/O failure).
    if isinstance(e, (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)) or (
            isinstance(e, OSError) and e.errno is None):
        raise ValueError(f"{tar_path} is not a readable tar archive ({e}); delete it and download it again") from None
    if isinstance(e, OSError):  # a full disk, a read-only target: the archive itself may be fine
        raise ValueError(f"cannot extract {tar_path} ({e}); free space or fix permissions, then retry") from None
