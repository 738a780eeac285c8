"""A folder speedrun needs exists as a file (or a FIFO, or a broken link), itself or one of its parents: every place
that creates a folder under the data root (downloads/, cache/, imagenet-debug's shards) or a prepare DST says so,
naming the file, and never gives advice about permissions."""

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from speedrun.cli.program import main
from speedrun.data import download, sources
from speedrun.data.prepare_tree import prepare_tree
from speedrun.errors import SpeedrunWarning
from speedrun.paths import in_the_way
from speedrun.recipes.imagenet import data as imagenet_data


def _folder_dataset(root: Path) -> Path:
    for split in ("train", "test"):
        for k, c in enumerate(("a", "b")):
            (root / split / c).mkdir(parents=True)
            Image.fromarray(np.full((8, 8, 3), 40 * k, np.uint8)).save(root / split / c / "0.png")
    return root


# What stands in the way: (make it at `path`, how the message names it)
BLOCKERS = {
    "a file": (lambda p: p.write_text("x"), "is a file, not a folder"),
    "a FIFO": (lambda p: os.mkfifo(p), "is not a folder (a device, FIFO or socket)"),
    "a broken link": (lambda p: p.symlink_to(p.parent / "nowhere"), "is a broken link, not a folder"),
    "a link to a file": (lambda p: ((p.parent / "target").write_text("x"), p.symlink_to(p.parent / "target")),
                         "is a file, not a folder"),
}


def _blocked(where: Path, blocker, depth: int) -> tuple[Path, Path]:
    """(a path speedrun needs as a folder, what stands in the way, at `where`): the blocker is that path itself
    (depth 0) or its parent."""
    where.parent.mkdir(parents=True, exist_ok=True)
    blocker(where)
    return (where / "sub" if depth else where), where


def _no_permission_advice(text: str) -> None:
    assert "ermission" not in text and "File exists" not in text and "Not a directory" not in text, text


def _refused(call, blocker_path: Path, said: str) -> str:
    with pytest.raises(ValueError) as e:
        call()
    message = str(e.value)
    # named as it is, or as the link it is resolves (prepare resolves DST, to see one that links into SRC)
    named = {f"{blocker_path} {said}", f"{blocker_path.resolve()} {said}"}
    assert any(n in message for n in named) and "\n" not in message, message
    _no_permission_advice(message)
    return message


@pytest.mark.parametrize("depth", [0, 1], ids=["itself", "a parent"])
@pytest.mark.parametrize("blocker,said", BLOCKERS.values(), ids=BLOCKERS.keys())
def test_every_folder_we_create_names_what_is_in_the_way(blocker, said, depth, tmp_path):
    need, blocker_path = _blocked(tmp_path / "a" / "blocked", blocker, depth)
    assert in_the_way(need) == f"{blocker_path} {said}"
    # data prepare's DST below it (DST itself not a folder: refused as that already; below a broken link, DST is
    # made where the link points, as the link resolves)
    if depth and said != "is a broken link, not a folder":
        _refused(lambda: prepare_tree(_folder_dataset(tmp_path / "src"), need, workers=0), blocker_path, said)
    # downloads/ for a named dataset (what fetch creates: the file's folder)
    need, blocker_path = _blocked(tmp_path / "b" / "downloads", blocker, depth)
    message = _refused(lambda: download.fetch("file:///nowhere/x.tar.gz", need / "x.tar.gz", "0" * 32),
                       blocker_path, said)
    assert "SPEEDRUN_DATA" in message
    # the scratch folder a CIFAR archive is extracted in: <data root>/downloads
    root = tmp_path / "c" / "root"
    root.mkdir(parents=True)
    need, blocker_path = _blocked(root / "downloads", blocker, 0) if depth == 0 else (root, root)
    if depth:  # the data root itself is the blocker: its downloads/ lies under it
        root.rmdir()
        blocker(root)
    _refused(lambda: sources._read_archive(tmp_path / "x.tar.gz", root, lambda line: None, expect=None),
             blocker_path, said)
    # imagenet-debug's synthetic shards: a data cache (--data-dir) below it (the data cache itself not a folder:
    # speedrun.paths.data_root refuses it)
    if depth:
        need, blocker_path = _blocked(tmp_path / "d" / "cache", blocker, depth)
        _refused(lambda: imagenet_data.load_data("synthetic", data_dir=need, log=lambda line: None), blocker_path,
                 said)


@pytest.mark.parametrize("depth", [0, 1], ids=["itself", "a parent"])
def test_the_dataset_cache_folder_as_a_file_is_a_true_warning_and_the_data_loads(depth, tmp_path, monkeypatch):
    pics = _folder_dataset(tmp_path / "pics")
    data = tmp_path / "data"
    data.mkdir()
    (data / "cache").write_text("x")  # <data root>/cache/ is a file
    root = data if depth == 0 else data / "cache" / "deeper"  # or the data root lies under that file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = sources.load_dataset(str(pics), cache_dir=root)
    assert ds.num_classes == 2
    messages = [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]
    assert len(messages) == 1 and f"{data / 'cache'} is a file, not a folder" in messages[0], messages
    _no_permission_advice(messages[0])


def test_through_the_cli_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    for env, argv in ((tmp_path / "file", ["train", "imagenet-debug", "--device", "cpu"]),
                      (tmp_path / "file" / "data", ["train", "imagenet-debug", "--device", "cpu"]),
                      (None, ["data", "prepare", str(_folder_dataset(tmp_path / "src")),
                              str(tmp_path / "file" / "shards")])):
        if env is None:
            monkeypatch.delenv("SPEEDRUN_DATA", raising=False)
        else:
            monkeypatch.setenv("SPEEDRUN_DATA", str(env))
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "is a file, not a folder" in err, err
        assert str(tmp_path / "file") in err and "Traceback" not in err
        _no_permission_advice(err)
