"""load_dataset(): CIFAR archives and batches, IDX files, image folders, synthetic specs, and the cache."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import struct
import tarfile
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from speedrun.data import cifar, folder, idx, sources
from speedrun.data.download import Remote
from speedrun.data.sources import load_dataset
from speedrun.errors import SpeedrunWarning

# ---- fake CIFAR files --------------------------------------------------------------------------------------------


class _Py2Pickler(pickle._Pickler):
    """Writes bytes the way Python 2's cPickle wrote str (BINSTRING), like the official CIFAR batches."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj):
        n = len(obj)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def _py2_pickle(path, obj):
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    # The official files name numpy 1's module path; GLOBAL opcodes are newline-terminated, so this is exact.
    path.write_bytes(buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))


def _batch(rng, n, num_classes, label_key):
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    return {b"batch_label": b"fake", label_key: [int(v) for v in rng.integers(0, num_classes, n)], b"data": data}


def _write_cifar10(d, rng, train_batches=(3, 2), test=4):
    d.mkdir(parents=True)
    batches = []
    for i, n in enumerate(train_batches, 1):
        batches.append(_batch(rng, n, 10, b"labels"))
        _py2_pickle(d / f"data_batch_{i}", batches[-1])
    batches.append(_batch(rng, test, 10, b"labels"))
    _py2_pickle(d / "test_batch", batches[-1])
    names = [f"class{i}".encode() for i in range(10)]
    _py2_pickle(d / "batches.meta", {b"label_names": names, b"num_cases_per_batch": 3})
    return batches


def _write_cifar100(d, rng):
    d.mkdir(parents=True)
    train, test = _batch(rng, 5, 100, b"fine_labels"), _batch(rng, 3, 100, b"fine_labels")
    for b in (train, test):
        b[b"coarse_labels"] = [0] * len(b[b"fine_labels"])
    _py2_pickle(d / "train", train)
    _py2_pickle(d / "test", test)
    meta = {b"fine_label_names": [f"fine{i}".encode() for i in range(100)], b"coarse_label_names": [b"c"] * 20}
    _py2_pickle(d / "meta", meta)
    return [train, test]


def _archive(tmp_path, kind, rng):
    """An archive laid out like the official one; returns (path, md5, batches)."""
    stage = tmp_path / f"stage-{kind}"
    inner = "cifar-10-batches-py" if kind == "cifar10" else "cifar-100-python"
    batches = (_write_cifar10 if kind == "cifar10" else _write_cifar100)(stage / inner, rng)
    server = tmp_path / "server"
    server.mkdir(exist_ok=True)
    path = server / cifar.ARCHIVE_NAMES[kind]
    with tarfile.open(path, "w:gz") as tf:
        tf.add(stage / inner, arcname=inner)
    return path, hashlib.md5(path.read_bytes()).hexdigest(), batches


def _expected(batches, label_key):
    """Images via explicit indexing of the documented row layout: pixel (c, r, col) = row[c*1024 + r*32 + col]."""
    rows = np.concatenate([b[b"data"] for b in batches])
    c, r, col = np.meshgrid(np.arange(3), np.arange(32), np.arange(32), indexing="ij")
    x = rows[:, c * 1024 + r * 32 + col]  # (N, 3, 32, 32)
    y = np.concatenate([b[label_key] for b in batches])
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))


def _no_call(*args, **kwargs):
    raise AssertionError("should not be called: the dataset must come from the cache / local files")


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache-root"


