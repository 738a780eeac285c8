"""Shards of prepared images: POSIX tar files, WebDataset's layout, plus an index of byte offsets.

Why this format (BENCHMARKS.md, "shard formats"): a tar shard is what WebDataset reads and any tool opens
(`tar tf`), and it needs no package that pulls torchvision (LitData's does); but a tar has no index, so reading
sample k means parsing every header before it (86 ms for the 1,000th sample from a cold reader), and Python's
tar parsing costs about a third of decoding a 256-px JPEG. So the writer also records where each image's bytes
lie: `SPLIT-index.npy`, one int64 row (shard, offset, size, label) per sample in writing order. A reader then
fetches any sample with one positioned read (os.pread), in any order: an epoch's order can be a pure function of
(seed, epoch), and a resumed epoch starts where it stopped without reading what came before.

Each sample is two members, `KEY.jpg` (the JPEG) and `KEY.cls` (the class index as ASCII digits), so
`webdataset.WebDataset(urls)` reads the same files. A shard closes once it holds `shard_bytes` of members.
The index is hostile like any file from elsewhere: loaded without pickle and checked against the shards' sizes.

A prepared folder's manifest (data/prepare_tree.py) is what its readers trust: its splits are those it lists (a
split file it does not list is none), and classes.json must be the one whose SHA-256 it records.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import shlex
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from speedrun.data import limits
from speedrun.errors import printable

INDEX_COLUMNS = ("shard", "offset", "size", "label")
MAX_SAMPLE_BYTES = 64 * 2**20  # one prepared JPEG; a 512-px q95 image is well under 1 MiB
MAX_SAMPLES = 2**28  # rows of one index (8 GiB of it): ImageNet-21k has 14 million images
_MAX_HEADER_BYTES = 4096  # np.save writes 128 bytes for an (N, 4) int64 array


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.tar"


def _add_sample(tar: tarfile.TarFile, key: int, jpeg: bytes, label: int) -> int:
    """Append sample `key` as KEY.jpg and KEY.cls; return the byte offset of the JPEG's data in the shard."""
    info = tarfile.TarInfo(f"{key:09d}.jpg")
    info.size = len(jpeg)
    # The data follows its header at the archive's current end (TarInfo.offset_data is set only when reading); the
    # header is what addfile writes, tobuf in the archive's format.
    offset = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
    tar.addfile(info, io.BytesIO(jpeg))
    cls = str(label).encode("ascii")
    info = tarfile.TarInfo(f"{key:09d}.cls")
    info.size = len(cls)
    tar.addfile(info, io.BytesIO(cls))
    return offset


def write_split(samples: Iterable[tuple[bytes, int]], root: str | os.PathLike, split: str,
                shard_bytes: int = 256 * 2**20) -> np.ndarray:
    """Write (jpeg, label) samples as shards `root/SPLIT-NNNNN.tar` and `root/SPLIT-index.npy`; return the index,
    an (N, 4) int64 array of INDEX_COLUMNS. Files are written under temporary names and renamed at the end, so a
    split is either whole or absent."""
    root = Path(root)
    rows: list[tuple[int, int, int, int]] = []
    written: list[Path] = []
    tar, number, size = None, -1, 0
    try:
        for jpeg, label in samples:
            if tar is None or size >= shard_bytes:
                if tar is not None:
                    tar.close()
                number, size = number + 1, 0
                written.append(root / f".{shard_name(split, number)}.tmp")
                tar = tarfile.open(written[-1], "w", format=tarfile.USTAR_FORMAT)
            rows.append((number, _add_sample(tar, len(rows), jpeg, label), len(jpeg), label))
            size += len(jpeg) + len(str(label)) + 2 * tarfile.BLOCKSIZE
        if tar is not None:
            tar.close()
        index = np.array(rows, dtype=np.int64).reshape(-1, len(INDEX_COLUMNS))
        np.save(root / f".{split}-index.npy.tmp.npy", index, allow_pickle=False)
        for tmp in written:  # shards first, the index last: an index never names a shard that is not there
            tmp.rename(root / tmp.name[1:-4])
        (root / f".{split}-index.npy.tmp.npy").rename(root / f"{split}-index.npy")
        return index
    except BaseException:
        if tar is not None:
            tar.close()
        for tmp in [*written, root / f".{split}-index.npy.tmp.npy"]:
            tmp.unlink(missing_ok=True)
        raise


