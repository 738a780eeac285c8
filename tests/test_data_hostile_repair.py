"""Advice that must not loop: a prepared folder damaged after it was written (a shard changed in place with its size
kept, cut, removed; the index changed or lost) is found by the next `speedrun data prepare`, which rewrites exactly
what is damaged; and every message a reader gives about a damaged folder names a command that repairs it."""

import json
import os
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


def _tree(root: Path, per_class: int = 3) -> Path:
    """SRC/{train,val}/{cat,dog}/ with small distinct JPEGs (train) and PNGs (val), and one corrupt file."""
    rng = np.random.default_rng(0)
    for split, n, ext in (("train", per_class, ".jpg"), ("val", 1, ".png")):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(root / split / c / f"{i}{ext}")
    (root / "train" / "dog" / "1b.jpg").write_bytes(b"not a JPEG at all")  # skipped: shard ranges carry it
    return root


def _prepare(src, dst, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prepare_tree(src, dst, **{"max_side_px": 32, "workers": 0, "shard_bytes": 1, **kwargs})
    return report, [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]


def _files(dst: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(dst.iterdir()) if p.is_file()}


def _flip(path: Path, at: int) -> None:
    """One byte changed in place: same size, and (os.utime) the same mtime."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x5A
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _jpeg_offset(dst: Path, split: str, number: int) -> int:
    index = np.load(dst / f"{split}-index.npy")
    row = index[index[:, 0] == number][0]
    return int(row[1] + row[2] // 2)  # inside the JPEG's entropy-coded data


DAMAGE = {
    "a shard changed in place": (lambda d: _flip(d / "train-00002.tar", _jpeg_offset(d, "train", 2)),
                                 ["train-00002.tar (checksum mismatch)"]),
    "a shard's tar header changed": (lambda d: _flip(d / "train-00000.tar", 10), ["train-00000.tar (checksum"]),
    "a shard cut": (lambda d: (d / "train-00003.tar").write_bytes((d / "train-00003.tar").read_bytes()[:700]),
                    ["train-00003.tar (700 bytes"]),
    "a shard removed": (lambda d: (d / "train-00004.tar").unlink(), ["train-00004.tar (missing)"]),
    "the last shard removed": (lambda d: (d / "val-00001.tar").unlink(), ["val-00001.tar (missing)"]),
    "the index changed in place": (lambda d: _flip(d / "train-index.npy", -20), ["train-index.npy (checksum"]),
    "the index removed": (lambda d: (d / "val-index.npy").unlink(), ["val-index.npy (missing)"]),
    "two shards and the index": (lambda d: ((d / "train-00001.tar").unlink(), _flip(d / "train-00005.tar", 900),
                                            _flip(d / "train-index.npy", -9)),
                                 ["train-00001.tar (missing)", "train-00005.tar (checksum",
                                  "train-index.npy (checksum"]),
}


@pytest.mark.parametrize("damage,named", DAMAGE.values(), ids=DAMAGE.keys())
def test_damage_is_found_and_exactly_it_is_written_again(damage, named, tmp_path):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    before = _files(dst)
    damage(dst)
    damaged = {k for k, v in _files(dst).items() if before.get(k) != v} | set(before) - set(_files(dst))
    report, _ = _prepare(src, dst)
    assert not report.up_to_date
    text = "\n".join(report.lines())
    assert all(n in text for n in named), text
    after = _files(dst)
    # every file as it was, byte for byte; only the damaged ones (and the manifest) written again
    assert {k: v[0] for k, v in after.items() if k != "manifest.json"} == \
           {k: v[0] for k, v in before.items() if k != "manifest.json"}
    rewritten = {k for k in after if after[k][1] != before[k][1]} - {"manifest.json"}
    assert rewritten - damaged <= {"train-index.npy", "val-index.npy"}, rewritten  # an index follows its shards
    assert damaged <= rewritten | {"manifest.json"}
    again, warned = _prepare(src, dst)
    assert again.up_to_date and warned == [] and _files(dst) == after
    assert "checksums match" in again.lines()[1]


def test_a_shard_whose_source_files_changed_unseen_rewrites_its_split(tmp_path):
    """A source file changed without changing its size or mtime (the listing cannot see it): the repaired shard
    would not hold what it held, so the whole split is prepared again."""
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    victim = src / "train" / "cat" / "0.jpg"
    st = victim.stat()
    victim.write_bytes(b"x" * st.st_size)  # no longer an image; same size
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (dst / "train-00000.tar").unlink()
    report, warned = _prepare(src, dst)
    train = report.splits[0]
    assert not train.repaired and train.written == 5 and "cat/0.jpg" in train.skipped
    assert any("cat/0.jpg" in w for w in warned)
    with shards.Shards(dst, "train") as s:
        assert len(s) == 5


def test_a_manifest_without_checksums_gets_them_without_a_rewrite(tmp_path):
    src, dst = _tree(tmp_path / "src", per_class=2), tmp_path / "dst"
    (src / "train" / "dog" / "1b.jpg").unlink()  # none skipped: each shard's source file is known
    _prepare(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for entry in manifest["splits"].values():  # as a speedrun that recorded no checksums wrote it
        del entry["shard_files"], entry["index_sha256"]
    del manifest["source"]
    (dst / "manifest.json").write_text(json.dumps(manifest))
    before = _files(dst)
    report, _ = _prepare(src, dst)
    assert report.up_to_date and all("checksums recorded now" in line for line in report.lines()[1:3])
    after = _files(dst)
    assert {k: v for k, v in after.items() if k != "manifest.json"} == \
           {k: v for k, v in before.items() if k != "manifest.json"}
    assert "shard_files" in json.loads((dst / "manifest.json").read_text())["splits"]["train"]
    _flip(dst / "train-00001.tar", _jpeg_offset(dst, "train", 1))
    report, _ = _prepare(src, dst)
    assert report.splits[0].repaired == ["train-00001.tar (checksum mismatch)"]


TABLES = {
    "one row short": lambda e: e["shard_files"].pop(),
    "a checksum not hex": lambda e: e["shard_files"][0].__setitem__("sha256", "z" * 64),
    "ranges with a gap": lambda e: e["shard_files"][1].__setitem__("first", 5),
    "samples that do not add up": lambda e: e["shard_files"][0].__setitem__("samples", 2),
    "a range on some rows only": lambda e: e["shard_files"][0].pop("first"),
    "a negative size": lambda e: e["shard_files"][0].__setitem__("bytes", -1),
    "a list for a row": lambda e: e["shard_files"].__setitem__(0, [1, 2]),
    "the index checksum missing": lambda e: e.pop("index_sha256"),
}


@pytest.mark.parametrize("tamper", TABLES.values(), ids=TABLES.keys())
def test_a_hostile_shard_table_is_no_manifest(tamper, tmp_path):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    good = json.loads((dst / "manifest.json").read_text())
    bad = json.loads((dst / "manifest.json").read_text())
    tamper(bad["splits"]["train"])
    (dst / "manifest.json").write_text(json.dumps(bad))
    report, _ = _prepare(src, dst)
    assert not any(s.up_to_date or s.repaired for s in report.splits)  # everything again, no crash
    assert json.loads((dst / "manifest.json").read_text())["splits"] == good["splits"]


def _sample_error(root: Path) -> str:
    """The first error reading every sample of train through the loader's dataset, or ""."""
    try:
        ds = ShardImages(str(root), "train", 16)
        for i in range(len(ds)):
            ds[i]
    except ValueError as e:
        return str(e)
    return ""


READER_DAMAGE = {
    "a JPEG's bytes overwritten": lambda d: _overwrite_sample(d, 2),
    "the index changed": lambda d: _edit_index(d, lambda a: a.__setitem__((1, 1), 10**9)),
    "a label below 0": lambda d: _edit_index(d, lambda a: a.__setitem__((0, 3), -1)),
    "a shard cut": lambda d: (d / "train-00000.tar").write_bytes((d / "train-00000.tar").read_bytes()[:3000]),
    "the index is not .npy": lambda d: (d / "train-index.npy").write_bytes(b"junk"),
    "classes.json lost": lambda d: (d / "classes.json").unlink(),
}


def _overwrite_sample(dst: Path, i: int) -> None:
    index = np.load(dst / "train-index.npy")
    number, offset, size, _ = index[i]
    with open(dst / shards.shard_name("train", int(number)), "r+b") as f:
        f.seek(int(offset))
        f.write(b"X" * int(size))


def _edit_index(dst: Path, change) -> None:
    index = np.load(dst / "train-index.npy")
    change(index)
    np.save(dst / "train-index.npy", index)


@pytest.mark.parametrize("damage", READER_DAMAGE.values(), ids=READER_DAMAGE.keys())
def test_every_readers_advice_names_a_command_that_repairs(damage, tmp_path, capsys):
    src, dst = _tree(tmp_path / "my src"), tmp_path / "shards"  # a space: the command must quote it
    code, _, _ = _run(["data", "prepare", str(src), str(dst), "--max-side-px", "48", "--quality", "80",
                       "--workers", "0"], capsys)
    assert code == 0
    before = _files(dst)
    damage(dst)
    try:
        message = _sample_error(dst) or str(imagenet_data.load_data(str(dst)))
    except ValueError as e:
        message = str(e)
    assert "\n" not in message and "`speedrun data prepare " in message, message
    command = message.split("`speedrun data prepare ", 1)[1].split("`", 1)[0]
    argv = shlex.split(command)
    assert Path(argv[0]).resolve() == src.resolve() and argv[1] == str(dst)
    assert argv[2:] == ["--max-side-px", "48", "--quality", "80"]  # its own settings, not the defaults
    code, out, err = _run(["data", "prepare", *argv, "--workers", "0"], capsys)
    assert code == 0, err
    assert "up to date: nothing to do" not in out  # it found the damage
    assert _sample_error(dst) == "" and imagenet_data.load_data(str(dst)).num_train == 6
    after = _files(dst)
    assert {k: v[0] for k, v in after.items() if k != "manifest.json"} == \
           {k: v[0] for k, v in before.items() if k != "manifest.json"}
    code, out, _ = _run(["data", "prepare", *argv], capsys)
    assert code == 0 and "up to date: nothing to do" in out


def test_without_a_manifest_the_advice_still_names_the_command(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    shards.write_split(iter([(b"not a jpeg", 0)]), root, "train")
    message = _sample_error(root)
    assert f"`speedrun data prepare SRC {root}`, SRC being the image folder it was prepared from" in message


def test_damaged_synthetic_shards_are_checked_and_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "data"))
    first = imagenet_data.load_data("synthetic", log=lambda line: None)
    root = Path(first.root)
    good = _files(root)
    assert "run the same command again" in shards.repair_advice(root)
    _overwrite_sample(root, 5)  # in place: sizes and the index still agree
    assert "run the same command again" in _sample_error(root)
    imagenet_data.load_data("synthetic", log=lambda line: None)
    assert _sample_error(root) == "" and {k: v[0] for k, v in _files(root).items()} == {k: v[0] for k, v in
                                                                                          good.items()}
