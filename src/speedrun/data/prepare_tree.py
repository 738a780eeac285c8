"""`speedrun data prepare SRC DST`: an image tree as shards, and on a second run only what changed or is damaged.

SRC's layout and the labels: data/prepare.py, which lists the files and prepares each image. DST receives:

    classes.json                      the class names, a JSON list: label = position
    SPLIT-NNNNN.tar, SPLIT-index.npy  each split's shards (data/shards.py), images in (class, file name) order
    manifest.json                     written last: format version, settings, SRC, the number of classes and the
                                      SHA-256 of classes.json (readers check it), and for each split a fingerprint
                                      of the source listing (relative path, size, mtime_ns of every image file),
                                      the SHA-256 of its index and of every shard, and which source files each
                                      shard was prepared from; the splits it lists are the folder's splits

A run prepares again only the splits whose fingerprint, settings or class index differ from the manifest; a
manifest that is not one we wrote is no manifest. A split that is otherwise up to date is checked against the
manifest: every shard's size and SHA-256 and the index's (about as long as reading DST once: 840 MB/s per core
here, on as many threads as --workers; preparing is a hundred times slower). A damaged shard (changed in place,
cut, missing) is prepared again from the source files it was made of, alone, and a damaged index rebuilt from the
shards' own tar headers; so the advice of every reader of a damaged folder, "run speedrun data prepare again",
repairs it (shards.repair_advice). A manifest from a speedrun that recorded no checksums gets them, from the files
as they are, on the first run that finds them whole.

DST changes only when all is done: new splits are written into a staging folder inside DST and moved into place
once every one is whole, so a failure (--on-error stop, Ctrl-C, a full disk) leaves DST as it was; the price is room
for the new shards beside the old ones while the run lasts.

Prepare never replaces nor deletes a file it did not write. DST must be absent, empty, or a folder prepare wrote:
its manifest says so (its format), or, that manifest damaged or lost, a shard index and classes.json are in
prepare's formats (shards.foreign_entry); any other folder is refused, naming a file in it, before SRC is read. A
split rewritten with fewer shards loses the extra old ones its manifest listed. Split files the manifest does not
list (a split SRC has not, files someone put there) are left as they are and named in a warning: every reader
ignores them (shards.listed_splits). No other file in DST is touched, none in SRC.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import tarfile
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speedrun.data import folder, shards
from speedrun.data.prepare import (DEFAULT_MAX_SIDE_PX, DEFAULT_QUALITY, SPLITS, SourceFile, check_settings,
                                   fingerprint, prepare_all, read_source, worker_pool)
from speedrun.errors import counted, escaped_refusals, printable, warn
from speedrun.paths import in_the_way, make_folder, user_path
from speedrun.records.result_file import write_text

FORMAT, VERSION = shards.PREPARED_FORMAT, 1
MANIFEST, CLASSES = shards.MANIFEST, shards.CLASSES
SHARD_BYTES = 256 * 2**20  # shards.write_split's default: ImageNet's train split at 256 px is about 75 shards
_MAX_MANIFEST_BYTES = 64 * 2**20  # about 200 bytes per shard: ImageNet-21k's ~1,400 shards take 280 KB
_MAX_WORKERS = 256
_STAGE_PREFIX = shards.STAGE_PREFIX
_SHOWN_FILES = 5  # unlisted files a warning names; the rest are counted
_PROGRESS_S = 30.0
_SAY_CHECKING_BYTES = 2**30  # a check of more than this says so first: it takes seconds


@dataclass
class SplitReport:
    split: str
    images: int  # image files in the source listing
    ignored: int  # entries its listing left out (left_out names them)
    left_out: folder.LeftOut = field(default_factory=folder.LeftOut)
    up_to_date: bool = False
    checksums: str = "match"  # up to date: "match", or "recorded" (a manifest that had none)
    repaired: list[str] = field(default_factory=list)  # damaged files rewritten: "train-00003.tar (checksum ...)"
    written: int = 0
    skipped: list[str] = field(default_factory=list)  # "<class>/<name>", as on disk
    skipped_before: int = 0  # up to date: the files skipped when it was prepared
    converted: Counter = field(default_factory=Counter)  # source mode ("L", "CMYK", "P", "RGBA" ...) -> images
    rotated: int = 0  # by their EXIF orientation
    resized: int = 0
    png_named_jpeg: int = 0  # PNG content in a file named .jpg/.jpeg
    bytes: int = 0  # of prepared JPEGs
    shards: int = 0
    seconds: float = 0.0
    workers: int = 0

    def line(self) -> str:
        left_out = f"; {self.left_out.text()}" if self.left_out.count else ""
        if self.up_to_date:
            before = f", {self.skipped_before:,} skipped when prepared" if self.skipped_before else ""
            sums = "checksums match" if self.checksums == "match" else "checksums recorded now"
            return (f"{self.split}: up to date ({counted(self.written, 'image')} in {counted(self.shards, 'shard')}, "
                    f"{sums}{before}){left_out}")
        rate = self.written / self.seconds if self.seconds > 0 else 0.0
        modes = ", ".join(f"{mode} {n}" for mode, n in sorted(self.converted.items()))
        done = (f"repaired {', '.join(self.repaired)}: {counted(self.written, 'image')} prepared again" if self.repaired
                else f"{self.written:,} written")
        text = (f"{self.split}: {done} ({self.bytes / 1e6:.1f} MB in {counted(self.shards, 'shard')}, "
                f"{self.seconds:.1f} s, {rate:,.0f} images/s with {_workers(self.workers)}); "
                f"{sum(self.converted.values())} converted to RGB{f' ({modes})' if modes else ''}, "
                f"{self.rotated} EXIF-rotated, {self.resized} resized, {self.png_named_jpeg} PNG named .jpg/.jpeg; "
                f"{len(self.skipped)} skipped")
        if self.skipped:
            more = f" and {len(self.skipped) - 10} more" if len(self.skipped) > 10 else ""
            text += f" ({', '.join(self.skipped[:10])}{more})"
        return text + left_out


@dataclass
class Report:
    dst: str  # as given
    classes: list[str]
    splits: list[SplitReport]
    src: str = ""  # as given
    beside: folder.LeftOut = field(default_factory=folder.LeftOut)  # SRC's entries beside its split folders
    classes_written: bool = False  # classes.json was missing or not what the class folders say

    @property
    def up_to_date(self) -> bool:
        return all(s.up_to_date for s in self.splits) and not self.classes_written

    def lines(self) -> list[str]:
        """The report as text to print, each line escaped (errors.printable): DST and the skipped files are named
        as they are on disk."""
        head = (f"{self.dst} is up to date: nothing to do" if self.up_to_date else
                f"{self.dst}: {len(self.classes)} classes; {CLASSES} was missing or changed: written again"
                if all(s.up_to_date for s in self.splits) else f"{self.dst}: {len(self.classes)} classes")
        beside = [f"{self.src}: {self.beside.text()}"] if self.beside.count else []
        return [printable(line) for line in (head, *(s.line() for s in self.splits), *beside)]


@dataclass
class _Job:
    """A split to write: whole, or (repair set) only its damaged files."""
    split: str
    files: list[SourceFile]
    listed: str  # the listing's fingerprint
    report: SplitReport
    repair: _Check | None = None
    entry: dict | None = None  # its manifest entry once written
    staged: list[int] = field(default_factory=list)  # the shard numbers written into the stage


@dataclass
class _Check:
    """A split's files held against its manifest entry."""
    entry: dict | None  # the entry to keep when nothing is damaged (with checksums added to an older one)
    damaged: list[int] = field(default_factory=list)  # shard numbers
    index_damaged: bool = False
    reasons: list[str] = field(default_factory=list)  # "train-00003.tar (checksum mismatch)", ...
    repairable: bool = False  # the entry says which source files each shard was made of

    @property
    def intact(self) -> bool:
        return self.entry is not None and not self.damaged and not self.index_damaged


