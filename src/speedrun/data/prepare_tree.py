"""`speedrun data prepare SRC DST`: an image tree as shards, and on a second run only what changed.

SRC's layout and the labels: data/prepare.py, which lists the files and prepares each image. DST receives:

    classes.json                      the class names, a JSON list: label = position
    SPLIT-NNNNN.tar, SPLIT-index.npy  each split's shards (data/shards.py), images in (class, file name) order
    manifest.json                     written last: format version, settings, and for each split a fingerprint
                                      of the source listing (relative path, size, mtime_ns of every image file)

A run prepares again only the splits whose fingerprint, settings or class index differ from the manifest (or whose
shards are missing or cut); a manifest that is not one we wrote is no manifest.

DST changes only when all is done: new splits are written into a staging folder inside DST and moved into place
once every one is whole, so a failure (--on-error stop, Ctrl-C, a full disk) leaves DST as it was; the price is room
for the new shards beside the old ones while the run lasts. A split rewritten with fewer shards loses its extra old
ones (files named exactly as shards.shard_name names that split's); no other file in DST is touched, none in SRC.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from speedrun.data import folder, shards
from speedrun.data.prepare import (DEFAULT_MAX_SIDE_PX, DEFAULT_QUALITY, SPLITS, SourceFile, check_settings,
                                   fingerprint, list_source, prepare_all, worker_pool)
from speedrun.errors import escaped_refusals, printable, warn
from speedrun.records.result_file import write_text

FORMAT, VERSION = "speedrun data prepare", 1
MANIFEST, CLASSES = "manifest.json", "classes.json"
SHARD_BYTES = 256 * 2**20  # shards.write_split's default: ImageNet's train split at 256 px is about 75 shards
_MAX_MANIFEST_BYTES = 2**20  # ours is about 200 bytes per split
_MAX_WORKERS = 256
_STAGE_PREFIX = ".speedrun-prepare-"
_PROGRESS_S = 30.0


@dataclass
class SplitReport:
    split: str
    images: int  # image files in the source listing
    ignored: int  # other entries in its class folders
    up_to_date: bool = False
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
        if self.up_to_date:
            before = f", {self.skipped_before:,} skipped when prepared" if self.skipped_before else ""
            return f"{self.split}: up to date ({self.written:,} images in {self.shards} shard(s){before})"
        rate = self.written / self.seconds if self.seconds > 0 else 0.0
        modes = ", ".join(f"{mode} {n}" for mode, n in sorted(self.converted.items()))
        text = (f"{self.split}: {self.written:,} written ({self.bytes / 1e6:.1f} MB in {self.shards} shard(s), "
                f"{self.seconds:.1f} s, {rate:,.0f} images/s with {self.workers or 'no'} worker process(es)); "
                f"{sum(self.converted.values())} converted to RGB{f' ({modes})' if modes else ''}, "
                f"{self.rotated} EXIF-rotated, {self.resized} resized, {self.png_named_jpeg} PNG named .jpg/.jpeg; "
                f"{len(self.skipped)} skipped")
        if self.skipped:
            more = f" and {len(self.skipped) - 10} more" if len(self.skipped) > 10 else ""
            text += f" ({', '.join(self.skipped[:10])}{more})"
        return text + (f"; {self.ignored} other file(s) ignored" if self.ignored else "")


@dataclass
class Report:
    dst: str  # as given
    classes: list[str]
    splits: list[SplitReport]

    @property
    def up_to_date(self) -> bool:
        return all(s.up_to_date for s in self.splits)

    def lines(self) -> list[str]:
        """The report as text to print, each line escaped (errors.printable): DST and the skipped files are named
        as they are on disk."""
        head = (f"{self.dst} is up to date: nothing to do" if self.up_to_date else
                f"{self.dst}: {len(self.classes)} classes")
        return [printable(line) for line in (head, *(s.line() for s in self.splits))]


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
        raise ValueError(f"--on-error must be skip or stop, got {on_error}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive number of bytes, got {shard_bytes}")
    log = log or (lambda line: None)
    src_dir, dst_dir = _paths(src, dst)
    classes, splits, ignored = list_source(src_dir)
    settings = {"max_side_px": int(max_side_px), "quality": int(quality), "shard_bytes": int(shard_bytes)}
    classes_bytes = (json.dumps(classes, ensure_ascii=False) + "\n").encode("utf-8")
    classes_sha = hashlib.sha256(classes_bytes).hexdigest()
    old = _read_manifest(dst_dir)
    same = old is not None and old["settings"] == settings and old["classes_sha256"] == classes_sha
    reports, entries, todo = [], {}, []
    for split, files in splits.items():
        listed, report = fingerprint(files), SplitReport(split, len(files), ignored[split])
        entry = old["splits"].get(split) if same else None
        if entry is not None and entry["fingerprint"] == listed \
                and _whole(dst_dir, split, entry["written"], len(classes)):
            report.up_to_date, entries[split] = True, entry
            report.written, report.skipped_before, report.shards = entry["written"], entry["skipped"], entry["shards"]
        else:
            todo.append((split, files, listed, report))
        reports.append(report)
    for split in sorted(set(old["splits"]) - set(splits)) if old else []:
        warn(f"{dst_dir} holds split {split}, which {src_dir} no longer has: its "
             f"files are left as they are ({split}-*.tar, {split}-index.npy) and no longer in {MANIFEST}")
    manifest = {"format": FORMAT, "version": VERSION, "settings": settings, "classes_sha256": classes_sha,
                "splits": entries}
    classes_ok = _read_small(dst_dir / CLASSES, len(classes_bytes)) == classes_bytes
    if not todo and classes_ok and old == manifest:
        with _locked(dst_dir):
            _remove_stages(dst_dir)  # left by a run that was killed (SIGKILL, power loss): GBs, perhaps
        return Report(str(dst), classes, reports)

    _check_targets(dst_dir, [MANIFEST, CLASSES, *(f"{split}-index.npy" for split, *_ in todo)])
    created = not dst_dir.exists()
    dst_dir.mkdir(parents=True, exist_ok=True)
    done = False
    # The workers are forked before the lock is taken: a process forked while it is held shares it, and a worker
    # outliving a killed run would keep every later run out ("another ... is writing") for as long as it lived.
    with worker_pool(workers if todo else 0) as pool, _locked(dst_dir):
        _remove_stages(dst_dir)
        stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=dst_dir))
        try:
            for split, files, _, report in todo:
                log(f"{split}: preparing {len(files):,} images with {workers or 'no'} worker process(es)")
                _write_split(split, files, stage, report, pool, workers, settings, on_error, log)
            # Every new split is whole: move them in. The manifest first forgets them, so that a crash while moving
            # leaves splits the next run prepares again, never a manifest vouching for shards it does not describe.
            _check_targets(dst_dir, [shards.shard_name(split, k) for split, _, _, report in todo
                                     for k in range(report.shards)])
            if todo:
                _write_json(dst_dir / MANIFEST, manifest)
            if not classes_ok:
                _write_bytes(dst_dir / CLASSES, classes_bytes)
            for split, files, listed, report in todo:
                _move_in(stage, dst_dir, split, report.shards)
                entries[split] = {"fingerprint": listed, "images": len(files), "written": report.written,
                                  "skipped": len(report.skipped), "shards": report.shards}
            _write_json(dst_dir / MANIFEST, manifest)
            done = True
        finally:
            _remove_stage(stage)
            if created and not done:
                with contextlib.suppress(OSError):
                    dst_dir.rmdir()
    return Report(str(dst), classes, reports)


def _paths(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[Path, Path]:
    """Both folders resolved (symlinks followed, so a DST that links into SRC is seen), SRC checked."""
    shown_src, shown_dst = str(src), str(dst)
    try:
        src_dir, dst_dir = Path(src).resolve(), Path(dst).resolve()
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
    for split, entry in m["splits"].items():
        if (split not in SPLITS or not isinstance(entry, dict) or not isinstance(entry.get("fingerprint"), str)
                or not all(count(entry.get(k)) for k in ("images", "written", "skipped", "shards"))):
            return None
    return m


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


def _write_split(split: str, files: list[SourceFile], stage: Path, report: SplitReport,
                 pool: cf.ProcessPoolExecutor | None, workers: int, settings: dict, on_error: str,
                 log: Callable[[str], None]) -> None:
    """Prepare one split's files and write its shards into `stage`, counting into `report`."""
    start = time.monotonic()
    next_log = start + _PROGRESS_S

    def samples() -> Iterator[tuple[bytes, int]]:
        nonlocal next_log
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
                yield out.jpeg, files[i].label
                if time.monotonic() > next_log:
                    next_log += _PROGRESS_S
                    log(f"{split}: {i + 1:,} of {len(files):,} images, "
                        f"{(i + 1) / (time.monotonic() - start):,.0f} images/s")

    index = shards.write_split(samples(), stage, split, settings["shard_bytes"])
    report.shards = int(index[:, 0].max()) + 1 if len(index) else 0
    report.seconds = time.monotonic() - start
    report.workers = workers


def _move_in(stage: Path, dst: Path, split: str, count: int) -> None:
    """The staged split replaces DST's: shards, then the index, then DST's shards of this split beyond `count`."""
    for number in range(count):
        os.replace(stage / shards.shard_name(split, number), dst / shards.shard_name(split, number))
    os.replace(stage / f"{split}-index.npy", dst / f"{split}-index.npy")
    for e in os.scandir(dst):
        digits = e.name[len(split) + 1:-len(".tar")]
        # Exactly the names shard_name gives (train-00012.tar), and no folder: nothing else in DST is ours.
        if (digits.isdigit() and digits.isascii() and e.name == shards.shard_name(split, int(digits))
                and int(digits) >= count and not e.is_dir(follow_symlinks=False)):
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
