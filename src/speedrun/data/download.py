"""Fetching raw dataset files: mirrors tried in order, a partial file resumed, the checksum verified, the file
published atomically and safely beside concurrent fetches, with a progress bar on a terminal.

Nothing here knows about particular datasets; `sources.py` holds the URL and checksum table. Extraction is
`archive.py`'s.

Mirrors. A mirror URL names a folder, to which the file's name is appended (`https://host/cifar` and
`https://host/cifar/` both give `https://host/cifar/cifar-10-python.tar.gz`), unless its path's last part is the
file's own name: then it is the file itself. A query stays after the path the name is joined to
(`https://host/get?dir=c` gives `https://host/get/cifar-10-python.tar.gz?dir=c`); a #fragment is refused. The
URLs tried, in order (`mirror_urls`): each `--mirror URL` (the CLI's, through `given_mirrors`), each of
$SPEEDRUN_MIRRORS (separated by spaces or commas), the file's published URL, then the mirrors its dataset's table
lists. A file is accepted only when its checksum (MD5, or SHA-256 where that is what is published) matches,
whichever mirror it came from.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import http.client
import math
import os
import re
import stat
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

from filelock import lock_descriptor
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from speedrun.data import limits
from speedrun.errors import counted, printable, warn
from speedrun.paths import in_the_way, make_dirs

_CHUNK = 1 << 20  # 1 MiB: big enough to keep urllib and hashlib overhead negligible
_REDIRECTS = (301, 302, 303, 307, 308)
# No byte for this long and the mirror counts as stalled: the next one is tried (SPEEDRUN_DOWNLOAD_TIMEOUT).
DEFAULT_TIMEOUT_S = 30.0
# Fewer bytes a second than this, on average over twice the timeout, and the mirror counts as too slow: a byte now
# and then never trips the timeout alone (SPEEDRUN_DOWNLOAD_MIN_RATE; 0 turns it off).
DEFAULT_MIN_RATE = 1000.0
# A partial or lock file is opened without following a link at its name, and without blocking on a FIFO there, so
# fstat can say what it is before anything is written (Windows has neither flag).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_SCHEMES = ("http", "https", "file")
# The --mirror URLs of the command being run (the CLI sets them as it parses: cli/parser.py).
_GIVEN_MIRRORS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("speedrun_mirrors", default=())


@dataclass(frozen=True)
class Remote:
    """A named dataset's published files. The file name on disk is the last part of each URL."""

    kind: str  # "cifar" (one python-pickle archive) or "idx" (four IDX files)
    files: tuple[tuple[str, str], ...]  # (url, checksum): the published MD5, or SHA-256 (64 hex digits)
    classes: tuple[str, ...] = ()  # empty: the class names come from the data (CIFAR meta)
    mirrors: tuple[str, ...] = ()  # folders holding the same files, tried after each file's own URL


def _no_log(_: str) -> None:
    pass


def hash_name(checksum: str) -> str:
    """"md5" or "sha256": the algorithm of a published checksum, told by its length (32 or 64 hex digits)."""
    algorithm = {32: "md5", 64: "sha256"}.get(len(checksum))
    if algorithm is None or re.fullmatch(r"[0-9a-fA-F]+", checksum) is None:
        raise ValueError(f"checksum {checksum!r:.80} is neither an MD5 (32 hex digits) nor a SHA-256 (64); give the "
                         "published one")
    return algorithm


def file_digest(path: str | os.PathLike, algorithm: str = "md5") -> str:
    """Hex digest of a file, read in chunks so a 170 MB archive never sits in memory twice."""
    with open(path, "rb") as f:
        return _digest(f, algorithm)


def md5_file(path: str | os.PathLike) -> str:
    return file_digest(path, "md5")


def _digest(f: BinaryIO, algorithm: str) -> str:
    # usedforsecurity=False: MD5 is only an integrity check against published values, and FIPS builds
    # refuse plain hashlib.md5().
    h = hashlib.new(algorithm, usedforsecurity=False)
    f.seek(0)
    for chunk in iter(lambda: f.read(_CHUNK), b""):
        h.update(chunk)
    return h.hexdigest()


def _reuse(dest: Path, checksum: str, log: Callable[[str], None]) -> Path:
    """`dest` if its checksum is right; it is never deleted or overwritten, so a wrong one is the user's to decide."""
    algorithm = hash_name(checksum)
    try:
        actual = file_digest(dest, algorithm)
    except OSError as e:
        raise ValueError(f"cannot read {dest} ({e}); fix its permissions or delete it to download it again") from None
    if actual != checksum.lower():
        raise ValueError(
            f"{dest} exists but its {algorithm} is {actual}, expected {checksum}; delete {dest} to download it again "
            f"or pass data_dir (--data-dir) with a good copy"
        )
    log(f"using {dest} ({algorithm} ok)")
    return dest