@escaped_refusals
def prepare_tree(src: str | os.PathLike, dst: str | os.PathLike, *, max_side_px: int = DEFAULT_MAX_SIDE_PX,
                 quality: int = DEFAULT_QUALITY, workers: int | None = None, on_error: str = "skip",
                 shard_bytes: int = SHARD_BYTES, log: Callable[[str], None] | None = None) -> Report:
    """Prepare the image tree `src` as shards in `dst` (see the module); return what was done.

    workers: processes that decode and encode (default min(8, CPUs)); 0 does it in this process. on_error: "skip"
    warns (errors.warn) for each file that cannot be used and leaves it out; "stop" raises a ValueError naming it,
    with DST left as it was. `log` receives progress lines (a long split says where it is every 30 s)."""
    check_settings(max_side_px, quality)
    workers = folder.default_workers() if workers is None else workers
    if not isinstance(workers, int) or not 0 <= workers <= _MAX_WORKERS:
        raise ValueError(f"--workers must be 0 to {_MAX_WORKERS}, got {workers}; 0 prepares in this process")
    if on_error not in ("skip", "stop"):
        raise ValueError(f"--on-error must be skip or stop, got {on_error}; pass --on-error skip or --on-error stop")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive number of bytes, got {shard_bytes}; leave it out for "
                         f"{SHARD_BYTES // 2**20} MiB shards")
    log = log or (lambda line: None)
    src_dir, dst_dir = _paths(src, dst)
    try:
        foreign = shards.foreign_entry(dst_dir)  # before SRC is listed (minutes for ImageNet): a refusal is at once
    except OSError as e:
        raise ValueError(f"cannot list DST {dst} ({folder.refusal_reason(e)}); choose a DST you can read and "
                         "write") from None
    if foreign is not None:
        held = (f"its {MANIFEST} is another program's" if foreign == MANIFEST else
                f"it holds {foreign} and no {MANIFEST} of prepare's")
        raise ValueError(f"DST {dst} is not a folder speedrun data prepare wrote ({held}), and prepare never replaces "
                         "nor deletes files it did not write; choose a new or empty DST")
    source = read_source(src_dir)
    classes, splits = source.classes, source.splits
    _warn_untrainable(src_dir, str(src), list(splits))
    settings = {"max_side_px": int(max_side_px), "quality": int(quality), "shard_bytes": int(shard_bytes)}
    classes_bytes = (json.dumps(classes, ensure_ascii=False) + "\n").encode("utf-8")
    classes_sha = hashlib.sha256(classes_bytes).hexdigest()
    old = _read_manifest(dst_dir)
    same = old is not None and old["settings"] == settings and old["classes_sha256"] == classes_sha
    reports, entries, todo = [], {}, []
    for split, files in splits.items():
        left_out = source.left_out[split]
        listed, report = fingerprint(files), SplitReport(split, len(files), left_out.count, left_out)
        entry = old["splits"].get(split) if same else None
        check = None
        if entry is not None and entry["fingerprint"] == listed:
            check = _check_split(dst_dir, split, entry, len(classes), workers, log)
        if check is not None and check.intact:
            report.up_to_date, entries[split] = True, check.entry
            report.written, report.skipped_before, report.shards = entry["written"], entry["skipped"], entry["shards"]
            report.checksums = "match" if check.entry is entry else "recorded"
        else:
            todo.append(_Job(split, files, listed, report, check if check is not None and check.repairable else None))
        reports.append(report)
    dropped = sorted(set(old["splits"]) - set(splits)) if old else []
    manifest = {"format": FORMAT, "version": VERSION, "settings": settings, "classes_sha256": classes_sha,
                "num_classes": len(classes), "source": os.fspath(src_dir), "splits": entries}
    classes_ok = _read_small(dst_dir / CLASSES, len(classes_bytes)) == classes_bytes
    done_report = Report(str(dst), classes, reports, str(src), source.beside, classes_written=not classes_ok)
    try:
        if not todo and classes_ok and old == manifest:
            with _locked(dst_dir):
                _remove_stages(dst_dir)  # left by a run that was killed (SIGKILL, power loss): GBs, perhaps
        else:
            _write(dst_dir, todo, reports, entries, manifest, old, classes_ok, classes_bytes, workers=workers,
                   settings=settings, on_error=on_error, log=log)
        _warn_unlisted(dst_dir, str(dst), str(src), entries, dropped)
    except OSError as e:  # DST's: SRC's files are read in prepare_image, whose failures are its one-line strings
        fix = ("free disk space, or choose a DST on another disk" if e.errno == errno.ENOSPC else
               "choose a DST you can write to")
        where = f": {e.filename}" if e.filename else ""
        raise ValueError(f"cannot write DST {dst} ({folder.refusal_reason(e)}{where}); {fix}") from None
    return done_report


