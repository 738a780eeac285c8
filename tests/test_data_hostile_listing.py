"""What the image-tree readers (`data prepare`'s and the image-folder dataset's) make of a folder: two class folders
whose names are stored alike once escaped are refused, naming both; whatever a listing leaves out is counted and
named, so a summary's counts are true; val/ stands for test/; a folder of the other kind says which command reads
it."""

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli as _run
from PIL import Image

from speedrun.data.prepare_tree import prepare_tree
from speedrun.data.sources import load_dataset
from speedrun.errors import printable


def _image(path: Path, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)


def _classes(root: Path, names, splits=("train", "test"), per_class=1) -> Path:
    for split in splits:
        for k, name in enumerate(names):
            for i in range(per_class):
                _image(root / split / name / f"{i}.png", seed=k * 10 + i)
    return root


def _prepare(src, dst):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_tree(src, dst, max_side_px=16, workers=0)


# Class: names that are stored alike once escaped (errors.printable): the class index would name a class twice.
ALIKE = {
    "a newline and a backslash-n": ("a\nb", "a\\nb"),
    "a tab and a backslash-t": ("x\ty", "x\\ty"),
    "an escape character and its escape": ("\x1b[31m", "\\x1b[31m"),
    "a byte that is not UTF-8 and its escape": (os.fsdecode(b"c\xff"), "c\\xff"),
}


@pytest.mark.parametrize("pair", ALIKE.values(), ids=ALIKE.keys())
def test_class_folders_stored_alike_are_refused_naming_both(pair, tmp_path):
    first, second = pair
    assert first != second and printable(first) == printable(second)
    for layout, splits in (("split folders", ("train", "test")), ("class folders only", None)):
        src = tmp_path / layout / "src"
        if splits:
            _classes(src, [first, second, "plain"], splits)
        else:
            for k, name in enumerate([first, second, "plain"]):
                _image(src / name / "0.png", k)
        dst = tmp_path / layout / "dst"
        with pytest.raises(ValueError) as e:
            _prepare(src, dst)
        message = str(e.value)
        assert "\n" not in message and repr(first) in message and repr(second) in message, message
        assert "rename one of them" in message and not dst.exists()
        if splits:  # the in-memory image-folder dataset, the same class of names
            with pytest.raises(ValueError) as e:
                load_dataset(str(src), cache_dir=tmp_path / "cache")
            assert "rename one of them" in str(e.value) and "\n" not in str(e.value)


def test_distinct_odd_names_are_kept_apart(tmp_path):
    names = ["a\nb", "a b", "é", os.fsdecode(b"c\xfe")]  # all different once stored
    src = _classes(tmp_path / "src", names)
    report = _prepare(src, tmp_path / "dst")
    assert report.classes == [printable(n) for n in sorted(names)]
    assert load_dataset(str(src), cache_dir=tmp_path / "cache").num_classes == 4


# Class: whatever a listing leaves out is counted and named; the counts it reports are true.
def _cluttered(root: Path, test: str = "test") -> Path:
    """Two real classes in train/ and `test`/, and everything else a real folder holds."""
    _classes(root, ["cat", "dog"], ("train", test), per_class=2)
    _image(root / "train" / ".ipynb_checkpoints" / "0.png")  # a hidden class folder holding images
    (root / "train" / ".DS_Store").write_bytes(b"\0")
    (root / "train" / "labels.txt").write_text("cat\ndog\n")  # a file beside the class folders
    (root / "train" / "gone").symlink_to(root / "nowhere")  # a broken link beside them
    (root / "train" / "cat" / "notes.txt").write_text("x")  # not an image
    (root / "train" / "cat" / "._0.png").write_bytes(b"\0" * 4)  # macOS AppleDouble: hidden
    (root / "train" / "cat" / "more").mkdir()  # a sub-folder: never entered
    _image(root / "train" / "cat" / "more" / "9.png")
    (root / "README.md").write_text("x")
    return root


