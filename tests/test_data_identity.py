"""Results are keyed by what the data is, not by how its path was typed: one data set read by a relative path, an
absolute path or from a copy elsewhere is one leaderboard, a changed image makes another; the recipe's target applies
on its own data set only; and the database's upgrade to schema version 3 (kind, data set name and fingerprint,
target) is one transaction: stopped midway, by an error or by SIGKILL, it leaves the database as it was."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import rest_of, run_cli
from speedrun.data.dataset import Dataset
from speedrun.records import db
from speedrun.report import queries

OLD = Path(__file__).parent / "fixtures" / "previous_version" / "results-v2.db"
SMALL = ["--device", "cpu", "--epochs", "1", "--runs", "1", "--set", "widths=8,8,8", "--set", "batch_size=10",
         "--set", "whiten_images=10", "--set", "tta_level=0", "--quiet"]


def _folder(root: Path) -> Path:
    """An image folder of 32x32 PNGs: 2 classes, 10 train and 4 test images each."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 10), ("test", 4)):
        for label in ("cat", "dog"):
            (root / split / label).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")
    return root


def _train(dataset: str, database: Path, capsys, *extra: str) -> dict:
    code, out, err = run_cli(["train", "cifar10-94", "--dataset", dataset, "--db", str(database), *SMALL, *extra],
                             capsys)
    assert code == 0, err
    with contextlib.closing(db.connect(database)) as conn:
        return db.get_result(conn, db.query(conn, limit=1)[0]["id"])


@pytest.mark.slow
def test_one_data_set_by_any_path_or_copy_is_one_leaderboard_and_a_changed_image_another(in_tmp, capsys):
    _folder(in_tmp / "pets")
    database = in_tmp / "results.db"
    relative = _train("pets", database, capsys)
    absolute = _train(str(in_tmp / "pets"), database, capsys)
    shutil.copytree(in_tmp / "pets", in_tmp / "elsewhere" / "pets-copy")
    copy = _train(str(in_tmp / "elsewhere" / "pets-copy"), database, capsys)
    # what each result records: the name, the content's fingerprint, and the path as typed (its source)
    assert relative["data"]["source"] == "pets" and absolute["data"]["source"] == str(in_tmp / "pets")
    assert relative["data"]["name"] == absolute["data"]["name"] == "pets"
    assert copy["data"]["name"] == "pets-copy"
    assert relative["data"]["fingerprint"] == absolute["data"]["fingerprint"] == copy["data"]["fingerprint"]
    assert relative["data"]["fingerprint"].startswith("sha256:")

    changed = in_tmp / "elsewhere" / "pets-copy" / "train" / "dog" / "3.png"
    pixels = np.array(Image.open(changed))
    pixels[0, 0, 0] ^= 1  # one bit of one pixel
    Image.fromarray(pixels).save(changed)
    other = _train(str(in_tmp / "elsewhere" / "pets-copy"), database, capsys)
    assert other["data"]["fingerprint"] != copy["data"]["fingerprint"]

    with contextlib.closing(db.connect(database)) as conn:
        boards = queries.leaderboards(conn)
    assert sorted(len(b["rows"]) for b in boards) == [1, 3]
    (same,) = [b for b in boards if len(b["rows"]) == 3]
    assert same["fingerprint"] == relative["data"]["fingerprint"]
    typed = {"pets", str(in_tmp / "pets"), str(in_tmp / "elsewhere" / "pets-copy")}
    assert {r["source"] for r in same["rows"]} == typed
    # a folder is not the recipe's own data set (cifar10 as published): no target, so no record is judged
    assert all(b["target"] is None for b in boards) and relative["target"] is None and relative["record"] is None


@pytest.mark.slow
def test_a_target_the_user_gives_applies_on_any_data(in_tmp, capsys):
    _folder(in_tmp / "pets")
    result = _train("pets", in_tmp / "r.db", capsys, "--set", "target_accuracy=0.25")
    assert result["target"] == 0.25 and result["record"] is not None
    with contextlib.closing(db.connect(in_tmp / "r.db")) as conn:
        (board,) = queries.leaderboards(conn)
    assert board["target"] == 0.25