def _warn_untrainable(src_dir: Path, src: str, splits: list[str]) -> None:
    """A warning before any image is prepared when the shards will lack what `speedrun train` needs, a train split
    and a val or test split to score (recipes/imagenet/data.py refuses them only when a run starts): a tree of
    val/ alone, or of class folders without split folders. Other readers (bench-loader) take them as they are."""
    if "train" in splits and any(s in splits for s in ("val", "test")):
        return
    held = " and ".join(f"{s}/" for s in splits)
    if "train" not in splits:
        fix = f"add {src}/train/<class>/<image> beside {held}"
        what = f"{src} has no train/ folder"
    elif (src_dir / "train").is_dir():
        fix, what = f"add {src}/val/<class>/<image> beside train/", f"{src} has no val/ or test/ folder"
    else:  # SRC/<class>/<image>: read as one split, train
        fix = f"lay it out as {src}/train/<class>/<image> and {src}/val/<class>/<image>"
        what = f"{src} holds class folders, not train/ and val/ (or test/) folders"
    warn(f"{what}, so its shards will hold {'a train split' if held == 'train/' else held} only, which speedrun "
         f"train refuses (it trains on train/ and scores val/ or test/; bench-loader can still read them); to train "
         f"on them, {fix}")


def _workers(n: int) -> str:
    """"no worker processes", "1 worker process", "4 worker processes"."""
    return counted(n, "worker process", "worker processes") if n else "no worker processes"


