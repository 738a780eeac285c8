"""Image folders: `ROOT/{train,test}/<class>/<image>` with .jpg/.jpeg/.png files, decoded with Pillow. A tree with
val/ and no test/ (ImageNet's layout, the one `speedrun data prepare` takes) evaluates on val/.

Class indices follow the sorted folder names of train/. Channels come from the data: if every image
is grayscale the result has 1 channel, otherwise 3 (grayscale images are replicated into RGB).
Images keep their own size, which must then be one size for all; `image_size=N` instead resizes each
image so its shorter side is N and centre-crops it to N x N.

What the listing leaves out (hidden entries such as .DS_Store or .ipynb_checkpoints, files beside the class
folders, other files in them) is counted and named (LeftOut), never dropped without a word.

Every file is hostile until its header is checked: its claimed width x height is held against
`limits.MAX_SOURCE_PIXELS` (and, without resizing, `limits.MAX_IMAGE_SIDE_PX`) before a pixel is decoded,
and the whole (N, 3, H, W) array against `limits.check_dataset_bytes` before it is allocated.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import multiprocessing as mp
import os
import stat
import sys
import unicodedata
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import numpy as np
from PIL import Image

from speedrun.data import limits
from speedrun.data.dataset import stored_class_names
from speedrun.data.workers import WAIT_SLICE_S, forked_worker, stop_signals_blocked

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
# Pillow picks a decoder by the file's content, not its name: without this list an EPS file named x.png would
# reach the Ghostscript plugin. Either format under either name is fine (ImageNet has PNGs named .JPEG).
_FORMATS = ("JPEG", "PNG")
# Modes that carry no colour: decoded as one "L" channel. Everything else converts to RGB (alpha dropped).
_GRAY_MODES = {"L", "LA", "1"}
CHUNK = 1024  # images a worker claims at a time: ~60 claims for CIFAR-10's 60k images keep the cores balanced
PARALLEL_MIN = 4096  # below this, starting processes costs more than it saves
# Pillow's resize first box-reduces by an integer factor while the image stays this many times larger than the
# target, then resamples: its docs call 3.0 indistinguishable from plain resampling, and it is much faster on photos.
_REDUCING_GAP = 3.0


def refusal_reason(e: BaseException) -> str:
    """`Type: message` on one line; an OSError's strerror only, since our message names the file already."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(f"{type(e).__name__}: {text}".split())[:200]


@dataclass(slots=True)
class ImageFile:
    path: str
    rel: str  # "<class>/<name>", relative to the split folder
    label: int
    size: int  # bytes, with mtime_ns: the cache fingerprint
    mtime_ns: int


@dataclass
class LeftOut:
    """The entries a listing leaves out, counted by why, the first few of each kind named (a folder may hold
    millions): what a report says instead of dropping them silently."""
    counts: Counter = field(default_factory=Counter)  # why -> entries
    names: dict[str, list[str]] = field(default_factory=dict)  # why -> the first NAMED of them, as on disk

    NAMED = 3

    def add(self, name: str, why: str) -> None:
        self.counts[why] += 1
        named = self.names.setdefault(why, [])
        if len(named) < self.NAMED:
            named.append(name)

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def text(self) -> str:
        """One clause, e.g. `left out: 1 hidden (.ipynb_checkpoints/), 2 not .jpg/.jpeg/.png (cat/a.txt, cat/b.gif)`;
        empty when nothing was left out."""
        if not self.counts:
            return ""
        return "left out: " + ", ".join(
            f"{n} {why} ({', '.join(self.names[why])}{' ...' if n > len(self.names[why]) else ''})"
            for why, n in self.counts.items())


def not_an_image(e: os.DirEntry) -> str:
    """Why an entry of a class folder that is not named like an image is left out (a LeftOut reason)."""
    try:
        return "sub-folder, not read" if e.is_dir() else "not .jpg/.jpeg/.png"
    except OSError:  # a symlink loop
        return "not .jpg/.jpeg/.png"