def test_the_fingerprint_is_the_content_whatever_the_name_and_a_sample_is_its_own(tiny):
    renamed = Dataset("another-name", tiny.train_images.clone(), tiny.train_labels.clone(),
                      tiny.test_images.clone(), tiny.test_labels.clone(), list(tiny.classes))
    assert renamed.fingerprint() == tiny.fingerprint()
    assert tiny.sample(10, 10).fingerprint() != tiny.fingerprint()
    relabelled = Dataset("t", tiny.train_images, tiny.train_labels, tiny.test_images, tiny.test_labels,
                         [f"k{i}" for i in range(tiny.num_classes)])
    assert relabelled.fingerprint() != tiny.fingerprint()  # class names are part of what the data says


def test_the_recipe_s_own_data_set_is_the_published_one_by_name():
    from speedrun.recipes.imagenet import data as imagenet_data
    from speedrun.recipes.in_memory import data as in_memory

    class Data:
        unofficial = ""

    assert in_memory.own_data("cifar10", "cifar10", Data()) and in_memory.own_data("cifar10", " CIFAR10 ", Data())
    for dataset in ("/data/cifar10", "cifar100", "synthetic", "./cifar10"):
        assert not in_memory.own_data("cifar10", dataset, Data())
    Data.unofficial = "cifar-10-python.tar.gz has md5 0, not the published 1"
    assert not in_memory.own_data("cifar10", "cifar10", Data())

    class Shards:
        classes = tuple(f"n{i:08d}" for i in range(1000))
        num_train, num_eval = imagenet_data.IMAGENET_1K_SIZES

    assert not imagenet_data.own_data("", "/x", Shards())  # ImageNet's sizes, other classes
    real = sorted(p.name for p in (Path(__file__).parents[2] / "shared" / "datasets" / "imagenet-sample" /
                                   "val").iterdir()) if (Path(__file__).parents[2] / "shared").is_dir() else None
    if real:  # this machine's 1,000 ImageNet classes: the constant is their digest
        Shards.classes = tuple(real)
        assert imagenet_data.own_data("", "/x", Shards())
        Shards.num_train = 50_000  # a subset of ImageNet is not ImageNet
        assert not imagenet_data.own_data("", "/x", Shards())


@pytest.mark.parametrize("result, command, dataset, expected", [
    ({}, "speedrun train", "../data/pets/", ("train", "pets", None, None)),
    ({"smoke_test": True, "kind": "bench"}, None, "x", ("smoke", "x", None, None)),
    ({"kind": "no such kind"}, "speedrun bench --vary a=1,2  # setting a=1", "cifar10.tar.gz",
     ("bench", "cifar10.tar.gz", None, None)),
    ({}, None, "/tmp/x/cifar-10-python.tar.gz", ("train", "cifar-10-python", None, None)),
    ({"config": {"target_accuracy": 0.94}}, None, "cifar10", ("train", "cifar10", None, 0.94)),
    ({"config": {"target_accuracy": 0.94}}, None, "/data/cifar10", ("train", "cifar10", None, None)),
    ({"target": None, "config": {"target_accuracy": 0.94}}, None, "cifar10", ("train", "cifar10", None, None)),
    ({"target": True}, None, "a", ("train", "a", None, None)),
    ({"target": 1.5}, None, "a", ("train", "a", None, None)),
    ({"target": "0.9"}, None, "a", ("train", "a", None, None)),
    ({"data": {"name": 3, "fingerprint": "sha256:" + "0" * 64}}, None, "a", ("train", "a", "sha256:" + "0" * 64, None)),
    ({"data": {"name": "n", "fingerprint": "md5:0"}}, None, "a", ("train", "n", None, None)),
    ({"data": ["n"]}, None, None, ("train", None, None, None)),
    ([], 3, 3, ("train", None, None, None)),
    ({"smoke_test": 1}, "speedrun train --smoke", "a", ("smoke", "a", None, None)),
    ({"smoke_test": 0}, None, "a", ("train", "a", None, None)),
])
def test_identity_takes_what_a_result_says_only_in_its_form(result, command, dataset, expected):
    assert db.identity(result, command, dataset) == expected


