"""Every `speedrun train` stores its result in the database (db.py) as well as its JSON file."""

import json
import sqlite3

from speedrun.records import db as db
from speedrun.cli.program import main

SMALL = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
         "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet"]


def test_train_stores_what_its_json_file_holds(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "env.db"))
    assert main(["train", *SMALL, "--runs", "2", "--json", str(tmp_path / "r.json")]) == 0  # the default: env
    with db.connect(tmp_path / "env.db") as conn:
        (row,) = db.query(conn)
        assert db.get_result(conn, row["id"]) == json.loads((tmp_path / "r.json").read_text())
        assert [r[0] for r in conn.execute("SELECT seed FROM runs ORDER BY run_index")] == [0, 1]
    assert main(["train", *SMALL, "--db", str(tmp_path / "flag.db"), "--json", str(tmp_path / "s.json")]) == 0
    with db.connect(tmp_path / "flag.db") as conn:
        assert len(db.query(conn)) == 1
    capsys.readouterr()
    assert main(["results", "--db", str(tmp_path / "env.db"), "--json"]) == 0
    assert [r["n"] for r in json.loads(capsys.readouterr().out)] == [2]


def test_a_bad_database_is_one_line_before_any_work(tmp_path, capsys):
    (tmp_path / "not.db").write_text("my notes")
    assert main(["train", *SMALL, "--db", str(tmp_path / "not.db"), "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not.db" in err and "--db" in err
    assert (tmp_path / "not.db").read_text() == "my notes" and not (tmp_path / "r.json").exists()


def test_a_database_that_fails_later_costs_a_warning_not_the_result(tmp_path, capsys, monkeypatch):
    def locked(*args, **kwargs):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(db, "insert_result", locked)
    out = tmp_path / "r.json"
    assert main(["train", *SMALL, "--db", str(tmp_path / "x.db"), "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: the result was not stored in the database" in err and "results import" in err
    assert json.loads(out.read_text())["n"] == 1


def test_results_names_the_users_network_and_lists_rows_whose_json_is_damaged(tmp_path, capsys):
    (tmp_path / "net.py").write_text("from torch import nn\n\ndef build(c, k, px):\n"
                                     "    return nn.Sequential(nn.Flatten(), nn.Linear(c * px * px, k))\n")
    store = str(tmp_path / "r.db")
    assert main(["train", *SMALL, "--db", store, "--json", str(tmp_path / "own.json")]) == 0
    assert main(["train", *SMALL, "--db", store, "--model", f"{tmp_path}/net.py:build",
                 "--json", str(tmp_path / "user.json")]) == 0
    capsys.readouterr()
    assert main(["results", "--db", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "cifar10-94 --model net:build" in lines[1] and "--model" not in lines[2], lines
    assert main(["results", "--db", store, "--json"]) == 0
    assert [r["model"] for r in json.loads(capsys.readouterr().out)] == ["net:build", None]
    with sqlite3.connect(store) as conn:  # a row's stored JSON edited by hand into something that is not JSON
        conn.execute("UPDATE results SET json = 'edited {' WHERE id = 2")
    conn.close()
    assert main(["results", "--db", store, "--csv"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].endswith(",model") and len(rows) == 3, rows
