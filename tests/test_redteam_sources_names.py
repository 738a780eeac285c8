"""Class names from every source meet the saved-model card's rule (run/model_files.py parse_card: printable, 1 to
1,024 characters) and are distinct, also once escaped and NFC normalised: checked when the data loads, before any
training, so a run that trains can be saved. And the empty-class message names the folders that hold the class."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from speedrun.cli.program import main
from speedrun.data import cifar, folder, idx, prepare, synthetic
from speedrun.data.dataset import MAX_CLASS_NAME_CHARS, Dataset, check_dataset, stored_class_names
from speedrun.data.sources import load_dataset
from speedrun.errors import printable
from speedrun.recipes import RECIPES
from speedrun.run import model_files

# ---- helpers -----------------------------------------------------------------------------------------------------


def _card(ds: Dataset) -> dict:
    """The smallest card parse_card reads, for `ds`'s classes and shape."""
    c, h, w = ds.image_shape
    return {"format": model_files.MODEL_FORMAT, "version": model_files.MODEL_VERSION, "recipe": "cifar10-94",
            "family": RECIPES["cifar10-94"].family, "config": {}, "classes": list(ds.classes),
            "image_shape": [c, h, w], "mean": [0.0] * c, "std": [1.0] * c, "tta_level": 0, "dataset": ds.name,
            "accuracy": None, "seed": None, "weights_sha256": "0" * 64}


def _saveable(ds: Dataset) -> None:
    """`ds`'s classes are what a saved model's card keeps: parse_card accepts them, and they are distinct."""
    assert model_files.parse_card(_card(ds)).classes == ds.classes
    keys = [unicodedata.normalize("NFC", c) for c in ds.classes]
    assert len(set(keys)) == len(keys)


def _pickle(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=4))  # bytes as BINBYTES: protocol 2 names builtins for b""