def _dump(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as raw:
        return [raw.execute("PRAGMA user_version").fetchone()[0], *raw.iterdump()]


def test_the_previous_version_s_database_is_upgraded_and_reads(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD, path)
    assert _dump(path)[0] == 2
    with contextlib.closing(db.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == db.VERSION == 3
        rows = db.query(conn)
        assert {(r["recipe"], r["kind"], r["dataset_name"], r["dataset_fingerprint"], r["target"]) for r in rows} == {
            ("cifar10-94", "train", "synthetic:train=256,test=64", None, None),
            ("imagenet-debug", "train", "synthetic", None, None)}
        for row in rows:  # every row reads whole, as it was stored
            assert json.loads(json.dumps(db.get_result(conn, row["id"])))["recipe"] == row["recipe"]


def test_an_upgrade_that_fails_midway_leaves_the_database_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    shutil.copy(OLD, path)
    before = _dump(path)
    calls = []

    def fail_on_the_second_row(*args):
        calls.append(args)
        if len({a[0] for a in calls}) > 1:  # the second row's first column: the first row is already written
            raise KeyboardInterrupt
        return real(*args)

    real = db._identity_column
    monkeypatch.setattr(db, "_identity_column", fail_on_the_second_row)
    # SQLite turns an exception in a function it calls into its own error: a refusal naming the file, then
    with pytest.raises((KeyboardInterrupt, ValueError)):
        db.connect(path)
    assert _dump(path) == before
    monkeypatch.undo()
    with contextlib.closing(db.connect(path)) as conn:  # and it upgrades next time
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3


KILLED = """
import sys, time
from speedrun.records import db
real = db._identity_column
def slow(*args):
    print("migrating", flush=True)
    time.sleep(60)
    return real(*args)
db._identity_column = slow
db.connect(sys.argv[1])
"""


@pytest.mark.slow
def test_an_upgrade_killed_midway_leaves_the_database_as_it_was(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD, path)
    before = _dump(path)
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "migrating"  # inside the upgrade's transaction, rows half done
    proc.send_signal(signal.SIGKILL)
    rest_of(proc, 30)
    assert _dump(path) == before
    with contextlib.closing(db.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3 and len(db.query(conn)) == 2


def test_an_upgrade_reads_rows_whose_text_is_not_utf8(tmp_path):
    """A version 2 row holding bytes that are not UTF-8 (SQLite keeps what it was given) is read as every read
    decodes it (U+FFFD), not a reason to refuse the whole database."""
    path = tmp_path / "v2.db"
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:
        for script in db.MIGRATIONS[:2]:
            for statement in filter(str.strip, script.replace("speedrun_sha256(json)", "NULL").split(";\n")):
                raw.execute(statement)
        raw.execute("INSERT INTO results (created_utc, recipe, dataset, device, command, n, json, sha256) VALUES "
                    "('2026-01-01T00:00:00+00:00', 'cifar10-94', CAST(X'2F64617461FF' AS TEXT), 'cpu', "
                    "CAST(X'7472FF' AS TEXT), 1, CAST(X'7B2278223AFF7D' AS TEXT), 'x')")
        raw.execute("PRAGMA user_version = 2")
    with contextlib.closing(db.connect(path)) as conn:
        (row,) = db.query(conn)
    assert row["kind"] == "train" and row["dataset_name"] == "data\ufffd" and row["target"] is None


def test_rows_from_before_fingerprints_join_the_one_board_of_their_name(tmp_path):
    from test_db import make_result

    conn = db.connect(tmp_path / "r.db")
    fingerprint = "sha256:" + "ab" * 32
    db.insert_result(conn, make_result(0, dataset="cifar10"))  # an old file: no "data", the named data set
    db.insert_result(conn, make_result(1, dataset="cifar10", target=0.94,
                                       data={"name": "cifar10", "fingerprint": fingerprint}))
    other = "sha256:" + "cd" * 32  # another data set that happens to be called cifar10, with the user's target
    db.insert_result(conn, make_result(2, dataset="/x/cifar10", target=0.94,
                                       data={"name": "cifar10", "fingerprint": other}))
    boards = queries.leaderboards(conn)
    assert sorted(len(b["rows"]) for b in boards) == [1, 1, 1]  # two fingerprints: the old row cannot tell which
    assert {queries.board_name(b) for b in boards} == {
        "cifar10 [data abababababab] (cifar family)", "cifar10 [data cdcdcdcdcdcd] (cifar family)",
        "cifar10 [data not fingerprinted] (cifar family)"}
    conn.execute("DELETE FROM results WHERE dataset = '/x/cifar10'")
    (board,) = queries.leaderboards(conn)
    assert len(board["rows"]) == 2 and board["fingerprint"] == fingerprint
    assert queries.board_name(board) == "cifar10 (cifar family)"


def test_where_no_target_applies_no_run_reached_it(tmp_path, tiny):
    from test_db import make_result

    conn = db.connect(tmp_path / "r.db")
    db.insert_result(conn, make_result(0))  # on cifar10-jpeg by its path: no target
    (row,) = db.query(conn)
    assert row["target"] is None and row["hit_rate"] is None


def test_a_cache_written_for_a_path_does_not_make_a_copy_official(tmp_path):
    """The same CIFAR batches, first given as a path (no check against the published files), then as
    --data-dir of the named data set: the second is checked, and found not to be the published files."""
    import pickle

    from speedrun.data.sources import load_dataset

    batches = tmp_path / "copy" / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 10), ("data_batch_2", 10), ("test_batch", 4)):
        (batches / name).write_bytes(pickle.dumps({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                                                   b"labels": [i % 10 for i in range(n)]}, protocol=4))
    (batches / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}))
    by_path = load_dataset(str(batches), cache_dir=tmp_path / "cache")
    assert by_path.unofficial == ""
    with pytest.warns(Warning, match="not the published cifar10"):
        named = load_dataset("cifar10", data_dir=tmp_path / "copy", cache_dir=tmp_path / "cache")
    assert named.unofficial and named.fingerprint() == by_path.fingerprint()