# ---- mirrors and settings ----------------------------------------------------------------------------------------


def check_mirror(url: str, where: str) -> str:
    """`url` if it is an http, https or file URL; a one-line refusal naming `where` it came from otherwise."""
    text = url.strip()
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:  # a malformed IPv6 host, say
        parts = None
    scheme = parts.scheme.lower() if parts is not None else ""
    if (scheme not in _SCHEMES or (scheme != "file" and not parts.netloc)
            or any(c.isspace() or not c.isprintable() for c in text)):
        raise ValueError(f"{where} {printable(url)!r:.200} is not an http, https or file URL; give a folder URL such "
                         "as https://host/datasets/ (the file's name is appended) or the file's own URL")
    if "#" in text:  # a fragment never reaches the server, and the file's name cannot be joined after it
        raise ValueError(f"{where} {printable(url)!r:.200} has a #fragment, which is never sent to the server; remove "
                         "it (from the #) or write it %23 where it is part of a name")
    return text


@contextlib.contextmanager
def given_mirrors(urls: Sequence[str]) -> Iterator[None]:
    """Try `urls` first (before $SPEEDRUN_MIRRORS and the published URLs) for the downloads inside the block."""
    token = _GIVEN_MIRRORS.set(tuple(check_mirror(u, "mirror") for u in urls))
    try:
        yield
    finally:
        _GIVEN_MIRRORS.reset(token)


def env_mirrors() -> tuple[str, ...]:
    """$SPEEDRUN_MIRRORS: URLs separated by spaces or commas (a URL holding a comma must be given by --mirror)."""
    text = os.environ.get("SPEEDRUN_MIRRORS", "")
    return tuple(check_mirror(u, "SPEEDRUN_MIRRORS entry") for u in re.split(r"[\s,]+", text) if u)


def mirror_url(mirror: str, name: str) -> str:
    """Where the mirror `mirror` keeps the file `name`: the mirror itself when its path's last part is `name`, else
    `name` joined to its path, its query kept after it (the module's docstring)."""
    parts = urllib.parse.urlsplit(mirror)
    if urllib.parse.unquote(parts.path.rsplit("/", 1)[-1]) == name:
        return mirror
    path = f"{parts.path.rstrip('/')}/{urllib.parse.quote(name)}"
    return urllib.parse.urlunsplit(parts._replace(path=path))


def mirror_urls(published: str, shipped: Sequence[str] = ()) -> list[str]:
    """Every URL to try for the file published at `published`, in order and without repeats: the given mirrors
    (--mirror), $SPEEDRUN_MIRRORS, the published URL, then `shipped` (the dataset table's mirrors)."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(published).path.rsplit("/", 1)[-1])
    given = [*_GIVEN_MIRRORS.get(), *env_mirrors()]
    urls = [*(mirror_url(m, name) for m in given), published, *(mirror_url(m, name) for m in shipped)]
    return list(dict.fromkeys(urls))


def _env_number(name: str, default: float, low: float, high: float, low_open: bool, what: str, example: str,
                unit: str = "") -> float:
    """$name as a number in [low, high] ((low, high] where low_open), else `default` when unset or empty; anything
    else is refused in one line saying what it should be."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (low < value if low_open else low <= value) or not value <= high:  # NaN fails this too
        raise ValueError(f"{name}={printable(text)!r:.60} is not {what}; set e.g. {example}, or unset it for "
                         f"{default:g}{unit}")
    return value


def download_timeout() -> float:
    """Seconds without a byte after which a mirror counts as stalled: $SPEEDRUN_DOWNLOAD_TIMEOUT, else 30."""
    return _env_number("SPEEDRUN_DOWNLOAD_TIMEOUT", DEFAULT_TIMEOUT_S, 0, 86400, True,
                       "a number of seconds above 0 and at most 86400", "120", " s")


def download_min_rate() -> float:
    """Bytes a second a mirror must average over each span of twice the timeout (its headers within the first),
    or count as too slow: $SPEEDRUN_DOWNLOAD_MIN_RATE, else 1000; 0 turns the check off."""
    return _env_number("SPEEDRUN_DOWNLOAD_MIN_RATE", DEFAULT_MIN_RATE, 0, 1e12, False,
                       "a number of bytes a second from 0 (no minimum) to 1e12", "500")


