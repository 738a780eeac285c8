"""A named dataset with data_dir (--data-dir): a folder without its files is refused there, saying what was looked
for and what the folder holds, with no download and no advice to pass --data-dir; a copy whose files are not the
published ones (MD5, or the set of batch files) loads with a warning and says so (Dataset.unofficial), also from the
cache, so it is not taken for the named dataset."""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
import struct
import tarfile
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest

from speedrun.cli.program import main
from speedrun.data import cifar, idx, sources
from speedrun.data.download import Remote
from speedrun.data.sources import load_dataset
from speedrun.errors import SpeedrunWarning


def _no_network(*args, **kwargs):
    raise AssertionError("the network must not be touched when data_dir is given")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr(sources, "fetch", _no_network)
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)


def _pickle(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=4))


def _batches(d: Path, kind: str, train_batches: int = 2) -> Path:
    """Tiny CIFAR batches of `kind` in `d` (cifar10: data_batch_1..N, test_batch, batches.meta)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(len(str(d)))
    label, k = (b"labels", 10) if kind == "cifar10" else (b"fine_labels", 100)

    def batch(n):
        return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), label: [i % k for i in range(n)]}

    if kind == "cifar10":
        for i in range(1, train_batches + 1):
            _pickle(d / f"data_batch_{i}", batch(10))
        _pickle(d / "test_batch", batch(4))
        _pickle(d / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    else:
        _pickle(d / "train", batch(100))
        _pickle(d / "test", batch(4))
        _pickle(d / "meta", {b"fine_label_names": [f"f{i}".encode() for i in range(100)]})
    return d


def _archive(folder: Path, kind: str) -> Path:
    stage = _batches(folder / f"stage-{kind}" / cifar.SUBDIRS[kind], kind)
    path = folder / cifar.ARCHIVE_NAMES[kind]
    with tarfile.open(path, "w:gz") as tf:
        tf.add(stage, arcname=cifar.SUBDIRS[kind])
    return path


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _idx(d: Path, gz: bool = True) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    arrays = {"train_images": np.zeros((10, 28, 28), np.uint8), "train_labels": np.arange(10, dtype=np.uint8),
              "test_images": np.ones((4, 28, 28), np.uint8), "test_labels": np.arange(4, dtype=np.uint8)}
    for role, base in idx.FILES.items():
        a = arrays[role]
        raw = bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()
        (d / (base + ".gz" if gz else base)).write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    return d


def _refusal(name: str, data_dir: Path, cache: Path) -> str:
    with pytest.raises(FileNotFoundError) as err:
        load_dataset(name, data_dir=data_dir, cache_dir=cache)
    message = str(err.value)
    assert "\n" not in message, message
    # The user passed data_dir: the message says what it lacks, and never advises passing it.
    assert "pass data_dir" not in message and "pass --data-dir" not in message, message
    assert f"data_dir (--data-dir) {data_dir} holds no {name} files" in message, message
    assert "leave out data_dir (--data-dir)" in message, message
    assert not list(cache.rglob("*.pt")) and not (cache / "downloads").exists()
    return message


# ---- 4. data_dir without the dataset's files ----------------------------------------------------------------------


def test_the_issues_case_cifar100_asked_and_only_cifar10s_archive_there(tmp_path):
    dd = tmp_path / "dd"
    dd.mkdir()
    _archive(dd, "cifar10")
    message = _refusal("cifar100", dd, tmp_path / "cache")
    assert "cifar100 needs cifar-100-python.tar.gz" in message
    assert "it holds cifar-10-python.tar.gz, which is cifar10's" in message


def test_what_the_folder_holds_is_said_for_each_kind(tmp_path):
    cache = tmp_path / "cache"
    other = _batches(tmp_path / "b" / "cifar-100-python", "cifar100").parent
    assert "cifar100's extracted batches" in _refusal("cifar10", other, cache)
    assert "cifar10 needs cifar-10-python.tar.gz, or its extracted batches (data_batch_1" in \
        _refusal("cifar10", other, cache)
    digits = _idx(tmp_path / "digits")
    assert "the four IDX files of an MNIST-style dataset" in _refusal("cifar100", digits, cache)
    (tmp_path / "c").mkdir()
    _archive(tmp_path / "c", "cifar100")
    message = _refusal("fashion-mnist", tmp_path / "c", cache)
    assert "needs its four IDX files (train-images-idx3-ubyte" in message
    assert "cifar-100-python.tar.gz, which is cifar100's" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "it is empty" in _refusal("mnist", empty, cache)
    clutter = tmp_path / "clutter"
    clutter.mkdir()
    for i in range(8):
        (clutter / f"f{i}.txt").write_text("x")
    (clutter / "a-folder").mkdir()
    assert "it holds a-folder/, f0.txt, f1.txt, f2.txt, f3.txt and 4 more" in _refusal("cifar10", clutter, cache)


def test_through_the_cli_one_line_and_no_download(tmp_path, monkeypatch, capsys):
    dd = tmp_path / "dd"
    dd.mkdir()
    _archive(dd, "cifar10")
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    code = main(["train", "--dataset", "cifar100", "--data-dir", str(dd), "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "cifar-10-python.tar.gz, which is cifar10's" in err and "cannot download" not in err
    assert "pass data_dir" not in err and "or pass --data-dir" not in err


# ---- 5. a data_dir copy that is not the published files -----------------------------------------------------------


def _load_warned(name, data_dir, cache):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_dataset(name, data_dir=data_dir, cache_dir=cache)
    said = [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]
    return ds, said


def _assert_unofficial(name, data_dir, cache, differs: str):
    for attempt in ("first read", "from the cache"):
        ds, said = _load_warned(name, data_dir, cache)
        assert differs in ds.unofficial, (attempt, ds.unofficial)
        assert f"not the published files: {ds.unofficial}" in ds.describe()
        assert len(said) == 1 and f"{data_dir} is not the published {name} ({ds.unofficial})" in said[0], said
        assert f"give it as a path dataset (--dataset {data_dir})" in said[0] and "\n" not in said[0]
    assert len(list(cache.rglob("*.pt"))) == 1  # the second load was the cache's


def _assert_published(name, data_dir, cache):
    for _ in range(2):
        ds, said = _load_warned(name, data_dir, cache)
        assert ds.unofficial == "" and "not the published" not in ds.describe() and said == []


def test_a_hand_made_archive_is_not_the_named_dataset(tmp_path):
    (tmp_path / "dd").mkdir()
    archive = _archive(tmp_path / "dd", "cifar10")
    differs = f"cifar-10-python.tar.gz has md5 {_md5(archive)}, not the published c58f30108f718f92721af3b95e74349a"
    _assert_unofficial("cifar10", archive.parent, tmp_path / "cache", differs)
    _assert_unofficial("cifar10", archive, tmp_path / "cache2", differs)  # the archive itself as data_dir


def test_the_published_archive_and_a_modified_copy(tmp_path, monkeypatch):
    (tmp_path / "dd").mkdir()
    archive = _archive(tmp_path / "dd", "cifar100")
    url = sources.SOURCES["cifar100"].files[0][0]
    monkeypatch.setitem(sources.SOURCES, "cifar100", Remote("cifar", ((url, _md5(archive)),)))
    _assert_published("cifar100", archive.parent, tmp_path / "cache")
    published = _md5(archive)
    with open(archive, "ab") as f:  # one byte more: a tar.gz still reads, but it is not the published file
        f.write(b"\0")
    _assert_unofficial("cifar100", archive.parent, tmp_path / "cache", f"not the published {published}")


def _publish_batches(monkeypatch, kind: str, d: Path) -> None:
    """Make the batches in `d` the published ones, as far as the check knows."""
    published = {p.name: _md5(p) for p in cifar.source_files(kind, d)}
    monkeypatch.setitem(cifar.PUBLISHED_BATCHES, kind, published)


def test_extracted_batches_are_checked_file_by_file(tmp_path, monkeypatch):
    d = _batches(tmp_path / "dd" / "cifar-10-batches-py", "cifar10", train_batches=2)
    _assert_unofficial("cifar10", d.parent, tmp_path / "c0", "lacks data_batch_3, data_batch_4, data_batch_5")
    _publish_batches(monkeypatch, "cifar10", d)
    _assert_published("cifar10", d.parent, tmp_path / "c1")
    # One batch fewer than published: a subset is not the dataset either.
    (d / "data_batch_2").rename(tmp_path / "kept")
    _assert_unofficial("cifar10", d.parent, tmp_path / "c2", "lacks data_batch_2 of the published batches")
    (tmp_path / "kept").rename(d / "data_batch_2")
    # One batch more.
    _pickle(d / "data_batch_3", pickle.loads((d / "data_batch_1").read_bytes()))
    _assert_unofficial("cifar10", d.parent, tmp_path / "c3", "holds data_batch_3, which the published batches")
    (d / "data_batch_3").unlink()
    # A changed meta file (other class names).
    _pickle(d / "batches.meta", {b"label_names": [f"k{i}".encode() for i in range(10)]})
    _assert_unofficial("cifar10", d.parent, tmp_path / "c4", "batches.meta has md5")


def test_cifar100_batches_too(tmp_path, monkeypatch):
    d = _batches(tmp_path / "dd" / "cifar-100-python", "cifar100")
    _publish_batches(monkeypatch, "cifar100", d)
    _assert_published("cifar100", d.parent, tmp_path / "c1")
    _pickle(d / "test", pickle.loads((d / "test").read_bytes()) | {b"extra": b"x"})
    _assert_unofficial("cifar100", d.parent, tmp_path / "c2", "test has md5")


def test_idx_files_are_checked_against_the_published_gz(tmp_path, monkeypatch):
    dd = _idx(tmp_path / "dd")
    _assert_unofficial("mnist", dd, tmp_path / "c0", "train-images-idx3-ubyte.gz has md5")
    remote = sources.SOURCES["mnist"]
    files = tuple((url, _md5(dd / (base + ".gz"))) for (url, _), base in zip(remote.files, idx.FILES.values()))
    monkeypatch.setitem(sources.SOURCES, "mnist", Remote("idx", files, remote.classes))
    _assert_published("mnist", dd, tmp_path / "c1")
    # Uncompressed files beside them (torchvision's raw/): the .gz ones are read, and checked.
    _idx(dd, gz=False)
    _assert_published("mnist", dd, tmp_path / "c2")
    # Uncompressed files alone have no published md5: the copy cannot be told to be the dataset.
    for base in idx.FILES.values():
        (dd / (base + ".gz")).unlink()
    _assert_unofficial("mnist", dd, tmp_path / "c3", "is not gzipped")
    # mnist's file names with fashion-mnist's content: the names are the same, the md5s are not.
    _assert_unofficial("fashion-mnist", _idx(tmp_path / "f"), tmp_path / "c4", "has md5")


def test_the_check_is_not_repeated_on_a_cache_hit(tmp_path, monkeypatch):
    (tmp_path / "dd").mkdir()
    archive = _archive(tmp_path / "dd", "cifar10")
    first, _ = _load_warned("cifar10", archive.parent, tmp_path / "cache")

    def no_hash(path):
        raise AssertionError("hashed again")

    monkeypatch.setattr(sources, "md5_file", no_hash)
    monkeypatch.setattr(cifar, "md5_file", no_hash)
    again, said = _load_warned("cifar10", archive.parent, tmp_path / "cache")
    assert again.unofficial == first.unofficial != "" and len(said) == 1


def test_a_damaged_copy_is_refused_for_its_damage_not_warned_about(tmp_path, capsys):
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "cifar-10-python.tar.gz").write_bytes(b"not a tar archive at all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning first would be a second line before the refusal
        with pytest.raises(ValueError, match="not a readable tar archive"):
            load_dataset("cifar10", data_dir=dd, cache_dir=tmp_path / "cache")


def test_a_run_on_a_hand_made_copy_is_recorded_under_its_path_not_the_named_dataset(tmp_path, monkeypatch):
    (tmp_path / "dd").mkdir()
    archive = _archive(tmp_path / "dd", "cifar10")
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedrunWarning)
        assert main(["train", "--dataset", "cifar10", "--data-dir", str(archive), "--smoke", "--device", "cpu",
                     "--set", "widths=8,8,8", "--set", "whiten_images=16", "--db", str(tmp_path / "r.db"),
                     "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["dataset"] == str(archive)