def shown_name(e: os.DirEntry, rel: str) -> str:
    """`rel`, with a trailing / for a folder (a link to one included)."""
    try:
        return rel + "/" if e.is_dir() else rel
    except OSError:  # a symlink loop
        return rel


SPLIT_FOLDERS = ("train", "val", "test")


def check_split_case(root: Path) -> None:
    """Refuse a split folder spelled in another case (Train/, VAL/): split folders are found by their lower-case
    names, so one spelled otherwise would be read as a class folder or left out, and the refusal that followed
    would name something else ("no images in its class folders", "holds no dataset"). A folder holding no folder
    among its first entries is a class (a vehicles dataset's Train/) and is left alone."""
    try:
        with os.scandir(root) as entries:  # one pass, keeping only the few names that can match
            wrong = sorted(e.name for e in entries if e.name.lower() in SPLIT_FOLDERS and e.name not in SPLIT_FOLDERS
                           and _holds_a_folder(Path(e.path)))
    except OSError:  # not a folder, or unreadable: the caller's own checks say so
        return
    if wrong:
        shown, fixed = ", ".join(f"{n}/" for n in wrong), ", ".join(f"{n.lower()}/" for n in wrong)
        raise ValueError(f"{root} has {shown}: split folders are found by their lower-case names (train/, val/, "
                         f"test/); rename {'it' if len(wrong) == 1 else 'them'} to {fixed}")


def _holds_a_folder(directory: Path, peek: int = 64) -> bool:
    """Whether one of the first `peek` entries of `directory` is a folder (bounded: a class folder may hold
    millions of images)."""
    try:
        with os.scandir(directory) as entries:
            for _, e in zip(range(peek), entries):
                if e.is_dir():
                    return True
    except OSError:
        return False
    return False


def which_test_folder(root: Path) -> str | None:
    """Which folder of `root` holds its test split: test/, or val/ where there is no test/ (ImageNet's layout);
    None when `root` has no train/ folder (not an image folder). Raises ValueError when train/ has neither
    beside it, or both hold class folders (which one is the test set is then the user's choice), or when a split
    folder is spelled in another case (check_split_case)."""
    check_split_case(root)
    if not (root / "train").is_dir():
        return None
    found = [s for s in ("test", "val") if (root / s).is_dir()]
    if not found:
        raise ValueError(f"{root} has train/ but no test/ or val/ folder beside it; an image folder needs a test "
                         "split: add test/<class>/<image> (or val/<class>/<image>)")
    if len(found) == 2:
        labelled = [s for s in found if class_dirs(root / s)]
        if len(labelled) == 2:
            raise ValueError(f"{root} has both test/ and val/ class folders, and only one can be the test split; "
                             "move one of them out of the folder")
        found = labelled or found
    return found[0]


def is_image_folder(root: Path) -> bool:
    """`root` holds train/ and test/ (or val/). Raises ValueError for a train/ whose test split is missing or
    ambiguous (which_test_folder)."""
    return which_test_folder(root) is not None


def visible_entries(directory: Path, left_out: LeftOut | None = None, prefix: str = "") -> list[os.DirEntry]:
    """The visible entries of `folder` sorted by name. Hidden ones are left out, and counted in `left_out` (named
    `prefix` + name): ".git", ".ipynb_checkpoints", or macOS's "._x.png" AppleDouble files, which carry an image's
    name but hold Finder metadata."""
    try:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise ValueError(f"cannot list {directory} ({refusal_reason(e)}); "
                         "make it a readable folder") from None
    visible = []
    for e in entries:
        if not e.name.startswith("."):
            visible.append(e)
        elif left_out is not None:
            left_out.add(shown_name(e, prefix + e.name), "hidden")
    return visible


