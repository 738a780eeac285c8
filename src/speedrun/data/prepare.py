"""`speedrun data prepare`, the source side: an image tree's files listed, and each one as the bytes a
shard holds, in worker processes. data/prepare_tree.py writes them (shards, manifest, what is up to date).

ImageNet's files are not all what their names say: a few are CMYK JPEGs, some grayscale, one is a PNG named
.JPEG, and phone photos carry an EXIF orientation that a decoder ignores unless asked. Every prepared image is the
same thing: upright, 8-bit RGB, its longer side at most `max_side_px` (FFCV's `max_resolution`; the aspect ratio
kept, never enlarged), encoded as baseline JPEG at `quality` (FFCV's `jpeg_quality`). Files are hostile: read
under the image folder reader's limits (data/folder.py: formats, header size, progressive scans) before a pixel
is decoded; a file that cannot be used is one ValueError naming it (the command decides: skip or stop).

The tree is `SRC/{train,val,test}/<class>/<image>` (whichever split folders are there: CIFAR-style folders have
train/ and test/), or `SRC/<class>/<image>`, one split named train. The images are the files in the class folders
named .jpg, .jpeg or .png in any case; everything else the listing meets (hidden entries such as ".DS_Store",
".ipynb_checkpoints" or macOS's "._x.JPEG", other files, sub-folders, files beside the class folders, folders beside
the split folders) is left out, counted and named in the report (folder.LeftOut). Labels follow the sorted
class-folder names of train/ (the classes a network learns), or of all splits together when there is no train/;
a split with a class folder outside that index is an error naming it, and so are two class folders whose names
are stored alike once escaped (folder.distinct_names).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import hashlib
import io
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from speedrun.data import folder, limits
from speedrun.data.workers import forked_worker, kill_pool, stop_signals_blocked, wait_for
from speedrun.errors import warn

SPLITS = folder.SPLIT_FOLDERS
# Prepared images waiting in memory at most: results come back in order, so a slow one holds the ones behind it.
_IN_FLIGHT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Prepared:
    """A prepared image and what was done to it (the command counts these in its report)."""
    jpeg: bytes
    width_px: int
    height_px: int
    source_format: str  # "JPEG" or "PNG": what the bytes were, whatever the file's name
    source_mode: str  # Pillow's mode before conversion: "RGB", "L", "CMYK", "P", "RGBA", ...
    rotated: bool  # an EXIF orientation other than 1 was applied
    resized: bool


# The command's defaults. 256 px on the longer side: a 4:3 photo keeps 256x192, enough for training crops of up to
# 192 px (FFCV's ResNet recipes train at 160 to 192), with 2.4 to 3.8 times fewer pixels to decode in every epoch
# than FFCV's 400 px (ResNet-18) or 500 px (ResNet-50) files; a 224-px evaluation would upsample from 256 px and
# wants those larger files. Quality 90 is FFCV's.
DEFAULT_MAX_SIDE_PX = 256
DEFAULT_QUALITY = 90


def check_settings(max_side_px: int, quality: int) -> None:
    if not isinstance(max_side_px, int) or not 16 <= max_side_px <= 8192:
        raise ValueError(f"max side (--max-side-px) must be 16 to 8192 px, got {max_side_px}; ImageNet recipes use "
                         "256 to 512")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality (--quality) must be 1 to 100, got {quality}; 90 keeps ImageNet's accuracy "
                         "(FFCV)")


def prepare_image(path: str, max_side_px: int, quality: int) -> Prepared:
    """The file at `path` as a Prepared image (see the module). Raises ValueError naming the file."""
    check_settings(max_side_px, quality)
    try:
        with folder.open_image(path) as im:  # JPEG or PNG by content, the file checked
            folder.check_header(path, im, max_side_px, grey_16bit=True)
            source_format, source_mode = im.format, im.mode
            # JPEG only: decode at 1/2, 1/4 or 1/8 scale while the longer side stays >= max_side_px.
            if max(im.size) > max_side_px:
                scale = max_side_px / max(im.size)
                im.draft("RGB", (max(1, round(im.width * scale)), max(1, round(im.height * scale))))
            orientation = im.getexif().get(0x0112, 1)  # EXIF Orientation
            upright = ImageOps.exif_transpose(im)
            if upright.mode in folder.GREY_16BIT_MODES:  # 16-bit grayscale: scaled to 8 bits (convert would clip)
                deep = np.asarray(upright).astype(np.float64)  # (H, W); values 0 .. 65535
                upright = Image.fromarray(np.clip(np.rint(deep / 257.0), 0, 255).astype(np.uint8), "L")
            rgb = upright.convert("RGB") if upright.mode != "RGB" else upright  # L, CMYK, P, RGBA, LA ...
            resized = max(rgb.size) > max_side_px
            if resized:  # exif_transpose returned a copy: thumbnail (in place) leaves the file's image alone
                rgb.thumbnail((max_side_px, max_side_px), Image.Resampling.LANCZOS)
            buf = io.BytesIO()
            rgb.save(buf, format="JPEG", quality=quality)
            # exif_transpose applies 2 to 8 only; 0, 9, 65535 or a string in a hostile file change nothing.
            return Prepared(buf.getvalue(), rgb.width, rgb.height, source_format, source_mode,
                            orientation in range(2, 9), resized)
    except folder.Refused as e:  # whatever failed inside the block (a file that does not decode to its end too)
        raise ValueError(str(e)) from None


@dataclass(slots=True)
class SourceFile:
    path: str
    rel: str  # "<class>/<name>", as on disk
    label: int
    size: int  # bytes, and mtime_ns: with rel, the source fingerprint; -1 when stat failed (a broken link)
    mtime_ns: int


@dataclass
class Source:
    """An image tree listed: its class names (printable, as classes.json stores them), each split's image files in
    (class, name) order, what each split's listing left out, and what SRC holds beside its split folders."""
    classes: list[str]
    splits: dict[str, list[SourceFile]]
    left_out: dict[str, folder.LeftOut]
    beside: folder.LeftOut


