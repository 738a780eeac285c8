"""What reads a prepared folder trusts its manifest: a split file the manifest does not list is no split (training
ignores it, bench-loader refuses it, prepare names it with the fix), classes.json must be the one the manifest
records, every class must have training images, and bench-loader's --baseline must be the images the shards were
prepared from, every file it will read checked before any measurement."""

import json
import shlex
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli as _run
from PIL import Image

from speedrun.data import shards
from speedrun.data.prepare_tree import prepare_tree
from speedrun.data.shard_loader import ShardImages
from speedrun.errors import SpeedrunWarning
from speedrun.recipes.imagenet import data as imagenet_data

CLASSES = ("n01", "n02", "n03")
TINY = ["--workers", "0", "--res", "16", "--batch", "2", "--batches", "1", "--runs", "1", "--decode-px", "16",
        "--device", "cpu"]


def _tree(root: Path, splits=("train", "val"), classes=CLASSES, per_class=2, empty=()) -> Path:
    """SRC/<split>/<class>/ with tiny distinct PNGs; the classes in `empty` have no training image."""
    rng = np.random.default_rng(0)
    for split in splits:
        for c in (*classes, *empty):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            if split == "train" and c in empty:
                continue
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return root


def _prepare(src, dst):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prepare_tree(src, dst, max_side_px=16, workers=0)
    return report, [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]


def _advised(message: str) -> list[str]:
    """The `speedrun data prepare ...` command a message advises, as argv after `speedrun`."""
    return shlex.split(message.split("`speedrun ", 1)[1].split("`", 1)[0])


# Class: a split file the manifest does not list is no split: training ignores it, bench-loader refuses it
# naming the listed ones, and no reader advises a prepare that finds nothing to do.
STRAYS = {
    "a junk index": lambda d, s: (d / f"{s}-index.npy").write_bytes(b"junk"),
    "a whole split written by hand": lambda d, s: shards.write_split(iter([(b"x", 0)]), d, s),
    "an index that is a folder": lambda d, s: (d / f"{s}-index.npy").mkdir(),
}


@pytest.mark.parametrize("make", STRAYS.values(), ids=STRAYS.keys())
def test_a_split_the_manifest_does_not_list_is_no_split(make, tmp_path, capsys):
    src, dst = _tree(tmp_path / "src", ("train", "test")), tmp_path / "dst"  # CIFAR-style: train and test
    _prepare(src, dst)
    make(dst, "val")  # val comes before test when training picks its evaluation split
    data = imagenet_data.load_data(str(dst))
    assert data.eval_split == "test" and data.num_eval == 6
    with pytest.raises(ValueError, match="split val is not one .*lists \\(it lists train, test\\)"):
        ShardImages(str(dst), "val", 16)
    code, out, err = _run(["bench-loader", str(dst), "--split", "val", *TINY], capsys)
    assert code == 2 and err.count("\n") == 1 and "it lists train, test" in err, err
    assert "choose --split train or --split test" in err and "speedrun data prepare again" not in err
    code, out, err = _run(["data", "prepare", str(src), str(dst), "--workers", "0", "--max-side-px", "16"], capsys)
    assert code == 0 and "up to date: nothing to do" in out
    if (dst / "val-index.npy").is_file():  # a file there is named, with the fix; a folder is no file of a split
        assert "val-index.npy" in err and "does not list" in err and "remove them" in err, err