def class_dirs(split_dir: Path, left_out: LeftOut | None = None, prefix: str = "") -> list[str]:
    """The class folders of a split folder, sorted; what else it holds is counted in `left_out` (named `prefix` +
    name): hidden entries, files, broken links."""
    names = []
    for e in visible_entries(split_dir, left_out, prefix):
        try:
            is_dir = e.is_dir()  # follows symlinks; a symlink loop raises ELOOP here
        except OSError as err:
            raise ValueError(f"cannot read {e.path} ({refusal_reason(err)}); fix or remove it") from None
        if is_dir:
            names.append(e.name)
        elif left_out is not None:
            broken = e.is_symlink() and not os.path.exists(e.path)
            left_out.add(prefix + e.name, "broken link" if broken else "not a class folder")
    return names


def distinct_names(names: list[str], where: Path) -> list[str]:
    """The class folder names as stored (errors.printable), refused when two of them are one name once stored: shown
    as the same text (a newline and a backslash-n: "a\nb" and "a\\nb"), or one name in two Unicode spellings
    ("café" composed and decomposed, equal after NFC normalisation). Their classes would merge, or print alike
    and a class index would name one class twice. The in-memory image folder and `speedrun data prepare`
    (prepare.py) both list their classes through this (dataset.stored_class_names, every source's rule)."""
    return stored_class_names(names, str(where), noun="class folders", fix="rename one of them")


def _image_file(e: os.DirEntry, rel: str, label: int) -> ImageFile:
    """An entry named like an image must be a readable regular file: a broken symlink or a folder named x.png
    is refused here rather than silently dropped, and a FIFO named x.png would block the decoder forever."""
    try:
        st = e.stat()  # follows symlinks
    except OSError as err:
        if isinstance(err, FileNotFoundError) and e.is_symlink():
            raise ValueError(f"{e.path} is a symlink to a missing file; fix the link or remove it") from None
        raise ValueError(f"cannot read {e.path} ({refusal_reason(err)}); fix or remove it") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{e.path} is named like an image but is not a regular file; rename or remove it")
    return ImageFile(e.path, rel, label, st.st_size, st.st_mtime_ns)


@dataclass
class Listing:
    """An image folder's classes (escaped, errors.printable, as a dataset, its cache and a model card store them)
    and files ({"train": [...], "test": [...]}, in (class, file name) order, named as on disk), the folder the
    test split came from ("test" or "val"), and what the listing left out."""
    classes: list[str]
    splits: dict[str, list[ImageFile]]
    test_folder: str
    left_out: LeftOut