def list_source(src: Path) -> tuple[list[str], dict[str, list[SourceFile]], dict[str, int]]:
    """(class names, printable; {split: image files in (class, name) order}; {split: entries left out}): read_source
    in short."""
    source = read_source(src)
    return source.classes, source.splits, {s: left.count for s, left in source.left_out.items()}


def read_source(src: Path) -> Source:
    """The tree at `src` listed, the layout checked (see the module). Only two levels are read, split/class/file,
    so no symlink loop is ever followed."""
    folder.check_split_case(src)
    split_dirs = {s: src / s for s in SPLITS if (src / s).is_dir()}
    beside = folder.LeftOut()
    if split_dirs:
        for e in folder.visible_entries(src, beside):  # hidden ones counted there
            if e.name not in split_dirs:
                beside.add(folder.shown_name(e, e.name), "not train/, val/ or test/")
    else:
        split_dirs = {"train": src}
    left_out = {s: folder.LeftOut() for s in split_dirs}
    prefix = {s: "" if d == src else f"{s}/" for s, d in split_dirs.items()}
    folders = {s: folder.class_dirs(d, left_out[s], prefix[s]) for s, d in split_dirs.items()}  # sorted
    if len(folders) > 1 and folders.get("test") == []:  # ImageNet's test/: unlabelled images, no class folders
        del folders["test"], split_dirs["test"], left_out["test"]
        beside.add("test/", "without class folders")
    index = folders["train"] if "train" in folders else sorted(set().union(*folders.values()))
    if not index:
        if any((src / name).is_file() for name in ("manifest.json", "train-index.npy", "val-index.npy")):
            raise ValueError(f"SRC {src} has no class folders: it is a folder of shards that speedrun data "
                             "prepare wrote, not an image tree; give the image folder it was prepared from")
        raise ValueError(f"{src} has no class folders; lay images out as SRC/train/<class>/<image> "
                         "(and val/ or test/), or SRC/<class>/<image>")
    stored = folder.distinct_names(index, split_dirs["train"] if "train" in split_dirs else src)
    if len(index) > limits.MAX_CLASSES:
        raise ValueError(f"{src} has {len(index):,} class folders, over the limit of "
                         f"{limits.MAX_CLASSES:,}; check that SRC is the dataset's top folder")
    label = {name: i for i, name in enumerate(index)}
    for split, names in folders.items():
        unknown = [n for n in names if n not in label]
        if unknown:
            folders = "a class folder" if len(unknown) == 1 else "class folders"
            raise ValueError(f"{split_dirs[split]} has {folders} that train/ has not: "
                             f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}; labels come from "
                             "train/'s folders: add them there or remove them")
    splits = {}
    for split, names in folders.items():
        files, empty = [], []
        for name in names:
            found = _class_files(split_dirs[split] / name, name, label[name], left_out[split], prefix[split])
            files += found
            if not found:
                empty.append(name)
        if not files:
            raise ValueError(f"{split_dirs[split]} has no .jpg/.jpeg/.png images in its class "
                             "folders; add images or remove the folder")
        if empty:
            # Kept in the index (a label is a position); the imagenet recipes refuse a class they never train on.
            refused = ("; training refuses a class without training images: add images or remove the "
                       f"{'folder' if len(empty) == 1 else 'folders'}"
                       if split == "train" else "")
            warn(f"{split_dirs[split]}: {'class folder' if len(empty) == 1 else 'class folders'} {', '.join(empty[:5])}"
                 f"{' ...' if len(empty) > 5 else ''} {'holds' if len(empty) == 1 else 'hold'} no images{refused}")
        splits[split] = files
    return Source(stored, splits, left_out, beside)