@pytest.mark.parametrize(
    "kind, label_key, classes0", [("cifar10", b"labels", "class0"), ("cifar100", b"fine_labels", "fine0")]
)
def test_named_cifar_downloads_then_reads_cache(tmp_path, cache, monkeypatch, kind, label_key, classes0):
    archive, md5, batches = _archive(tmp_path, kind, np.random.default_rng(0))
    monkeypatch.setitem(sources.SOURCES, kind, Remote("cifar", ((archive.as_uri(), md5),)))
    lines = []
    ds = load_dataset(kind, cache_dir=cache, log=lines.append)
    n_test = len(batches[-1][label_key])
    x, y = _expected(batches, label_key)
    assert ds.name == kind and ds.train_images.shape == (len(x) - n_test, 3, 32, 32)
    assert ds.train_images.is_contiguous() and ds.train_images.dtype == torch.uint8
    assert torch.equal(ds.train_images, x[:-n_test]) and torch.equal(ds.test_images, x[-n_test:])
    assert torch.equal(ds.train_labels, y[:-n_test]) and torch.equal(ds.test_labels, y[-n_test:])
    assert ds.classes[0] == classes0 and len(ds.classes) == (10 if kind == "cifar10" else 100)
    # Pixel round-trip for one value: red plane, row 1, column 2 of the first image is byte 34 of its row.
    assert ds.train_images[0, 0, 1, 2] == batches[0][b"data"][0, 34]
    assert (cache / "downloads" / archive.name).is_file()
    assert not list((cache / "downloads").glob(".extract-*"))  # the extracted copy is cleaned up
    assert any("downloading" in line for line in lines)

    # Second call: no download, no extraction, not even the archive is needed.
    (cache / "downloads" / archive.name).unlink()
    archive.unlink()
    monkeypatch.setattr(sources, "fetch", _no_call)
    monkeypatch.setattr(sources, "safe_extract", _no_call)
    lines.clear()
    again = load_dataset(kind, cache_dir=cache, log=lines.append)
    assert torch.equal(again.train_images, ds.train_images) and again.classes == ds.classes
    assert len(lines) == 1 and "from cache" in lines[0]


