"""Hostile image folders: every bad file is one ValueError line naming it, bombs stay small in memory,
nothing is written outside the cache dir, and a damaged cache is rebuilt with a warning."""

from __future__ import annotations

import io
import os
import signal
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_peak, snapshot
from PIL import Image

from speedrun.data import cache, folder, synthetic
from speedrun.data.dataset import Dataset
from speedrun.data.sources import check_dataset, load_dataset
from speedrun.errors import SpeedrunWarning

MB = 2**20


def _chunk(kind: bytes, data: bytes) -> bytes:
    # PNG chunk: 4-byte big-endian length, type, data, CRC-32 over type + data (PNG spec, section 5.3).
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, idat: bytes = b"", colour_type: int = 2) -> bytes:
    """A PNG whose IHDR claims width x height (8-bit, RGB by default); the IDAT holds `idat`, compressed."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(idat or bytes(64)))
            + _chunk(b"IEND", b""))


def _zlib_bomb(side: int) -> bytes:
    """A grey side x side PNG whose IDAT really inflates to side * (side + 1) bytes (zeros, filter byte 0)."""
    z = zlib.compressobj(9)
    row = bytes(side + 1)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _folder(root: Path, size=(4, 4), classes=("a", "b")) -> Path:
    """ROOT/{train,test}/<class>/1.png, small valid RGB images of `size` with a different colour per file."""
    for s, split in enumerate(("train", "test")):
        for c, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            colour = (40 * c + 7, 100 + s, 9)
            Image.fromarray(np.full((size[1], size[0], 3), colour, np.uint8)).save(root / split / cls / "1.png")
    return root


def _refused(tmp_path: Path, root: Path, named: str, *, exc=ValueError, **kwargs) -> str:
    """load_dataset(root) must raise `exc` with one line naming `named`, and write nothing anywhere."""
    before = snapshot(tmp_path)
    with pytest.raises(exc) as err:
        load_dataset(str(root), cache_dir=tmp_path / "cache", **kwargs)
    message = str(err.value)
    assert type(err.value) is exc and "\n" not in message and named in message, message
    assert snapshot(tmp_path) == before
    return message


# ---- 1. allocation bombs -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_png_headers_claiming_12000px_are_refused_before_any_allocation(tmp_path):
    root = _folder(tmp_path / "pics")
    # The first really inflates to 144 MB of grey pixels from 140 kB; the second is a 74-byte header alone. Before
    # this fix decode() sized a (4, 12000, 12000, 3) array from the first and filled it: 3.3 GB peak growth.
    (root / "train" / "a" / "0.png").write_bytes(_zlib_bomb(12000))
    (root / "train" / "b" / "0.png").write_bytes(_png(12000, 12000))
    assert (root / "train" / "a" / "0.png").stat().st_size < 200_000
    before = snapshot(tmp_path)
    peak, stderr = run_peak(f"speedrun.data.sources.load_dataset({str(root)!r}, cache_dir={str(tmp_path / 'c')!r})")
    claim = f"{root}/train/a/0.png claims 12000x12000 pixels, over the limit of 48,000,000 per image"
    assert f'OUTCOME "ValueError: {claim}' in stderr
    assert "DecompressionBombWarning" not in stderr and "Traceback" not in stderr
    assert peak < 64 * MB, peak
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_bomb_variants_stay_small(tmp_path):
    """A real zlib bomb (48 kB inflating to 49 MB, just over the per-image limit), a bomb that is not the first
    file and is met by a pool worker, a header past Pillow's own DecompressionBombError, and a folder whose total
    is over SPEEDRUN_MAX_DATA_BYTES: each refused with one line, in one process that stays small."""
    zlib_root = _folder(tmp_path / "zlib")
    (zlib_root / "test" / "b" / "0.png").write_bytes(_zlib_bomb(7000))  # 7000^2 = 49 Mpx
    assert (zlib_root / "test" / "b" / "0.png").stat().st_size < 64_000
    later = _folder(tmp_path / "later")
    (later / "test" / "b" / "2.png").write_bytes(_png(12000, 9000))
    huge = _folder(tmp_path / "huge")
    (huge / "train" / "a" / "0.png").write_bytes(_png(20000, 20000))  # 400 Mpx: Pillow raises in Image.open
    total = _folder(tmp_path / "total", size=(1024, 1024))  # 4 x 3 MB decoded, over the 8 MB limit set below
    cache = str(tmp_path / "c")
    body = f"""
    from speedrun.data import folder
    folder.PARALLEL_MIN, folder.CHUNK = 2, 1  # the second case decodes in worker processes
    for root in {[str(zlib_root), str(later), str(huge), str(total)]!r}:
        try:
            speedrun.data.sources.load_dataset(root, cache_dir={cache!r})
        except ValueError as e:
            print("CASE", type(e).__name__, e, file=sys.stderr)
    """
    before = snapshot(tmp_path)
    peak, stderr = run_peak(body, env={"SPEEDRUN_MAX_DATA_BYTES": str(8 * 10**6)})
    cases = [line for line in stderr.splitlines() if line.startswith("CASE")]
    assert len(cases) == 4 and "Traceback" not in stderr and "Warning" not in stderr, stderr
    assert f"{zlib_root}/test/b/0.png claims 7000x7000 pixels, over the limit" in cases[0]
    assert f"{later}/test/b/2.png claims 12000x9000 pixels" in cases[1]
    assert f"{huge}/train/a/0.png claims too many pixels (DecompressionBombError: " in cases[2]
    assert f"{total} (4 images of 1024x1024) would take 12.6 MB of memory" in cases[3]
    assert "SPEEDRUN_MAX_DATA_BYTES" in cases[3]
    assert peak < 64 * MB, peak
    assert snapshot(tmp_path) == before


def test_side_over_limit_without_resize_names_the_fix_and_loads_with_it(tmp_path):
    root = _folder(tmp_path / "pics", size=(1500, 8))
    message = _refused(tmp_path, root, f"{root}/train/a/1.png")
    assert "is 1500x8 pixels" in message and "pass image_size (--image-size N)" in message
    assert load_dataset(str(root), cache_dir=tmp_path / "cache", image_size=8).image_shape == (3, 8, 8)


def test_pillow_bomb_warning_never_escapes(tmp_path):
    # 12000 x 9000 = 108 Mpx: above Pillow's warning threshold (89 Mpx), below its error (179 Mpx).
    path = tmp_path / "x.png"
    path.write_bytes(_png(12000, 9000))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DecompressionBombWarning would raise here instead of our ValueError
        with pytest.raises(ValueError, match=r"x\.png claims 12000x9000 pixels"):
            folder.decode([str(path)])


# ---- 2. the first file is as safe as the others --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "directory", "dangling", "loop", "empty"])
def test_first_file_failures_are_one_line(tmp_path, kind):
    root = _folder(tmp_path / "pics")
    first = root / "train" / "a" / "0.png"  # sorts before 1.png: the file decode() opened unguarded before
    if kind == "text":
        first.write_text("not an image")
    elif kind == "directory":
        first.mkdir()
    elif kind == "dangling":
        first.symlink_to(tmp_path / "missing.png")
    elif kind == "loop":
        first.symlink_to(first)
    else:
        first.write_bytes(b"")
    expected = {"text": "is not a JPEG or PNG image", "directory": "is not a regular file",
                "dangling": "is a symlink to a missing file", "loop": "Too many levels of symbolic links",
                "empty": "is not a JPEG or PNG image"}[kind]
    assert expected in _refused(tmp_path, root, str(first))
    # decode() given the path directly (the Python API, or a file that changed after listing) says the same kind
    # of thing in one line.
    with pytest.raises(ValueError) as err:
        folder.decode([str(first), str(root / "train" / "a" / "1.png")])
    assert type(err.value) is ValueError and str(first) in str(err.value) and "\n" not in str(err.value)


def test_unreadable_first_file_and_class_folder(tmp_path, monkeypatch):
    # Tests run as root, so permissions cannot be taken away: raise what open() would raise instead.
    root = _folder(tmp_path / "pics")
    first = str(root / "train" / "a" / "1.png")
    real_open, real_scandir = Image.open, os.scandir

    def no_permission(path, *args, **kwargs):
        if str(path) == first:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(Image, "open", no_permission)
    message = _refused(tmp_path, root, first)
    assert "cannot read" in message and "PermissionError: Permission denied" in message
    monkeypatch.setattr(Image, "open", real_open)

    def unlistable(path="."):
        if str(path) == str(root / "test" / "b"):
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", unlistable)
    assert "cannot list" in _refused(tmp_path, root, str(root / "test" / "b"))


def test_symlink_loop_as_class_folder(tmp_path):
    root = _folder(tmp_path / "pics")
    (root / "train" / "c").symlink_to(root / "train" / "c")
    assert "Too many levels of symbolic links" in _refused(tmp_path, root, str(root / "train" / "c"))


def test_worker_error_reraises_as_one_line_without_remote_traceback(tmp_path, monkeypatch):
    root = _folder(tmp_path / "pics", classes=("a", "b", "c", "d"))
    bad = root / "train" / "c" / "1.png"
    bad.write_text("garbage")
    paths = sorted(str(p) for p in root.rglob("*.png"))
    monkeypatch.setattr(folder, "PARALLEL_MIN", 2)
    monkeypatch.setattr(folder, "CHUNK", 2)
    with pytest.raises(ValueError) as err:
        folder.decode(paths, workers=2)
    assert type(err.value) is ValueError and err.value.__cause__ is None
    assert str(err.value) == f"{bad} is not a JPEG or PNG image; delete it or convert it to PNG"


# ---- 3. only JPEG and PNG decoders run -----------------------------------------------------------------------------


def test_eps_named_png_never_reaches_ghostscript(tmp_path):
    root = _folder(tmp_path / "pics")
    eps = root / "test" / "b" / "0.png"
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\nshowpage\n")
    with Image.open(eps) as im:  # what happened before: Pillow picked its EPS plugin by content
        assert im.format == "EPS"
    assert "is not a JPEG or PNG image" in _refused(tmp_path, root, str(eps))


def test_gif_named_png_is_refused_but_jpeg_named_png_loads(tmp_path):
    root = _folder(tmp_path / "pics")
    gif = root / "train" / "b" / "0.png"
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    assert "is not a JPEG or PNG image" in _refused(tmp_path, root, str(gif))
    Image.fromarray(np.full((4, 4, 3), 128, np.uint8)).save(gif, format="JPEG", quality=95)  # ImageNet has these
    ds = load_dataset(str(root), cache_dir=tmp_path / "cache")
    assert ds.train_images.shape == (3, 3, 4, 4) and abs(int(ds.train_images[1].float().mean()) - 128) <= 2


# ---- 4. file names that are not UTF-8 ------------------------------------------------------------------------------


def test_non_utf8_names_load_and_messages_stay_printable(tmp_path):
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    _folder(root, classes=(os.fsdecode(b"\xe9t\xe9"), "b"))
    image = os.fsdecode(os.fsencode(root) + b"/train/b/caf\xe9.png")
    Image.fromarray(np.full((4, 4, 3), 50, np.uint8)).save(image)
    lines = []
    ds = load_dataset(str(root), cache_dir=tmp_path / "cache", log=lines.append)
    assert ds.train_images.shape == (3, 3, 4, 4) and ds.train_labels.tolist() == [0, 0, 1]
    assert ds.name == "caf\\xe9" and ds.classes == ["b", "\\xe9t\\xe9"]  # printable, the bytes still visible
    assert int(ds.train_images[1, 0, 0, 0]) == 50  # b/caf\xe9.png sorts after b/1.png
    for text in lines + [ds.name, *ds.classes]:
        text.encode("utf-8")  # a lone surrogate would raise here, as print() would on a UTF-8 terminal
    lines.clear()
    load_dataset(str(root), cache_dir=tmp_path / "cache", log=lines.append)
    assert "from cache" in lines[0]
    Path(image).write_text("now broken")
    message = _refused(tmp_path, root, f"{tmp_path}/caf\\xe9/train/b/caf\\xe9.png")
    message.encode("utf-8")


def test_newline_in_a_file_name_keeps_the_message_on_one_line(tmp_path):
    root = _folder(tmp_path / "pics")
    (root / "train" / "a" / "x\ny.png").write_text("junk")
    _refused(tmp_path, root, "x\\ny.png")


# ---- 5. image_size -----------------------------------------------------------------------------------------------


def test_mixed_sizes_load_with_image_size(tmp_path):
    root = tmp_path / "pics"
    for split in ("train", "test"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
    # 64x32: red 8-px strips at both ends, green in between. The centred 32x32 square is columns 16..47, and a 2x
    # bicubic shrink reads 4 source pixels either side (columns 12..51): all green, so every output pixel is green.
    wide = np.zeros((32, 64, 3), np.uint8)
    wide[:] = (255, 0, 0)
    wide[:, 8:56] = (0, 255, 0)
    Image.fromarray(wide).save(root / "train" / "a" / "wide.png")
    Image.fromarray(wide.transpose(1, 0, 2).copy()).save(root / "train" / "b" / "tall.png")  # 32x64, same idea
    Image.fromarray(np.full((24, 40, 3), (10, 20, 30), np.uint8)).save(root / "test" / "a" / "solid.png")
    Image.fromarray(np.full((50, 30), 99, np.uint8)).save(root / "test" / "b" / "grey.png")  # 1 channel -> RGB
    Image.fromarray(np.full((300, 200, 3), (5, 6, 7), np.uint8)).save(root / "test" / "b" / "photo.jpg",
                                                                      quality=95)  # JPEG: drafted at 1/8
    _refused(tmp_path, root, "all images must have one size")
    before = snapshot(tmp_path)
    ds = load_dataset(str(root), cache_dir=tmp_path / "cache", image_size=16)
    assert ds.train_images.shape == (2, 3, 16, 16) and ds.test_images.shape == (3, 3, 16, 16)
    green = torch.tensor([0, 255, 0], dtype=torch.uint8).view(3, 1, 1).expand(3, 16, 16)
    assert torch.equal(ds.train_images[0], green) and torch.equal(ds.train_images[1], green)
    assert torch.equal(ds.test_images[0], torch.tensor([10, 20, 30], dtype=torch.uint8).view(3, 1, 1).expand(3, 16, 16))
    assert torch.equal(ds.test_images[1], torch.full((3, 16, 16), 99, dtype=torch.uint8))
    assert (ds.test_images[2].int() - torch.tensor([5, 6, 7]).view(3, 1, 1)).abs().max() <= 2
    assert all(p.startswith(str(tmp_path / "cache")) for p in snapshot(tmp_path) - before)
    # The cache key holds image_size: another size is a build of its own, and the first stays cached.
    assert load_dataset(str(root), cache_dir=tmp_path / "cache", image_size=8).image_shape == (3, 8, 8)
    lines = []
    again = load_dataset(str(root), cache_dir=tmp_path / "cache", image_size=16, log=lines.append)
    assert "from cache" in lines[0] and torch.equal(again.train_images, ds.train_images)


@pytest.mark.parametrize("value", [4, 2000, 32.0, "32", True])
def test_image_size_is_validated(tmp_path, value):
    with pytest.raises(ValueError, match=r"image_size \(--image-size\) must be a whole number of pixels from 8"):
        load_dataset(str(_folder(tmp_path / "pics")), cache_dir=tmp_path / "cache", image_size=value)


def test_image_size_applies_to_image_folders_only(tmp_path):
    for spec in ("synthetic:train=4,test=4", "cifar10"):  # refused before any download
        with pytest.raises(ValueError, match=r"image_size \(--image-size\) applies to image folders only"):
            load_dataset(spec, cache_dir=tmp_path, image_size=32)
    archive = tmp_path / "x.tar.gz"
    archive.write_bytes(b"")
    with pytest.raises(ValueError, match=r"applies to image folders only, but .*x\.tar\.gz holds a CIFAR archive"):
        load_dataset(str(archive), cache_dir=tmp_path, image_size=32)


# ---- 6. decode workers leave signals to the parent -----------------------------------------------------------------

_SIGNAL_CHILD = """
import signal, sys, time
import numpy as np
from speedrun.data import folder