def _write(dst_dir: Path, todo: list[_Job], reports: list[SplitReport], entries: dict, manifest: dict,
           old: dict | None, classes_ok: bool, classes_bytes: bytes, *, workers: int, settings: dict,
           on_error: str, log: Callable[[str], None]) -> None:
    """Write the splits `todo` and what changed (classes.json, the manifest) into DST (see the module)."""
    _check_targets(dst_dir, [MANIFEST, CLASSES, *(f"{job.split}-index.npy" for job in todo)])
    created = not dst_dir.exists()
    make_folder(dst_dir, "DST", "choose a DST in a folder you can write to")
    done = False
    # The workers are forked before the lock is taken: a process forked while it is held shares it, and a worker
    # outliving a killed run would keep every later run out ("another ... is writing") for as long as it lived.
    try:
        with worker_pool(workers if todo else 0) as pool, _locked(dst_dir):
            _remove_stages(dst_dir)
            stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=dst_dir))
            try:
                for job in todo:
                    if job.repair is not None and _repair_split(job, dst_dir, stage, pool, workers, settings,
                                                                on_error, log):
                        continue
                    job.report = SplitReport(job.split, job.report.images, job.report.ignored, job.report.left_out)
                    log(f"{job.split}: preparing {counted(len(job.files), 'image')} with {_workers(workers)}")
                    _write_split(job, stage, pool, workers, settings, on_error, log)
                reports[:] = [next((job.report for job in todo if job.split == r.split), r) for r in reports]
                # Every new split is whole: move them in. The manifest first forgets them, so that a crash while
                # moving leaves splits the next run prepares again, never a manifest vouching for shards it does
                # not describe.
                _check_targets(dst_dir, [shards.shard_name(job.split, k) for job in todo for k in job.staged])
                if todo:
                    _write_json(dst_dir / MANIFEST, manifest)
                if not classes_ok:
                    _write_bytes(dst_dir / CLASSES, classes_bytes)
                for job in todo:
                    # Shards beyond the new count are removed only where the manifest this run found listed them.
                    before = old["splits"][job.split]["shards"] if old and job.split in old["splits"] else 0
                    _move_in(stage, dst_dir, job.split, job.staged, job.report.shards, before)
                    entries[job.split] = job.entry
                _write_json(dst_dir / MANIFEST, manifest)
                done = True
            finally:
                _remove_stage(stage)
    finally:
        if created and not done:  # the lock released: DST as it was, absent
            with contextlib.suppress(OSError):
                dst_dir.rmdir()


def _unlisted(dst: Path, entries: dict) -> dict[str, list[str]]:
    """{split: its files in DST that the manifest's `entries` do not list}: the index and shards of a split it does
    not list, the shards of a listed split numbered beyond its count. Folders are left out: none is ours."""
    found: dict[str, list[str]] = {}
    with os.scandir(dst) as listing:
        entries_here = sorted(listing, key=lambda e: e.name)
    for e in entries_here:
        split, _, rest = e.name.partition("-")
        if split not in SPLITS or e.is_dir(follow_symlinks=False):
            continue
        digits = rest[:-len(".tar")] if rest.endswith(".tar") else ""
        shard = digits.isdigit() and digits.isascii() and e.name == shards.shard_name(split, int(digits))
        listed = entries[split]["shards"] if split in entries else 0
        if (rest == "index.npy" and split not in entries) or (shard and int(digits) >= listed):
            found.setdefault(split, []).append(e.name)
    return found


def _named(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN_FILES} more" if len(names) > _SHOWN_FILES else ""
    return ", ".join(names[:_SHOWN_FILES]) + more


def _warn_unlisted(dst: Path, shown_dst: str, shown_src: str, entries: dict, dropped: list[str]) -> None:
    """Say which split files in DST its manifest does not list (every reader ignores them) and what to do: a split
    the manifest listed and SRC has not (its folder gone, or another SRC), or files someone else put there."""
    unlisted = _unlisted(dst, entries)
    for split in dropped:
        files = unlisted.pop(split, [])
        kept = (f"; its files ({_named(files)}) are left as they are and every reader ignores them: remove them"
                if files else "")
        warn(f"{shown_dst}'s {MANIFEST} listed split {split}, which SRC {shown_src} has not (no {split}/ folder): "
             f"it is no longer in the manifest{kept}")
    rest = [name for files in unlisted.values() for name in files]
    if rest:
        warn(f"{shown_dst} holds {_named(rest)}, which its {MANIFEST} does not list: no split of this folder, every "
             "reader ignores them; remove them")