def write_shard(samples: Iterable[tuple[bytes, int]], root: str | os.PathLike, split: str, number: int,
                first_key: int) -> np.ndarray:
    """One shard, `root/SPLIT-NNNNN.tar` numbered `number`, of every sample given, keyed from `first_key` on (its
    position in the split): what write_split wrote there, for a repair. Returns its rows of the index, (n, 4)
    int64. Written under a temporary name and renamed once whole."""
    root = Path(root)
    tmp, rows = root / f".{shard_name(split, number)}.tmp", []
    try:
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for jpeg, label in samples:
                rows.append((number, _add_sample(tar, first_key + len(rows), jpeg, label), len(jpeg), label))
        tmp.rename(root / shard_name(split, number))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return np.array(rows, dtype=np.int64).reshape(-1, len(INDEX_COLUMNS))


def write_index(index: np.ndarray, root: str | os.PathLike, split: str) -> None:
    """`root/SPLIT-index.npy`, written under a temporary name and renamed once whole."""
    root = Path(root)
    tmp = root / f".{split}-index.npy.tmp.npy"
    try:
        np.save(tmp, np.ascontiguousarray(index, dtype=np.int64), allow_pickle=False)
        tmp.rename(root / f"{split}-index.npy")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a regular file, read 4 MiB at a time (hashlib releases the GIL on such blocks, so threads
    hash several shards at once). Raises OSError for a missing file, a FIFO or a folder."""
    h = hashlib.sha256()
    with open(open_regular(Path(path)), "rb") as f:  # closes the descriptor
        while block := f.read(4 * 2**20):
            h.update(block)
    return h.hexdigest()


def shard_rows(root: str | os.PathLike, split: str, number: int) -> np.ndarray:
    """Index rows rebuilt from shard `number`'s own tar headers, (n, 4) int64, for a split whose index is lost or
    damaged while the shard is intact (its checksum matched): each KEY.jpg followed by its KEY.cls, as
    write_split writes them. Raises ValueError for any other layout."""
    path = Path(root) / shard_name(split, number)
    rows = []
    with open(open_regular(path), "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
        members = iter(tar)
        for jpg in members:
            cls = next(members, None)
            if not (jpg.isfile() and jpg.name.endswith(".jpg") and cls is not None and cls.isfile()
                    and cls.name == jpg.name[:-4] + ".cls" and 0 < cls.size <= 20):
                raise ValueError(f"{path} is not laid out as speedrun data prepare writes shards")
            label = tar.extractfile(cls).read()
            if not label.isdigit():
                raise ValueError(f"{path}: {cls.name} holds no class number")
            rows.append((number, jpg.offset_data, jpg.size, int(label)))
    return np.array(rows, dtype=np.int64).reshape(-1, len(INDEX_COLUMNS))


# What the manifest of a prepared folder (data/prepare_tree.py) and of imagenet-debug's synthetic shards say they
# are: the advice for a damaged folder names the command that writes it again.
PREPARED_FORMAT = "speedrun data prepare"
SYNTHETIC_FORMAT = "speedrun synthetic shards"
MANIFEST = "manifest.json"
CLASSES = "classes.json"
SPLITS = ("train", "val", "test")
MAX_CLASSES_BYTES = 4 * 2**20  # classes.json: 21,841 ImageNet-21k names are about 250 KB
_MAX_READ_MANIFEST_BYTES = 64 * 2**20  # prepare_tree's limit: about 200 bytes per shard


def read_manifest(root: str | os.PathLike) -> dict | None:
    """The JSON object in `root`/manifest.json, or None: no file, a FIFO or folder in its place, over
    64 MiB, not JSON, or JSON of another kind. A file from elsewhere: only read, never run."""
    try:
        with open(open_regular(Path(root) / MANIFEST), "rb") as f:
            data = f.read(_MAX_READ_MANIFEST_BYTES + 1)
        manifest = json.loads(data.decode("utf-8")) if len(data) <= _MAX_READ_MANIFEST_BYTES else None
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, nested a million deep
        return None
    return manifest if isinstance(manifest, dict) else None


def listed_splits(root: str | os.PathLike) -> list[str] | None:
    """The splits a prepared folder's manifest lists (prepare's "splits", or the synthetic shards' files), in
    SPLITS order; None when `root` has no manifest of ours to say (then its index files are its splits). A split
    whose files are in the folder but not in the manifest is none: prepare left it (SRC has no such split), or
    someone else put it there."""
    manifest = read_manifest(root)
    if manifest is None:
        return None
    if manifest.get("format") == PREPARED_FORMAT and isinstance(manifest.get("splits"), dict):
        return [s for s in SPLITS if s in manifest["splits"]]
    if manifest.get("format") == SYNTHETIC_FORMAT and isinstance(manifest.get("files"), dict):
        return [s for s in SPLITS if f"{s}-index.npy" in manifest["files"]]
    return None


def unlisted_split(root: str | os.PathLike, split: str, listed: list[str], choose: str = "") -> str:
    """The refusal for reading `split` of `root` when its manifest lists only `listed`. choose: the fix (by
    default, to read one of those; for a manifest that lists none, prepare's repair)."""
    fix = choose or (f"read {' or '.join(listed)}" if listed else repair_advice(root))
    return (f"split {split} is not one {root}'s {MANIFEST} lists (it lists {', '.join(listed) or 'none'}): a split "
            f"file the manifest does not list is no prepared data of this folder; {fix}")


def check_listed(root: str | os.PathLike, split: str) -> None:
    """ValueError when `root`'s manifest lists its splits and `split` is not one of them."""
    listed = listed_splits(root)
    if listed is not None and split not in listed:
        raise ValueError(unlisted_split(root, split, listed))


def read_classes(root: str | os.PathLike) -> tuple[str, ...]:
    """classes.json, a file from elsewhere: at most MAX_CLASSES_BYTES of a regular file (a FIFO would block,
    /dev/zero never end), holding what prepare writes: 2 to limits.MAX_CLASSES distinct, non-empty, printable
    names, and (in a folder prepare wrote) the very bytes whose SHA-256 its manifest records: a reordered or
    edited list would give every label the wrong name, silently."""
    root = Path(root)
    path = root / CLASSES
    fix = repair_advice(root)
    try:
        fd = open_regular(path)
        with open(fd, "rb") as f:
            raw = f.read(MAX_CLASSES_BYTES + 1)
        if len(raw) > MAX_CLASSES_BYTES:
            raise ValueError(f"over {MAX_CLASSES_BYTES:,} bytes")
        names = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        if (root / MANIFEST).exists():  # prepared, and classes.json lost since: prepare writes it again
            raise ValueError(f"{root} has no classes.json; {fix}") from None
        raise ValueError(f"{root} has no classes.json: it is not a folder written by speedrun data "
                         "prepare; run `speedrun data prepare SRC DST` and train on DST") from None
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, nested a million deep
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        if type(e) is ValueError:
            reason = str(e)
        raise ValueError(f"cannot read {path} ({reason}); {fix}") from None
    if not (isinstance(names, list) and 2 <= len(names) <= limits.MAX_CLASSES
            and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{path} is not a list of 2 to {limits.MAX_CLASSES:,} class names; {fix}")
    bad = next((n for n in names if not n or printable(n) != n), None)
    if bad is not None:
        raise ValueError(f"{path} has the class name {repr(bad)[:80]}: names are "
                         f"non-empty and printable; {fix}")
    seen: set[str] = set()
    dup = next((n for n in names if n in seen or seen.add(n)), None)
    if dup is not None:
        raise ValueError(f"{path} names class {dup[:80]} twice; {fix}")
    manifest = read_manifest(root)
    if manifest is not None and manifest.get("format") == PREPARED_FORMAT:
        recorded, count = manifest.get("classes_sha256"), manifest.get("num_classes")
        if type(count) is int and count != len(names):
            raise ValueError(f"{path} names {len(names):,} classes where {MANIFEST} records {count:,}: it is not "
                             f"the class index these shards were prepared with, and labels would name the wrong "
                             f"classes; {fix}")
        if isinstance(recorded, str) and hashlib.sha256(raw).hexdigest() != recorded:
            raise ValueError(f"{path} is not the class index these shards were prepared with (its SHA-256 is not "
                             f"the one {MANIFEST} records: reordered, renamed or edited), and labels would name "
                             f"the wrong classes; {fix}")
    return tuple(names)


STAGE_PREFIX = ".speedrun-prepare-"  # the staging folders data/prepare_tree.py makes in DST


def foreign_entry(root: str | os.PathLike) -> str | None:
    """The name of an entry of `root` that speedrun data prepare did not write, and so must never replace nor
    delete; None when `root` is absent, empty but for prepare's staging folders, or a folder prepare wrote: its
    manifest says so (its format), or, that manifest damaged or lost (not a JSON object, a FIFO, removed), a shard
    index is in write_split's format and classes.json, when there, is a JSON list. A manifest that is another
    program's JSON is named first. Raises OSError when `root` cannot be listed."""
    root = Path(root)
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries
                           if not (e.name.startswith(STAGE_PREFIX) and e.is_dir(follow_symlinks=False)))
    except FileNotFoundError:
        return None
    if not names:
        return None
    manifest = read_manifest(root)
    if manifest is not None:
        return None if manifest.get("format") == PREPARED_FORMAT else MANIFEST
    if any(is_index(root / f"{s}-index.npy") for s in SPLITS) and _a_list_or_absent(root / CLASSES):
        return None
    return names[0]


def _a_list_or_absent(path: Path) -> bool:
    try:
        with open(open_regular(path), "rb") as f:
            raw = f.read(MAX_CLASSES_BYTES + 1)
        return len(raw) <= MAX_CLASSES_BYTES and isinstance(json.loads(raw.decode("utf-8")), list)
    except FileNotFoundError:
        return not os.path.lexists(path)  # a broken link in its place is someone's
    except (OSError, ValueError, RecursionError):
        return False


def prepare_command(root: str | os.PathLike) -> tuple[str, str | None]:
    """(`speedrun data prepare SRC ROOT` with the settings ROOT was prepared with, SRC as its manifest records it
    or None): SRC in the command is the word SRC when none is recorded. Without the settings the command would prepare
    everything again at the defaults."""
    manifest = read_manifest(root)
    recorded, flags = None, ""
    if manifest is not None and manifest.get("format") == PREPARED_FORMAT:
        if isinstance(manifest.get("source"), str) and manifest["source"]:
            recorded = manifest["source"]
        settings = manifest.get("settings")
        if isinstance(settings, dict) and all(type(settings.get(k)) is int for k in ("max_side_px", "quality")):
            flags = f" --max-side-px {settings['max_side_px']} --quality {settings['quality']}"
    return f"speedrun data prepare {shlex.quote(recorded or 'SRC')} {shlex.quote(str(root))}{flags}", recorded


def repair_advice(root: str | os.PathLike) -> str:
    """What repairs a damaged prepared folder `root`: `speedrun data prepare SRC ROOT` again, SRC as its manifest
    records it (prepare checks every shard against the checksum recorded when it was written and rewrites the
    damaged ones); the synthetic shards are checked and rewritten by the command that uses them; a folder prepare
    did not write (it refuses to write there) is prepared anew elsewhere."""
    root = Path(root)
    manifest = read_manifest(root)  # no manifest, or not one of ours: the advice names SRC
    if manifest is not None and manifest.get("format") == SYNTHETIC_FORMAT:
        return (f"run the same command again: it checks the synthetic shards in {root} and writes damaged ones "
                "again")
    if manifest is None or manifest.get("format") != PREPARED_FORMAT:
        try:
            foreign = foreign_entry(root)
        except OSError:
            foreign = None
        if foreign is not None:  # prepare refuses to write into it: a new folder repairs
            return (f"prepare the images again into a new folder (`speedrun data prepare SRC NEW_DST`, SRC being "
                    f"the image folder these shards were prepared from) and use that: {root} holds {foreign}, "
                    "which speedrun data prepare did not write, so it does not write into that folder")
    command, recorded = prepare_command(root)
    where = "" if recorded else ", SRC being the image folder it was prepared from"
    return (f"run speedrun data prepare again (`{command}`{where}): it checks every shard against its checksum "
            "and rewrites what is damaged")


def open_regular(path: Path) -> int:
    """A read-only descriptor of a regular file: a FIFO (which would block open() and read() forever), a folder or
    a device named like our file is an OSError, never a hang."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(0, "not a regular file", str(path))
    return fd


_INDEX_ERRORS = (OSError, ValueError, SyntaxError, MemoryError, RecursionError, KeyError, TypeError, AttributeError)


def _index_rows(f, fd: int) -> int:
    """The rows an .npy index file claims, its header checked (at most _MAX_HEADER_BYTES, literals only) and against
    the file's size; `f` is left at the start of the data. Raises one of _INDEX_ERRORS naming what is wrong."""
    head = f.read(10)
    if len(head) < 10 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2, 3):
        raise ValueError("not an .npy file")
    if head[6] == 1:
        length, start = int.from_bytes(head[8:10], "little"), 10
    else:
        head += f.read(2)
        length, start = int.from_bytes(head[8:12], "little"), 12
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length:,} bytes")
    header = ast.literal_eval(f.read(length).decode("latin1"))  # literals only: no code, no pickle
    shape = header["shape"] if isinstance(header, dict) else None
    if not (header.get("descr") == "<i8" and header.get("fortran_order") is False
            and isinstance(shape, tuple) and len(shape) == 2 and shape[1] == len(INDEX_COLUMNS)
            and type(shape[0]) is int and 0 <= shape[0] <= MAX_SAMPLES):
        raise ValueError(f"{header.get('descr')}, shape {shape}; an index is (N, 4) little-endian int64")
    body = shape[0] * 8 * len(INDEX_COLUMNS)
    if os.fstat(fd).st_size != start + length + body:
        raise ValueError(f"{os.fstat(fd).st_size:,} bytes where its header says "
                         f"{start + length + body:,}: cut or changed")
    return shape[0]