def test_offline_error_names_file_md5_and_directory(cache, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("Network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("cifar10", cache_dir=cache)
    expected = f"put cifar-10-python.tar.gz (md5 c58f30108f718f92721af3b95e74349a) in {cache / 'downloads'}"
    assert expected in str(err.value) and "--data-dir" in str(err.value)


def test_download_false_never_touches_the_network(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", _no_call)
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\.gz is not in .*downloads.*mnist"):
        load_dataset("mnist", cache_dir=cache, download=False)


def test_data_dir_with_archive(tmp_path, cache, monkeypatch):
    archive, _, batches = _archive(tmp_path, "cifar10", np.random.default_rng(1))
    monkeypatch.setattr(sources, "fetch", _no_call)
    ds = load_dataset("cifar10", data_dir=archive.parent, cache_dir=cache)
    x, y = _expected(batches, b"labels")
    assert torch.equal(torch.cat([ds.train_images, ds.test_images]), x)
    assert torch.equal(torch.cat([ds.train_labels, ds.test_labels]), y)
    # --data-dir may name the archive file itself.
    assert torch.equal(load_dataset("cifar10", data_dir=archive, cache_dir=cache).train_images, ds.train_images)
    # The archive given as a path works too, and is named after what it holds.
    assert torch.equal(load_dataset(str(archive), cache_dir=cache).test_images, ds.test_images)
    assert load_dataset(str(archive), cache_dir=cache).name == "cifar10"


def test_data_dir_with_extracted_batches(tmp_path, cache, monkeypatch):
    batches = _write_cifar100(tmp_path / "data" / "cifar-100-python", np.random.default_rng(2))
    monkeypatch.setattr(sources, "fetch", _no_call)
    ds = load_dataset("cifar100", data_dir=tmp_path / "data", cache_dir=cache)
    x, y = _expected(batches, b"fine_labels")
    assert torch.equal(ds.train_images, x[:5]) and torch.equal(ds.test_labels, y[5:])
    assert ds.classes[:2] == ["fine0", "fine1"]
    # Same batches through a path spec (the folder holding them directly).
    by_path = load_dataset(str(tmp_path / "data" / "cifar-100-python"), cache_dir=cache)
    assert by_path.name == "cifar100" and torch.equal(by_path.train_images, ds.train_images)


def test_data_dir_that_does_not_exist(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("cifar10", data_dir=tmp_path / "nope", cache_dir=cache)


def test_cifar_pickle_with_foreign_globals_is_refused(tmp_path, cache):
    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())  # harmless if it ever ran, but it must not

    d = tmp_path / "batches"
    _write_cifar10(d, np.random.default_rng(3))
    _py2_pickle(d / "test_batch", {b"data": Evil(), b"labels": []})
    with pytest.raises(ValueError, match=r"test_batch.*posix\.getcwd is not allowed"):
        load_dataset(str(d), cache_dir=cache)


# ---- IDX ---------------------------------------------------------------------------------------------------------


def _write_idx(path, array, gz):
    raw = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def _idx_dir(d, rng, n=(6, 3)):
    d.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, count in zip(("train", "test"), n):
        arrays[f"{split}_images"] = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    # Classes inferred from the data must all occur in training: train holds each of 0..k-1 (k <= 10) at least once.
    k = min(10, n[0])
    arrays["train_labels"] = rng.permutation(np.arange(n[0]) % k).astype(np.uint8)
    arrays["test_labels"] = rng.integers(0, k, n[1], dtype=np.uint8)
    for i, (role, base) in enumerate(idx.FILES.items()):
        gz = i % 2 == 0  # mix gzipped and raw files
        _write_idx(d / (base + (".gz" if gz else "")), arrays[role], gz)
    return arrays


def test_idx_folder_by_path_and_as_named_data_dir(tmp_path, cache, monkeypatch):
    arrays = _idx_dir(tmp_path / "digits", np.random.default_rng(4))
    ds = load_dataset(str(tmp_path / "digits"), cache_dir=cache)
    assert ds.name == "digits" and ds.train_images.shape == (6, 1, 28, 28) and ds.test_images.shape == (3, 1, 28, 28)
    assert torch.equal(ds.train_images[:, 0], torch.from_numpy(arrays["train_images"]))
    assert torch.equal(ds.test_labels, torch.from_numpy(arrays["test_labels"].astype(np.int64)))
    monkeypatch.setattr(sources, "fetch", _no_call)
    named = load_dataset("kmnist", data_dir=tmp_path / "digits", cache_dir=cache)
    assert named.name == "kmnist" and named.classes[:3] == ["o", "ki", "su"]
    assert torch.equal(named.train_images, ds.train_images)


def test_idx_named_download_through_file_urls(tmp_path, cache, monkeypatch):
    served = tmp_path / "server"
    arrays = _idx_dir(served, np.random.default_rng(5))
    for base in idx.FILES.values():  # the published files are all gzipped
        if (served / base).exists():
            (served / (base + ".gz")).write_bytes(gzip.compress((served / base).read_bytes()))
    files = tuple(((served / (b + ".gz")).as_uri(), hashlib.md5((served / (b + ".gz")).read_bytes()).hexdigest())
                  for b in idx.FILES.values())
    classes = sources.SOURCES["fashion-mnist"].classes
    monkeypatch.setitem(sources.SOURCES, "fashion-mnist", Remote("idx", files, classes))
    ds = load_dataset("fashion-mnist", cache_dir=cache)
    assert ds.classes[0] == "T-shirt/top" and ds.image_shape == (1, 28, 28)
    assert torch.equal(ds.train_labels, torch.from_numpy(arrays["train_labels"].astype(np.int64)))
    assert sorted(os.listdir(cache / "downloads" / "fashion-mnist")) == sorted(f + ".gz" for f in idx.FILES.values())


@pytest.mark.parametrize(
    "header, message",
    [
        (b"\x00\x01\x08\x01", "bad magic 00010801"),
        (b"\x00\x00\x0d\x01", "dtype code 0x0d"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x09", "truncated"),  # claims 9 bytes, has 3
    ],
    ids=["magic", "dtype", "truncated"],
)
def test_malformed_idx_is_rejected(tmp_path, header, message):
    bad = tmp_path / "train-labels-idx1-ubyte"
    bad.write_bytes(header + b"\x01\x02\x03")
    with pytest.raises(ValueError) as err:
        idx.read_idx(bad)
    assert str(bad) in str(err.value) and message in str(err.value) and "\n" not in str(err.value)


def test_idx_folder_missing_a_file(tmp_path, cache):
    _idx_dir(tmp_path / "d", np.random.default_rng(6))
    os.remove(tmp_path / "d" / "t10k-labels-idx1-ubyte")
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_dataset(str(tmp_path / "d"), cache_dir=cache)


# ---- image folders -----------------------------------------------------------------------------------------------


def _image_folder(root, rng, mode="RGB", size=(8, 6), per_class=(("cat", 2, 1), ("ant", 1, 2)), ext=".png"):
    """Writes ROOT/{train,test}/<class>/<i><ext>; returns {relative path: pixel array}."""
    pixels = {}
    for cls, n_train, n_test in per_class:
        for split, n in (("train", n_train), ("test", n_test)):
            d = root / split / cls
            if n:
                d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                shape = (size[1], size[0]) + (() if mode == "L" else (3,))
                a = rng.integers(0, 256, shape, dtype=np.uint8)
                Image.fromarray(a, mode).save(d / f"{i}{ext}")
                pixels[f"{split}/{cls}/{i}{ext}"] = a
    return pixels


def test_image_folder_rgb_png_is_exact(tmp_path, cache):
    pixels = _image_folder(tmp_path / "pics", np.random.default_rng(7))
    ds = load_dataset(str(tmp_path / "pics"), cache_dir=cache)
    assert ds.name == "pics" and ds.classes == ["ant", "cat"]  # sorted folder names
    assert ds.train_images.shape == (3, 3, 6, 8) and ds.test_images.shape == (3, 3, 6, 8)
    assert ds.train_labels.tolist() == [0, 1, 1] and ds.test_labels.tolist() == [0, 0, 1]
    # train order: ant/0, cat/0, cat/1; HWC file pixels -> CHW tensor
    assert torch.equal(ds.train_images[2], torch.from_numpy(pixels["train/cat/1.png"]).permute(2, 0, 1))


def test_image_folder_grayscale_gives_one_channel_and_mixed_gives_three(tmp_path, cache):
    rng = np.random.default_rng(8)
    gray = _image_folder(tmp_path / "gray", rng, mode="L")
    ds = load_dataset(str(tmp_path / "gray"), cache_dir=cache)
    assert ds.image_shape == (1, 6, 8)
    assert torch.equal(ds.test_images[1, 0], torch.from_numpy(gray["test/ant/1.png"]))
    # One RGB image among grey ones: everything becomes RGB, grey replicated into all three channels.
    _image_folder(tmp_path / "gray", rng, per_class=(("cat", 0, 1),), ext=".PNG")
    mixed = load_dataset(str(tmp_path / "gray"), cache_dir=cache)
    assert mixed.image_shape == (3, 6, 8) and mixed.test_images.shape[0] == 4
    expected = torch.from_numpy(gray["test/ant/1.png"])
    assert all(torch.equal(mixed.test_images[1, c], expected) for c in range(3))


def test_image_folder_jpeg_decodes_close_to_source(tmp_path, cache):
    smooth = np.tile(np.linspace(0, 255, 16, dtype=np.uint8), (16, 1))  # JPEG keeps smooth ramps well
    for split in ("train", "test"):
        for cls in ("a", "b"):  # a dataset needs two classes
            (tmp_path / "j" / split / cls).mkdir(parents=True)
            rgb = np.stack([smooth, smooth.T, 255 - smooth], -1)
            Image.fromarray(rgb).save(tmp_path / "j" / split / cls / "x.JPEG", quality=95)
    ds = load_dataset(str(tmp_path / "j"), cache_dir=cache)
    assert ds.image_shape == (3, 16, 16)
    error = (ds.train_images[0, 0].int() - torch.from_numpy(smooth).int()).abs().float().mean()
    assert error < 3


def test_image_folder_cache_invalidates_when_a_file_is_added(tmp_path, cache, monkeypatch):
    rng = np.random.default_rng(9)
    _image_folder(tmp_path / "pics", rng)
    lines = []
    first = load_dataset(str(tmp_path / "pics"), cache_dir=cache, log=lines.append)
    assert any("decoding 6 images" in line for line in lines)
    lines.clear()
    monkeypatch.setattr(folder, "decode", _no_call)
    assert torch.equal(load_dataset(str(tmp_path / "pics"), cache_dir=cache, log=lines.append).train_images,
                       first.train_images)
    assert "from cache" in lines[0]
    monkeypatch.undo()
    Image.fromarray(np.zeros((6, 8, 3), np.uint8)).save(tmp_path / "pics" / "train" / "ant" / "new.png")
    lines.clear()
    grown = load_dataset(str(tmp_path / "pics"), cache_dir=cache, log=lines.append)
    assert grown.train_images.shape[0] == first.train_images.shape[0] + 1
    assert any("decoding 7 images" in line for line in lines)
    assert len(list((cache / "cache").glob("pics-*.pt"))) == 1  # the stale cache was replaced


def test_image_folder_sizes_must_match(tmp_path, cache):
    _image_folder(tmp_path / "pics", np.random.default_rng(10))
    odd = tmp_path / "pics" / "test" / "cat" / "odd.png"
    Image.fromarray(np.zeros((5, 7, 3), np.uint8)).save(odd)
    with pytest.raises(ValueError) as err:
        load_dataset(str(tmp_path / "pics"), cache_dir=cache)
    assert str(odd) in str(err.value) and "7x5" in str(err.value) and "8x6" in str(err.value)


def test_image_folder_decode_pool_matches_serial_and_reports_errors(tmp_path, monkeypatch):
    _image_folder(tmp_path / "pics", np.random.default_rng(11), per_class=(("a", 5, 0), ("b", 4, 0)))
    paths = sorted(str(p) for p in (tmp_path / "pics" / "train").rglob("*.png"))
    serial = folder.decode(paths, workers=1)
    monkeypatch.setattr(folder, "PARALLEL_MIN", 2)
    monkeypatch.setattr(folder, "CHUNK", 2)
    assert np.array_equal(folder.decode(paths, workers=2), serial)
    Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(paths[-1])  # the error comes from a worker process
    with pytest.raises(ValueError, match="2x2"):
        folder.decode(paths, workers=2)


def test_image_folder_class_sets_must_match(tmp_path, cache):
    _image_folder(tmp_path / "pics", np.random.default_rng(12), per_class=(("cat", 1, 1), ("dog", 1, 0)))
    assert not (tmp_path / "pics" / "test" / "dog").exists()
    with pytest.raises(ValueError, match=r"only in train: \['dog'\]"):
        load_dataset(str(tmp_path / "pics"), cache_dir=cache)


# ---- cache robustness ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_cache_is_rebuilt(tmp_path, cache, damage):
    _image_folder(tmp_path / "pics", np.random.default_rng(13))
    first = load_dataset(str(tmp_path / "pics"), cache_dir=cache)
    (cache_file,) = (cache / "cache").glob("*.pt")
    data = cache_file.read_bytes()
    cache_file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    lines = []
    # A warning, not a log line: the user sees it even in quiet mode.
    with pytest.warns(SpeedrunWarning, match=r"cache .*\.pt is unreadable \(.*\); rebuilding it from the source"):
        rebuilt = load_dataset(str(tmp_path / "pics"), cache_dir=cache, log=lines.append)
    assert torch.equal(rebuilt.train_images, first.train_images) and rebuilt.classes == first.classes
    lines.clear()
    load_dataset(str(tmp_path / "pics"), cache_dir=cache, log=lines.append)
    assert "from cache" in lines[0]  # the rebuilt file is good again


def test_cache_dir_defaults_to_speedrun_data(tmp_path, monkeypatch):
    _image_folder(tmp_path / "pics", np.random.default_rng(14))
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "env-cache"))
    load_dataset(str(tmp_path / "pics"))
    assert len(list((tmp_path / "env-cache" / "cache").glob("pics-*.pt"))) == 1


# ---- synthetic and spec errors -------------------------------------------------------------------------------------


def test_synthetic_spec_parsing_and_determinism(tmp_path):
    ds = load_dataset("synthetic:train=20, test=7,shape=1x5x4,classes=3,seed=2", cache_dir=tmp_path)
    assert ds.name == "synthetic" and ds.train_images.shape == (20, 1, 5, 4) and ds.test_images.shape == (7, 1, 5, 4)
    assert ds.classes == ["0", "1", "2"] and int(ds.train_labels.max()) <= 2 and ds.train_images.dtype == torch.uint8
    same = load_dataset("synthetic:seed=2,shape=1x5x4,classes=3,test=7,train=20")
    assert torch.equal(same.train_images, ds.train_images) and torch.equal(same.test_labels, ds.test_labels)
    other = load_dataset("synthetic:train=20,test=7,shape=1x5x4,classes=3,seed=3")
    assert not torch.equal(other.train_images, ds.train_images)
    more_train = load_dataset("synthetic:train=30,test=7,shape=1x5x4,classes=3,seed=2")
    assert torch.equal(more_train.test_images, ds.test_images)  # the test set does not depend on train=
    assert not (tmp_path / "cache").exists()  # never cached
    default = load_dataset("synthetic")
    assert default.train_images.shape == (50000, 3, 32, 32) and default.test_images.shape == (10000, 3, 32, 32)
    assert default.num_classes == 10


@pytest.mark.parametrize(
    "spec, message",
    [
        ("synthetic:size=3", "unknown key 'size'; valid keys are train, test, shape, classes, seed"),
        ("synthetic:shape=32x32", "shape must look like 3x32x32"),
        ("synthetic:train=0", "train must be >= 1"),
        ("synthetic:classes=ten", "classes must be an integer"),
        ("synthetic:seed", "needs a value"),
    ],
)
def test_synthetic_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(spec)


def test_unknown_spec_lists_names_and_asks_for_a_real_path(tmp_path):
    with pytest.raises(ValueError) as err:
        load_dataset("cifar11", cache_dir=tmp_path)
    message = str(err.value)
    assert all(n in message for n in ("cifar10", "cifar100", "mnist", "fashion-mnist", "kmnist", "synthetic"))
    assert "path that exists" in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no dataset"):
        load_dataset(str(tmp_path / "empty"), cache_dir=tmp_path)


def test_a_sample_of_an_image_folder_decodes_its_images_alone_and_caches_nothing(tmp_path, cache, monkeypatch):
    """A smoke test's sample (load_dataset(sample=...)): only the sampled files are decoded, no cache is read or
    written (a later whole load decodes every image and caches them), and the sample holds exactly the images, in
    the order, that Dataset.sample takes from the whole dataset."""
    _image_folder(tmp_path / "pics", np.random.default_rng(11), per_class=(("cat", 9, 5), ("ant", 8, 6)))
    decoded, decode = [], folder.decode

    def counted(paths, *args, **kwargs):
        decoded.append(len(paths))
        return decode(paths, *args, **kwargs)
    monkeypatch.setattr(folder, "decode", counted)
    lines = []
    part = load_dataset(str(tmp_path / "pics"), cache_dir=cache, sample=(4, 3), log=lines.append)
    assert decoded == [7] and lines == [f"decoding 7 of 28 images from {tmp_path / 'pics'} (a sample; not cached)"]
    assert not (cache / "cache").exists() or not any((cache / "cache").iterdir())
    assert part.sampled_from == (17, 11) and "a fixed sample of its 17 train / 11 test images" in part.describe()
    whole = load_dataset(str(tmp_path / "pics"), cache_dir=cache)
    assert decoded == [7, 28] and len(whole.train_labels) == 17 and whole.sampled_from is None
    assert len(list((cache / "cache").iterdir())) == 1  # the whole folder, cached as usual
    again = whole.sample(4, 3)
    for key in ("train_images", "train_labels", "test_images", "test_labels"):
        assert torch.equal(getattr(part, key), getattr(again, key)), key
    assert part.describe() == again.describe()
    cached = load_dataset(str(tmp_path / "pics"), cache_dir=cache, sample=(4, 3))  # the cache is there: not read
    assert decoded == [7, 28, 7] and torch.equal(cached.train_images, part.train_images)
    assert whole.sample(100, 100) is whole  # nothing to leave out


def test_a_named_dataset_is_sampled_after_it_is_read(cache):
    whole = load_dataset("synthetic:train=64,test=32", cache_dir=cache)
    part = load_dataset("synthetic:train=64,test=32", cache_dir=cache, sample=(16, 8))
    assert (len(part.train_labels), len(part.test_labels), part.sampled_from) == (16, 8, (64, 32))
    assert torch.equal(part.test_images, whole.sample(16, 8).test_images)
