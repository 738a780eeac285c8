"""Every class of hostile input, end to end through `speedrun train`.

The readers' own tests (test_hostile_archives.py, test_hostile_folder.py) check each refusal in detail. This one
runs the command a user types, in a fresh process whose HOME, cache, results and working directories all lie in a
temporary tree, and asserts for each input: exit code 2, exactly one line on stderr naming the problem, no
traceback, a peak memory growth far below what the bomb would need, and no file written anywhere but the cache and
results directories (and, there, no result and no cached dataset).
"""

from __future__ import annotations

import json
import os
import pickle
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import run_peak, snapshot
from PIL import Image
from test_data_sources import _archive, _py2_pickle, _write_cifar10
from test_hostile_archives import MiB, _gzip, _idx_header, _tar_header
from test_hostile_folder import _folder, _png, _zlib_bomb

from speedrun.data import cifar, idx

SMALL = 64 * MiB  # every bomb below would need 300 MiB or more


def _idx_folder(d: Path, images: bytes | None = None, train_labels=(0, 1, 2, 1), test_labels=(0, 1)) -> Path:
    """Four IDX files; `images` replaces the train-images file (gzipped) when given."""
    d.mkdir(parents=True)
    arrays = {"train_labels": np.array(train_labels, np.uint8), "test_labels": np.array(test_labels, np.uint8),
              "train_images": np.zeros((len(train_labels), 28, 28), np.uint8),
              "test_images": np.zeros((len(test_labels), 28, 28), np.uint8)}
    for role, base in idx.FILES.items():
        a = arrays[role]
        if role == "train_images" and images is not None:
            (d / (base + ".gz")).write_bytes(images)
        else:
            (d / base).write_bytes(_idx_header(*a.shape) + a.tobytes())
    return d


def _cifar_dir(d: Path, replace: str, data: bytes) -> Path:
    """Extracted CIFAR-10 batches with the file `replace` swapped for `data`."""
    _write_cifar10(d, np.random.default_rng(0))
    (d / replace).write_bytes(data)
    return d