class Stop(Exception):
    pass

def stop(signum, frame):  # like the CLI's handler: turn SIGTERM into an exception
    raise Stop()

def slow(path, image_size, ref):
    if path == "p0":
        print("STARTED", flush=True)
    time.sleep(0.05)
    return np.zeros((4, 4), np.uint8)

signal.signal(signal.SIGTERM, stop)
folder.read_image, folder.header_size = slow, lambda path: (4, 4)
folder.PARALLEL_MIN, folder.CHUNK = 2, 4
try:
    folder.decode([f"p{i}" for i in range(400)], workers=2)
except (Stop, KeyboardInterrupt) as e:
    print("PARENT", type(e).__name__, flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_process_group_stops_quietly(signum):
    """Ctrl-C and `kill -TERM -<pgid>` reach the workers too. Before, workers ran the parent's SIGTERM handler and
    the pool never finished; with SIG_DFL in Pool workers, Pool.terminate() hung about 1 run in 3 under load, on
    the task-queue lock of a worker killed while holding it."""
    child = subprocess.Popen([sys.executable, "-c", _SIGNAL_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert child.stdout.readline() == "STARTED\n"
        os.killpg(child.pid, signum)
        out, err = child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    expected = "Stop" if signum == signal.SIGTERM else "KeyboardInterrupt"
    assert out == f"PARENT {expected}\n" and "Traceback" not in err and child.returncode == 0, err


_SIGNAL_TO_ANOTHER_THREAD = """
import signal, threading, time
import numpy as np
from speedrun.data import folder

def slow(path, image_size, ref):
    if path == "p0":
        print("STARTED", flush=True)
    time.sleep(0.05)
    return np.zeros((4, 4), np.uint8)

def interrupt_this_thread():
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

folder.read_image, folder.header_size = slow, lambda path: (4, 4)
folder.PARALLEL_MIN, folder.CHUNK = 2, 4
threading.Timer(1.0, interrupt_this_thread).start()
start = time.monotonic()
try:
    folder.decode([f"p{i}" for i in range(2000)], workers=2)  # 50 s of decoding
except KeyboardInterrupt:
    print("PARENT KeyboardInterrupt after", round(time.monotonic() - start), "s", flush=True)
"""


def test_ctrl_c_delivered_to_another_thread_stops_the_decode(tmp_path):
    """The kernel gives a process-wide SIGINT to any thread not blocking it (torch's, a timer's), and it always
    does while the decoding thread blocks it to fork a worker. Python runs the handler in the main thread only when
    that thread next runs bytecode: one blocking wait on the workers saw it at the end of the decode (a minute or
    more for a large folder). Waiting in short slices, it stops within one."""
    child = subprocess.run([sys.executable, "-c", _SIGNAL_TO_ANOTHER_THREAD], capture_output=True, text=True,
                           timeout=120)
    lines = child.stdout.splitlines()
    assert lines[0] == "STARTED" and lines[-1].startswith("PARENT KeyboardInterrupt after"), child.stderr
    assert int(lines[-1].split()[-2]) < 25, lines[-1]  # 50 s when the interrupt waits for the decode's end


def test_a_worker_killed_from_outside_is_one_line_not_a_hang(monkeypatch):
    def killed_on_p9(path, image_size, ref):  # runs in the forked worker: as if the OOM killer struck there
        if path == "p9":
            os.kill(os.getpid(), signal.SIGKILL)
        return np.zeros((4, 4), np.uint8)

    monkeypatch.setattr(folder, "read_image", killed_on_p9)
    monkeypatch.setattr(folder, "header_size", lambda path: (4, 4))
    monkeypatch.setattr(folder, "PARALLEL_MIN", 2)
    monkeypatch.setattr(folder, "CHUNK", 4)
    with pytest.raises(ValueError, match=r"^my pics: a decode worker died \(killed by signal 9; out of memory\?\)"):
        folder.decode([f"p{i}" for i in range(40)], workers=2, source="my pics")


# ---- 7. cache integrity ------------------------------------------------------------------------------------------


def test_flipped_label_byte_in_the_cache_is_detected_and_rebuilt(tmp_path):
    root = _folder(tmp_path / "pics", classes=("a", "b", "c"))
    Image.new("RGB", (4, 4)).save(root / "train" / "c" / "2.png")  # train labels [0, 1, 2, 2], unlike test's
    first = load_dataset(str(root), cache_dir=tmp_path / "cache")
    (path,) = (tmp_path / "cache" / "cache").glob("*.pt")
    data = bytearray(path.read_bytes())
    labels = first.train_labels.numpy().tobytes()  # as int64: stored raw in the zip
    assert data.count(labels) == 1
    data[data.find(labels) + 8] ^= 3  # label 1 -> 2: still a valid class, so only the checksum can tell
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["train_labels"].tolist() == [0, 2, 2, 2]  # torch.load does not notice
    with pytest.warns(SpeedrunWarning, match=r"cache .*\.pt is corrupt \(checksum mismatch\); rebuilding it"):
        rebuilt = load_dataset(str(root), cache_dir=tmp_path / "cache")
    assert rebuilt.train_labels.tolist() == [0, 1, 2, 2] and torch.equal(rebuilt.train_images, first.train_images)
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedrunWarning)  # the rewritten cache verifies: no warning this time
        load_dataset(str(root), cache_dir=tmp_path / "cache", log=lines.append)
    assert "from cache" in lines[0]


@pytest.mark.parametrize("kind", ["fifo", "too-large"])
def test_a_cache_that_is_a_fifo_or_too_large_is_rebuilt_not_read(tmp_path, monkeypatch, kind):
    root = _folder(tmp_path / "pics")
    first = load_dataset(str(root), cache_dir=tmp_path / "cache")
    (path,) = (tmp_path / "cache" / "cache").glob("*.pt")
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block forever
    else:
        with open(path, "wb") as f:  # sparse: 2 GB on paper, over the 1 MB dataset limit set below
            f.truncate(2 * 10**9)
        monkeypatch.setenv("SPEEDRUN_MAX_DATA_BYTES", str(10**6))
    signal.alarm(30)  # a hang fails the test instead of the whole suite
    try:
        if kind == "fifo":
            with pytest.warns(SpeedrunWarning, match=r"is unreadable .*rebuilding it"):
                again = load_dataset(str(root), cache_dir=tmp_path / "cache")
        else:  # not read; the source is read again, and its own size check decides
            lines = []
            again = load_dataset(str(root), cache_dir=tmp_path / "cache", log=lines.append)
            assert any("is over the data limit; reading the source instead" in line for line in lines)
    finally:
        signal.alarm(0)
    assert torch.equal(again.train_images, first.train_images) and path.is_file() and path.stat().st_size < 10**6


@pytest.mark.slow
def test_a_cache_whose_zip_members_are_compressed_is_refused_before_inflating(tmp_path):
    """torch.load inflates deflated members whole: a 300 MiB member in a file of a few hundred kB is refused first."""
    root = _folder(tmp_path / "pics")
    load_dataset(str(root), cache_dir=tmp_path / "cache")
    (path,) = (tmp_path / "cache" / "cache").glob("*.pt")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for i, name in enumerate(names):  # the same member names, deflated; the last holds 300 MiB of zeros
            with z.open(name, "w", force_zip64=True) as f:
                for _ in range(300 if i == len(names) - 1 else 0):
                    f.write(bytes(MB))
    assert path.stat().st_size < 2 * MB
    peak, err = run_peak(f"""
        import warnings
        from speedrun.data.sources import load_dataset
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ds = load_dataset({str(root)!r}, cache_dir={str(tmp_path / "cache")!r})
        assert len(ds.train_labels) == 2 and any("compressed" in str(w.message) for w in seen), seen
        """)
    assert 'OUTCOME "ok"' in err, err[-2000:]
    assert peak < 64 * MB, peak


def test_cache_with_valid_checksum_but_bad_labels_is_rebuilt(tmp_path):
    root = _folder(tmp_path / "pics")
    first = load_dataset(str(root), cache_dir=tmp_path / "cache")
    (path,) = (tmp_path / "cache" / "cache").glob("*.pt")
    tensors = {k: getattr(first, k).clone() for k in cache.TENSORS}
    tensors["test_labels"][0] = 7  # two classes: out of range, and signed as if we had written it
    payload = {"format": cache.CACHE_FORMAT, "name": first.name, "classes": first.classes, **tensors,
               "sha256": cache.checksum(first.name, first.classes, tensors)}
    torch.save(payload, path)
    with pytest.warns(SpeedrunWarning, match=r"unreadable \(ValueError: .*test label 7 is outside \[0, 2\)"):
        rebuilt = load_dataset(str(root), cache_dir=tmp_path / "cache")
    assert torch.equal(rebuilt.test_labels, first.test_labels)


# ---- 8. check_dataset on every dataset ---------------------------------------------------------------------------


def _ds(n_train=4, n_test=2, classes=("a", "b"), channels=3, labels=None) -> Dataset:
    x = torch.zeros(n_train, channels, 2, 2, dtype=torch.uint8)
    y = torch.zeros(n_train, dtype=torch.int64) if labels is None else torch.tensor(labels)
    return Dataset("d", x, y, torch.zeros(n_test, channels, 2, 2, dtype=torch.uint8),
                   torch.zeros(n_test, dtype=torch.int64), list(classes))


@pytest.mark.parametrize(
    "ds, message",
    [
        (_ds(n_test=0), "src: the test split has no images"),
        (_ds(n_train=0, classes=()), "src: the train split has no images"),  # no classes to infer: no crash
        (_ds(classes=("a",)), "src has 1 class; a classifier needs at least 2"),
        (_ds(channels=4), "src has 4-channel images"),
        (_ds(labels=[0, 1, 2, 0]), r"src: train label 2 is outside \[0, 2\)"),
        (_ds(labels=[0, -1, 1, 0]), r"src: train label -1 is outside \[0, 2\)"),
    ],
    ids=["empty-test", "empty-train", "one-class", "four-channels", "label-too-big", "label-negative"],
)
def test_check_dataset_refuses(ds, message):
    with pytest.raises(ValueError, match=message):
        check_dataset(ds, "src")


def test_dataset_construction_raises_value_errors():
    with pytest.raises(ValueError, match=r"train_images must be a uint8 \(N, C, H, W\) tensor, got torch.float32"):
        Dataset("d", torch.zeros(2, 3, 2, 2), torch.zeros(2, dtype=torch.int64), torch.zeros(1, 3, 2, 2),
                torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"test_labels must be an int64 \(1,\) tensor, got torch.int64 \(2,\)"):
        Dataset("d", torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64),
                torch.zeros(1, 3, 2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))


def test_load_dataset_checks_synthetic_and_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "make", lambda spec: _ds(n_test=0))
    with pytest.raises(ValueError, match=r"^synthetic:test=0: the test split has no images"):
        load_dataset("synthetic:test=0")
    message = _refused(tmp_path, _folder(tmp_path / "one", classes=("only",)), str(tmp_path / "one"))
    assert "has 1 class" in message


