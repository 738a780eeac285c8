"""Shards of prepared images (issue 9): POSIX tar files, WebDataset's layout, plus an index of byte offsets.

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
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from speedrun.errors import printable

INDEX_COLUMNS = ("shard", "offset", "size", "label")
MAX_SAMPLE_BYTES = 64 * 2**20  # one prepared JPEG; a 512-px q95 image is well under 1 MiB


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.tar"


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
            key = f"{len(rows):09d}"
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(jpeg)
            # The data follows its header at the archive's current end (TarInfo.offset_data is set only when
            # reading); the header is what addfile writes, tobuf in the archive's format.
            offset = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
            tar.addfile(info, io.BytesIO(jpeg))
            rows.append((number, offset, len(jpeg), label))
            cls = str(label).encode("ascii")
            info = tarfile.TarInfo(f"{key}.cls")
            info.size = len(cls)
            tar.addfile(info, io.BytesIO(cls))
            size += len(jpeg) + len(cls) + 2 * tarfile.BLOCKSIZE
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


class Shards:
    """The samples of one split: `len(shards)`, `shards.label(i)`, `shards.read(i)` (the JPEG bytes)."""

    def __init__(self, root: str | os.PathLike, split: str):
        self.root, self.split = Path(root), split
        where = printable(str(self.root / f"{split}-index.npy"))
        try:
            index = np.load(self.root / f"{split}-index.npy", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"cannot read the shard index {where} ({e}); run speedrun data prepare again") from None
        if index.dtype != np.int64 or index.ndim != 2 or index.shape[1] != len(INDEX_COLUMNS):
            raise ValueError(f"{where} is not a shard index ({index.dtype}, shape {index.shape}); run speedrun "
                             "data prepare again")
        shards = sorted(set(index[:, 0].tolist())) if len(index) else []
        sizes = {}  # each shard's size in bytes; -1 for a shard that is missing (or a negative number)
        for number in shards:
            try:
                sizes[number] = os.stat(self.root / shard_name(split, number)).st_size if number >= 0 else -1
            except OSError:
                sizes[number] = -1
        shard, offset, size = index[:, 0], index[:, 1], index[:, 2]
        limit = np.array([sizes.get(s, -1) for s in shard.tolist()], dtype=np.int64)
        bad = (offset < 0) | (size < 0) | (size > MAX_SAMPLE_BYTES) | (offset + size > limit) | (index[:, 3] < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{where}: sample {i} points outside its shard ({shard_name(split, int(shard[i]))}, "
                             f"offset {int(offset[i])}, size {int(size[i])}); the shards or the index were changed "
                             "or cut; run speedrun data prepare again")
        self.index = index
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.index)

    def label(self, i: int) -> int:
        return int(self.index[i, 3])

    def read(self, i: int) -> bytes:
        """Sample i's JPEG bytes: one positioned read in its shard (safe to share across threads)."""
        number, offset, size, _ = (int(v) for v in self.index[i])
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = os.open(self.root / shard_name(self.split, number), os.O_RDONLY)
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise ValueError(f"{printable(shard_name(self.split, number))} ended early at sample {i}; run speedrun "
                             "data prepare again")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