def _paths(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[Path, Path]:
    """Both folders resolved (symlinks followed, so a DST that links into SRC is seen), SRC checked. An empty path
    (an unset shell variable) is refused: it would mean the current folder."""
    for name, value, what in (("SRC", src, "the image folder (it holds train/, val/ or test/, or the class "
                                           "folders)"),
                              ("DST", dst, "the folder for the shards (new, empty, or one prepare wrote)")):
        text = os.fsdecode(value)
        if not text.strip():
            said = "is empty" if not text else f"{text!r} is only whitespace"
            raise ValueError(f"{name} {said} (an unset shell variable?); give {what}")
    shown_src, shown_dst = str(src), str(dst)
    try:
        src_dir, dst_dir = user_path(src, "SRC").resolve(), user_path(dst, "DST").resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError up to Python 3.12, OSError after
        raise ValueError(f"cannot resolve {shown_src} or {shown_dst} ({folder.refusal_reason(e)}); "
                         "fix the link") from None
    if not src_dir.is_dir():
        what = "is not a folder" if src_dir.exists() else "does not exist"
        raise ValueError(f"SRC {shown_src} {what}; give the folder that holds train/ (and val/ or test/) or the "
                         "class folders")
    if dst_dir == src_dir or src_dir in dst_dir.parents:
        raise ValueError(f"DST {shown_dst} is inside SRC {shown_src}: its shards would become part of the source; "
                         "choose a DST outside SRC")
    if dst_dir.exists() and not dst_dir.is_dir():
        raise ValueError(f"DST {shown_dst} exists and is not a folder; choose a folder (it is created if missing)")
    blocked = in_the_way(dst_dir)  # a file where one of DST's parent folders should be
    if blocked:
        raise ValueError(f"DST {shown_dst} cannot be created: {blocked}; choose a DST under folders")
    return src_dir, dst_dir


def _read_small(path: Path, limit: int) -> bytes | None:
    """At most limit + 1 bytes of a regular file, or None: never blocks on a FIFO nor reads /dev/zero forever, and
    a folder in the file's place is None too."""
    try:
        fd = shards.open_regular(path)
    except OSError:
        return None
    with open(fd, "rb") as f:  # closes fd
        try:
            return f.read(limit + 1)
        except OSError:
            return None


def _read_manifest(dst: Path) -> dict | None:
    """DST's manifest if it is one we wrote, else None: a file from elsewhere (not JSON, other types, huge, nested
    a million deep) means "prepare again", never an exception. It is only compared, never executed or unpickled."""
    data = _read_small(dst / MANIFEST, _MAX_MANIFEST_BYTES)
    if data is None or len(data) > _MAX_MANIFEST_BYTES:
        return None
    try:
        m = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, an int of 5,000 digits
        return None

    def count(v) -> bool:
        return type(v) is int and 0 <= v < 2**63  # type(): True is an int too

    if not (isinstance(m, dict) and m.get("format") == FORMAT and count(m.get("version"))
            and m.get("version") == VERSION and isinstance(m.get("classes_sha256"), str)
            and isinstance(m.get("settings"), dict) and all(count(v) for v in m["settings"].values())
            and isinstance(m.get("splits"), dict)):
        return None
    if not isinstance(m.get("source", ""), str) or not count(m.get("num_classes", 0)):
        return None
    for split, entry in m["splits"].items():
        if (split not in SPLITS or not isinstance(entry, dict) or not isinstance(entry.get("fingerprint"), str)
                or not all(count(entry.get(k)) for k in ("images", "written", "skipped", "shards"))):
            return None
        if ("shard_files" in entry or "index_sha256" in entry) and not _valid_checksums(entry, count):
            return None
    return m


def _valid_checksums(entry: dict, count: Callable[[object], bool]) -> bool:
    """A split entry's checksums and shard table are as _write_split records them: one row per shard, its samples
    summing to the split's, and (where recorded) source file ranges that follow each other over the whole
    listing."""
    def sha(v) -> bool:
        return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)

    table = entry.get("shard_files")
    if not (sha(entry.get("index_sha256")) and isinstance(table, list) and len(table) == entry["shards"]):
        return False
    if not all(isinstance(t, dict) and sha(t.get("sha256")) and count(t.get("bytes")) and count(t.get("samples"))
               and t["samples"] >= 1 for t in table):
        return False
    if sum(t["samples"] for t in table) != entry["written"]:
        return False
    ranged = ["first" in t or "files" in t for t in table]
    if not any(ranged):
        return True  # recorded for shards an earlier speedrun wrote: which files made them is not known
    first = 0
    for t in table:
        if not (count(t.get("first")) and count(t.get("files")) and t["first"] == first
                and t["samples"] <= t["files"]):
            return False
        first += t["files"]
    return first == entry["images"]


