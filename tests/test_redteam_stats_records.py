"""What the results database and result files give back, and the one-line refusals about them.

- A stored row is read as a result file is (result_file.parse_result): one nested 100000 levels, a list, a cut
  text, a BLOB that is not UTF-8 JSON, an oversized one: each a refusal naming the row, the database and the fix.
- One check of a training result's runs (result_file.check_train_result) at import, at every insert and at
  compare; a stored id that fails it is named with its database, with advice for a stored id.
- A full disk met while the database is opened is called a full disk.
- An output path that is empty or names a folder ("sub/dir/") is refused, never made into a file named dir.
- `results`: an inverted --since/--until window is refused; a bad date is quoted as typed; import says its fix
  once.
"""

import contextlib
import errno
import json
import os
import sqlite3
from collections import namedtuple

import pytest
from test_db import make_result

from speedrun.cli.program import main
from speedrun.instruments import bench
from speedrun.instruments.compare import compare
from speedrun.records import db
from speedrun.records.result_file import check_file_name, claim_result_path, parse_result

DAMAGED_ROWS = {
    "nested 100000 levels": ("[" * 100000 + "]" * 100000, "nested more than"),
    "nested 200 levels": ('{"a":' * 200 + "1" + "}" * 200, "nested more than"),
    "a list": ("[1,2]", "a result is a JSON object, found list"),
    "cut short": ('{"recipe": ', "not valid JSON (Expecting value at line 1, column 12)"),
    "empty": ("  ", "empty"),
    "a BLOB": (b"\xff\xfe{}", "not valid JSON"),
}


def _database_with(tmp_path, texts) -> tuple[str, list[int]]:
    """A database holding one good result and then one row per text, whose json is replaced by that text."""
    path = str(tmp_path / "r.db")
    with contextlib.closing(db.connect(path)) as conn:
        ids = [db.insert_result(conn, make_result(i)) for i in range(len(texts) + 1)]
    with contextlib.closing(sqlite3.connect(path)) as raw:
        for id_, text in zip(ids[1:], texts):
            raw.execute("UPDATE results SET json = ? WHERE id = ?", (text, id_))
        raw.commit()
    return path, ids


@pytest.mark.parametrize("case", DAMAGED_ROWS)
def test_a_damaged_row_is_refused_naming_the_row_the_database_and_the_fix(case, tmp_path, capsys):
    text, reason = DAMAGED_ROWS[case]
    path, (good, bad) = _database_with(tmp_path, [text])
    with contextlib.closing(db.connect(path)) as conn:
        with pytest.raises(ValueError) as caught:
            db.get_result(conn, bad)
        assert db.get_result(conn, good)["recipe"]  # the rows around it read as ever
    message = str(caught.value)
    assert message.startswith(f"row #{bad} of the results database {path} is damaged: ") and reason in message
    assert "move the database aside" in message and f"DELETE FROM results WHERE id = {bad}" in message
    for refs in ([str(good), str(bad)], [f"#{bad}", str(good)]):
        assert main(["compare", *refs, "--db", path]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"speedrun: error: row #{bad} of the results database")
        assert "internal error" not in err and reason in err
    assert main(["results", "--db", path]) == 0  # the listing reads columns: the damaged row is listed, not fatal
    assert capsys.readouterr().out.count("\n") == 3


def test_an_oversized_row_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path, (_, bad) = _database_with(tmp_path, [json.dumps(make_result(5))])
    monkeypatch.setattr(db, "MAX_RESULT_BYTES", 100)
    with contextlib.closing(db.connect(path)) as conn:
        with pytest.raises(ValueError, match=rf"row #{bad} of .* is damaged: \d+ bytes, more than any result"):
            db.get_result(conn, bad)


def test_a_result_file_and_a_row_are_read_by_one_loader(tmp_path):
    for text, reason in DAMAGED_ROWS.values():
        if isinstance(text, str):
            with pytest.raises(ValueError, match="^f.json: ") as caught:
                parse_result(text, "f.json")
            assert reason in str(caught.value) and "give a result JSON file" in str(caught.value)


BAD_RUNS = [({"train_seconds": -1}, "run 1 has train_seconds=-1, not a number in [0, 3.2e+08]"),
            ({"train_seconds": 1e300}, "run 1 has train_seconds=1e+300"),
            ({"accuracy": 1.5}, "run 1 has accuracy=1.5, not a number in [0, 1]"),
            ({"accuracy": None}, "run 1 has accuracy=None"),
            ({"accuracy": True}, "run 1 has accuracy=True"),
            ({"seed": 1.5}, "run 1 has seed=1.5, not an integer"),
            ({"diverged": False}, "run 1 is not a run record")]


@pytest.mark.parametrize("change, reason", BAD_RUNS)
def test_one_check_of_a_training_result_at_import_insert_and_compare(change, reason, tmp_path, capsys):
    bad = make_result(1)
    bad["runs"][0].update(change)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(bad))
    database = str(tmp_path / "r.db")
    assert main(["results", "import", str(file), "--db", database]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err
    assert err.count("give a result JSON") == 1  # the fix said once
    with contextlib.closing(db.connect(database)) as conn:
        with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("+", r"\+")):
            db.insert_result(conn, bad)
        assert db.query(conn) == []
        good = db.insert_result(conn, make_result(2))
    assert main(["compare", str(good), str(file), "--db", database]) == 2
    err = capsys.readouterr().err
    assert f"{file}: {reason}" in err and "give a result JSON of speedrun train" in err
    with pytest.raises(ValueError, match="^B: run 1 "):
        compare(make_result(2), bad)


