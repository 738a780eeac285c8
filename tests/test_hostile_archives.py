"""Hostile and broken data files: bombs stay small, every refusal is one line naming the file and the fix.

Bombs are built small and fast: a deflate stream of zeros is compressed once per MiB after a full flush, so the same
~1 kB block repeats (a 300 MiB payload is a 300 kB file, made in milliseconds, never held in memory). Memory is
measured in a fresh process (conftest.run_peak); each refusal must stay far below what the bomb would inflate to.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_peak, snapshot
from test_data_sources import _archive, _py2_pickle, _write_cifar10

from speedrun.data import cifar, download, idx, limits, synthetic
from speedrun.data.archive import safe_extract
from speedrun.data.download import fetch
from speedrun.data.sources import load_dataset

MiB = 1 << 20
SMALL = 64 * MiB  # the most a refusal may add to a process's peak memory; every bomb below needs >= 300 MiB


def _gzip(prefix: bytes, zeros_mib: int = 0, suffix: bytes = b"") -> bytes:
    """A valid .gz of prefix + zeros_mib MiB of zeros + suffix (RFC 1952 framing around raw deflate)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(MiB)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)  # the same bytes every MiB: the flush resets the state
    tail = c.compress(suffix) + c.flush(zlib.Z_FINISH)
    crc = zlib.crc32(prefix)
    for _ in range(zeros_mib):
        crc = zlib.crc32(zeros, crc)
    size = len(prefix) + zeros_mib * MiB + len(suffix)
    trailer = struct.pack("<II", zlib.crc32(suffix, crc), size & 0xFFFFFFFF)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head + block * zeros_mib + tail + trailer