def _whole(dst: Path, split: str, written: int, num_classes: int) -> bool:
    """The split's index and shards are there and agree (shards.Shards checks every offset against the sizes), and
    every label names one of the classes."""
    try:
        with shards.Shards(dst, split) as s:
            return len(s) == written and (written == 0 or int(s.index[:, 3].max()) < num_classes)
    except ValueError:
        return False


def _check_targets(dst: Path, names: list[str]) -> None:
    """What this run writes or replaces in DST is not a folder: os.replace cannot put a file over one, and a folder
    with one of our names is someone's (a file, link or FIFO there is replaced: it is ours, or holds no data).
    Called before the run changes anything in DST, which the error leaves as it was."""
    for name in names:
        path = dst / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ValueError(f"cannot check {path} ({folder.refusal_reason(e)}); "
                             "fix it or choose another DST") from None
        if stat.S_ISDIR(mode):
            raise ValueError(f"{path} is a folder, and speedrun data prepare writes its {name} "
                             "there; move it out of DST (or choose another DST)")


def _samples(split: str, files: list[SourceFile], pool: cf.ProcessPoolExecutor | None, workers: int,
             settings: dict, on_error: str, report: SplitReport, log: Callable[[str], None],
             positions: array) -> Iterator[tuple[bytes, int]]:
    """The files prepared, as (jpeg, label) for the shard writer, counted into `report`; each one's position in
    `files` appended to `positions`. A file that cannot be used is warned about and left out, or (on_error stop)
    a ValueError."""
    start = time.monotonic()
    next_log = start + _PROGRESS_S
    results = prepare_all(files, pool, workers, settings["max_side_px"], settings["quality"])
    with contextlib.closing(results):  # on an error here, no more chunks are submitted
        for i, out in enumerate(results):
            if isinstance(out, str):  # prepare_image's one line: it names the file and the fix
                if on_error == "stop":
                    raise ValueError(f"{out}, or pass --on-error skip to leave such files out")
                report.skipped.append(files[i].rel)
                warn(f"{split}: skipped: {out}")
                continue
            report.written += 1
            report.bytes += len(out.jpeg)
            if out.source_mode != "RGB":
                report.converted[out.source_mode] += 1
            report.rotated += out.rotated
            report.resized += out.resized
            report.png_named_jpeg += out.source_format == "PNG" and files[i].rel.lower().endswith((".jpg", ".jpeg"))
            positions.append(i)
            yield out.jpeg, files[i].label
            if time.monotonic() > next_log:
                next_log += _PROGRESS_S
                log(f"{split}: {i + 1:,} of {len(files):,} images, "
                    f"{(i + 1) / (time.monotonic() - start):,.0f} images/s")


def _write_split(job: _Job, stage: Path, pool: cf.ProcessPoolExecutor | None, workers: int, settings: dict,
                 on_error: str, log: Callable[[str], None]) -> None:
    """Prepare one split's files and write its shards into `stage`, counting into the job's report; its manifest
    entry records the checksums and which source files (a range of the listing) each shard was made of."""
    start, report, positions = time.monotonic(), job.report, array("q")
    samples = _samples(job.split, job.files, pool, workers, settings, on_error, report, log, positions)
    index = shards.write_split(samples, stage, job.split, settings["shard_bytes"])
    report.shards = int(index[:, 0].max()) + 1 if len(index) else 0
    per_shard = np.bincount(index[:, 0], minlength=report.shards).tolist() if len(index) else []
    # Shard k was made of the files from its first image's on, up to the next shard's first image: the files
    # skipped between two shards count to the earlier one.
    first_sample = np.concatenate([[0], np.cumsum(per_shard)[:-1]]).astype(int).tolist() if per_shard else []
    firsts = [0, *(positions[j] for j in first_sample[1:]), len(job.files)]
    table = [{"samples": n, "first": firsts[k], "files": firsts[k + 1] - firsts[k]} for k, n in enumerate(per_shard)]
    job.staged = list(range(report.shards))
    job.entry = _entry(job, stage, table, report.written, len(report.skipped), workers)
    report.seconds = time.monotonic() - start
    report.workers = workers