def list_images(root: Path) -> Listing:
    """The image folder at `root` listed in a deterministic order (class, then file name); see Listing."""
    test_folder = which_test_folder(root) or "test"
    left_out = LeftOut()
    for e in visible_entries(root, left_out):  # hidden ones counted there
        if e.name not in ("train", test_folder, "test"):
            left_out.add(shown_name(e, e.name), f"beside train/ and {test_folder}/")
    classes = class_dirs(root / "train", left_out, "train/")
    if not classes:
        raise ValueError(f"{root / 'train'} has no class folders; lay images out as "
                         "train/<class>/<image>")
    stored = distinct_names(classes, root / "train")
    if test_folder == "val" and (root / "test").is_dir():  # ImageNet's test/: unlabelled images, no class folders
        left_out.add("test/", "without class folders")
    test_classes = class_dirs(root / test_folder, left_out, f"{test_folder}/")
    if test_classes != classes:
        only_train = sorted(set(classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(classes))
        # One name in two Unicode spellings (a tree copied between file systems that store names NFC and NFD)
        # would be listed as two names that print alike: say which, by their code points.
        spelled = {unicodedata.normalize("NFC", n): n for n in only_test}
        twin = next(((n, spelled[unicodedata.normalize("NFC", n)]) for n in only_train
                     if unicodedata.normalize("NFC", n) in spelled), None)
        if twin is not None:
            raise ValueError(f"{root}: train/ has class folder {twin[0]!r} and {test_folder}/ {twin[1]!r}, one name "
                             f"in two Unicode spellings ({ascii(twin[0])} and {ascii(twin[1])}: equal after NFC "
                             f"normalisation); rename one so that train/ and {test_folder}/ spell it alike")
        raise ValueError(
            f"{root}: train/ and {test_folder}/ must hold the same class folders; "
            f"only in train: {only_train or 'none'}, only in {test_folder}: {only_test or 'none'}"
        )
    splits: dict[str, list[ImageFile]] = {}
    for split, folder_name in (("train", "train"), ("test", test_folder)):
        files = []
        for label, name in enumerate(classes):
            prefix = f"{folder_name}/{name}/"
            for e in visible_entries(root / folder_name / name, left_out, prefix):
                if e.name.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(_image_file(e, f"{name}/{e.name}", label))
                else:
                    left_out.add(shown_name(e, prefix + e.name), not_an_image(e))
        if not files:
            raise ValueError(f"{root / folder_name} has no .jpg/.jpeg/.png images in its class folders")
        if split == "train":  # a class never seen in training is a mistake in the layout, not a class
            empty = sorted(set(range(len(classes))) - {f.label for f in files})
            if empty:
                names = ", ".join(classes[i] for i in empty[:5]) + (" ..." if len(empty) > 5 else "")
                # Every class folder is in train/ and in the test split's folder (checked above).
                folders, hold = ("folder", "holds") if len(empty) == 1 else ("folders", "hold")
                raise ValueError(f"{root / 'train'}: class {folders} {names} {hold} no .jpg/.jpeg/.png images; add "
                                 f"training images or remove the {folders} from train/ and {test_folder}/")
        splits[split] = files
    return Listing(stored, splits, test_folder, left_out)


def fingerprint(root: Path, splits: dict[str, list[ImageFile]]) -> str:
    """Changes whenever a file is added, removed, renamed, resized or touched (path, size, mtime)."""
    lines = [str(root.resolve())]
    for split, files in splits.items():
        lines += [f"{split}/{f.rel}\t{f.size}\t{f.mtime_ns}" for f in files]
    # surrogateescape: a name that is not UTF-8 (os.fsdecode keeps its bytes as surrogates) hashes as its bytes.
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()


class Refused(ValueError):
    """One file refused, its one-line message written; `decode` re-raises it as a plain ValueError."""


@contextlib.contextmanager
def open_image(path: str) -> Iterator[Image.Image]:
    """Image.open(path) limited to JPEG and PNG. Every file, the first included, is read inside this block, so
    whatever fails in it (opening, the header, decoding) leaves as one ValueError naming the file."""
    try:
        # Checked before opening: a FIFO would block open() forever, /dev/zero would never end.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise Refused(f"{path} is not a regular file; remove it from the image folder")
        with warnings.catch_warnings():  # 1 us per image
            # Pillow's warnings are about its own handling, once per file and without the file's name: above
            # 89 Mpx (our own, lower limit refuses such a file with one line), a palette with transparency (we drop
            # alpha by design), a malformed EXIF or MPO segment in a JPEG whose pixels decode. 50,000 such files
            # would print 50,000 identical lines; what matters, a file that does not decode, is an error.
            warnings.filterwarnings("ignore", module=r"PIL\.")
            with Image.open(path, formats=_FORMATS) as im:
                yield im
    except Refused:
        raise
    except Image.UnidentifiedImageError:
        raise Refused(f"{path} is not a JPEG or PNG image; delete it or convert it to PNG") from None
    except Image.DecompressionBombError as e:
        # Raised by Image.open above 2 x Image.MAX_IMAGE_PIXELS (179 Mpx), before our own header check can run.
        raise Refused(f"{path} claims too many pixels ({refusal_reason(e)}); the limit is "
                       f"{limits.MAX_SOURCE_PIXELS:,} per image: shrink it or remove it") from None
    # Broad on purpose: for a damaged file Pillow's decoders raise OSError, SyntaxError, ValueError, EOFError,
    # struct.error, zlib.error, IndexError ..., and every one means "this file cannot be read".
    except Exception as e:  # noqa: BLE001
        raise Refused(f"cannot read {path} ({refusal_reason(e)}); delete or replace it") from None


# Pillow's modes for a 16-bit grayscale PNG (I;16 from Pillow 10 on; I, 32-bit, before).
GREY_16BIT_MODES = ("I;16", "I;16B", "I;16L", "I")


def check_header(path: str, im: Image.Image, image_size: int | None, grey_16bit: bool = False) -> None:
    """Refuse by the header's claim alone: Image.open has read no pixel yet. grey_16bit: 16-bit grayscale is
    accepted (data prepare scales it to 8 bits)."""
    w, h = im.size
    if w * h > limits.MAX_SOURCE_PIXELS or max(w, h) > limits.MAX_SOURCE_SIDE_PX:
        raise Refused(f"{path} claims {w}x{h} pixels, over the limit of {limits.MAX_SOURCE_PIXELS:,} "
                       f"per image or {limits.MAX_SOURCE_SIDE_PX} per side; shrink it or remove it")
    if im.format == "JPEG" and im.info.get("progressive"):
        scans = _jpeg_scans(path)
        if scans > limits.MAX_JPEG_SCANS:
            raise Refused(f"{path} is a progressive JPEG of {scans} scans, over the "
                           f"{limits.MAX_JPEG_SCANS} any encoder writes; re-encode it or remove it")
    if image_size is None and max(w, h) > limits.MAX_IMAGE_SIDE_PX:
        raise Refused(f"{path} is {w}x{h} pixels, over the {limits.MAX_IMAGE_SIDE_PX} px kept without "
                       "resizing; pass image_size (--image-size N) to resize every image to N x N")
    if im.mode.startswith(("I", "F")) and not (grey_16bit and im.mode in GREY_16BIT_MODES):
        raise Refused(f"{path} has {im.mode} (16/32-bit) pixels; convert it to 8-bit first")


def _jpeg_scans(path: str) -> int:
    """Start-of-scan markers (FF DA) in a JPEG file, read in 1 MiB chunks. In entropy-coded data every FF byte is
    followed by 00 (JPEG's byte stuffing, ITU T.81 B.1.1.5), so FF DA there is always a marker; an EXIF thumbnail
    adds its own one."""
    count, tail = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            data = tail + chunk
            count += data.count(b"\xff\xda")
            tail = data[-1:] if data.endswith(b"\xff") else b""  # a marker split across two chunks
    return count


def header_size(path: str, image_size: int | None = None) -> tuple[int, int]:
    """(width, height) from the header, checked as read_image checks it; no pixel is decoded."""
    with open_image(path) as im:
        check_header(path, im, image_size)
        return im.size


def as_user_input(e: Refused) -> ValueError:
    """A refusal of a file the user gave (`speedrun predict`'s images): the folder reader's advice is for a
    dataset's files."""
    return ValueError(str(e).replace("; delete it or convert it to PNG", "; give a JPEG or PNG file"))


def read_image(path: str, image_size: int | None, ref: tuple[str, tuple[int, int]] | None) -> np.ndarray:
    """One image: (H, W) uint8 if it has no colour, else (H, W, 3). With image_size=N it is scaled so its
    shorter side is N and centre-cropped to N x N; without, it must match `ref` (path, (width, height))."""
    with open_image(path) as im:
        check_header(path, im, image_size)
        if image_size is None and ref is not None and im.size != ref[1]:
            (w, h), (rw, rh) = im.size, ref[1]
            raise Refused(f"all images must have one size: {path} is {w}x{h} but {ref[0]} "
                           f"is {rw}x{rh}; pass image_size (--image-size N) to resize every image to N x N")
        mode = "L" if im.mode in _GRAY_MODES else "RGB"
        if image_size is not None:
            # JPEG only (a no-op for PNG): decode at 1/2, 1/4 or 1/8 scale, as long as the shorter side stays
            # >= image_size. A 4000x3000 photo for 64 px decodes as 500x375: 64 times fewer pixels.
            scale = image_size / min(im.size)
            im.draft(None, (max(1, round(im.width * scale)), max(1, round(im.height * scale))))
        out = im if im.mode == mode else im.convert(mode)
        if image_size is not None:
            w, h = out.size
            side = min(w, h)
            # The centred side x side square, scaled to N x N in one antialiased resample (Pillow widens the filter
            # by the scale factor when it shrinks): the same pixels as resize-then-crop, without the full resize.
            box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
            out = out.resize((image_size, image_size), Image.Resampling.BICUBIC, box=box,
                             reducing_gap=_REDUCING_GAP)
        return np.asarray(out)


def decode_one(path: str, image_size: int | None = None) -> np.ndarray:
    """One image file as uint8 (1, H, W) if it has no colour, else (3, H, W), under the same limits and with the same
    resize as `decode` (for `speedrun predict`). A file that cannot be used raises one ValueError naming it."""
    try:
        pixels = read_image(path, image_size, None)
    except Refused as e:
        raise as_user_input(e) from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _decode_into(paths: list[str], out: np.ndarray, gray: np.ndarray, image_size: int | None,
                 ref: tuple[str, tuple[int, int]] | None) -> None:
    """Decode paths into out (n, 3, H, W); grey images fill channel 0 only and set their `gray` flag."""
    for i, path in enumerate(paths):
        pixels = read_image(path, image_size, ref)
        if pixels.ndim == 2:  # (H, W)
            out[i, 0] = pixels
            gray[i] = True
        else:  # (H, W, 3) -> (3, H, W)
            out[i] = pixels.transpose(2, 0, 1)


def _worker(paths: list[str], out: np.ndarray, gray: np.ndarray, image_size: int | None,
            ref: tuple[str, tuple[int, int]] | None, claimed: Synchronized, errors: Connection, parent: int) -> None:
    """A forked decode worker: claims CHUNK images at a time and decodes them straight into the shared `out`."""
    # The CLI's SIGTERM handler, inherited, would print a traceback in every worker; SIGTERM ends one at once (it
    # holds no lock the parent will wait for), and the parent alone turns Ctrl-C into KeyboardInterrupt.
    forked_worker(parent)
    try:
        while True:
            with claimed.get_lock():
                start = claimed.value
                claimed.value += CHUNK
            if start >= len(paths):
                return
            end = min(start + CHUNK, len(paths))
            _decode_into(paths[start:end], out[start:end], gray[start:end], image_size, ref)
    except Refused as e:
        errors.send(str(e))
        sys.exit(1)  # SystemExit: the process ends with code 1 and prints nothing
    except Exception as e:  # noqa: BLE001 -- a worker prints no traceback either: the parent reports one line
        errors.send(f"a decode worker failed ({refusal_reason(e)})")
        sys.exit(1)


def _decode_parallel(paths: list[str], out: np.ndarray, gray: np.ndarray, image_size: int | None,
                     ref: tuple[str, tuple[int, int]] | None, workers: int, source: str) -> None:
    """Fill `out` (N, 3, H, W) and `gray` (N,), both in shared memory, with `workers` forked processes.

    Not multiprocessing.Pool: when SIGTERM reaches the whole process group (systemd, Slurm, `kill -TERM -PGID`), a
    worker can die holding the pool's task-queue lock, and Pool.terminate() then waits for that lock forever (seen
    in this package's tests under load). Here the parent takes no lock a worker may hold: it waits on process
    sentinels only, kills what is left on any way out, and notices a worker that died (out of memory?) rather than
    waiting for its results forever. No pixels are pickled either: workers write into `out` directly.
    """
    ctx = mp.get_context("fork")
    claimed = ctx.Value("q", 0)  # the first image no worker has claimed yet
    procs: list[tuple[mp.process.BaseProcess, Connection]] = []
    try:
        for _ in range(workers):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(paths, out, gray, image_size, ref, claimed, send, os.getpid()),
                               daemon=True)
            # Blocked across fork (workers.py). The worker is also tracked before they are unblocked: a Ctrl-C
            # delivered between start() and the append would leave a worker no `finally` below knows to kill,
            # decoding on with the terminal's pipes open.
            with stop_signals_blocked():
                proc.start()
                procs.append((proc, receive))
                send.close()
        running = {proc.sentinel: (proc, receive) for proc, receive in procs}
        while running:
            for sentinel in wait(list(running), timeout=WAIT_SLICE_S):  # in slices: workers.py
                proc, receive = running.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    try:
                        raise Refused(receive.recv())  # the file it refused; never blocks: both write ends are closed
                    except EOFError:  # it died without a word
                        pass
                    how = (f"killed by signal {-proc.exitcode}; out of memory?" if proc.exitcode < 0
                           else f"exit code {proc.exitcode}")
                    raise Refused(f"{source}: a decode worker died ({how}); free memory or decode fewer "
                                   "images")
    finally:
        for proc, receive in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
            receive.close()


