"""The input path against files from elsewhere: a prepared folder tampered with (index, shards, classes.json),
hostile DST states for `data prepare`, hostile originals for `bench-loader --baseline`, errors raised inside
DataLoader workers, and worker processes outliving a killed `data prepare`. Every case is one line on stderr,
exit 2, the file named, DST as it was, no traceback."""

import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli as _run
from PIL import Image

from speedrun.cli.output import one_line as _one_line
from speedrun.data import shards
from speedrun.data.prepare import prepare_image
from speedrun.data.prepare_tree import prepare_tree


def _jpeg(colour=(200, 40, 40), size=(24, 16), **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG", **kwargs)
    return buf.getvalue()


def _prepared(root: Path, n_train=8, n_val=4) -> Path:
    """A folder as `data prepare` writes it (2 classes), made directly: fast."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        shards.write_split(((_jpeg((40 * i % 255, 90, 30 + 100 * (i % 2))), i % 2) for i in range(n)), root, split)
    (root / "classes.json").write_text(json.dumps(["cat", "dog"]))
    return root


def _one_error(code, err, *fragments):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("speedrun") and "error:" in lines[-1], err
    assert "Traceback" not in err and "internal error" not in err and 'File "' not in err, err
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


def _npy(shape, descr="<i8", body=b"") -> bytes:
    header = ("{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)).encode("latin1")
    header += b" " * (64 - (10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + body


def _edit_index(root, split, f):
    index = np.load(root / f"{split}-index.npy")
    f(index)
    np.save(root / f"{split}-index.npy", index)


# Class: every shard index is checked before anything is allocated or read past it, and every row against the
# shards' real sizes without int64 overflow.
INDEXES = {
    "claims 10^12 rows in 128 bytes": lambda r: (r / "train-index.npy").write_bytes(_npy((10**12, 4))),
    "claims 10^18 elements, 1-D": lambda r: (r / "train-index.npy").write_bytes(_npy((10**18,))),
    "object dtype (pickle)": lambda r: np.save(r / "train-index.npy", np.array([[0, 0, 1, 0]], dtype=object),
                                               allow_pickle=True),
    "float64": lambda r: np.save(r / "train-index.npy", np.load(r / "train-index.npy").astype(np.float64)),
    "a header of 2 GiB": lambda r: (r / "train-index.npy").write_bytes(b"\x93NUMPY\x02\x00" + (2**31).to_bytes(4, "little")),
    "a FIFO": lambda r: (os.unlink(r / "train-index.npy"), os.mkfifo(r / "train-index.npy")),
    "a folder": lambda r: (os.unlink(r / "train-index.npy"), (r / "train-index.npy").mkdir()),
    "offset + size wraps int64": lambda r: _edit_index(r, "train", lambda a: a[0, 1:3].__setitem__(
        slice(None), (2**63 - 10, 100))),
    "a negative label": lambda r: _edit_index(r, "train", lambda a: a.__setitem__((0, 3), -1)),
    "a size of 0": lambda r: _edit_index(r, "train", lambda a: a.__setitem__((0, 2), 0)),
    "a shard that is a folder": lambda r: (os.unlink(r / "train-00000.tar"), (r / "train-00000.tar").mkdir()),
    "a shard cut in half": lambda r: (r / "train-00000.tar").write_bytes((r / "train-00000.tar").read_bytes()[:2048]),
}


@pytest.mark.parametrize("tamper", INDEXES.values(), ids=INDEXES.keys())
def test_a_tampered_index_or_shard_is_one_error_naming_it(tamper, tmp_path, capsys):
    root = _prepared(tmp_path / "shards")
    tamper(root)
    with pytest.raises(ValueError, match="train-") as e:
        shards.Shards(root, "train")
    assert "\n" not in str(e.value) and "run speedrun data prepare again" in str(e.value)
    code, out, err = _run(["bench-loader", str(root), "--split", "train", "--batch", "2", "--batches", "1",
                           "--runs", "1", "--workers", "0", "--res", "16", "--device", "cpu"], capsys)
    _one_error(code, err, str(root))


# Class: classes.json is bounded, never blocks, and holds what prepare writes; empty splits are refused before
# training.
CLASSES = {
    "a FIFO": (lambda p: (p.unlink(), os.mkfifo(p)), "not a regular file"),
    "a folder": (lambda p: (p.unlink(), p.mkdir()), "not a regular file"),
    "not UTF-8": (lambda p: p.write_bytes(b'["\xff", "b"]'), "UnicodeDecodeError"),
    "nested 100,000 deep": (lambda p: p.write_bytes(b"[" * 100_000), "RecursionError"),
    "a name twice": (lambda p: p.write_text('["cat", "cat"]'), "names class cat twice"),
    "an empty name": (lambda p: p.write_text('["", "dog"]'), "non-empty and printable"),
    "a newline and an escape": (lambda p: p.write_text('["a\\nb", "\\u001b[31m"]'), "non-empty and printable"),
    "numbers": (lambda p: p.write_text("[1, 2]"), "not a list of 2 to"),
    "over 4 MiB": (lambda p: p.write_bytes(b" " * (4 * 2**20 + 1)), "over"),
}


@pytest.mark.parametrize("tamper,fragment", CLASSES.values(), ids=CLASSES.keys())
def test_a_hostile_classes_json_is_one_error_before_training(tamper, fragment, tmp_path, capsys):
    root = _prepared(tmp_path / "shards")
    tamper(root / "classes.json")
    code, out, err = _run(["train", "imagenet-debug", "--dataset", str(root), "--device", "cpu"], capsys)
    _one_error(code, err, "classes.json", fragment)
    assert "run 1/1" not in out + err  # refused before any training


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_split_is_refused_before_training(split, tmp_path, capsys):
    root = _prepared(tmp_path / "shards")
    np.save(root / f"{split}-index.npy", np.zeros((0, 4), np.int64))
    code, out, err = _run(["train", "imagenet-debug", "--dataset", str(root), "--device", "cpu"], capsys)
    _one_error(code, err, f"the {split} split has no images")
    assert "run 1/1" not in out + err


# Class: an error raised in a DataLoader worker process is its own one line, not the worker's traceback.
def test_an_error_in_a_loader_worker_is_its_own_line(tmp_path, capsys):
    from torch.utils.data._utils import ExceptionWrapper

    try:
        raise ValueError("sample 3 of train is not a usable JPEG (x); run speedrun data prepare again")
    except ValueError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(ValueError) as e:
        wrapped.reraise()
    assert "Traceback" in str(e.value)
    assert _one_line(e.value) == "sample 3 of train is not a usable JPEG (x); run speedrun data prepare again"
    root = _prepared(tmp_path / "shards")
    index = np.load(root / "train-index.npy")
    with open(root / "train-00000.tar", "r+b") as f:  # every sample's bytes are no longer a JPEG
        for _, offset, size, _ in index:
            f.seek(offset)
            f.write(b"X" * size)
    code, out, err = _run(["bench-loader", str(root), "--batch", "2", "--batches", "1", "--runs", "1",
                           "--workers", "1", "--res", "16", "--device", "cpu"], capsys)
    _one_error(code, err, "is not a usable JPEG", str(root))


# Class: what `data prepare` would replace in DST is checked before any work; DST is left as it was.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["manifest.json", "classes.json", "train-index.npy", "train-00000.tar"])
def test_a_folder_with_one_of_our_names_in_dst_is_refused_and_dst_kept(name, tmp_path, capsys):
    src = tmp_path / "src"
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (src / split / c).mkdir(parents=True)
            (src / split / c / "a.jpg").write_bytes(_jpeg())
    dst = tmp_path / "dst"
    prepare_tree(src, dst, workers=0, max_side_px=16)
    (src / "train" / "cat" / "b.jpg").write_bytes(_jpeg((0, 0, 255)))  # so train is prepared again
    target = dst / name
    target.unlink()
    target.mkdir()
    (target / "keep.txt").write_text("someone's")
    before = {p.relative_to(dst): p.read_bytes() if p.is_file() else None for p in dst.rglob("*")}
    code, out, err = _run(["data", "prepare", str(src), str(dst), "--workers", "0", "--max-side-px", "16"], capsys)
    _one_error(code, err, str(target), "is a folder")
    after = {p.relative_to(dst): p.read_bytes() if p.is_file() else None for p in dst.rglob("*")}
    assert after == before


def test_an_index_whose_labels_exceed_the_classes_is_prepared_again(tmp_path):
    src = tmp_path / "src"
    for c in ("cat", "dog"):
        (src / "train" / c).mkdir(parents=True)
        (src / "train" / c / "a.jpg").write_bytes(_jpeg())
    dst = tmp_path / "dst"
    prepare_tree(src, dst, workers=0, max_side_px=16)
    _edit_index(dst, "train", lambda a: a.__setitem__((0, 3), 10**6))
    report = prepare_tree(src, dst, workers=0, max_side_px=16)
    assert not report.up_to_date
    with shards.Shards(dst, "train") as s:
        assert s.index[:, 3].tolist() == [0, 1]


# Class: an EXIF orientation is counted as a rotation only when one is applied (2 to 8).
@pytest.mark.parametrize("orientation,rotated", [(0, False), (1, False), (6, True), (9, False), (65535, False)])
def test_bogus_exif_orientations_are_no_rotation(orientation, rotated, tmp_path):
    im = Image.new("RGB", (40, 20), "red")
    exif = im.getexif()
    exif[0x0112] = orientation
    im.save(tmp_path / "x.jpg", exif=exif)
    out = prepare_image(str(tmp_path / "x.jpg"), 32, 90)
    assert out.rotated is rotated and (out.width_px, out.height_px) == ((16, 32) if rotated else (32, 16))


# Class: every original file the baseline opens is read under the same limits as `data prepare`'s.
def _png_header(w, h) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


BASELINE_FILES = {
    "60,000 x 60,000 PNG": (lambda p: p.with_suffix(".png").write_bytes(_png_header(60_000, 60_000)), "pixels"),
    "12,000 x 12,000 PNG": (lambda p: p.with_suffix(".png").write_bytes(_png_header(12_000, 12_000)), "pixels"),
    "a FIFO": (lambda p: os.mkfifo(p), "not a regular file"),
    "a GIF named .jpg": (lambda p: p.write_bytes(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"), "not a JPEG or PNG"),
}


@pytest.mark.parametrize("make,fragment", BASELINE_FILES.values(), ids=BASELINE_FILES.keys())
def test_hostile_baseline_originals_are_one_error_naming_the_file(make, fragment, tmp_path, capsys):
    root = _prepared(tmp_path / "shards")
    src = tmp_path / "originals"
    for c in ("cat", "dog"):
        (src / "train" / c).mkdir(parents=True)
        for i in range(3):
            make(src / "train" / c / f"{i}.jpg")
    code, out, err = _run(["bench-loader", str(root), "--batch", "2", "--batches", "1", "--runs", "1",
                           "--workers", "0", "--res", "16", "--device", "cpu", "--baseline", str(src)], capsys)
    _one_error(code, err, "--baseline", str(src), fragment)


# Class: worker processes end with the command, however it ends (a SIGKILL included), and never hold DST's lock.
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_parent(tmp_path):
    script = ("import os, sys, time\n"
              "from speedrun.data.prepare import worker_pool\n"
              "with worker_pool(2) as pool:\n"
              "    print(*sorted(pool.submit(os.getpid).result() for _ in range(8)), flush=True)\n"
              "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = {int(p) for p in proc.stdout.readline().split()}
        assert workers and proc.pid not in workers
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if Path(f"/proc/{p}").exists() and
                 Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0] != "Z"}
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived their parent"
