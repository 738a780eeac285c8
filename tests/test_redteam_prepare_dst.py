"""`speedrun data prepare` and the folders it is given: it never replaces nor deletes a file it did not write (DST is
absent, empty, or a folder it wrote), an empty or blank path argument is refused (it would mean the current
folder), and a refusal about DST names DST and a fix."""

import errno
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli as _run
from PIL import Image

from speedrun.data import shards
from speedrun.data.prepare_tree import prepare_tree
from speedrun.errors import SpeedrunWarning


def _tree(root: Path, classes=("n01", "n02", "n03"), train=2, val=1) -> Path:
    """SRC/{train,val}/<class>/ with tiny distinct PNGs."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return root


def _prepare(src, dst, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prepare_tree(src, dst, **{"max_side_px": 16, "workers": 0, **kwargs})
    return report, [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]


def _snapshot(root: Path) -> dict:
    """Every entry under root: a file's bytes, a link's target, None for a folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
    return out


# Class: DST that is not a folder prepare wrote is refused before anything is read or written, naming DST and a
# file prepare did not write, with the fix; nothing in it changes.
FOREIGN = {
    "another program's manifest and a shard name": (
        lambda d: ((d / "manifest.json").write_text('{"name": "my web app"}'),
                   (d / "train-00000.tar").write_text("mine")), "manifest.json"),
    "a lone file with a shard's name": (lambda d: (d / "train-00000.tar").write_text("mine"), "train-00000.tar"),
    "our file names, none in our formats": (
        lambda d: ((d / "classes.json").write_text("mine"), (d / "train-index.npy").write_text("mine"),
                   (d / "val-00003.tar").write_text("mine")), "classes.json"),
    "the synthetic shards' manifest": (
        lambda d: (d / "manifest.json").write_text(json.dumps({"format": shards.SYNTHETIC_FORMAT, "files": {}})),
        "manifest.json"),
    "a manifest of ours in name only: a JSON list, and notes": (
        lambda d: ((d / "manifest.json").write_text("[]"), (d / "notes.txt").write_text("mine")), "manifest.json"),
    "an index in our format beside someone's classes.json": (
        lambda d: (shards.write_split(iter([(b"x", 0)]), d, "train"), (d / "classes.json").write_text('{"a": 1}')),
        "classes.json"),
    "a hidden file": (lambda d: (d / ".env").write_text("SECRET=1"), ".env"),
    "a broken link": (lambda d: (d / "train-index.npy").symlink_to(d / "nowhere"), "train-index.npy"),
}