def is_index(path: Path) -> bool:
    """Whether `path` is a shard index as write_split writes it, by its header and size (no row is read)."""
    try:
        with open(open_regular(path), "rb") as f:
            _index_rows(f, f.fileno())
        return True
    except _INDEX_ERRORS:
        return False


def load_index(path: Path, where: str) -> np.ndarray:
    """The (N, 4) int64 index in an .npy file, its header checked against the file's size before anything is
    allocated (np.load allocates what the header claims: 29 TiB for a 128-byte file), never unpickled."""
    try:
        fd = open_regular(path)
    except OSError as e:
        raise ValueError(f"cannot read the shard index {where} ({e.strerror or e}); "
                         f"{repair_advice(path.parent)}") from None
    with open(fd, "rb") as f:
        try:
            rows = _index_rows(f, fd)
            body = rows * 8 * len(INDEX_COLUMNS)
            data = f.read(body)
            if len(data) != body:
                raise ValueError("it ended early")
        except _INDEX_ERRORS as e:
            reason = " ".join(str(getattr(e, "strerror", None) or e).split())[:200]
            raise ValueError(f"cannot read the shard index {where} ({reason}); {repair_advice(path.parent)}") from None
    return np.frombuffer(data, dtype="<i8").reshape(rows, len(INDEX_COLUMNS)).astype(np.int64)