def _idx_header(*dims: int) -> bytes:
    return bytes([0, 0, 0x08, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)


def _one_line(message: str, *names: str) -> None:
    assert "\n" not in message and all(n in message for n in names), message


@contextlib.contextmanager
def _recursion_limit(limit: int):
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def _outcomes(stderr: str) -> list[str]:
    return [json.loads(line.split(" ", 1)[1]) for line in stderr.splitlines() if line.startswith("CASE ")]


def _peak_cases(calls: list[str], env: dict | None = None) -> tuple[int, list[str]]:
    """Run each call (a Python expression) in one fresh process; (peak growth, 'Type: message' or 'ok' per call)."""
    body = "import json\nfrom speedrun.data import archive, cifar, download, idx, sources\nfrom pathlib import Path\n"
    for call in calls:
        body += textwrap.dedent(f"""
            try:
                {call}
            except Exception as e:
                print("CASE", json.dumps(type(e).__name__ + ": " + str(e)), file=sys.stderr)
            else:
                print("CASE", json.dumps("ok"), file=sys.stderr)
            """)
    peak, stderr = run_peak(body, env=env)
    outcomes = _outcomes(stderr)
    assert len(outcomes) == len(calls), stderr[-3000:]
    return peak, outcomes


# ---- 1. IDX: the header is checked before anything is inflated or allocated --------------------------------------


def test_idx_bombs_are_refused_after_reading_only_what_the_header_promises(tmp_path):
    claim = tmp_path / "claim" / "train-images-idx3-ubyte.gz"  # the issue's: a .gz whose header claims ~300 GB
    trailing = tmp_path / "trail" / "train-images-idx3-ubyte.gz"  # a true 10x28x28 header, then 300 MiB more
    liar = tmp_path / "liar" / "train-images-idx3-ubyte"  # claims 1 GB, holds 10 bytes
    for p in (claim, trailing, liar):
        p.parent.mkdir()
    claim.write_bytes(_gzip(_idx_header(300_000, 1000, 1000), 300))
    trailing.write_bytes(_gzip(_idx_header(10, 28, 28) + bytes(7840), 300))
    liar.write_bytes(_idx_header(1000, 1000, 1000) + bytes(10))
    assert max(p.stat().st_size for p in (claim, trailing, liar)) < 400_000
    peak, out = _peak_cases([f"idx.read_idx(Path({str(p)!r}))" for p in (claim, trailing, liar)],
                            env={"SPEEDRUN_MAX_DATA_BYTES": str(4 * 2**30)})
    assert peak < SMALL, (peak, out)
    assert out[0].startswith("ValueError") and "300.0 GB" in out[0] and "SPEEDRUN_MAX_DATA_BYTES" in out[0]
    assert out[1].startswith("ValueError") and "more follows" in out[1]
    assert out[2].startswith("ValueError") and "truncated" in out[2] and "file has 10" in out[2]
    for o, p in zip(out, (claim, trailing, liar)):
        _one_line(o, str(p))


def test_idx_bomb_in_a_dataset_folder_leaves_the_cache_empty(tmp_path):
    d = tmp_path / "digits"
    d.mkdir()
    for role, base in idx.FILES.items():
        n = 6 if role.startswith("train") else 3
        shape = (n, 28, 28) if role.endswith("images") else (n,)
        (d / base).write_bytes(_idx_header(*shape) + bytes(int(np.prod(shape))))
    (d / idx.FILES["train_images"]).unlink()
    (d / (idx.FILES["train_images"] + ".gz")).write_bytes(_gzip(_idx_header(6, 28, 28) + bytes(6 * 784), 300))
    cache = tmp_path / "cache"
    before = snapshot(tmp_path)
    peak, out = _peak_cases([f"sources.load_dataset({str(d)!r}, cache_dir={str(cache)!r})"])
    assert peak < SMALL and out[0].startswith("ValueError") and "more follows" in out[0]
    assert snapshot(tmp_path) == before  # no cache file, nothing else


@pytest.mark.parametrize("damage", ["crc", "length"])
def test_idx_gzip_with_a_damaged_trailer_is_one_line(tmp_path, damage):
    good = _gzip(_idx_header(4) + bytes([1, 2, 3, 4]))
    bad = bytearray(good)
    bad[-8 if damage == "crc" else -4] ^= 0x01  # CRC-32 or ISIZE, the last 8 bytes of a gzip member
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError) as err:
        idx.read_idx(path)
    _one_line(str(err.value), str(path), "replace it")
    path.write_bytes(good)
    assert idx.read_idx(path).tolist() == [1, 2, 3, 4]  # the same file undamaged reads exactly


def test_idx_header_with_too_many_dimensions_or_wrong_label_count(tmp_path):
    many = tmp_path / "x-idx"
    many.write_bytes(bytes([0, 0, 0x08, 200]) + bytes(800))
    with pytest.raises(ValueError) as err:
        idx.read_idx(many)
    _one_line(str(err.value), str(many), "200 dimensions")
    images, labels = tmp_path / "images", tmp_path / "labels"
    images.write_bytes(_idx_header(3, 2, 2) + bytes(12))
    labels.write_bytes(_idx_header(4) + bytes(4))  # 4 labels for 3 images: refused from the header
    with pytest.raises(ValueError) as err:
        idx.read_split(images, labels)
    _one_line(str(err.value), str(labels), "expected shape (3,)", "(4,)")


# ---- 2. IDX labels: where classes come from the data, a stray label is an error -------------------------------------


def _label_folder(d: Path, train_labels, test_labels) -> Path:
    d.mkdir()
    arrays = {"train_labels": np.array(train_labels, np.uint8), "test_labels": np.array(test_labels, np.uint8)}
    arrays["train_images"] = np.zeros((len(train_labels), 4, 4), np.uint8)
    arrays["test_images"] = np.zeros((len(test_labels), 4, 4), np.uint8)
    for role, base in idx.FILES.items():
        a = arrays[role]
        (d / base).write_bytes(_idx_header(*a.shape) + a.tobytes())
    return d