def test_prepare_names_everything_it_leaves_out_and_counts_true(tmp_path, capsys):
    src = _cluttered(tmp_path / "src")
    (src / "extra").mkdir()  # a folder beside the split folders
    _image(src / "extra" / "cat" / "0.png")
    dst = tmp_path / "dst"
    for attempt in ("first", "up to date"):
        code, out, err = _run(["data", "prepare", str(src), str(dst), "--workers", "0", "--max-side-px", "16"],
                              capsys)
        assert code == 0, err
        train = next(line for line in out.splitlines() if line.startswith("train: ") and "preparing" not in line)
        for named in ("train/.DS_Store", "train/.ipynb_checkpoints/", "train/cat/._0.png", "train/labels.txt",
                      "1 broken link (train/gone)", "1 sub-folder, not read (train/cat/more/)",
                      "1 not .jpg/.jpeg/.png (train/cat/notes.txt)"):
            assert named in train, (attempt, named, train)
        assert "3 hidden" in train, train  # .DS_Store, .ipynb_checkpoints/, cat/._0.png
        beside = next(line for line in out.splitlines() if line.startswith(str(src)))
        assert "2 not train/, val/ or test/ (README.md, extra/)" in beside, beside
        if attempt == "first":
            assert f"{dst}: 2 classes" in out and "train: 4 written" in out
        else:
            assert "up to date: nothing to do" in out and "(4 images in 1 shard," in out


def test_the_image_folder_dataset_says_what_it_left_out(tmp_path):
    src = _cluttered(tmp_path / "pics")
    ds = load_dataset(str(src), cache_dir=tmp_path / "cache")
    text = ds.describe()
    assert ds.num_classes == 2 and len(ds.train_labels) == 4
    for named in ("3 hidden", "train/.DS_Store", "train/.ipynb_checkpoints/", "train/cat/._0.png",
                  "train/labels.txt", "1 broken link (train/gone)", "1 not .jpg/.jpeg/.png (train/cat/notes.txt)",
                  "1 sub-folder, not read (train/cat/more/)", "README.md"):
        assert named in text, (named, text)
    again = load_dataset(str(src), cache_dir=tmp_path / "cache")  # from the cache: said again
    assert again.describe() == text
    clean = _classes(tmp_path / "clean", ["a", "b"])
    assert "left out" not in load_dataset(str(clean), cache_dir=tmp_path / "cache").describe()


# Class: which folder is the test split.
def test_val_is_the_test_split_when_there_is_no_test(tmp_path, capsys):
    src = _classes(tmp_path / "imagenet-like", ["cat", "dog"], ("train", "val"))
    ds = load_dataset(str(src), cache_dir=tmp_path / "cache")
    assert len(ds.test_labels) == 2 and "2 test (from val/)" in ds.describe()
    _image(src / "test" / "unlabelled.png")  # ImageNet's test/: images without class folders
    ds = load_dataset(str(src), cache_dir=tmp_path / "cache")
    assert "(from val/)" in ds.describe() and "without class folders (test/)" in ds.describe()
    _classes(src, ["cat", "dog"], ("test",))  # now both are labelled: which one is the test set?
    with pytest.raises(ValueError, match="has both test/ and val/ class folders.*move one of them"):
        load_dataset(str(src), cache_dir=tmp_path / "cache")
    only_train = _classes(tmp_path / "only-train", ["cat", "dog"], ("train",))
    code, out, err = _run(["train", "cifar10-94", "--dataset", str(only_train), "--device", "cpu"], capsys)
    assert code == 2 and err.count("\n") == 1 and "no test/ or val/" in err, err


def test_prepare_leaves_an_unlabelled_test_folder_out_and_says_so(tmp_path):
    src = _classes(tmp_path / "src", ["cat", "dog"], ("train", "val"))
    _image(src / "test" / "a.png")
    report = _prepare(src, tmp_path / "dst")
    assert [s.split for s in report.splits] == ["train", "val"]
    assert any("without class folders (test/)" in line for line in report.lines())


# Class: a folder given to the recipes that read the other kind says which command reads it.
def test_a_prepared_folder_given_to_an_in_memory_recipe_points_to_imagenet(tmp_path, capsys):
    src = _classes(tmp_path / "src", ["cat", "dog"], ("train", "val"))
    dst = tmp_path / "shards"
    _prepare(src, dst)
    with pytest.raises(ValueError, match="prepared shards folder.*imagenet-resnet18 --dataset"):
        load_dataset(str(dst), cache_dir=tmp_path / "cache")
    for recipe in ("cifar10-94", "cifar10-resnet18"):
        code, out, err = _run(["train", recipe, "--dataset", str(dst), "--device", "cpu"], capsys)
        assert code == 2 and err.count("\n") == 1 and "use an imagenet-* recipe" in err, err


def test_an_image_folder_given_to_an_imagenet_recipe_points_to_prepare(tmp_path, capsys):
    for splits in (("train", "val"), ("train", "test"), ("val",)):
        src = _classes(tmp_path / "-".join(splits), ["cat", "dog"], splits)
        code, out, err = _run(["train", "imagenet-debug", "--dataset", str(src), "--device", "cpu"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"`speedrun data prepare {src} {src}-shards`" in err and f"--dataset {src}-shards" in err, err