def _cases(inputs: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, argv after `train`, fragments the one stderr line must hold), inputs built under `inputs`."""
    cases = []

    def add(name, argv, *fragments):
        cases.append((name, [*argv, "--device", "cpu"], list(fragments)))

    # ---- decompression and allocation bombs (the examples, then variants)
    d = _idx_folder(inputs / "idx-claim", _gzip(_idx_header(300_000, 1000, 1000), 300))
    add("idx gz header claims 300 GB", ["--dataset", str(d)], "train-images-idx3-ubyte.gz", "300.0 GB")
    d = _idx_folder(inputs / "idx-trailing", _gzip(_idx_header(4, 28, 28) + bytes(4 * 784), 300))
    add("idx gz with 300 MiB after its data", ["--dataset", str(d)], "train-images-idx3-ubyte.gz", "more follows")
    root = _folder(inputs / "png-12000")
    (root / "train" / "a" / "0.png").write_bytes(_zlib_bomb(12000))
    add("png claims 12000x12000", ["--dataset", str(root)], "0.png", "12000x12000")
    root = _folder(inputs / "png-header-only")
    (root / "train" / "b" / "2.png").write_bytes(_png(30000, 30000))
    add("png header claims 30000x30000", ["--dataset", str(root)], "2.png")
    d = _cifar_dir(inputs / "pickle-bytes", "data_batch_1",
                   b"\x80\x02cbuiltins\nbytes\nJ" + (500_000_000).to_bytes(4, "little") + b"\x85R.")
    add("cifar pickle builds 500 MB bytes", ["--dataset", str(d)], "data_batch_1", "builtins.bytes is not allowed")
    d = _cifar_dir(inputs / "pickle-str", "test_batch", b"\x80\x02cbuiltins\nstr\ncbuiltins\nbytes\nJ"
                   + (100_000_000).to_bytes(4, "little") + b"\x85R\x85R.")
    add("cifar pickle builds a 400 MB str", ["--dataset", str(d)], "test_batch", "builtins.str is not allowed")
    bomb = inputs / "member-bomb" / "cifar-10-python.tar.gz"
    bomb.parent.mkdir()
    bomb.write_bytes(_gzip(_tar_header("cifar-10-batches-py/data_batch_1", 300 * MiB), 300))
    add("tar.gz member inflates to 300 MiB", ["--dataset", "cifar10", "--data-dir", str(bomb)], "data_batch_1")
    bomb = inputs / "pax-bomb" / "cifar-10-python.tar.gz"
    bomb.parent.mkdir()
    bomb.write_bytes(_gzip(_tar_header("././@PaxHeader", 300 * MiB, tarfile.XHDTYPE), 300))
    add("tar.gz PAX header of 300 MiB", ["--dataset", str(bomb)], "cifar-10-python.tar.gz")
    add("synthetic 10^12 images", ["--dataset", "synthetic:train=1000000000000"], "SPEEDRUN_MAX_DATA_BYTES")
    add("synthetic 4096x4096 images", ["--dataset", "synthetic:train=100000,shape=3x1024x1024"],
        "SPEEDRUN_MAX_DATA_BYTES")

    # ---- inputs that used to end in a traceback
    root = _folder(inputs / "first-not-image")
    (root / "test" / "a" / "0.png").write_text("not an image")
    add("first file is not an image", ["--dataset", str(root)], "0.png", "not a JPEG or PNG")
    root = _folder(inputs / "first-loop")
    os.symlink("0.png", root / "test" / "a" / "0.png")
    add("first file is a symlink loop", ["--dataset", str(root)], "0.png")
    root = _folder(inputs / "first-dir")
    (root / "train" / "a" / "0.jpg").mkdir()
    add("first file is a folder", ["--dataset", str(root)], "0.jpg", "not a regular file")
    root = _folder(inputs / "pillow-bomb")
    (root / "train" / "a" / "0.png").write_bytes(_png(20000, 20000))
    add("decompression-bomb image", ["--dataset", str(root)], "0.png")
    root = _folder(inputs / "eps")
    (root / "test" / "b" / "0.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\nshowpage\n")
    add("EPS named .png", ["--dataset", str(root)], "0.png", "not a JPEG or PNG")
    add("empty test split", ["--dataset", "synthetic:test=0"], "test")
    d = _cifar_dir(inputs / "empty-cifar", "test_batch", b"")
    _py2_pickle(d / "test_batch", {b"data": np.zeros((0, 3072), np.uint8), b"labels": []})
    add("CIFAR test batch with no rows", ["--dataset", str(d)], "test_batch")
    add("8x8 images", ["--dataset", "synthetic:train=64,test=16,shape=3x8x8"], "8x8 images are too small")
    add("widths too deep", ["--dataset", "synthetic:train=64,test=16", "--set", "widths=8,8,8,8,8"],
        "use at most 4 widths")
    archive, _, _ = _archive(inputs, "cifar10", np.random.default_rng(1))
    add("mnist given the CIFAR-10 archive", ["--dataset", "mnist", "--data-dir", str(archive)], "four IDX files")
    other = inputs / "c100"
    other.mkdir()
    archive100, _, _ = _archive(other, "cifar100", np.random.default_rng(2))
    add("cifar10 given the CIFAR-100 archive", ["--dataset", "cifar10", "--data-dir", str(archive100)], "cifar100")
    add("--set compile_mode=bogus", ["--dataset", "synthetic:train=64,test=16", "--set", "compile_mode=bogus"],
        "compile_mode")
    add("--epochs inf", ["--dataset", "synthetic:train=64,test=16", "--epochs", "inf"], "--epochs")
    add("--set seed=1", ["--dataset", "synthetic:train=64,test=16", "--set", "seed=1"], "use --seed")

    # ---- silent wrong results
    d = _idx_folder(inputs / "stray-255", train_labels=(0, 1, 2, 255))
    add("a stray label 255", ["--dataset", str(d)], "255", "stray label")
    d = _cifar_dir(inputs / "float-labels", "data_batch_2", b"")
    _py2_pickle(d / "data_batch_2", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [1.0, 3.7]})
    add("float labels", ["--dataset", str(d)], "data_batch_2")
    flipped = inputs / "crc" / "cifar-10-python.tar.gz"
    flipped.parent.mkdir()
    data = bytearray(archive.read_bytes())
    data[-8] ^= 0xFF  # the gzip trailer's CRC-32
    flipped.write_bytes(bytes(data))
    add("archive with a bad gzip CRC", ["--dataset", str(flipped)], "cifar-10-python.tar.gz")
    add("--set lr_per_1024=nan", ["--dataset", "synthetic:train=64,test=16", "--set", "lr_per_1024=nan"],
        "finite")
    return cases


@pytest.mark.slow
def test_hostile_inputs_through_the_cli(tmp_path):
    inputs, home, work = tmp_path / "inputs", tmp_path / "home", tmp_path / "work"
    cache, results = tmp_path / "cache", tmp_path / "results"
    for d in (inputs, home, work):
        d.mkdir()
    cases = _cases(inputs)
    argvs = json.dumps([["train", *argv] for _, argv, _ in cases])
    body = textwrap.dedent(f"""
        import contextlib, io, json
        from speedrun.cli import main
        for argv in json.loads({argvs!r}):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            print("CASE", json.dumps([code, err.getvalue()]), file=sys.stderr)
        """)
    before = snapshot(tmp_path)
    peak, stderr = run_peak(body, cwd=work, env={"HOME": str(home), "SPEEDRUN_DATA": str(cache),
                                                 "SPEEDRUN_RESULTS": str(results)})
    outcomes = [json.loads(line[5:]) for line in stderr.splitlines() if line.startswith("CASE ")]
    assert len(outcomes) == len(cases), stderr[-3000:]
    failures = []
    for (name, argv, fragments), (code, err) in zip(cases, outcomes):
        ok = (code == 2 and err.count("\n") == 1 and err.startswith("speedrun: error: ")
              and "Traceback" not in err and all(f in err for f in fragments))
        if not ok:
            failures.append(f"{name}: exit {code}: {err!r}")
    assert not failures, "\n".join(failures)
    assert peak < SMALL, peak
    # Nothing anywhere but the cache and results directories, and in them no result and no cached dataset.
    written = snapshot(tmp_path) - before
    assert all(Path(p).is_relative_to(cache) or Path(p).is_relative_to(results) for p in written), written
    assert not [p for p in written if p.endswith((".json", ".pt"))], written
    assert not list(cache.glob("downloads/.extract-*"))  # no extraction scratch left behind


def test_the_valid_twins_of_the_inputs_load(tmp_path):
    """The same builders without the damage give data that trains, so the refusals above are the damage's."""
    rng = np.random.default_rng(0)
    d = _idx_folder(tmp_path / "idx", _gzip(_idx_header(4, 28, 28) + bytes(4 * 784)))
    root = _folder(tmp_path / "pics", size=(16, 16))
    c = tmp_path / "cifar"
    _write_cifar10(c, rng)
    from speedrun.data.sources import load_dataset

    assert load_dataset(str(d), cache_dir=tmp_path / "cache").train_images.shape == (4, 1, 28, 28)
    assert load_dataset(str(root), cache_dir=tmp_path / "cache").train_images.shape == (2, 3, 16, 16)
    assert load_dataset(str(c), cache_dir=tmp_path / "cache").classes[0] == "class0"
    with open(c / "data_batch_1", "rb") as f:  # the fixtures are real Python-2-style CIFAR pickles
        assert pickle.load(f, encoding="bytes")[b"labels"]
    Image.open(root / "train" / "a" / "1.png").verify()
    assert cifar.ARCHIVE_NAMES["cifar10"] == "cifar-10-python.tar.gz"