def test_a_stray_label_does_not_make_256_classes(tmp_path):
    d = _label_folder(tmp_path / "stray", [0, 1, 2, 3, 255, 1], [0, 1])  # the issue's: one 255 among digits
    with pytest.raises(ValueError) as err:
        load_dataset(str(d), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), str(d / idx.FILES["train_labels"]), "label 255 leaves classes 4..254", "stray label")
    # A test label with no training example is the same mistake, reported on the test file.
    d = _label_folder(tmp_path / "unseen", [0, 1, 2, 0], [0, 7])
    with pytest.raises(ValueError) as err:
        load_dataset(str(d), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), str(d / idx.FILES["test_labels"]), "label 7 leaves classes 3..7")
    # Named datasets know their classes: the same stray label is refused against those.
    d = _label_folder(tmp_path / "named", [0, 1, 2, 255], [0, 1])
    with pytest.raises(ValueError, match=r"label 255 but the dataset has 10 classes"):
        load_dataset("mnist", data_dir=d, cache_dir=tmp_path / "cache", download=False)
    ok = load_dataset(str(_label_folder(tmp_path / "ok", [2, 0, 1, 1], [2, 0])), cache_dir=tmp_path / "cache")
    assert ok.classes == ["0", "1", "2"] and ok.train_labels.tolist() == [2, 0, 1, 1]


# ---- 3. CIFAR pickles: nothing a pickle names may allocate what it likes -------------------------------------------


