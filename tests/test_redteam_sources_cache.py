"""A data root whose cache cannot be written: the data loads, one warning says why, and the first-read line says
"not cached" instead of "cached afterwards". SPEEDRUN_DATA (or cache_dir) of only whitespace is refused; empty
means the default."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from speedrun.cli.program import main
from speedrun.data import cache
from speedrun.data.sources import load_dataset
from speedrun.errors import SpeedrunWarning
from speedrun.paths import data_root


def _folder(root: Path) -> Path:
    for split in ("train", "test"):
        for k, name in enumerate(("a", "b")):
            (root / split / name).mkdir(parents=True)
            Image.fromarray(np.full((4, 4, 3), 40 * k, np.uint8)).save(root / split / name / "0.png")
    return root


def _batches(d: Path) -> Path:
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 4), ("test_batch", 2)):
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": [i % 2 for i in range(n)]}
        (d / name).write_bytes(pickle.dumps(batch, protocol=4))
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}, protocol=4))
    return d


def _unwritable_roots(tmp_path: Path) -> dict[str, Path]:
    """Data roots under which no cache folder can be made, each for its own reason (root or not)."""
    (tmp_path / "file").write_text("x")
    roots = {"a file where the cache folder goes": tmp_path / "file-root",
             "a parent that is a file": tmp_path / "file" / "data",
             "a device for a parent": Path("/dev/null/data")}
    (tmp_path / "file-root").mkdir()
    (tmp_path / "file-root" / "cache").write_text("x")
    if sys.platform.startswith("linux") and os.path.isdir("/proc/self"):
        roots["the issue's /proc/nope"] = Path("/proc/nope")
    if os.geteuid() != 0:  # root writes anywhere a mode says it may not
        ro = tmp_path / "read-only"
        ro.mkdir(mode=0o555)
        roots["a read-only folder"] = ro
    return roots


@pytest.mark.parametrize("source", ["image folder", "CIFAR batches"])
def test_the_first_read_line_is_true_when_the_cache_cannot_be_written(source, tmp_path, monkeypatch):
    data = _folder(tmp_path / "pics") if source == "image folder" else _batches(tmp_path / "cifar-10-batches-py")
    for why, root in _unwritable_roots(tmp_path).items():
        monkeypatch.setenv("SPEEDRUN_DATA", str(root))
        lines: list[str] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = load_dataset(str(data), log=lines.append)
        assert ds.num_classes == 2, why
        said = [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]
        assert len(said) == 1 and "could not write cache" in said[0] and "continuing without it" in said[0], \
            (why, said)
        first = [line for line in lines if "first read" in line or "not cached" in line]
        assert len(first) == 1 and f"({cache.NOT_CACHED})" in first[0], (why, lines)
        assert not any("cached afterwards" in line or line.startswith("cached ") for line in lines), (why, lines)


def test_a_writable_cache_still_says_cached_afterwards_and_is(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "data"))
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedrunWarning)
        load_dataset(str(_folder(tmp_path / "pics")), log=lines.append)
    assert any(f"({cache.CACHED_AFTERWARDS})" in line for line in lines), lines
    assert len(list((tmp_path / "data" / "cache").glob("*.pt"))) == 1
    assert not [p for p in (tmp_path / "data" / "cache").iterdir() if p.name.startswith(".")]  # no probe left


def test_a_write_that_fails_after_the_probe_still_warns_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "data"))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.torch, "save", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_dataset(str(_folder(tmp_path / "pics")))
    said = [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]
    assert len(said) == 1 and "No space left on device" in said[0], said


@pytest.mark.parametrize("blank", [" ", "   ", "\t", " \n ", "\u3000"])
def test_speedrun_data_of_only_whitespace_is_refused(blank, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where Path(blank) would be a folder
    monkeypatch.setenv("SPEEDRUN_DATA", blank)
    with pytest.raises(ValueError) as err:
        data_root()
    message = str(err.value)
    assert f"SPEEDRUN_DATA is {blank!r}, only whitespace" in message and "\n" not in message
    pics = _folder(tmp_path / "pics")
    with pytest.raises(ValueError, match="SPEEDRUN_DATA is .*only whitespace"):
        load_dataset(str(pics))
    monkeypatch.delenv("SPEEDRUN_DATA")
    with pytest.raises(ValueError, match="cache_dir is .*only whitespace; name a folder, or leave it out"):
        load_dataset(str(pics), cache_dir=blank)
    assert not any(p.name.strip() == "" for p in tmp_path.iterdir())  # no folder named by the whitespace


def test_empty_speedrun_data_means_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPEEDRUN_DATA", "")
    assert data_root() == tmp_path / "home" / ".cache" / "speedrun"


def test_whitespace_speedrun_data_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEEDRUN_DATA", "  ")
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    code = main(["train", "--dataset", str(_folder(tmp_path / "pics")), "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "only whitespace" in err, err