# ---- found by trying hostile inputs beyond the list ----------------------------------------------------------


def test_a_progressive_jpeg_with_hundreds_of_scans_is_refused_before_decoding(tmp_path):
    """libjpeg decodes scan after scan into a full-size buffer: one tiny scan repeated 20,000 times cost 49 s."""
    root = _folder(tmp_path / "pics")
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), 99, np.uint8)).save(buf, format="JPEG", progressive=True)
    data = buf.getvalue()
    last_scan = data[data.rfind(b"\xff\xda"):-2]  # the last SOS segment with its entropy-coded data, before EOI
    bomb = root / "train" / "a" / "0.jpg"
    bomb.write_bytes(data[:-2] + last_scan * 300 + b"\xff\xd9")
    message = _refused(tmp_path, root, str(bomb))
    assert "progressive JPEG of 310 scans" in message
    ok = root / "train" / "a" / "0.jpg"  # the same image as written: 10 scans, accepted
    ok.write_bytes(data)
    assert load_dataset(str(root), cache_dir=tmp_path / "cache").train_images.shape[0] == 3


def test_a_tall_thin_png_is_refused_by_its_side(tmp_path):
    """Pillow keeps a pointer per row: 1 x 48,000,000 took 20 times its pixels' memory, within the pixel limit."""
    root = _folder(tmp_path / "pics")
    (root / "train" / "a" / "0.png").write_bytes(_png(1, 40_000_000, colour_type=0))
    message = _refused(tmp_path, root, "0.png", image_size=16)
    assert "1x40000000" in message and "32768 per side" in message