def _cifar_pickles(d: Path) -> dict[str, Path]:
    """name -> hostile pickle file, each a few dozen bytes."""
    d.mkdir()
    files = {
        # The issue's: REDUCE builtins.bytes(500000000), 500 MB of zeros from 30 bytes.
        "bytes": b"\x80\x02cbuiltins\nbytes\nJ" + struct.pack("<i", 500_000_000) + b"\x85R.",
        # Its repr as str: 400 MB of text from 47 bytes (the zeros of bytes() alone are not touched memory).
        "str": b"\x80\x02cbuiltins\nstr\ncbuiltins\nbytes\nJ" + struct.pack("<i", 100_000_000) + b"\x85R\x85R.",
        "binbytes8": b"\x80\x04\x8e" + struct.pack("<Q", 500_000_000) + b"abc.",  # claims 500 MB, holds 3 bytes
        "binunicode8": b"\x80\x04\x8d" + struct.pack("<Q", 500_000_000) + b"abc.",
        # numpy's _reconstruct asked for a 500 MB array directly, not the (ndarray, (0,), b"b") numpy writes.
        "reconstruct": b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ"
        + struct.pack("<i", 500_000_000) + b"\x85C\x01b\x87R.",
        # numpy.ndarray called with a shape: allocates whatever the file names.
        "ndarray": b"\x80\x02cnumpy\nndarray\nJ" + struct.pack("<i", 500_000_000) + b"\x85\x85R.",
        # A void dtype of 500 MB per item.
        "void": b"\x80\x02cnumpy\ndtype\nX\x0a\x00\x00\x00V500000000\x89\x88\x87R.",
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    return {name: d / name for name in files}


def test_cifar_pickle_bombs_are_refused_small(tmp_path):
    files = _cifar_pickles(tmp_path / "p")
    big = tmp_path / "p" / "big"
    with open(big, "wb") as f:  # sparse: over MAX_CIFAR_MEMBER_BYTES on paper, no disk used
        f.truncate(limits.MAX_CIFAR_MEMBER_BYTES + 1)
    paths = [*files.values(), big]
    peak, out = _peak_cases([f"cifar.load_batch(Path({str(p)!r}))" for p in paths])
    assert peak < SMALL, (peak, out)
    for o, p in zip(out, paths):
        assert o.startswith("ValueError"), o
        _one_line(o, str(p), "replace it")
    assert "builtins.bytes is not allowed" in out[0] and "builtins.str is not allowed" in out[1]
    assert "over the" in out[-1]


class _SharedRaw:
    """Pickles as a numpy array (numpy's own reduce: _reconstruct, then the state) whose raw bytes are one shared
    bytes object: the pickle's memo stores it once, however many arrays refer to it."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def __reduce__(self):
        try:
            from numpy._core.multiarray import _reconstruct  # numpy 2
        except ImportError:
            from numpy.core.multiarray import _reconstruct
        return (_reconstruct, (np.ndarray, (0,), b"b"),
                (1, (len(self.raw) // 2,), np.dtype(">u2"), False, self.raw))


def test_arrays_sharing_one_memoized_string_cannot_multiply_it(tmp_path):
    """100 byte-swapped arrays over one 4 MiB string: a 4 MiB file that numpy would copy into 400 MiB."""
    raw = bytes(4 * MiB)
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": [_SharedRaw(raw) for _ in range(100)], b"labels": [0]}, protocol=4))
    assert path.stat().st_size < 5 * MiB
    peak, (out,) = _peak_cases([f"cifar.load_batch(Path({str(path)!r}))"])
    assert out.startswith("ValueError") and "its arrays hold more bytes than the file itself" in out, out
    _one_line(out, str(path))
    assert peak < SMALL, peak
    one = tmp_path / "one"  # the same construction with a single array is a valid (if odd) batch entry
    one.write_bytes(pickle.dumps({b"data": _SharedRaw(raw)}, protocol=4))
    assert cifar.load_batch(one)[b"data"].shape == (2 * MiB,)


def test_cifar_dtypes_must_be_plain_numbers(tmp_path):
    d = tmp_path / "b"
    _write_cifar10(d, np.random.default_rng(0))
    # An object array and a structured dtype with an object field (numpy would fill its pointers from raw bytes).
    _py2_pickle(d / "test_batch", {b"data": np.array([None, 1], dtype=object), b"labels": []})
    with pytest.raises(ValueError) as err:
        load_dataset(str(d), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), str(d / "test_batch"), "not a plain numeric")
    structured = np.zeros(2, dtype=[("a", "u1")])
    _py2_pickle(d / "test_batch", {b"data": structured, b"labels": []})
    with pytest.raises(ValueError) as err:
        load_dataset(str(d), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), str(d / "test_batch"), "not a plain numeric")
    assert np.dtype("u1").fields is None  # nothing changed numpy's own uint8


@pytest.mark.parametrize(
    "labels, found",
    [([3.7, 1.0], "3.7 (float)"), ([True, False], "True (bool)"), (np.array([1.5, 2.0]), "float64 array"),
     (np.array([True, False]), "bool array"), ([b"3", b"1"], "b'3' (bytes)")],
    ids=["floats", "bools", "float-array", "bool-array", "bytes"],
)
def test_cifar_labels_must_be_integers(tmp_path, labels, found):
    d = tmp_path / "b"
    _write_cifar10(d, np.random.default_rng(1))
    data = np.zeros((2, 3072), np.uint8)
    _py2_pickle(d / "test_batch", {b"data": data, b"labels": labels})
    with pytest.raises(ValueError) as err:
        load_dataset(str(d), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), str(d / "test_batch"), found, "integer labels")


def test_cifar_batches_pickled_by_python3_still_load_exactly(tmp_path):
    d = tmp_path / "b"
    batches = _write_cifar10(d, np.random.default_rng(2))
    # Protocol 2 writes bytes as _codecs.encode(str, "latin1"); protocol 4 an int64 label array and str keys.
    test = {"data": batches[-1][b"data"], "labels": np.array(batches[-1][b"labels"], np.int64)}
    (d / "test_batch").write_bytes(pickle.dumps(test, protocol=4))
    (d / "data_batch_1").write_bytes(pickle.dumps(batches[0], protocol=2))
    ds = load_dataset(str(d), cache_dir=tmp_path / "cache")
    assert torch.equal(ds.test_labels, torch.tensor(batches[-1][b"labels"]))
    assert torch.equal(ds.test_images.reshape(len(test["data"]), -1), torch.from_numpy(test["data"]))
    assert torch.equal(ds.train_images[:3].reshape(3, -1), torch.from_numpy(batches[0][b"data"]))


# ---- 4. tar archives: sizes from the headers, the gzip CRC, and the bytes after the end -----------------------------


def _tar_header(name: str, size: int, kind: bytes = b"0") -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _small_tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_tar_bombs_are_refused_from_their_headers(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    member = d / "member.tar.gz"  # the issue's, scaled: a 300 MiB member of zeros (over the 192 MiB per member)
    member.write_bytes(_gzip(_tar_header("cifar-10-batches-py/data_batch_1", 300 * MiB), 300))
    pax = d / "pax.tar.gz"  # a PAX header whose payload tarfile would read into memory in one piece
    pax.write_bytes(_gzip(_tar_header("././@PaxHeader", 300 * MiB, tarfile.XHDTYPE), 300))
    trailer = d / "trailer.tar.gz"  # a valid tar, then 300 MiB of zeros inside the same gzip stream
    trailer.write_bytes(_gzip(_small_tar({"x": b"abc"}), 300))
    paths = [member, pax, trailer]
    assert max(p.stat().st_size for p in paths) < 400_000
    out_dirs = [tmp_path / f"out{i}" for i in range(len(paths))]
    peak, out = _peak_cases([f"archive.safe_extract(Path({str(p)!r}), Path({str(o)!r}))"
                             for p, o in zip(paths, out_dirs)])
    assert peak < SMALL, (peak, out)
    for o, p in zip(out, paths):
        assert o.startswith("ValueError"), o
        _one_line(o, p.name)
    assert "data_batch_1" in out[0] and "over the" in out[0]
    assert "after its end-of-archive marker" in out[2]
    assert not any(o.exists() for o in out_dirs)  # what safe_extract created, it removed


def test_tar_bomb_as_cifar_data_dir_leaves_nothing_in_the_cache(tmp_path):
    archive = tmp_path / "in" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(_gzip(_tar_header("cifar-10-batches-py/data_batch_1", 300 * MiB), 300))
    cache = tmp_path / "cache"
    peak, out = _peak_cases([f"sources.load_dataset('cifar10', data_dir={str(archive)!r}, "
                             f"cache_dir={str(cache)!r}, download=False)"])
    assert peak < SMALL and out[0].startswith("ValueError") and "data_batch_1" in out[0]
    assert snapshot(cache) == set() and list((cache / "downloads").iterdir()) == []  # no .extract-* left


def test_tar_member_count_and_total_size_limits(tmp_path):
    many = tmp_path / "many.tar"
    many.write_bytes(_small_tar({f"f{i}": b"x" for i in range(limits.MAX_ARCHIVE_MEMBERS + 1)}))
    with pytest.raises(ValueError) as err:
        safe_extract(many, tmp_path / "o1")
    _one_line(str(err.value), "many.tar", f"more than {limits.MAX_ARCHIVE_MEMBERS} members")
    two = tmp_path / "two.tar.gz"
    two.write_bytes(_gzip(_small_tar({"a": bytes(1000), "b": bytes(1000)})))
    with pytest.raises(ValueError) as err:
        safe_extract(two, tmp_path / "o2", max_member_bytes=1000, max_total_bytes=1500)
    _one_line(str(err.value), "two.tar.gz", "unpacked is 2.0 kB")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    out = safe_extract(two, tmp_path / "o3", max_member_bytes=1000, max_total_bytes=2000)
    assert (out / "a").read_bytes() == bytes(1000) and (out / "b").read_bytes() == bytes(1000)


@pytest.mark.parametrize("where", [-8, -4, 12], ids=["crc", "length", "deflate"])
def test_tar_gz_with_a_flipped_byte_is_one_line(tmp_path, where):
    good = _gzip(_small_tar({"a": b"hello" * 100}))
    bad = bytearray(good)
    bad[where] ^= 0x10
    path = tmp_path / "flip.tar.gz"
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError) as err:
        safe_extract(path, tmp_path / "out")
    _one_line(str(err.value), "flip.tar.gz")
    assert not (tmp_path / "out").exists()


# ---- 5. a named dataset given a file of the wrong kind -------------------------------------------------------------


def test_named_dataset_given_the_wrong_kind_of_file(tmp_path, monkeypatch, capsys):
    archive10, _, _ = _archive(tmp_path, "cifar10", np.random.default_rng(3))
    archive100, _, _ = _archive(tmp_path, "cifar100", np.random.default_rng(4))
    cache = tmp_path / "cache"
    # The issue's: mnist given CIFAR's archive crashed with KeyError.
    with pytest.raises(ValueError) as err:
        load_dataset("mnist", data_dir=archive10, cache_dir=cache)
    _one_line(str(err.value), str(archive10), "four IDX files", "data_dir (--data-dir)")
    # cifar10 given CIFAR-100's archive: by its name before extracting, by its content after renaming it.
    with pytest.raises(ValueError) as err:
        load_dataset("cifar10", data_dir=archive100, cache_dir=cache)
    _one_line(str(err.value), "the cifar100 archive", "cifar-10-python.tar.gz", "data_dir (--data-dir)")
    renamed = archive100.rename(tmp_path / "mine.tar.gz")
    with pytest.raises(ValueError) as err:
        load_dataset("cifar10", data_dir=renamed, cache_dir=cache)
    _one_line(str(err.value), str(renamed), "holds cifar100 batches, not cifar10")
    assert snapshot(cache) == set()
    # And from the command line: one line, exit 2.
    from speedrun.cli.program import main

    monkeypatch.setenv("SPEEDRUN_DATA", str(cache))
    assert main(["train", "--dataset", "mnist", "--data-dir", str(archive10), "--device", "cpu"]) == 2
    err_text = capsys.readouterr().err.strip()
    assert "\n" not in err_text and "KeyError" not in err_text and "four IDX files" in err_text


# ---- 6. concurrent downloads -----------------------------------------------------------------------------------------

_FETCHER = """
import errno, sys, time, urllib.request
from pathlib import Path
from speedrun.data import download
url, dest, md5, go, ready, locking = sys.argv[1:7]
if locking == "0":  # a file system that refuses locks: publishing alone must keep the processes apart
    def refuse(fd, **kwargs):
        raise OSError(errno.ENOLCK, "No locks available")
    download.lock_descriptor = refuse
real = urllib.request.urlopen

class Slow:  # a slow server: 4 kB per read, 10 ms apart, so the two downloads overlap
    def __init__(self, response):
        self.response, self.headers = response, response.headers
    def read(self, n):
        time.sleep(0.01)
        return self.response.read(4096)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.response.close()

download.urllib.request.urlopen = lambda u, timeout: Slow(real(u, timeout=timeout))
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.002)
lines = []
download.fetch(url, dest, md5, lines.append)
print("|".join(lines))
"""


@pytest.mark.parametrize("locking", ["1", "0"], ids=["locked", "no-lock"])
def test_two_processes_fetching_the_same_file(tmp_path, locking):
    payload = bytes(range(256)) * 512  # 128 kB: 32 slow reads, about 0.35 s
    src = tmp_path / "server" / "archive.tar.gz"
    src.parent.mkdir()
    src.write_bytes(payload)
    md5 = hashlib.md5(payload).hexdigest()
    dest = tmp_path / "downloads" / "archive.tar.gz"
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        argv = [src.as_uri(), str(dest), md5, str(go), str(tmp_path / f"ready{i}"), locking]
        procs.append(subprocess.Popen([sys.executable, "-c", _FETCHER, *argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start fetching within milliseconds of each other
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    logs = [out for out, _ in results]
    assert hashlib.md5(dest.read_bytes()).hexdigest() == md5
    assert sorted(os.listdir(dest.parent)) == ["archive.tar.gz"]  # no .part, no lock file
    assert sum("downloaded archive.tar.gz" in log for log in logs) == 1  # one file published, by one process
    if locking == "1":  # one downloads, the other waits for it and reuses its file
        assert sum("waiting for another process" in log for log in logs) == 1
        assert sum("using" in log and "md5 ok" in log for log in logs) == 1
    else:  # both download; the second to finish finds the first's file, checks it and uses it
        assert sum("another process published archive.tar.gz first" in log for log in logs) == 1


def test_fetch_leaves_an_existing_file_alone_when_it_loses_the_race(tmp_path, monkeypatch):
    """Another process publishes a different file while we download: ours is dropped and theirs is kept."""
    payload = b"payload" * 1000
    src = tmp_path / "archive.tar.gz"
    src.write_bytes(payload)
    dest = tmp_path / "dl" / "archive.tar.gz"
    real_publish = download.publish

    def racing_publish(part, target):
        target.write_bytes(b"someone else's file")
        return real_publish(part, target)

    monkeypatch.setattr(download, "publish", racing_publish)
    with pytest.raises(ValueError) as err:
        fetch(src.as_uri(), dest, hashlib.md5(payload).hexdigest())
    _one_line(str(err.value), str(dest), "exists but its md5", "data_dir (--data-dir)")
    # the verified part is kept (a failed publish never loses a download); the other file is untouched
    assert dest.read_bytes() == b"someone else's file"
    assert sorted(os.listdir(dest.parent)) == [".archive.tar.gz.part", "archive.tar.gz"]


def test_a_download_longer_than_the_limit_is_cut_off(tmp_path):
    """A server that sends more than the file can hold (without end, say) is refused as the bytes arrive."""
    src = tmp_path / "endless.tar.gz"
    src.write_bytes(bytes(3 * MiB))  # stands for an endless stream: 3 MiB against a 1 MiB limit
    dest = tmp_path / "dl" / "cifar-10-python.tar.gz"
    with pytest.raises(ValueError) as err:
        fetch(src.as_uri(), dest, "0" * 32, max_bytes=MiB)
    _one_line(str(err.value), "sent more than 1048576 bytes", "data_dir (--data-dir)")
    assert os.listdir(dest.parent) == []  # no part file, no lock file, no dest


# ---- 7. synthetic: refused before allocating -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("synthetic:train=1000000000000", "3072.0 TB"),  # the issue's
        ("synthetic:train=1000,test=1000000000", "SPEEDRUN_MAX_DATA_BYTES"),
        ("synthetic:test=0", "test must be >= 1"),
        ("synthetic:classes=1", "classes must be >= 2"),
        ("synthetic:shape=3x100000x32", "shape H must be <= 1024"),
        ("synthetic:shape=1000x32x32", "shape C must be <= 4"),
        ("synthetic:classes=1000000000000", "classes must be <= 100000"),
    ],
)
def test_synthetic_refuses_before_allocating(spec, message):
    with pytest.raises(ValueError) as err:
        synthetic.make(spec)
    _one_line(str(err.value), message)


def test_synthetic_bomb_peak_is_small():
    peak, out = _peak_cases(["sources.load_dataset('synthetic:train=1000000000000')",
                             "sources.load_dataset('synthetic:train=10,test=1,classes=2')"])
    assert peak < SMALL and out[0].startswith("ValueError") and out[1] == "ok"


@pytest.mark.parametrize("spec", ["synthetic:train=64_0", "synthetic:train=\u0666\u0664", "synthetic:test=1e3"])
def test_synthetic_numbers_are_plain_ascii_digits(spec):
    with pytest.raises(ValueError, match="must be an integer"):
        synthetic.parse_spec(spec)


# ---- tar header tricks that act inside tarfile, before a member reaches our checks ------------------------------


def _octal(n: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, n)


def _gnu_sparse_chain(blocks: int) -> bytes:
    """A GNU sparse ('S') member whose header says more sparse maps follow, then `blocks` extension blocks of 21
    (offset, size) pairs each, every one saying another follows but the last (GNU tar's format: the flag at byte
    482 of the header, 504 of each extension block)."""
    head = bytearray(tarfile.TarInfo("cifar-10-batches-py/x").tobuf(tarfile.GNU_FORMAT)[:512])
    head[156:157] = b"S"
    head[482] = 1
    head[483:495] = _octal(16, 12)  # the real size
    head[148:156] = b" " * 8  # the checksum is computed over the header with its own field as spaces
    head[148:156] = b"%06o\0 " % sum(head)
    ext = bytearray(b"".join(_octal(1, 12) * 2 for _ in range(21)) + bytes(8))
    ext[504] = 1
    last = bytearray(ext)
    last[504] = 0
    c = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    chunk = bytes(ext) * 1024
    body = [c.compress(bytes(head))] + [c.compress(chunk) for _ in range(blocks // 1024)]
    return b"".join(body) + c.compress(bytes(last) + bytes(1024)) + c.flush()


@pytest.mark.slow
def test_a_gnu_sparse_chain_is_refused_before_tarfile_lists_it(tmp_path):
    """tarfile keeps 21 entries per extension block in a list inside next(), before safe_extract sees the member:
    a million blocks (21 kB of bzip2) took 1.7 GB. Here 200,000 blocks, 100 MB of headers in a 100 kB file."""
    bomb = tmp_path / "cifar-10-python.tar.gz"
    bomb.write_bytes(_gnu_sparse_chain(200_000))
    assert bomb.stat().st_size < 400_000
    peak, (out,) = _peak_cases([f"archive.safe_extract(Path({str(bomb)!r}), Path({str(tmp_path / 'out')!r}))"])
    assert out.startswith("ValueError") and "header blocks" in out, out
    _one_line(out, "cifar-10-python.tar.gz")
    assert peak < SMALL, peak


def test_chained_extended_headers_and_deep_names_are_one_line(tmp_path):
    """tarfile recurses once per chained PAX header, and os.makedirs once per path level: both used to end in a
    RecursionError, an internal error with exit 1."""
    pax = tarfile.TarInfo._create_pax_generic_header({"comment": "x"}, tarfile.XHDTYPE, "utf-8")
    member = tarfile.TarInfo("cifar-10-batches-py/f")
    member.size = 1
    chain = tmp_path / "chain.tar.gz"
    chain.write_bytes(gzip.compress(pax * 5000 + member.tobuf(tarfile.USTAR_FORMAT) + b"x" + bytes(511 + 1024)))
    # The same refusal whatever the process's recursion limit and stack depth (a compiled model raises the limit):
    # the per-member block cap trips at a chain of 8 PAX headers, long before tarfile's recursion could.
    for limit in (sys.getrecursionlimit(), 100_000):
        with _recursion_limit(limit), pytest.raises(ValueError) as err:
            safe_extract(chain, tmp_path / "o1")
        _one_line(str(err.value), "chain.tar.gz", "header blocks for one member", "chained extended headers")
    deep = tmp_path / "deep.tar.gz"
    deep.write_bytes(gzip.compress(_small_tar({"cifar-10-batches-py/" + "d/" * 20_000 + "f": b"x"})))
    with pytest.raises(ValueError) as err:
        safe_extract(deep, tmp_path / "o2")
    _one_line(str(err.value), "deep.tar.gz", "or 32 or more levels", "(40,021 characters)")
    assert len(str(err.value)) < 400  # the 40,021-character name is cut short in the message
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_folder_and_a_file_of_one_name_is_the_archives_fault(tmp_path):
    clash = tmp_path / "clash.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        folder = tarfile.TarInfo("cifar-10-batches-py")
        folder.type = tarfile.DIRTYPE
        tf.addfile(folder)
        tf.addfile(tarfile.TarInfo("cifar-10-batches-py"), io.BytesIO(b""))
    clash.write_bytes(gzip.compress(buf.getvalue()))
    with pytest.raises(ValueError) as err:
        safe_extract(clash, tmp_path / "o")
    _one_line(str(err.value), "clash.tar.gz", "members that clash")
    assert "free space" not in str(err.value)