@pytest.mark.parametrize("make,named", FOREIGN.values(), ids=FOREIGN.keys())
def test_a_folder_prepare_did_not_write_is_refused_and_left_as_it_was(make, named, tmp_path, capsys):
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    dst.mkdir()
    make(dst)
    before = _snapshot(dst)
    with pytest.raises(ValueError) as e:
        _prepare(src, dst)
    message = str(e.value)
    assert "\n" not in message and f"DST {dst} " in message and named in message, message
    assert "choose a new or empty DST" in message
    assert _snapshot(dst) == before
    code, out, err = _run(["data", "prepare", str(src), str(dst), "--workers", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and named in err and out == "", err
    assert _snapshot(dst) == before


def test_absent_empty_half_made_and_own_folders_are_written(tmp_path):
    src = _tree(tmp_path / "src")
    _prepare(src, tmp_path / "absent" / "deeper")  # created, parents too
    (tmp_path / "empty").mkdir()
    _prepare(src, tmp_path / "empty")
    half = tmp_path / "half"  # a first run killed before its manifest: only a staging folder of ours
    (half / f"{shards.STAGE_PREFIX}abc").mkdir(parents=True)
    (half / f"{shards.STAGE_PREFIX}abc" / "train-00000.tar").write_bytes(b"partial")
    _prepare(src, half)
    assert not [p for p in half.iterdir() if p.name.startswith(".")]  # the stage is gone
    for dst in (tmp_path / "absent" / "deeper", tmp_path / "empty", half):
        assert json.loads((dst / "classes.json").read_text()) == ["n01", "n02", "n03"]
        report, warned = _prepare(src, dst)
        assert report.up_to_date and warned == []


@pytest.mark.parametrize("damage", ["removed", "not JSON", "a FIFO"])
def test_our_folder_with_its_manifest_damaged_is_still_ours(damage, tmp_path):
    """A folder prepare wrote whose manifest was lost or damaged still holds classes.json and shard indexes in
    prepare's formats: it is prepared again in place, as a damaged folder's advice says."""
    src, dst = _tree(tmp_path / "src"), tmp_path / "dst"
    _prepare(src, dst)
    (dst / "manifest.json").unlink()
    if damage == "not JSON":
        (dst / "manifest.json").write_bytes(b"\x00garbage")
    elif damage == "a FIFO":
        os.mkfifo(dst / "manifest.json")
    (dst / "notes.txt").write_text("mine")  # another file beside ours: never touched
    assert "run speedrun data prepare again" in shards.repair_advice(dst)
    report, _ = _prepare(src, dst)
    assert not report.up_to_date
    assert json.loads((dst / "manifest.json").read_text())["format"] == "speedrun data prepare"
    assert (dst / "notes.txt").read_text() == "mine"


def test_a_folder_prepare_refuses_gets_advice_that_does_not_name_it_as_dst(tmp_path):
    """The readers' repair advice for a folder prepare would refuse names a new folder, not a command that loops."""
    root = tmp_path / "mine"
    root.mkdir()
    (root / "val-index.npy").write_bytes(b"not numpy")
    (root / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as e:
        shards.Shards(root, "val")
    assert "NEW_DST" in str(e.value) and f"speedrun data prepare SRC {root}`" not in str(e.value)


# Class: in a folder of ours, a file its manifest does not list is never deleted: left, and named.
def test_only_the_shards_the_manifest_listed_are_removed_and_strays_are_named(tmp_path):
    src, dst = _tree(tmp_path / "src", train=3), tmp_path / "dst"
    _prepare(src, dst, shard_bytes=1)  # one image per shard: train-00000 ... train-00008
    strays = {"train-00020.tar": b"someone's", "test-index.npy": b"someone's", "val-00007.tar": b"someone's"}
    for name, data in strays.items():
        (dst / name).write_bytes(data)
    for c in ("n01", "n02", "n03"):
        (src / "train" / c / "2.png").unlink()
    report, warned = _prepare(src, dst, shard_bytes=1)
    assert report.splits[0].written == 6
    assert sorted(p.name for p in dst.glob("train-0000?.tar")) == [f"train-{k:05d}.tar" for k in range(6)]
    assert all((dst / name).read_bytes() == data for name, data in strays.items())
    named = [w for w in warned if "does not list" in w]
    assert len(named) == 1 and all(name in named[0] for name in strays) and "remove them" in named[0], warned
    # A manifest that is ours but no longer valid vouches for nothing: nothing of this split is deleted.
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["version"] = 99
    (dst / "manifest.json").write_text(json.dumps(manifest))
    (src / "train" / "n03" / "1.png").unlink()
    report, warned = _prepare(src, dst, shard_bytes=1)
    assert (dst / "train-00005.tar").is_file() and any("train-00005.tar" in w for w in warned), warned
    with shards.Shards(dst, "train") as s:
        assert len(s) == 5


# Class: an empty or blank path argument (an unset shell variable) is refused, naming the argument: it would mean
# the current folder.
@pytest.mark.parametrize("blank", ["", " ", "\t", "  \n"])
@pytest.mark.parametrize("which", ["SRC", "DST"])
def test_a_blank_path_argument_is_refused_naming_it(blank, which, tmp_path, capsys, monkeypatch):
    src = _tree(tmp_path / "src")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = [blank, str(tmp_path / "dst")] if which == "SRC" else [str(src), blank]
    with pytest.raises(ValueError, match=f"^{which} "):
        _prepare(*args)
    code, out, err = _run(["data", "prepare", *args, "--workers", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and f"error: {which} " in err and "inside SRC" not in err, err
    assert list(cwd.iterdir()) == [] and not (tmp_path / "dst").exists()


# Class: a DST prepare cannot create or write is one line naming DST, with a fix.
def test_a_dst_that_cannot_be_made_or_written_names_dst_and_a_fix(tmp_path, capsys, monkeypatch):
    src = _tree(tmp_path / "src")
    code, out, err = _run(["data", "prepare", str(src), "/proc/speedrun-x", "--workers", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and "DST /proc/speedrun-x" in err and "choose a DST" in err, err

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "dst" / "x"))

    monkeypatch.setattr("speedrun.data.prepare_tree.tempfile.mkdtemp", full)
    code, out, err = _run(["data", "prepare", str(src), str(tmp_path / "dst"), "--workers", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and f"DST {tmp_path / 'dst'}" in err, err
    assert "free disk space" in err and not (tmp_path / "dst").exists()