def test_a_stored_id_that_fails_the_check_is_named_with_its_database(tmp_path, capsys):
    """Rows stored before the check (or edited since): the refusal names the id and the database, and does not
    ask for a result JSON file."""
    bad = make_result(1)
    bad["runs"][0]["train_seconds"] = -1
    path, (good, stored) = _database_with(tmp_path, [json.dumps(bad)])
    assert main(["compare", str(good), f"#{stored}", "--db", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"speedrun: error: stored result #{stored} of the results database {path}: run 1 has "
                          "train_seconds=-1") and err.count("\n") == 1
    assert "give a result JSON" not in err and "`speedrun results` lists them" in err
    with contextlib.closing(sqlite3.connect(path)) as raw:  # a report's id is not a training result either
        raw.execute("UPDATE results SET json = ? WHERE id = ?", (json.dumps({"benchmark": "bench"}), stored))
        raw.commit()
    assert main(["compare", str(good), str(stored), "--db", path]) == 2
    assert "a 'bench' report, not a training result" in capsys.readouterr().err


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("error", [sqlite3.OperationalError("disk I/O error"),
                                   sqlite3.OperationalError("unable to open database file")])
def test_a_full_disk_at_open_is_called_full(error, tmp_path, monkeypatch):
    name = str(tmp_path / "full" / "r.db")
    monkeypatch.setattr(db.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 0))
    text = str(db.refusal(error, name))
    assert f"the disk holding the results database {name} is full" in text and "free space" in text
    monkeypatch.setattr(db.shutil, "disk_usage", lambda path: Usage(10**9, 0, 10**9))
    assert "is full" not in str(db.refusal(error, name))  # room enough: the disk is to be checked, not emptied

    def cannot(*args, **kwargs):
        raise error

    monkeypatch.setattr(db.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 4096))
    monkeypatch.setattr(db.sqlite3, "connect", cannot)
    with pytest.raises(ValueError, match=r"the disk holding it is full .*free space and run again"):
        db.connect(name)
    monkeypatch.setattr(db.sqlite3, "connect", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space "
                                                                                              "left on device")))
    monkeypatch.setattr(db.shutil, "disk_usage", lambda path: Usage(10**9, 0, 10**9))
    with pytest.raises(ValueError, match="is full"):
        db.connect(name)


@pytest.mark.parametrize("name", ["", "   ", "sub/dir/", "sub/dir//", ".", "..", "sub/.", "sub/..", "/",
                                  f"sub{os.sep}"])
def test_an_output_path_that_is_empty_or_a_folder_is_refused(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"--json .*(is empty|names a folder); give a file name, e\.g\. ") as caught:
        claim_result_path(name, "--json")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "sub").exists() and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="--trace"):
        check_file_name(name, "--trace")


def test_train_and_bench_refuse_a_folder_as_their_result_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = ["--dataset", "synthetic:train=64,test=32", "--device", "cpu", "--epochs", "0.5", "--db",
            str(tmp_path / "r.db")]
    assert main(["train", *tiny, "--json", "sub/dir/"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names a folder; give a file name, e.g. sub/dir/result.json" in err
    assert not (tmp_path / "sub" / "dir").exists()
    assert main(["bench", *tiny, "--vary", "lookahead=false", "--json", "out/"]) == 2
    assert "names a folder" in capsys.readouterr().err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="is empty"):  # the Python API's empty path: refused, not the default
        bench.run_and_store(lambda log: {}, kind="bench", recipe="cifar10-94", dataset=None, device="cpu",
                            db_path=str(tmp_path / "r.db"), json_path="", command="c", log=print)
    assert not (tmp_path / "results").exists()


def test_an_inverted_window_and_a_bad_date_are_refused_as_typed(tmp_path, capsys):
    path = str(tmp_path / "r.db")
    with contextlib.closing(db.connect(path)) as conn:
        ids = [db.insert_result(conn, make_result(i)) for i in range(4)]  # 2026-11-01 .. 2026-11-04, at noon
        with pytest.raises(ValueError, match=r"--since '2026-12-01' is after --until '2026-01-01'.*swap them"):
            db.query(conn, since="2026-12-01", until="2026-01-01")
        with pytest.raises(ValueError, match="is after"):
            db.query(conn, since="2026-11-03T13:00Z", until="2026-11-03T12:00Z")
        assert [r["id"] for r in db.query(conn, since="2026-11-03", until="2026-11-03")] == [ids[2]]  # one day
        assert [r["id"] for r in db.query(conn, since="20261102", until="20261103")] == [ids[2], ids[1]]
        for bad in ("2026-02-30", "2026-13-01", "tomorrow"):
            with pytest.raises(ValueError, match=f"^--until '{bad}' is not an ISO date"):
                db.query(conn, until=bad)
    assert main(["results", "--since", "2026-12-01", "--until", "2026-01-01", "--db", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is after --until" in err and "no stored result matches" not in err
    assert main(["results", "--until", "2026-02-30", "--db", path]) == 2
    err = capsys.readouterr().err
    assert "'2026-02-30'" in err and "T23:59:59" not in err


@pytest.mark.parametrize("content", ['{"recipe": ', "[1, 2]", "", "\xff"])
def test_import_says_its_fix_once(content, tmp_path, capsys):
    file = tmp_path / "r.json"
    file.write_bytes(content.encode("latin-1"))
    assert main(["results", "import", str(file), "--db", str(tmp_path / "r.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count("give a result JSON") + err.count("pass a result") == 1, err