def test_pillows_own_warnings_do_not_flood_stderr(tmp_path):
    """A palette PNG with transparency makes Pillow warn once per file, without its name; we drop alpha by design."""
    root = _folder(tmp_path / "pics")
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (4, 4, 3), dtype=np.uint8)).convert("P")
    with warnings.catch_warnings(record=True) as seen:  # what Pillow alone does with such a file
        warnings.simplefilter("always")
        noise.save(root / "train" / "a" / "p.png", transparency=bytes([0, 255, 128]))
        Image.open(root / "train" / "a" / "p.png").convert("RGB")
    assert any("Transparency expressed in bytes" in str(w.message) for w in seen)
    for i in range(4):
        noise.save(root / "train" / "a" / f"p{i}.png", transparency=bytes([0, 255, 128]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset(str(root), cache_dir=tmp_path / "cache")
    assert ds.train_images.shape[0] == 7  # two of _folder's, five palette PNGs


@pytest.mark.parametrize("rename", [{"train": "Train", "test": "Test"}, {"test": "TEST"}, {"train": "tRain"}])
def test_a_split_folder_in_another_case_is_named_by_every_reader(rename, tmp_path, capsys):
    """Train/ or TEST/ would otherwise be read as a class folder or left out, and each reader (train's image
    folder, prepare) refused it with words about something else."""
    from speedrun.cli import main
    from speedrun.data.prepare import read_source
    root = _folder(tmp_path / "d")
    for old, new in rename.items():
        (root / old).rename(root / new)
    with pytest.raises(ValueError, match=r"split folders are found by their lower-case names") as e:
        load_dataset(str(root), data_dir=tmp_path / "cache")
    for new in rename.values():
        assert f"{new}/" in str(e.value)
    with pytest.raises(ValueError, match=r"rename (it|them) to "):
        read_source(root)
    assert main(["data", "prepare", str(root), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lower-case names" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_class_folder_named_like_a_split_is_a_class(tmp_path):
    """SRC/<class>/<image> with a class called Train (a vehicles dataset): it holds images, not folders."""
    from speedrun.data.prepare import read_source
    root = tmp_path / "vehicles"
    for cls in ("Bus", "Train"):
        (root / cls).mkdir(parents=True)
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / cls / "1.png")
    assert read_source(root).classes == ["Bus", "Train"]