def test_an_image_folder_is_hashed_once_per_load(tmp_path, monkeypatch):
    from speedrun.data import cache
    from speedrun.data import dataset as dataset_module
    from speedrun.data.sources import load_dataset

    _folder(tmp_path / "pets")
    calls = []
    real = dataset_module.content_fingerprint
    for module in (dataset_module, cache):
        monkeypatch.setattr(module, "content_fingerprint", lambda *a: calls.append(1) or real(*a))
    for _ in ("built", "from the cache"):
        calls.clear()
        load_dataset(str(tmp_path / "pets"), cache_dir=tmp_path / "cache").fingerprint()
        assert len(calls) == 1


@pytest.mark.parametrize("text, shown", [
    ("--dataset C:\\Users\\bob\\cifar10 --x 1", "--dataset …\\cifar10 --x 1"),
    ("\\\\server\\share\\bob\\data", "…\\data"),
    ("file://localhost/home/bob/x", "file://…/x"),
    ("@/home/bob/args.txt", "@…/args.txt"),
    ("a\u00a0/home/bob/x", "a\u00a0…/x"),
])
def test_machine_paths_of_other_forms_are_not_shown(text, shown):
    from speedrun.report.portable import portable_paths

    assert portable_paths(text) == shown == portable_paths(shown)