def _class_files(directory: Path, name: str, label: int, left_out: folder.LeftOut, prefix: str) -> list[SourceFile]:
    """The image files of one class folder sorted by name; the other entries counted in `left_out`."""
    files = []
    for e in folder.visible_entries(directory, left_out, f"{prefix}{name}/"):  # hidden ones counted there
        if not e.name.lower().endswith(folder.IMAGE_EXTENSIONS):
            left_out.add(folder.shown_name(e, f"{prefix}{name}/{e.name}"), folder.not_an_image(e))
            continue
        try:
            st = e.stat()  # follows symlinks
            size, mtime_ns = st.st_size, st.st_mtime_ns
        except OSError:  # a broken link or a loop: prepare_image names it, and --on-error decides
            size = mtime_ns = -1
        files.append(SourceFile(e.path, f"{name}/{e.name}", label, size, mtime_ns))
    return files


def fingerprint(files: list[SourceFile]) -> str:
    """A hash of the listing that changes when a file is added, removed, renamed, resized or touched."""
    h = hashlib.sha256()
    for f in files:
        rel = f.rel.encode("utf-8", "surrogateescape")  # a name that is not UTF-8 hashes as its bytes
        h.update(b"%d:%s %d %d\n" % (len(rel), rel, f.size, f.mtime_ns))  # length-prefixed: any name is unambiguous
    return h.hexdigest()


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[cf.ProcessPoolExecutor | None]:
    """`workers` processes, or None for 0. concurrent.futures rather than multiprocessing.Pool: a Pool whose worker
    dies (the OOM killer, a signal) waits for its results forever, and one that died holding the task queue's lock
    hangs Pool.terminate() (folder.py's docstring); here a dead worker is BrokenProcessPool, an error."""
    if workers == 0:
        yield None
        return
    context = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None  # no re-import per worker
    # Signals are the parent's (workers.py); SIGTERM ends a worker at once: it writes nothing of DST's. A worker
    # lives on after a SIGKILL of the command otherwise: concurrent.futures' idle workers wait on a queue whose
    # writing end they hold themselves, holding the command's files and the DST lock, were they forked under it.
    initializer = functools.partial(forked_worker, os.getpid())
    with stop_signals_blocked():
        pool = cf.ProcessPoolExecutor(workers, mp_context=context, initializer=initializer)
        wait_for(pool.submit(int))  # the first task forks the workers: now, while the signals are blocked
    try:
        yield pool
    except BaseException:  # abandoned (Ctrl-C, an error): not waiting for the chunks the workers hold
        kill_pool(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _prepare_chunk(paths: list[str], max_side_px: int, quality: int) -> list[Prepared | str]:
    """In a worker: each file prepared, or the one-line reason it cannot be."""
    out: list[Prepared | str] = []
    for path in paths:
        try:
            out.append(prepare_image(path, max_side_px, quality))
        except ValueError as e:
            out.append(str(e))
    return out


def prepare_all(files: list[SourceFile], pool: cf.ProcessPoolExecutor | None, workers: int, max_side_px: int,
                quality: int) -> Iterator[Prepared | str]:
    """Each file's result in the files' order, as an ordered imap with a chunk size: chunks of up to 16 files, at
    most 2 per worker submitted ahead, so what waits in memory is bounded (_IN_FLIGHT_BYTES at the largest sides)."""
    if pool is None:
        for f in files:
            yield from _prepare_chunk([f.path], max_side_px, quality)
        return
    per_image = 3 * max_side_px**2  # bytes: a JPEG is smaller than its raw pixels at any quality but noise at 100
    chunk = max(1, min(16, _IN_FLIGHT_BYTES // (per_image * 2 * workers)))
    pending: deque[cf.Future] = deque()
    try:
        for start in range(0, len(files), chunk):
            paths = [f.path for f in files[start:start + chunk]]
            pending.append(pool.submit(_prepare_chunk, paths, max_side_px, quality))
            if len(pending) > 2 * workers:
                yield from wait_for(pending.popleft())
        while pending:
            yield from wait_for(pending.popleft())
    except BrokenProcessPool:
        raise ValueError("a worker process of speedrun data prepare died (killed, or out of memory?); run again "
                         "with fewer --workers or a smaller --max-side-px") from None
    # After an error or an interrupt, the chunks not yet started are cancelled by worker_pool's shutdown
    # (cancel_futures=True), in the pool's own management thread. Not here: a SIGTERM to the process group ends
    # the workers too, and Python 3.11's management thread then marks every pending future failed without
    # asking whether it was cancelled meanwhile: a future cancelled from this thread at that moment made it raise
    # InvalidStateError and print a thread's traceback beside the one line (2 of 10 interrupted runs, measured).