def test_a_split_src_has_not_is_dropped_with_a_true_warning_and_then_refused(tmp_path, capsys):
    src, dst = _tree(tmp_path / "src", ("train", "val", "test")), tmp_path / "dst"
    _prepare(src, dst)
    for p in sorted((src / "test").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    (src / "test").rmdir()
    _, warned = _prepare(src, dst)
    assert len(warned) == 1 and "listed split test, which SRC" in warned[0] and "remove them" in warned[0], warned
    assert "test-index.npy" in warned[0] and "test-00000.tar" in warned[0]
    assert (dst / "test-index.npy").is_file()  # left as it is
    code, out, err = _run(["bench-loader", str(dst), "--split", "test", *TINY], capsys)
    assert code == 2 and "split test is not one" in err and "choose --split train or --split val" in err, err
    _, warned = _prepare(src, dst)  # every later run names them, until they are removed
    assert len(warned) == 1 and "test-index.npy" in warned[0] and "does not list" in warned[0]
    # A split the manifest claimed with no file of it (SRC never had one): no file is said to be left.
    manifest = json.loads((dst / "manifest.json").read_text())
    (dst / "test-index.npy").unlink()
    (dst / "test-00000.tar").unlink()
    manifest["splits"]["test"] = manifest["splits"]["val"]
    (dst / "manifest.json").write_text(json.dumps(manifest))
    _, warned = _prepare(src, dst)
    assert len(warned) == 1 and "listed split test" in warned[0] and "left" not in warned[0], warned
    _, warned = _prepare(src, dst)
    assert warned == []


def test_bench_loader_names_the_fix_for_a_split_that_is_not_there(tmp_path, capsys):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    for split in ("nope", "test"):
        code, out, err = _run(["bench-loader", str(dst), "--split", split, *TINY], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--split {split}: {dst} has train, val; choose --split train or --split val" in err, err


# Class: classes.json is the one the manifest records (SHA-256, number of classes); an edited one is refused before
# training, and the advised command writes it again.
EDITS = {
    "reordered": '["n03", "n02", "n01"]\n',
    "more names": '["a", "b", "c", "d"]\n',
    "renamed": '["n01", "n02", "cat"]\n',
    "the same names, reformatted": '[ "n01",  "n02",  "n03" ]',
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_an_edited_classes_json_is_refused_and_the_advice_repairs_it(edit, tmp_path, capsys):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    (dst / "classes.json").write_text(edit)
    with pytest.raises(ValueError) as e:
        imagenet_data.load_data(str(dst))
    message = str(e.value)
    assert "\n" not in message and "classes.json" in message and "manifest.json" in message, message
    if edit.count(",") != 2:
        assert "names 4 classes where manifest.json records 3" in message
    code, out, err = _run(["train", "imagenet-debug", "--dataset", str(dst), "--device", "cpu"], capsys)
    assert code == 2 and "classes.json" in err and "run 1/1" not in out + err
    code, out, err = _run([*_advised(message), "--workers", "0"], capsys)
    assert code == 0 and "classes.json was missing or changed: written again" in out, err
    assert imagenet_data.load_data(str(dst)).classes == CLASSES


def test_classes_json_without_a_manifest_of_ours_is_read_as_it_is(tmp_path):
    root = tmp_path / "hand"
    root.mkdir()
    for split in ("train", "val"):
        shards.write_split(iter([(b"x", 0), (b"y", 1)]), root, split)
    (root / "classes.json").write_text('["b", "a"]')
    assert shards.read_classes(root) == ("b", "a")


# Class: every class of classes.json has training images, checked before training (as the in-memory image-folder
# loader checks it).
@pytest.mark.parametrize("empty", [("n00",), ("n00", "n99"), ("n02b",)])
def test_a_class_without_training_images_is_refused_naming_it(empty, tmp_path, capsys):
    src, dst = _tree(tmp_path / "src", empty=empty), tmp_path / "dst"
    _, warned = _prepare(src, dst)
    hold = "holds" if len(empty) == 1 else "hold"
    assert any(f"{hold} no images" in w and "training refuses" in w for w in warned), warned
    with pytest.raises(ValueError) as e:
        imagenet_data.load_data(str(dst))
    message = str(e.value)
    assert "\n" not in message and all(c in message for c in empty) and "no training images" in message, message
    assert f"{src}/train/" in message and _advised(message)[:4] == ["data", "prepare", str(src), str(dst)]
    code, out, err = _run(["train", "imagenet-resnet18", "--dataset", str(dst), "--smoke", "--device", "cpu"], capsys)
    assert code == 2 and "no training images" in err and "run 1/1" not in out + err, err


# Class: --baseline is the images these shards were prepared from, and every original file the baseline will read
# is checked before the first measurement.
def _baseline_other(tmp_path, how):
    base = tmp_path / "base"
    if how == "other names":
        _tree(base, ("train",), ("a", "b", "c"))
    elif how == "more classes":
        _tree(base, ("train",), (*CLASSES, "n04"))
    elif how == "fewer classes":
        _tree(base, ("train",), CLASSES[:2])
    return base


@pytest.mark.parametrize("how", ["other names", "more classes", "fewer classes"])
def test_a_baseline_of_other_classes_is_refused_before_any_measurement(how, tmp_path, capsys):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    base = _baseline_other(tmp_path, how)
    code, out, err = _run(["bench-loader", str(dst), *TINY, "--baseline", str(base)], capsys)
    assert code == 2 and "round " not in err and "is not the image folder these shards were prepared from" in err
    assert str(src) in err.splitlines()[-1], err  # the manifest's SRC, the one to give
    code, out, err = _run(["bench-loader", str(dst), *TINY, "--baseline", str(src)], capsys)
    assert code == 0, err


def test_shards_without_classes_json_need_a_baseline_that_covers_their_labels(tmp_path, capsys):
    root = tmp_path / "hand"
    root.mkdir()
    jpeg = (tmp_path / "x.jpg")
    Image.new("RGB", (8, 8)).save(jpeg)
    shards.write_split(iter([(jpeg.read_bytes(), k % 4) for k in range(8)]), root, "train")
    code, out, err = _run(["bench-loader", str(root), *TINY, "--baseline", str(_tree(tmp_path / "base", ("train",)))],
                          capsys)
    assert code == 2 and "has 3 class folders, but the train split" in err and "label 3" in err, err


BAD_FILES = {
    "not an image": lambda p: p.write_bytes(b"junk"),
    "a GIF": lambda p: p.write_bytes(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"),
    "a PNG claiming 60,000 x 60,000": lambda p: _png_claiming(p, 60_000),
}


def _png_claiming(path: Path, side: int) -> None:
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("make", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_baseline_file_is_found_before_ours_is_measured(make, tmp_path, capsys):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    for c in CLASSES:  # every training original bad: whichever the baseline reads first
        for p in (src / "train" / c).iterdir():
            make(p)
    code, out, err = _run(["bench-loader", str(dst), *TINY, "--runs", "2", "--baseline", str(src)], capsys)
    assert code == 2 and "round " not in err and "--baseline: " in err and str(src) in err, err


# Class: bench-loader's path arguments, empty or blank, are refused naming the argument.
@pytest.mark.parametrize("blank", ["", "  "])
def test_bench_loader_refuses_a_blank_dir_or_baseline(blank, tmp_path, capsys, monkeypatch):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    monkeypatch.chdir(dst)  # a blank DIR would be this prepared folder
    code, out, err = _run(["bench-loader", blank, *TINY], capsys)
    assert code == 2 and err.count("\n") == 1 and "error: DIR is empty" in err, err
    code, out, err = _run(["bench-loader", str(dst), *TINY, "--baseline", blank], capsys)
    assert code == 2 and err.count("\n") == 1 and "error: --baseline is empty" in err, err