class Shards:
    """The samples of one split: `len(shards)`, `shards.label(i)`, `shards.read(i)` (the JPEG bytes)."""

    def __init__(self, root: str | os.PathLike, split: str):
        self.root, self.split = Path(root), split
        where = str(self.root / f"{split}-index.npy")
        index = load_index(self.root / f"{split}-index.npy", where)
        shards = sorted(set(index[:, 0].tolist())) if len(index) else []
        sizes = {}  # each shard's size in bytes; -1 for one that is missing, not a regular file, or numbered < 0
        for number in shards:
            try:
                st = os.stat(self.root / shard_name(split, number)) if number >= 0 else None
                sizes[number] = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else -1
            except OSError:
                sizes[number] = -1
        shard, offset, size, label = index[:, 0], index[:, 1], index[:, 2], index[:, 3]
        if len(index) and int(label.min()) < 0:
            i = int(np.argmax(label < 0))
            raise ValueError(f"{where}: sample {i} has label {int(label[i])}, below 0; the index was changed; "
                             f"{repair_advice(self.root)}")
        limit = np.array([sizes.get(s, -1) for s in shard.tolist()], dtype=np.int64)
        # offset > limit - size, not offset + size > limit: int64 sums of numbers from a file can wrap around.
        bad = (offset < 0) | (size < 1) | (size > MAX_SAMPLE_BYTES) | (offset > limit - size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{where}: sample {i} points outside its shard ({shard_name(split, int(shard[i]))}, "
                             f"offset {int(offset[i])}, size {int(size[i])}; missing, not a file, or shorter); the "
                             f"shards or the index were changed or cut; {repair_advice(self.root)}")
        self.index = index
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.index)

    def label(self, i: int) -> int:
        return int(self.index[i, 3])

    def read(self, i: int) -> bytes:
        """Sample i's JPEG bytes: one positioned read in its shard (safe to share across threads)."""
        number, offset, size, _ = (int(v) for v in self.index[i])
        shown = str(self.root / shard_name(self.split, number))
        try:
            fd = self._fds.get(number)
            if fd is None:
                fd = open_regular(self.root / shard_name(self.split, number))
                self._fds[number] = fd
            data = os.pread(fd, size, offset)
        except OSError as e:
            raise ValueError(f"cannot read sample {i} from {shown} ({e.strerror or e}); "
                             f"{repair_advice(self.root)}") from None
        if len(data) != size:
            raise ValueError(f"{shard_name(self.split, number)} ended early at sample {i}; "
                             f"{repair_advice(self.root)}")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