def _entry(job: _Job, stage: Path, table: list[dict], written: int, skipped: int, workers: int) -> dict:
    """The manifest entry of a split whose index and shards `job.staged` are in `stage`, its other shards in DST
    with their checksums in `table`."""
    staged = [stage / shards.shard_name(job.split, k) for k in job.staged]
    sums = _hash_all([stage / f"{job.split}-index.npy", *staged], workers)
    for k, path, digest in zip(job.staged, staged, sums[1:]):
        table[k] = {"sha256": digest, "bytes": path.stat().st_size, **{key: v for key, v in table[k].items()
                                                                       if key not in ("sha256", "bytes")}}
    return {"fingerprint": job.listed, "images": len(job.files), "written": written, "skipped": skipped,
            "shards": len(table), "index_sha256": sums[0], "shard_files": table}


def _hash_all(paths: list[Path], workers: int) -> list[str]:
    """The SHA-256 of each file, on up to `workers` threads (hashlib hashes outside the GIL). Raises OSError."""
    with cf.ThreadPoolExecutor(max(1, min(workers, 8))) as threads:
        return list(threads.map(shards.file_sha256, paths))


def _check_split(dst: Path, split: str, entry: dict, num_classes: int, workers: int,
                 log: Callable[[str], None]) -> _Check:
    """The split's files in DST held against its manifest entry: every shard's size and SHA-256, and the
    index's. An entry without checksums (an earlier speedrun's) gets them from the files as they are, if they are
    whole (_whole); else the split is prepared again."""
    table = entry.get("shard_files")
    index_path = dst / f"{split}-index.npy"
    paths = [dst / shards.shard_name(split, k) for k in range(entry["shards"])]
    if table is None:
        if not _whole(dst, split, entry["written"], num_classes):
            return _Check(None)
        try:
            sums = _hash_all([index_path, *paths], workers)
            counts = shards.load_index(index_path, str(index_path))[:, 0]
            sizes = [p.stat().st_size for p in paths]
        except (OSError, ValueError):
            return _Check(None)
        per_shard = np.bincount(counts, minlength=len(paths)).tolist() if len(counts) else [0] * len(paths)
        # Which files made each shard is known only when none was skipped: image k of the split is file k.
        exact = entry["skipped"] == 0 and entry["written"] == entry["images"]
        first = np.concatenate([[0], np.cumsum(per_shard)[:-1]]).astype(int).tolist() if per_shard else []
        rows = [{"sha256": digest, "bytes": size, "samples": n, **({"first": f, "files": n} if exact else {})}
                for digest, size, n, f in zip(sums[1:], sizes, per_shard, first)]
        log(f"{split}: recorded the checksums of its {counted(len(paths), 'shard')}, prepared by a speedrun that "
            "recorded none")
        return _Check({**entry, "index_sha256": sums[0], "shard_files": rows})
    total = sum(t["bytes"] for t in table)
    if total > _SAY_CHECKING_BYTES:
        log(f"{split}: checking {counted(len(paths), 'shard')} ({total / 1e9:.1f} GB) against their checksums")
    check = _Check(entry, repairable=all("first" in t for t in table))
    expected = [(index_path, None, entry["index_sha256"]),
                *((p, t["bytes"], t["sha256"]) for p, t in zip(paths, table))]  # the index as number -1 + 1
    to_hash = []
    for number, (path, size, _) in enumerate(expected):
        try:
            st = os.stat(path)
            why = (None if stat.S_ISREG(st.st_mode) and size in (None, st.st_size) else
                   "not a file" if not stat.S_ISREG(st.st_mode) else f"{st.st_size:,} bytes, not {size:,}")
        except OSError as e:
            why = "missing" if isinstance(e, FileNotFoundError) else folder.refusal_reason(e)
        if why is None:
            to_hash.append(number)
        else:
            _damaged(check, number - 1, path, why)
    with cf.ThreadPoolExecutor(max(1, min(workers, 8))) as threads:
        for number, got in zip(to_hash, threads.map(_sha256_or_none, (expected[n][0] for n in to_hash))):
            if got != expected[number][2]:
                _damaged(check, number - 1, expected[number][0], "unreadable" if got is None else "checksum mismatch")
    return check


def _sha256_or_none(path: Path) -> str | None:
    try:
        return shards.file_sha256(path)
    except OSError:  # removed or made unreadable since it was looked at
        return None


def _damaged(check: _Check, number: int, path: Path, why: str) -> None:
    """Shard `number` (-1: the index) found damaged."""
    if number < 0:
        check.index_damaged = True
    else:
        check.damaged.append(number)
    check.reasons.append(f"{path.name} ({why})")