# ---- progress and the lock -----------------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_line(name: str, done: int, total: int | None, rate: float | None, width: int = 20) -> str:
    """A download's progress as one line of text, for a log that cannot show a redrawn bar, e.g.
    `cifar-10-python.tar.gz [#####---------------]  26%  45.2 MB/170.5 MB  1.2 MB/s  ETA 1:44`. total: the file's
    size, None when the server did not say (then only the bytes and the rate); rate: bytes a second of the transfer
    in progress, None (or 0) before it is known."""
    speed = f"{_size(rate)}/s" if rate else "-- B/s"
    if not total:
        return f"{name}  {_size(done)}  {speed}"
    fraction = min(max(done / total, 0.0), 1.0)
    filled = int(fraction * width)
    eta = _clock((total - done) / rate) if rate and done < total else ("0:00" if done >= total else "--:--")
    return (f"{name} [{'#' * filled}{'-' * (width - filled)}] {int(fraction * 100):3d}%  {_size(done)}/{_size(total)}"
            f"  {speed}  ETA {eta}")


class _Progress:
    """A file's progress on stderr while it arrives. On a terminal: a rich.progress bar, erased at the end (the
    caller logs the final line); each transfer has a task of its own, so the rate shown is that mirror's. Nothing else
    may draw there: while a rich live display (the CLI's status line) holds stderr, sys.stderr is its proxy
    (rich_proxied_file), which would print each redraw of a second display as a line, so then progress_line goes to
    `log` at each tenth of the file, and that display shows it as its status. Not a terminal (a log file, CI):
    nothing; the final line is all."""

    def __init__(self, name: str, log: Callable[[str], None], stream=None):
        stream = sys.stderr if stream is None else stream
        try:
            terminal = bool(stream.isatty())
        except (AttributeError, OSError, ValueError):  # no stream, or a closed one
            terminal = False
        self.name, self.log = printable(name), log
        self.logging = terminal and hasattr(stream, "rich_proxied_file")
        self.bar = self.task = None  # a rich Progress while one is drawn, and this transfer's task in it
        console = Console(file=stream, soft_wrap=True) if terminal and not self.logging else None
        if console is not None and console.is_interactive:  # not TERM=dumb, nor TTY_COMPATIBLE=0
            # Redrawn 4 times a second: reads as live without costing the transfer anything. stderr's lines print
            # above the bar (soft_wrap: each stays one line); stdout stays where it is (`speedrun ... > summary.txt`).
            self.bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), TaskProgressColumn(),
                                DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                                transient=True, refresh_per_second=4, redirect_stdout=False)
        self.tenth = -1

    def restart(self) -> None:
        """A new transfer begins: its bytes are counted, and its rate measured, from the next update."""
        if self.bar is not None and self.task is not None:
            self.bar.remove_task(self.task)
        self.task = None

    def update(self, done: int, total: int | None, rate: float | None) -> None:
        if self.bar is not None:
            try:
                if self.task is None:
                    self.task = self.bar.add_task(self.name, total=total, completed=done)
                    self.bar.start()
                else:
                    self.bar.update(self.task, completed=done)
            except (OSError, ValueError):  # the terminal went away: the download goes on without a bar
                self.close()
                self.bar = None
        elif self.logging and total:
            tenth = min(10 * done // total, 10)
            if tenth > self.tenth:
                if 0 < tenth < 10 and self.tenth >= 0:
                    self.log(progress_line(self.name, done, total, rate))
                self.tenth = tenth

    def close(self) -> None:
        if self.bar is not None and self.bar.live.is_started:
            with contextlib.suppress(OSError, ValueError):
                self.bar.stop()


@contextlib.contextmanager
def _download_lock(dest: Path, log: Callable[[str], None]) -> Iterator[bool]:
    """Hold a lock on `.<dest name>.lock` beside `dest`, so one process downloads and others wait; yields whether it
    holds one.

    The lock is filelock's (flock, or LockFileEx on Windows), taken on a descriptor of our own (_open_own, as for
    the partial file: never a link, FIFO or someone's file), not through filelock.FileLock, which leaves its file in
    place on release, while a download leaves nothing beside its file. So the lock file is removed by its holder
    before unlocking. A waiter may then hold a lock on a file that is no longer at that path (or has been replaced),
    so after locking it checks that the path still names the file it locked, and starts over if not: whoever
    proceeds holds the lock on the one current lock file. Where the file system refuses locks, this does nothing:
    publishing stays safe (see fetch), at worst two processes both download.
    """
    lock_path = dest.with_name(f".{dest.name}.lock")
    fd = _lock_file(lock_path, dest.name, log)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            identity = os.fstat(fd)
            _remove_own(lock_path, identity)  # while still holding it: see above
            os.close(fd)
            if os.name == "nt":  # Windows removes no file that is open anywhere: now, unless a waiter holds it
                _remove_own(lock_path, identity)


def _lock_file(lock_path: Path, name: str, log: Callable[[str], None]) -> int | None:
    """An open descriptor holding the exclusive lock on the file now at `lock_path`; None where locks fail."""
    while True:
        try:
            fd = _open_own(lock_path, os.O_RDWR)
        except OSError:
            return None  # an unwritable directory: the download itself will say so
        try:
            if not lock_descriptor(fd, blocking=False):
                log(f"waiting for another process downloading {name}")
                lock_descriptor(fd)
        except OSError:  # e.g. ENOLCK on some network file systems: no lock for anyone, so no file to leave
            _remove_own(lock_path, os.fstat(fd))
            os.close(fd)
            return None
        try:
            current = os.lstat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            return fd
        os.close(fd)  # the holder before us removed this file; lock the one there now


def _open_own(path: Path, flags: int) -> int:
    """os.open(path, flags), creating the file, for a file of this module's own beside `dest` (the partial file, the
    lock). Its name is predictable and the folder may be writable by others, so whatever else is found there is
    refused, untouched: a symbolic link (the download would overwrite what it points to), a FIFO or device (it
    would block, or feed the download), a file with other names (a hard link to someone's file). O_NOFOLLOW refuses
    a link itself; fstat on the open descriptor says what was opened, with no race between a check and the open."""
    try:
        fd = os.open(path, flags | os.O_CREAT | _NOFOLLOW | _NONBLOCK, 0o644)
    except OSError:
        try:
            what = _not_own(os.lstat(path))
        except OSError:
            what = None
        if what:
            raise ValueError(_refusal(path, what)) from None
        raise
    what = _not_own(os.fstat(fd))
    if what:
        os.close(fd)
        raise ValueError(_refusal(path, what))
    if _NONBLOCK:
        os.set_blocking(fd, True)
    return fd


def _not_own(st: os.stat_result) -> str | None:
    """What the file of `st` is when it cannot be a partial or lock file this module made; None when it can."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, socket or device)"
    if st.st_nlink > 1:
        return f"a file with {counted(st.st_nlink - 1, 'other name')} (a hard link)"
    return None


def _refusal(path: Path, what: str) -> str:
    return f"{path} is {what}, not a file a download made; remove it (nothing was written to it) and run again"


def _remove_own(path: Path, identity: os.stat_result) -> None:
    """Remove `path` if it still names the file of `identity` (one this module made), never whatever is there
    instead."""
    try:
        if os.path.samestat(os.lstat(path), identity):
            os.unlink(path)
    except OSError:
        pass


def _present(dest: Path) -> bool:
    """Whether there is a file at `dest` to reuse. A symbolic link to nothing is refused: exists() says no, yet no
    file can be published under that name, so downloading would be for nothing."""
    if dest.exists():
        return True
    if os.path.islink(dest):
        try:
            target = os.readlink(dest)
        except OSError:
            target = "?"
        raise ValueError(f"{dest} is a symbolic link to {target}, which does not exist; remove the link (or point it "
                         "at a good copy) to download it again")
    return False


@dataclass
class _Failure:
    """Why one mirror did not give the file. wrong: it sent another file (a checksum or size that is not the
    published one); restart: it did not continue the partial file (a wrong checksum after resuming, a Content-Range
    elsewhere), so either is not the file: _from_mirrors may ask it again from byte 0."""

    reason: str
    wrong: bool = False
    restart: bool = False


class _Parts:
    """The files a fetch fills beside `dest`. kept: the partial file resumed from, which (with the lock) outlives a
    failure for the next fetch. A mirror that starts again from byte 0 while `kept` holds bytes (it ignored the
    Range, or is asked for the whole file because the kept start may be wrong) writes a `fresh` temporary file
    instead, which replaces `kept` only once its checksum is right (promote): a mirror answering a resume with some
    other page (a captive portal's 200) never costs the bytes kept."""

    def __init__(self, kept: BinaryIO, path: Path, dest: Path):
        self.kept, self.path, self.dest = kept, path, dest
        self.identity = os.fstat(kept.fileno())  # what `path` must still name for this fetch to remove it
        self.fresh: tuple[BinaryIO, Path] | None = None
        self.resumed_from = 0  # bytes of the verified file that an earlier fetch received

    def start_fresh(self) -> BinaryIO:
        self.drop_fresh()
        fd, name = tempfile.mkstemp(prefix=f".{self.dest.name}.", suffix=".part", dir=self.dest.parent)
        out = os.fdopen(fd, "w+b")
        _share(out)
        self.fresh = (out, Path(name))
        return out

    def drop_fresh(self) -> None:
        if self.fresh is not None:
            out, path = self.fresh
            self.fresh = None
            out.close()
            path.unlink(missing_ok=True)

    def promote(self) -> None:
        """The verified fresh file becomes the kept one, under its name."""
        if self.fresh is None:
            return
        out, path = self.fresh
        self.fresh = None
        self.kept.close()
        os.replace(path, self.path)  # replaces the name only: a link put there meanwhile is not followed
        self.kept, self.identity = out, os.fstat(out.fileno())

    def close(self) -> int:
        """Close every file; the bytes the kept one holds."""
        left = _length(self.kept) if not self.kept.closed else 0
        self.kept.close()
        self.drop_fresh()
        return left


def _share(out: BinaryIO) -> None:
    if hasattr(os, "fchmod"):  # mkstemp makes it private; a download is as readable as its folder
        os.fchmod(out.fileno(), 0o644)


def fetch(
    urls: str | Sequence[str],
    dest: str | os.PathLike,
    checksum: str,
    log: Callable[[str], None] | None = None,
    *,
    timeout: float | None = None,
    min_rate: float | None = None,
    max_bytes: int = limits.MAX_DOWNLOAD_BYTES,
) -> Path:
    """Make `dest` a verified copy of the file at `urls` (one URL, or mirrors tried in order), downloading only if
    it is not already there.

    The bytes go to a partial file beside `dest`; `dest` gets its name only once the whole file's checksum (MD5,
    or SHA-256 for a 64-digit `checksum`) matches, with a hard link that fails rather than replace an existing
    `dest`. So a crash, a cut connection or a wrong file never leaves something at `dest` that looks finished. An
    existing `dest` is never deleted or overwritten: with the right checksum it is reused, with the wrong one
    this raises and the user decides; a symbolic link to nothing there is refused before any download.

    Resuming: with the advisory lock held (one process downloads, the others wait and reuse its file), the
    partial file is `.<name>.part` and outlives a failure or Ctrl-C; the next fetch asks the next mirror only for
    the rest (an HTTP Range request). A server that ignores the Range sends the whole file into a temporary file
    beside it, which replaces the partial file only once its checksum is right. Without a lock (Windows, a file
    system refusing locks) each process writes its own temporary `.<name>.*.part`, removed on failure, so two
    writers never share a file. A partial or lock file that is a symbolic link, a FIFO, a device or a hard link
    is refused and left alone: the folder may be writable by others.

    Mirrors: a connection that fails, stalls for `timeout` seconds (default: download_timeout()), averages fewer
    than `min_rate` bytes a second over twice that (default: download_min_rate(); its headers must come within
    it) or closes early moves on to the next URL, keeping the bytes for it to resume; a file whose checksum is
    wrong is deleted (the partial file only) and the next URL tried, with a warning naming the mirror and both
    checksums. When every URL fails, one error names each with its reason, the checksum and where to put the file
    by hand. A response longer than `max_bytes` is cut off and refused as it arrives, so a server sending without
    end cannot fill the disk.
    """
    log = log or _no_log
    urls = [urls] if isinstance(urls, str) else list(urls)
    dest = Path(dest)
    algorithm = hash_name(checksum)
    checksum = checksum.lower()
    if _present(dest):
        return _reuse(dest, checksum, log)
    timeout = download_timeout() if timeout is None else timeout
    min_rate = download_min_rate() if min_rate is None else min_rate
    offline_fix = f"put {dest.name} ({algorithm} {checksum}) in {dest.parent} or pass data_dir (--data-dir)"
    try:
        make_dirs(dest.parent)
    except OSError as e:
        blocked = in_the_way(dest.parent)
        if blocked:  # "File exists" / "Not a directory": no permission would help
            raise ValueError(f"cannot create {dest.parent} ({blocked}); remove or rename it, or set SPEEDRUN_DATA "
                             f"to another folder, or {offline_fix}") from None
        raise ValueError(f"cannot create {dest.parent} ({e}); fix its permissions or {offline_fix}") from None
    with _download_lock(dest, log) as locked:
        if _present(dest):  # another process published it while we waited
            return _reuse(dest, checksum, log)
        # Opened before any URL is: a folder we cannot write in is refused without network traffic.
        try:
            if locked:
                part = dest.with_name(f".{dest.name}.part")
                # What an earlier fetch left is kept, to resume it.
                out = os.fdopen(_open_own(part, os.O_RDWR), "r+b")
            else:
                fd, part_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
                part = Path(part_name)
                out = os.fdopen(fd, "w+b")
                _share(out)
        except OSError as e:
            raise ValueError(f"cannot write in {dest.parent} ({e}); fix its permissions or {offline_fix}") from None
        parts = _Parts(out, part, dest)
        done, left = False, 0
        try:
            start = time.perf_counter()
            try:
                size = _from_mirrors(urls, parts, checksum, offline_fix, timeout, min_rate, max_bytes, log,
                                     resumable=locked)
                parts.promote()
                verified = os.fstat(parts.kept.fileno())
            finally:
                left = parts.close()
            if not publish(part, dest):
                log(f"another process published {dest.name} first")
                reused = _reuse(dest, checksum, log)  # raising, our verified file stays (locked) for the next fetch
                done = True
                return reused
            try:
                published = os.lstat(dest)
            except OSError:
                published = None
            if published is None or not os.path.samestat(published, verified):
                # `part` was replaced after it was verified: what got the name is not the verified file.
                if published is not None and not stat.S_ISDIR(published.st_mode):
                    os.unlink(dest)  # the name this fetch just made
                raise ValueError(f"{part} was replaced by another program while {dest.name} was checked, so nothing "
                                 f"was published; remove {part} and run again")
            done = True
            seconds = time.perf_counter() - start
            received = size - parts.resumed_from
            if received:
                resumed = f", resumed from byte {parts.resumed_from}" if parts.resumed_from else ""
                log(f"downloaded {dest.name}: {_size(received)} in {seconds:.1f} s{resumed}, {algorithm} ok")
            else:
                log(f"{dest.name}: all of it was left by an earlier download in {part.name}, {algorithm} ok")
            return dest
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"cannot write {dest} ({e}); free space or fix permissions, or {offline_fix}") from None
        finally:
            # Published, `part` is only a second name of `dest`. Otherwise (every mirror failed, Ctrl-C) what arrived
            # stays for the next fetch to resume, when there is one: a private temporary file has none.
            if done or not locked or not left:
                _remove_own(part, parts.identity)


def _length(out: BinaryIO) -> int:
    out.flush()
    return os.fstat(out.fileno()).st_size


def _from_mirrors(urls: list[str], parts: _Parts, checksum: str, offline_fix: str, timeout: float, min_rate: float,
                  max_bytes: int, log: Callable[[str], None], *, resumable: bool) -> int:
    """Fill parts.kept (or a fresh file, parts.fresh) with the verified file from the first URL that gives it, and
    return its size; when none does, raise one line naming each URL with its reason. resumable: parts.path
    outlives a failure (fetch)."""
    algorithm = hash_name(checksum)
    dest, part = parts.dest, parts.path
    held = _length(parts.kept)
    parts.resumed_from = held
    if held:
        # Left by an earlier fetch: complete when it stopped between the last byte and the check.
        if _digest(parts.kept, algorithm) == checksum:
            log(f"{part.name} left by an earlier download is the whole {dest.name}")
            return held
        log(f"resuming {dest.name} from byte {held} ({part.name})")
    progress = _Progress(dest.name, log)
    failures: list[tuple[str, _Failure]] = []
    suspects: list[str] = []  # mirrors that did not continue the partial file: it, or they, are not the file
    try:
        for i, url in enumerate(urls):
            failure = _transfer(url, parts, checksum, timeout, min_rate, max_bytes, log, progress)
            if failure is None:
                return _verified(parts)
            parts.drop_fresh()
            failures.append((url, failure))
            if failure.restart:
                suspects.append(url)
            if i + 1 < len(urls):
                warn(f"{dest.name}: mirror {url} failed ({failure.reason}); trying the next, {urls[i + 1]}")
        if suspects and _length(parts.kept):
            # Every mirror failed, and some would not continue the partial file: its start may be what is wrong (a
            # wrong file cut short earlier), so the first of them is asked once more for the whole file.
            log(f"starting {dest.name} again from byte 0 from {suspects[0]}")
            failure = _transfer(suspects[0], parts, checksum, timeout, min_rate, max_bytes, log, progress, whole=True)
            if failure is None:
                return _verified(parts)
            parts.drop_fresh()
            failures.append((f"{suspects[0]} from byte 0", failure))
    finally:
        progress.close()
    tried = "; ".join(f"{url} ({failure.reason})" for url, failure in failures)
    left = _length(parts.kept)
    kept = f"; the {left} bytes received are kept in {part} to resume from" if resumable and left else ""
    text = (f"cannot download {dest.name}: tried {tried}{kept}; {offline_fix}, or give a mirror that holds it "
            f"(--mirror URL, SPEEDRUN_MIRRORS)")
    if all(failure.wrong for _, failure in failures):
        raise ValueError(text)
    raise FileNotFoundError(text)


def _verified(parts: _Parts) -> int:
    """The size of the file a transfer just verified; a fresh one owes nothing to an earlier fetch."""
    if parts.fresh is not None:
        parts.resumed_from = 0
        return _length(parts.fresh[0])
    return _length(parts.kept)


class _TooSlow(Exception):
    """A mirror that sends, but too slowly to count (its reason the message)."""


def _open(request: urllib.request.Request, timeout: float, within: float):
    """urllib.request.urlopen(request), given up after `within` seconds: a server sending its headers a byte at a
    time never trips the read timeout. The call runs in a daemon thread; one given up on ends by itself, and its
    response, if one comes, is closed then."""
    lock = threading.Lock()
    box: dict = {}

    def call():
        try:
            result = urllib.request.urlopen(request, timeout=timeout)
        except BaseException as e:  # handed to the caller, which raises it
            result = e
        with lock:
            if "late" in box:
                if not isinstance(result, BaseException):
                    result.close()
                return
            box["result"] = result

    worker = threading.Thread(target=call, name="speedrun-download", daemon=True)
    worker.start()
    interrupted = True  # Ctrl-C while waiting: whatever the call brings is closed, now or when it comes
    try:
        worker.join(within)
        interrupted = False
    finally:
        with lock:
            result = box.pop("result", None)
            if result is None or interrupted:
                box["late"] = True
        if interrupted and result is not None and not isinstance(result, BaseException):
            result.close()
    if result is None:
        raise _TooSlow(f"too slow: no response headers within {within:g} s")
    if isinstance(result, BaseException):
        raise result
    return result


def _transfer(url: str, parts: _Parts, checksum: str, timeout: float, min_rate: float, max_bytes: int,
              log: Callable[[str], None], progress: _Progress, *, whole: bool = False) -> _Failure | None:
    """One request for the rest of the file (all of it when parts.kept is empty, or `whole`: then into a fresh
    file); None when that file then holds the verified file."""
    algorithm = hash_name(checksum)
    dest = parts.dest
    out = parts.start_fresh() if whole else parts.kept
    offset = _length(out)
    # The span over which the bytes a second are averaged: twice the read timeout, so that a mirror that goes
    # silent is told as stalled (the timeout) before it is told as too slow.
    window = 2 * timeout
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = _open(request, timeout, window) if min_rate else urllib.request.urlopen(request, timeout=timeout)
    except _TooSlow as e:
        return _Failure(str(e))
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and offset:  # nothing past byte `offset` here: the partial file is not this mirror's file
            return _Failure(f"HTTP 416: it holds no byte {offset}", restart=True)
        if e.code in _REDIRECTS and urllib.request.HTTPRedirectHandler.inf_msg in str(e.reason):
            # urllib's own words for it take three lines
            return _Failure(f"HTTP {e.code}: its redirects go round in a loop, or past "
                            f"{urllib.request.HTTPRedirectHandler.max_redirections} hops")
        return _Failure(f"HTTP {e.code} {_words(e.reason)}")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        return _Failure(_why(e, timeout))
    with response:
        headers = response.headers or {}
        status = getattr(response, "status", None)
        length = _number(headers.get("Content-Length"))
        total = length
        if offset and status == 206:
            span = _content_range(headers.get("Content-Range"))
            if span is None or span[0] != offset:
                return _Failure(f"its Content-Range {printable(str(headers.get('Content-Range')))!r:.80} does not "
                                f"continue byte {offset}", restart=True)
            total = span[1] if span[1] is not None else (offset + length if length is not None else None)
        elif offset:  # 200 (or a file: URL): the server ignored the Range and sends the whole file
            out = parts.start_fresh()
            log(f"{url} ignored the request to resume at byte {offset}: starting {dest.name} again from byte 0 in "
                f"{parts.fresh[1].name}, keeping {parts.path.name} until it is verified")
            offset = 0
        elif status == 206:  # a part we did not ask for
            return _Failure("it answered a request for the whole file with a part (HTTP 206)")
        if total is not None and total > max_bytes:
            return _Failure(f"it sent more than {max_bytes} bytes (its length says {total}), more than {dest.name} "
                            "holds: not the published file", wrong=True)
        log(f"downloading {url} -> {dest}" + (f" from byte {offset}" if offset else ""))
        progress.restart()
        out.seek(offset)
        read = getattr(response, "read1", None) or response.read  # read1: what has arrived, so stalls show at once
        received, start = 0, time.monotonic()
        window_start, window_received = start, 0
        while True:
            try:
                chunk = read(_CHUNK)
            except http.client.IncompleteRead as e:
                out.write(e.partial)
                received += len(e.partial)
                return _Failure(_cut_short(offset + received, total))
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
                return _Failure(f"{_why(e, timeout)} after {offset + received} bytes")
            if not chunk:
                break
            out.write(chunk)
            received += len(chunk)
            window_received += len(chunk)
            if offset + received > max_bytes:
                out.seek(offset)
                out.truncate()
                return _Failure(f"it sent more than {max_bytes} bytes, more than {dest.name} holds: not the published "
                                "file", wrong=True)
            now = time.monotonic()
            elapsed = now - start
            progress.update(offset + received, total, received / elapsed if elapsed > 0 else None)
            if min_rate and now - window_start >= window:
                if window_received < min_rate * (now - window_start):
                    return _Failure(f"too slow: {window_received} bytes in {now - window_start:.1f} s, under "
                                    f"{min_rate:g} B/s (SPEEDRUN_DOWNLOAD_MIN_RATE), after {offset + received} bytes")
                window_start, window_received = now, 0
    if total is not None and offset + received < total:
        return _Failure(_cut_short(offset + received, total))
    actual = _digest(out, algorithm)  # of the whole file: a resumed file's start came from an earlier transfer
    if actual != checksum:
        # Only this mirror's bytes go: a resumed start stays for the next mirror to continue, as either may be wrong.
        out.seek(offset)
        out.truncate()
        if total is None:  # no length said, so a close was its end: the bytes may be a cut-short file, not another
            return _Failure(f"no complete response: it sent {received:,} bytes without a Content-Length and closed, "
                            f"perhaps cut short; they make {algorithm} {actual}, not the published {checksum}",
                            restart=offset > 0)
        return _Failure(f"its {dest.name} has {algorithm} {actual}, not the published {checksum}", wrong=True,
                        restart=offset > 0)
    return None


def _cut_short(done: int, total: int | None) -> str:
    """A transfer that ended after `done` bytes of `total` (None: no length was given, as in a chunked one)."""
    if total is None:
        return f"no complete response: the connection closed after {done:,} bytes, before its response ended"
    return f"the connection closed after {done} of {total} bytes"


def _why(e: BaseException, timeout: float) -> str:
    """A failed connection or read in a few words."""
    reason = getattr(e, "reason", e)
    if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
        return f"stalled: no data for {timeout:g} s"
    return _words(reason) or type(e).__name__


def _words(reason: object) -> str:
    """A server's or a library's reason as words on one line: its line breaks are layout, shown as spaces (an
    escaped \\n would read as part of the text)."""
    return printable(" ".join(str(reason).split()))


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def _content_range(text: str | None) -> tuple[int, int | None] | None:
    """(first byte, total size or None for `*`) of a `bytes FIRST-LAST/TOTAL` Content-Range; None if malformed."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", text or "")
    if match is None:
        return None
    return int(match[1]), None if match[3] == "*" else int(match[3])


def publish(part: Path, dest: Path) -> bool:
    """Give the verified `part` the name `dest`; False, touching nothing, if a `dest` (a link to nothing too)
    appeared meanwhile. A symbolic link at `part` is not followed: the link itself would get the name, which fetch
    sees is not the file it verified."""
    try:
        try:
            os.link(part, dest, follow_symlinks=False)  # atomic, and fails with FileExistsError instead of overwriting
        except NotImplementedError:  # no linkat here: fetch's check after publishing catches a followed link
            os.link(part, dest)
    except FileExistsError:
        return False
    except OSError:
        # No hard links here (some FUSE or SMB mounts): rename under the lock. On Windows os.rename refuses an
        # existing target by itself; elsewhere the lock, and this check, keep it from replacing one.
        if os.path.lexists(dest):
            return False
        os.rename(part, dest)
    return True