def default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cpus)


def decode(paths: list[str], workers: int | None = None, *, image_size: int | None = None,
           source: str = "image folder") -> np.ndarray:
    """(N, C, H, W) uint8 from image files; C is 1 if all are grayscale, else 3.

    Without image_size the images must all share one size, the first one's; with image_size=N every image is
    scaled so its shorter side is N and centre-cropped, giving N x N. `source` names the data in messages.

    Large folders decode in worker processes. Measured on 2 cores with 32x32 JPEGs (warm page cache):
    serial 5-7 s per 60k images, 2 threads 10-11 s (slower: per-image Python work holds the GIL),
    2 processes 3.4-4.8 s. Workers are forked, so they need no re-import and the caller's script
    needs no `if __name__ == "__main__"` guard; where fork does not exist we stay serial.
    """
    if not paths:
        raise ValueError(f"{source} has no image files to decode; add .jpg/.jpeg/.png files")
    try:
        if image_size is None:
            ref = (paths[0], header_size(paths[0]))  # the first file's header sets the size; no pixel decoded
            w, h = ref[1]
        else:
            ref, w, h = None, image_size, image_size
        # Three channels whatever the images turn out to be: that is what is allocated below.
        limits.check_dataset_bytes(len(paths) * 3 * h * w, f"{source} ({len(paths)} images of {w}x{h})")
        workers = default_workers() if workers is None else workers
        if workers > 1 and len(paths) >= PARALLEL_MIN and "fork" in mp.get_all_start_methods():
            # MAP_SHARED anonymous memory: forked workers write their pixels where the parent reads them.
            out = np.frombuffer(mmap.mmap(-1, len(paths) * 3 * h * w), np.uint8).reshape(len(paths), 3, h, w)
            gray = np.frombuffer(mmap.mmap(-1, len(paths)), bool)
            _decode_parallel(paths, out, gray, image_size, ref, workers, source)
        else:
            out = np.empty((len(paths), 3, h, w), dtype=np.uint8)  # (N, 3, H, W)
            gray = np.zeros(len(paths), dtype=bool)
            _decode_into(paths, out, gray, image_size, ref)
    except Refused as e:
        raise ValueError(str(e)) from None  # a plain ValueError, and no chained context: one line
    if gray.all():
        return np.ascontiguousarray(out[:, :1])  # (N, 1, H, W)
    if gray.any():
        out[gray, 1:] = out[gray, :1]  # grey -> RGB by replication
    return out
