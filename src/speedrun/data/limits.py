"""Limits for files from elsewhere, in one place: what a reader may read, inflate, extract or allocate.

Every reader checks what a file *claims* (an IDX header's count and shape, an image header's width and height, a
tar member's size) against these limits before it reads or allocates anything, and then reads no more than the
claim: so a small hostile file can never make the process allocate or write more than a small multiple of what
its format legitimately holds. The numbers come from the formats we read:

- CIFAR "python version" batches: 10,000 rows of 3,072 pixel bytes (31.0 MB) for CIFAR-10, one 50,000-row train
  file (155.4 MB) for CIFAR-100, and small meta files; the archives hold 8 (CIFAR-10) or 5 (CIFAR-100) members.
- IDX (MNIST family): a header of 4 + 4*ndim bytes states every dimension, so the data size is known exactly.
- Images: a header states width and height before any pixel is decoded.

In-memory datasets are further bounded by `max_dataset_bytes()`: the decoded uint8 tensors must fit in memory
with room for the loader's per-epoch copies.
"""

from __future__ import annotations

import os

# CIFAR: the largest official member is CIFAR-100's `train` pickle, 155,440,879 bytes (50,000 x 3,072 pixels plus
# labels, coarse labels and file names). 192 MiB leaves room for a re-pickled copy and refuses anything larger.
MAX_CIFAR_MEMBER_BYTES = 192 * 2**20
# The official archives extract to 186 MB (CIFAR-10: 6 x 31 MB) and 178 MB (CIFAR-100).
MAX_CIFAR_ARCHIVE_BYTES = 256 * 2**20
# A download is checked against its published MD5 only at its end, so its size is bounded as it arrives: the
# largest file we fetch is cifar-10-python.tar.gz, 170,498,071 bytes.
MAX_DOWNLOAD_BYTES = 256 * 2**20
MAX_ARCHIVE_MEMBERS = 64  # official: 9 entries (CIFAR-10, with its folder) and 6 (CIFAR-100)
# A tar ends with two zero blocks and is padded to its 10,240-byte record; gzip may follow with nothing. More than
# this after the end of the archive is not an archive we wrote or downloaded.
MAX_ARCHIVE_TRAILER_BYTES = 1 * 2**20

# Images in an in-memory image folder. Without a resize, every image is kept at its own size: CIFAR-class data
# is 32 px, and larger sides belong to the sharded path (data/shards.py) or to --image-size.
MAX_IMAGE_SIDE_PX = 1024
# One source image may be decoded up to this many pixels before it is resized (a 48-megapixel photo; Pillow's
# own warning starts at 89 Mpx). Its header is checked before any pixel is decoded.
MAX_SOURCE_PIXELS = 48_000_000
# And each side: Pillow keeps a pointer per row, so a 1 x 48,000,000 PNG took 20 times its pixels' memory. The
# widest panoramas are around 30,000 px.
MAX_SOURCE_SIDE_PX = 32_768
# A progressive JPEG is decoded scan by scan into a full-size buffer, so repeating a tiny scan 20,000 times made
# one 1.6 MB file take 49 s. Encoders write about 10 scans (libjpeg's default script); libjpeg-turbo's own tools
# stop at 500.
MAX_JPEG_SCANS = 256

# Classes of one dataset: ImageNet-21k has 21,841. A class count comes from files (CIFAR's meta, folder names) and
# sizes the network's head and every one-hot target, so it is bounded like any other claim.
MAX_CLASSES = 100_000

MAX_IDX_DIMS = 4  # MNIST-family files have 1 (labels) or 3 (images) dimensions
_DEFAULT_MAX_DATASET_BYTES = 16 * 2**30  # 16 GiB of uint8 pixels: ImageNet-64x64 is 15 GB; larger is not in-memory data


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else physical memory, else None (unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def max_dataset_bytes() -> int:
    """The most bytes of decoded images one dataset may hold in memory.

    $SPEEDRUN_MAX_DATA_BYTES if set (an integer), else the smaller of 16 GiB and a quarter of the memory available
    now: the on-device loader makes about three per-epoch copies of the training set beside the original.
    """
    text = os.environ.get("SPEEDRUN_MAX_DATA_BYTES")
    if text:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"SPEEDRUN_MAX_DATA_BYTES={text!r} is not an integer number of bytes; "
                             "set it to e.g. 8000000000 or unset it") from None
        if value < 1:
            raise ValueError(f"SPEEDRUN_MAX_DATA_BYTES={text!r} must be >= 1; set it to a byte count or unset it")
        return value
    available = available_memory_bytes()
    return _DEFAULT_MAX_DATASET_BYTES if available is None else min(_DEFAULT_MAX_DATASET_BYTES, available // 4)


def _size_text(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _two_sizes(n: int, limit: int) -> tuple[str, str]:
    """Both sizes rounded alike, or exact where rounding would print one number for both (62.7 kB over 62.7 kB)."""
    a, b = _size_text(n), _size_text(limit)
    return (a, b) if a != b else (f"{n:,} bytes", f"{limit:,} bytes")


def check_dataset_bytes(nbytes: int, what: str) -> None:
    """Refuse, before allocating, a dataset whose decoded images would take `nbytes`; `what` names the source."""
    limit = max_dataset_bytes()
    if nbytes > limit:
        size, most = _two_sizes(nbytes, limit)
        raise ValueError(f"{what} would take {size} of memory as decoded images, over the limit of {most}; use "
                         "fewer or smaller images, or raise SPEEDRUN_MAX_DATA_BYTES")


def check_memory(nbytes: int, what: str, fix: str) -> None:
    """Refuse, before allocating, `nbytes` that cannot fit in the memory available now (e.g. a network a typo made
    huge): on Linux an allocation that does not fit ends in the kernel's OOM killer, with no message at all."""
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} would take {_size_text(nbytes)} of memory, more than the {_size_text(available)} "
                         f"available; {fix}")


def check_size(nbytes: int, limit: int, what: str, fix: str) -> None:
    """Refuse a member, file or claim of `nbytes` above `limit` (a format's known bound) before reading it."""
    if nbytes > limit:
        size, most = _two_sizes(nbytes, limit)
        raise ValueError(f"{what} is {size}, over the {most} that this format holds; {fix}")