def _cifar(d: Path, kind: str, names: list) -> Path:
    """Tiny CIFAR batches of `kind` in `d` whose meta file holds `names` (bytes or str, as given)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    label = b"labels" if kind == "cifar10" else b"fine_labels"

    def batch(n):
        return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                label: [int(v) for v in np.arange(n) % 2]}

    if kind == "cifar10":
        _pickle(d / "data_batch_1", batch(4))
        _pickle(d / "test_batch", batch(2))
        _pickle(d / "batches.meta", {b"label_names": names})
    else:
        _pickle(d / "train", batch(4))
        _pickle(d / "test", batch(2))
        _pickle(d / "meta", {b"fine_label_names": names, b"coarse_label_names": [b"c"]})
    return d


def _archive(d: Path, kind: str) -> Path:
    """The batches in `d` as an archive laid out like the official one."""
    path = d.parent / cifar.ARCHIVE_NAMES[kind]
    with tarfile.open(path, "w:gz") as tf:
        tf.add(d, arcname=cifar.SUBDIRS[kind])
    return path


def _image(path: Path, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)


def _tree(root: Path, names, splits=("train", "test")) -> Path:
    for split in splits:
        for k, name in enumerate(names):
            _image(root / split / name / "0.png", seed=k)
    return root


def _one_line(message: str, *parts: str) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    for part in parts:
        assert part in message, (part, message)


# ---- 1. every source's names meet the card's rule ----------------------------------------------------------------

# Names a CIFAR meta file may hold that are usable once escaped, as an image folder's are.
ESCAPED = {
    "an escape sequence": "a\x1b[31mred",
    "a newline": "b\nnl",
    "a tab": "t\tab",
    "a zero-width joiner (format character)": "z\u200dj",
    "bytes that are not UTF-8": b"c\xff\xfe",
}


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
@pytest.mark.parametrize("how", ["batches", "archive"])
def test_cifar_meta_names_are_escaped_as_folder_names_are(kind, how, tmp_path):
    hostile = [n.encode() if isinstance(n, str) else n for n in ESCAPED.values()]
    d = _cifar(tmp_path / "src" / cifar.SUBDIRS[kind], kind, hostile + [f"plain{i}".encode() for i in range(95)])
    spec = d if how == "batches" else _archive(d, kind)
    ds = load_dataset(str(spec), cache_dir=tmp_path / "cache")
    expected = [printable(os.fsdecode(n)) for n in hostile]
    assert ds.classes[:len(hostile)] == expected and ds.classes[len(hostile)] == "plain0"
    assert ds.classes[0] == "a\\x1b[31mred" and ds.classes[4] == "c\\xff\\xfe"  # as a folder named so is stored
    _saveable(ds)
    again = load_dataset(str(spec), cache_dir=tmp_path / "cache")  # from the cache: the same names
    assert again.classes == ds.classes


# Meta files whose names no card could keep, or that name one class twice: refused when the data loads.
REFUSED_META = {
    "an empty name": ([b"", b"b"], "class 0's name is empty"),
    "a name over 1,024 characters": ([b"a", b"x" * 1025], "class 1's name is 1,025 characters long"),
    "a name over 1,024 characters once escaped": ([b"a", b"\x01" * 300], "is 1,200 characters long"),
    "one name twice": ([b"a", b"a"], "'a' twice (classes 0 and 1)"),
    "two names stored alike once escaped": ([b"a\nb", b"a\\nb"], "stored alike as 'a\\\\nb'"),
    "one name composed and decomposed (NFC, NFD)": (
        ["caf\u00e9".encode(), "cafe\u0301".encode()], "'caf\\xe9' and 'cafe\\u0301': equal after NFC"),
    "a str name that is not a name": ([b"a", 12], "class 1 in 'label_names' is a int, not a name"),
}


@pytest.mark.parametrize("names, said", REFUSED_META.values(), ids=REFUSED_META.keys())
def test_cifar_meta_names_a_card_could_not_keep_are_refused_on_load(names, said, tmp_path):
    d = _cifar(tmp_path / "src" / "cifar-10-batches-py", "cifar10", names)
    with pytest.raises(ValueError) as err:
        load_dataset(str(d), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), str(d / "batches.meta"), said)
    assert "replace it with a good copy" in str(err.value)
    assert not list((tmp_path / "cache").rglob("*.pt"))  # nothing cached


def test_a_cifar_meta_refusal_stops_train_before_any_step(tmp_path, monkeypatch, capsys):
    d = _cifar(tmp_path / "src" / "cifar-10-batches-py", "cifar10", [b"a\x1b[31mred", b"a\\x1b[31mred"])
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    code = main(["train", "--dataset", str(d), "--device", "cpu", "--epochs", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "\x1b" not in err, err
    assert "rename one of them" not in err and "stored alike" in err


# Image folders whose names are one name in two Unicode spellings.
SPELLINGS = {
    "é": ("caf\u00e9", "cafe\u0301"),
    "Å": ("\u00c5", "A\u030a"),
    "ñ": ("ma\u00f1ana", "man\u0303ana"),
    "a Hangul syllable and its jamo": ("\ud55c", "\u1112\u1161\u11ab"),
}


@pytest.mark.parametrize("pair", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_one_name_in_two_unicode_spellings_is_refused_naming_both(pair, tmp_path):
    composed, decomposed = pair
    assert composed != decomposed and unicodedata.normalize("NFC", decomposed) == composed
    src = _tree(tmp_path / "src", [composed, decomposed, "plain"])
    with pytest.raises(ValueError) as err:
        load_dataset(str(src), cache_dir=tmp_path / "cache")
    message = str(err.value)
    first, second = sorted([composed, decomposed])
    _one_line(message, repr(first), repr(second), ascii(first), ascii(second), "NFC", "rename one of them",
              str(src / "train"))
    # data prepare lists its classes through the same function (folder.distinct_names): the same refusal.
    with pytest.raises(ValueError) as err:
        prepare.read_source(src)
    _one_line(str(err.value), ascii(first), ascii(second), "rename one of them")


def test_train_and_test_spelling_one_name_differently_say_so(tmp_path):
    src = tmp_path / "src"
    _tree(src, ["caf\u00e9", "x"], splits=("train",))
    _tree(src, ["cafe\u0301", "x"], splits=("test",))
    with pytest.raises(ValueError) as err:
        load_dataset(str(src), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), "'caf\\xe9'", "'cafe\\u0301'", "two Unicode spellings", "train/ and test/")


def test_distinct_unicode_names_are_kept_apart_and_saveable(tmp_path):
    names = ["caf\u00e9", "cafe", "\u00c5", "A", "\ud55c", "e\u0301\u0301"]  # distinct even once NFC normalised
    ds = load_dataset(str(_tree(tmp_path / "src", names)), cache_dir=tmp_path / "cache")
    assert ds.classes == sorted(names) and ds.num_classes == 6
    _saveable(ds)


def test_every_named_and_synthetic_sources_names_are_saveable():
    for name, remote in idx.REMOTES.items():
        assert remote.classes and stored_class_names(remote.classes, name) == list(remote.classes), name
    for spec in ("synthetic:train=4,test=2,classes=2,shape=1x8x8", "synthetic:train=4,test=2,classes=300"):
        _saveable(load_dataset(spec))
    _saveable(synthetic.make("synthetic:train=2,test=2,classes=3,shape=3x8x8"))


def _ds(classes) -> Dataset:
    x = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    y = torch.tensor([0, 1, 0, 1])
    return Dataset("d", x, y, x[:2].clone(), y[:2].clone(), list(classes))


# A Dataset built in Python (or a cache another version wrote): check_dataset holds the card's rule too.
NOT_A_CARD_NAME = {
    "a control character": (["a\nb", "c"], "class 0 is 'a\\nb'"),
    "an empty name": (["a", ""], "class 1 is ''"),
    "a name too long": (["a", "x" * (MAX_CLASS_NAME_CHARS + 1)], "class 1 is 'xxx"),
    "not a string": (["a", 7], "class 1 is 7"),
    "a lone surrogate": (["a", "\udcff"], "class 1 is '\\udcff'"),
}
ONE_NAME = {
    "one name twice": (["a", "a"], "classes 0 and 1 are both 'a'"),
    "composed and decomposed": (["caf\u00e9", "cafe\u0301"], "('caf\\xe9' and 'cafe\\u0301': equal after NFC"),
}


@pytest.mark.parametrize("classes, said", [*NOT_A_CARD_NAME.values(), *ONE_NAME.values()],
                         ids=[*NOT_A_CARD_NAME, *ONE_NAME])
def test_check_dataset_refuses_names_a_card_would_refuse(classes, said):
    with pytest.raises(ValueError) as err:
        check_dataset(_ds(classes), "src")
    _one_line(str(err.value), "src: ", said)
    if classes in [c for c, _ in NOT_A_CARD_NAME.values()]:  # the card's own check refuses these too
        with pytest.raises(model_files.Unusable):
            model_files.parse_card(_card(_ds(classes)))


def test_the_limit_is_the_cards():
    assert MAX_CLASS_NAME_CHARS == model_files.MAX_CLASS_NAME_CHARS
    check_dataset(_ds(["a", "x" * MAX_CLASS_NAME_CHARS]), "src")  # the longest a card keeps is accepted


def test_folder_distinct_names_is_the_shared_rule(tmp_path):
    assert folder.distinct_names(["a\x1bb", "c"], tmp_path) == ["a\\x1bb", "c"]
    with pytest.raises(ValueError, match="rename one of them"):
        folder.distinct_names(["\u00c5", "A\u030a"], tmp_path)


# ---- 3. the empty-class message names the folders that hold the class --------------------------------------------


@pytest.mark.parametrize("test_folder", ["test", "val"])
@pytest.mark.parametrize("empty", [["evil"], ["a", "evil"]], ids=["one", "two"])
def test_an_empty_class_names_train_and_the_test_folder(test_folder, empty, tmp_path):
    src = _tree(tmp_path / "src", ["b", "c"], splits=("train", test_folder))
    for name in empty:
        (src / "train" / name).mkdir()
        (src / test_folder / name).mkdir()
    with pytest.raises(ValueError) as err:
        load_dataset(str(src), cache_dir=tmp_path / "cache")
    folders = "folder" if len(empty) == 1 else "folders"
    _one_line(str(err.value), ", ".join(empty), f"remove the {folders} from train/ and {test_folder}/")
    assert "train/ and train/" not in str(err.value)


def test_an_empty_class_with_images_in_test_only_names_both_folders(tmp_path):
    src = _tree(tmp_path / "src", ["b", "c"])
    (src / "train" / "evil").mkdir()
    _image(src / "test" / "evil" / "0.png")
    with pytest.raises(ValueError) as err:
        load_dataset(str(src), cache_dir=tmp_path / "cache")
    _one_line(str(err.value), "evil", "train/ and test/")


def test_pickle_names_of_python3_str_are_read_too(tmp_path):
    d = _cifar(tmp_path / "src" / "cifar-10-batches-py", "cifar10", ["x\u00e9", "y\x07"])
    buf = io.BytesIO()
    pickle.dump({b"label_names": ["x\u00e9", "y\x07"]}, buf, protocol=4)
    (d / "batches.meta").write_bytes(buf.getvalue())
    ds = load_dataset(str(d), cache_dir=tmp_path / "cache")
    assert ds.classes == ["x\u00e9", "y\\x07"]
    _saveable(ds)