def _repair_split(job: _Job, dst: Path, stage: Path, pool: cf.ProcessPoolExecutor | None, workers: int,
                  settings: dict, on_error: str, log: Callable[[str], None]) -> bool:
    """Write the damaged shards of a split again into `stage`, each from the source files it was made of, and the
    index again (its rows of intact shards from the old index, or from the shards' own tar headers when the index
    is damaged). False when a shard does not come out with the images it had (its source files changed without
    changing the listing: a file that decoded no longer does, or the other way round): then the whole split is
    prepared again."""
    check, report, start = job.repair, job.report, time.monotonic()
    entry = check.entry
    table = [dict(t) for t in entry["shard_files"]]
    report.repaired = list(check.reasons)
    log(f"{job.split}: damaged: {', '.join(check.reasons)}; writing {'them' if len(check.reasons) > 1 else 'it'} "
        "again")
    rows = {}
    for k in sorted(set(check.damaged)):
        files = job.files[table[k]["first"]:table[k]["first"] + table[k]["files"]]
        samples = _samples(job.split, files, pool, workers, settings, on_error, report, log, array("q"))
        rows[k] = shards.write_shard(samples, stage, job.split, k, sum(t["samples"] for t in table[:k]))
        job.staged.append(k)
        if len(rows[k]) != table[k]["samples"]:
            log(f"{job.split}: {shards.shard_name(job.split, k)} came out with {counted(len(rows[k]), 'image')} "
                f"where it had {table[k]['samples']:,}: its source files changed; preparing the whole split again")
            job.staged.clear()
            return False
    old = None
    if not check.index_damaged:
        with contextlib.suppress(ValueError):
            old = shards.load_index(dst / f"{job.split}-index.npy", job.split)
    parts = []
    for k in range(len(table)):
        if k in rows:
            parts.append(rows[k])
        elif old is not None:
            parts.append(old[old[:, 0] == k])
        else:
            try:
                parts.append(shards.shard_rows(dst, job.split, k))
            except (OSError, ValueError, tarfile.TarError):  # intact by its checksum: not ours after all
                job.staged.clear()
                return False
    index = np.concatenate(parts) if parts else np.zeros((0, len(shards.INDEX_COLUMNS)), np.int64)
    shards.write_index(index, stage, job.split)
    job.entry = _entry(job, stage, table, entry["written"], entry["skipped"], workers)
    report.shards = len(table)
    report.seconds = time.monotonic() - start
    report.workers = workers
    return True


def _move_in(stage: Path, dst: Path, split: str, numbers: list[int], count: int, listed: int) -> None:
    """The staged split replaces DST's: the shards `numbers`, then the index, then DST's shards of this split
    numbered `count` to `listed` - 1 (those beyond the new count that the manifest listed: no other file is
    removed)."""
    for number in numbers:
        os.replace(stage / shards.shard_name(split, number), dst / shards.shard_name(split, number))
    os.replace(stage / f"{split}-index.npy", dst / f"{split}-index.npy")
    for e in os.scandir(dst):
        digits = e.name[len(split) + 1:-len(".tar")]
        # Exactly the names shard_name gives (train-00012.tar), and no folder: nothing else in DST is ours.
        if (digits.isdigit() and digits.isascii() and e.name == shards.shard_name(split, int(digits))
                and count <= int(digits) < listed and not e.is_dir(follow_symlinks=False)):
            os.unlink(e.path)


_STAGED = re.compile(r"\.?(train|val|test)-(\d{5,}\.tar|index\.npy)(\.tmp|\.tmp\.npy)?")  # write_split's names


@contextlib.contextmanager
def _locked(dst: Path) -> Iterator[None]:
    """One run at a time in DST (an advisory lock on the folder, released when the process ends however it ends):
    so a staging folder found there belongs to a run that was killed."""
    fd = os.open(dst, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another speedrun data prepare is writing {dst}; wait for it to "
                             "end") from None
        yield
    finally:
        os.close(fd)


def _remove_stage(stage: Path) -> None:
    """A staging folder and the files write_split makes in it; anything else found there is left."""
    with contextlib.suppress(OSError):
        for e in os.scandir(stage):
            if _STAGED.fullmatch(e.name) and not e.is_dir(follow_symlinks=False):
                os.unlink(e.path)
        stage.rmdir()


def _remove_stages(dst: Path) -> None:
    for e in os.scandir(dst):
        if e.name.startswith(_STAGE_PREFIX) and e.is_dir(follow_symlinks=False):
            _remove_stage(Path(e.path))


def _write_json(path: Path, value: dict) -> None:
    _write_bytes(path, (json.dumps(value, indent=1) + "\n").encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    write_text(path, data.decode("utf-8"))
