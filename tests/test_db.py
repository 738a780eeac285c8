import argparse
import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun.cli import file_commands
from speedrun.errors import counted
from speedrun.records import db as db

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "benchmarks" / "results" / "issue7" / "cpu-cifar10jpeg-epochs1-1proc.json"


def make_result(i: int = 0, **changes) -> dict:
    """A Result.to_dict() taken from a real result file, made distinct by `i` (command line and date)."""
    result = json.loads(TEMPLATE.read_text())
    result["command"] = f"speedrun train --seed {i}"
    result["environment"]["timestamp_utc"] = f"2026-11-{1 + i % 28:02d}T12:00:00+00:00"
    result.update(changes)
    return result


def count(conn, table: str) -> int:
    return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


WRITER = """
import json, sys
from speedrun.records import db
result = json.load(open(sys.argv[2]))
conn = db.connect(sys.argv[1])
for i in range(25):
    result["command"] = f"writer {sys.argv[3]} result {i}"
    db.insert_result(conn, result)
"""


def test_eight_writer_processes_on_a_new_database_lose_nothing(tmp_path):
    path = tmp_path / "results.db"  # not created beforehand: the writers also race to create and migrate it
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(TEMPLATE), str(k)],
                                stderr=subprocess.PIPE, text=True) for k in range(8)]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0] * 8, errors
    assert not any("locked" in e for e in errors)
    conn = db.connect(path)
    assert count(conn, "results") == 200 and count(conn, "runs") == 200 * 3
    commands = {row["command"] for row in db.query(conn)}
    assert commands == {f"writer {k} result {i}" for k in range(8) for i in range(25)}
    assert sorted(row[0] for row in conn.execute("SELECT id FROM results")) == list(range(1, 201))


KILLED = """
import json, sys, time
from speedrun.records import db
conn = db.connect(sys.argv[1])
result = json.load(open(sys.argv[2]))
result["command"] = "the killed writer"
# 60 runs of 100 kB each: more than the page cache holds, so uncommitted pages spill into the WAL file
result["runs"] = [dict(result["runs"][0], seed=s, history=[{"pad": "x" * 100_000}]) for s in range(60)]
runs_started = []
def trace(sql):
    if sql.startswith("INSERT INTO runs"):
        runs_started.append(sql)
        if len(runs_started) == 50:  # the results row and 49 runs rows are written, uncommitted
            print("ready", flush=True)
            time.sleep(600)
conn.set_trace_callback(trace)
db.insert_result(conn, result)
"""


def test_a_writer_killed_mid_transaction_leaves_no_trace(tmp_path):
    path = tmp_path / "results.db"
    conn = db.connect(path)
    first = db.insert_result(conn, make_result(0))
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(path), str(TEMPLATE)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert os.path.getsize(f"{path}-wal") > 2_000_000  # the transaction's pages really are on disk
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    conn.close()
    conn = db.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    assert [row["id"] for row in db.query(conn)] == [first]
    assert count(conn, "runs") == 3
    assert count(conn, "runs WHERE result_id NOT IN (SELECT id FROM results)") == 0
    second = db.insert_result(conn, make_result(1))
    assert second == first + 1 and count(conn, "results") == 2 and count(conn, "runs") == 6


def test_a_version_1_database_migrates_with_its_rows_backfilled(tmp_path):
    old = make_result(3, cost={"price_per_hour": 2.5, "price_source": "test"}, wall_seconds=460.0)
    raw = sqlite3.connect(tmp_path / "v1.db")
    raw.executescript(db.MIGRATIONS[0])
    raw.execute("PRAGMA user_version = 1")
    for text in (json.dumps(old, indent=2), json.dumps(old)):  # version 1 did not deduplicate: two copies
        raw.execute("INSERT INTO results (created_utc, recipe, dataset, device, command, mean_accuracy, n, json) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", ("2026-11-04T12:00:00+00:00", old["recipe"], old["dataset"],
                                                        old["device"], old["command"], old["mean_accuracy"],
                                                        old["n"], text))
    raw.commit()
    raw.close()

    conn = db.connect(tmp_path / "v1.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == db.VERSION == 3
    [migrated] = db.query(conn)
    assert migrated["id"] == 1 and db.get_result(conn, 1) == old
    fresh = db.connect(tmp_path / "v2.db")
    assert db.insert_result(fresh, old) == 1
    assert migrated == db.query(fresh)[0]
    assert migrated["git_commit"] == old["environment"]["git_commit"] and migrated["git_dirty"] is True
    assert migrated["cost"] == pytest.approx(2.5 * old["train_seconds"]["mean"] / 3600)
    columns = "recipe, device_name, torch_version, mean_seconds, std_seconds, wall_seconds, warmup_seconds, " \
              "data_seconds, world_processes, price_per_hour, cost, sha256"
    [row] = conn.execute(f"SELECT {columns} FROM results").fetchall()
    assert row == fresh.execute(f"SELECT {columns} FROM results").fetchone()
    assert row[1:3] == ("AMD EPYC", "2.13.0+cpu") and row[5] == 460.0 and row[8] == 1
    runs = "SELECT run_index, seed, accuracy, train_seconds, steps, diverged, history FROM runs ORDER BY run_index"
    assert conn.execute(runs).fetchall() == fresh.execute(runs).fetchall()
    assert [r[2] for r in conn.execute(runs)] == [run["accuracy"] for run in old["runs"]]
    assert db.insert_result(conn, old) == 1  # the backfilled SHA-256 deduplicates


def test_import_of_every_stored_result_round_trips_and_is_idempotent(tmp_path, capsys):
    files = sorted((REPO / "benchmarks" / "results").rglob("*.json"))
    assert len(files) >= 8
    conn = db.connect(tmp_path / "r.db")
    done = db.import_files(conn, files)
    assert [entry.error for entry in done] == [None] * len(files) and all(entry.new for entry in done)
    for entry in done:
        assert db.get_result(conn, entry.id) == json.loads(entry.path.read_text())
    assert len({entry.id for entry in done}) == len(files)
    again = db.import_files(conn, files)
    assert [e.id for e in again] == [e.id for e in done] and not any(e.new for e in again)
    reports = [f for f in files if "benchmark" in json.loads(f.read_text())]
    kinds = {json.loads(f.read_text())["benchmark"] for f in reports}
    assert {"vs_airbench", "ab_commits", "step_time", "ablate", "waterfall"} <= kinds
    assert {r["kind"] for r in db.query_reports(conn)} == kinds
    # a report's training results (its settings', as its command stored them) are rows too, each stored once
    rows = {json.dumps(r, sort_keys=True) for f in files for r in
            (json.loads(f.read_text()).get("results", []) if f in reports else [json.loads(f.read_text())])}
    assert len(db.query_reports(conn)) == len(reports) and len(db.query(conn)) == len(rows)
    assert [e.results for e in done] == [len(json.loads(f.read_text()).get("results", [])) if f in reports else 0
                                         for f in files]
    args = argparse.Namespace(files=[str(f) for f in files[:2]], db=str(tmp_path / "r.db"))
    assert file_commands.import_command(args) == 0
    carried = [f", with the {counted(e.results, 'training result')} it carries" if e.results else "" for e in done[:2]]
    assert capsys.readouterr().out.splitlines() == [f"{f} already stored as #{e.id}{c}"
                                                    for f, e, c in zip(files[:2], done, carried)]


def test_query_filters_and_the_results_command(tmp_path, capsys):
    conn = db.connect(tmp_path / "r.db")
    ids = [db.insert_result(conn, make_result(i)) for i in range(4)]  # dated 2026-11-01 ... 04
    gpu = make_result(5, device="cuda", dataset="/data/cifar10", cost={"price_per_hour": 3.6, "price_source": "t"},
                      world={"processes": 2, "nodes": 1, "backend": "nccl", "restarts": 0})
    gpu["environment"].update(device_name="NVIDIA H100 80GB HBM3", device_type="cuda")
    gpu_id = db.insert_result(conn, gpu)
    assert [r["id"] for r in db.query(conn)] == [gpu_id, *reversed(ids)]  # newest first
    assert [r["id"] for r in db.query(conn, device="h100")] == [gpu_id] == [r["id"] for r in db.query(conn,
                                                                                                     device="CUDA")]
    assert db.query(conn, device="cuda")[0]["cost"] == pytest.approx(3.6 * 2 * gpu["train_seconds"]["mean"] / 3600)
    assert [r["id"] for r in db.query(conn, dataset="cifar10")] == [gpu_id]
    assert [r["id"] for r in db.query(conn, since="2026-11-02", until="2026-11-03")] == [ids[2], ids[1]]
    assert [r["id"] for r in db.query(conn, command="--seed 0")] == [ids[0]]
    assert [r["id"] for r in db.query(conn, recipe="cifar10-94", limit=2)] == [gpu_id, ids[3]]
    assert db.query(conn, recipe="nope") == []
    row = db.query(conn, command="--seed 1")[0]
    assert set(row) == set(db.COLUMNS) and row["n"] == 3 and row["mean_accuracy"] == make_result()["mean_accuracy"]
    for bad in ({"since": "yesterday"}, {"until": "2026-13-01"}, {"limit": 0}):
        with pytest.raises(ValueError, match="since|until|limit"):
            db.query(conn, **bad)

    def run(**flags):
        args = dict(recipe=None, dataset=None, device=None, since=None, until=None, command_text=None, limit=None,
                    json=False, csv=False, db=str(tmp_path / "r.db"))
        assert file_commands.results_command(argparse.Namespace(**{**args, **flags})) == 0
        return capsys.readouterr().out

    assert json.loads(run(json=True, device="cpu")) == db.query(conn, device="cpu")
    table = list(csv.DictReader(io.StringIO(run(csv=True))))
    assert [int(r["id"]) for r in table] == [gpu_id, *reversed(ids)] and table[0]["device_name"].startswith("NVIDIA")
    lines = run(limit=2).splitlines()
    assert lines[0].split()[:4] == ["ID", "KIND", "DATE", "RECIPE"] and len(lines) == 3
    assert "NVIDIA H100 80GB HBM3" in lines[1] and "66.73 ± 0.74" in lines[2] and "2508d5a4+" in lines[2]
    with pytest.raises(ValueError, match="exclusive"):
        run(json=True, csv=True)


def one_line_error(path, match: str) -> str:
    with pytest.raises(ValueError, match=match) as caught:
        db.connect(path)
    text = str(caught.value)
    assert "\n" not in text and str(path) in text and "--db PATH" in text
    return text


def test_hostile_databases_and_files(tmp_path, capsys):
    one_line_error(tmp_path, "is a directory")
    (tmp_path / "notes.txt").write_text("not a database, just some text\n" * 100)
    one_line_error(tmp_path / "notes.txt", "not a database")
    one_line_error(tmp_path / "notes.txt" / "results.db", "cannot create")
    future = sqlite3.connect(tmp_path / "future.db")
    future.execute("PRAGMA user_version = 99")
    future.close()
    one_line_error(tmp_path / "future.db", "schema version 99.*newer speedrun")
    other = sqlite3.connect(tmp_path / "other.db")
    other.execute("CREATE TABLE notes (text TEXT)")
    other.close()
    one_line_error(tmp_path / "other.db", "another program")

    conn = db.connect(tmp_path / "r.db")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(make_result(1)))
    bad.write_text(json.dumps({k: v for k, v in make_result(2).items() if k != "recipe"}))
    (tmp_path / "half.json").write_text(json.dumps(make_result(3))[:100])
    done = db.import_files(conn, [bad, good, tmp_path / "half.json", tmp_path / "missing.json"])
    assert done[0].id is None and "'recipe'" in done[0].error
    assert done[1].id == 1 and done[1].error is None and count(conn, "results") == 1
    assert "not valid JSON" in done[2].error and "No such file" in done[3].error
    args = argparse.Namespace(files=[str(bad), str(good)], db=str(tmp_path / "r.db"))
    assert file_commands.import_command(args) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{good} already stored as #1"]  # the failure is on stderr, as the command's error
    assert err.startswith(f"speedrun: error: {bad}: ") and err.count("\n") == 1

    junk = [("n", "3", "'n' is str"), ("runs", [1], "run 1 is not a run record"), ("environment", None, "environment"),
            ("mean_accuracy", True, "is bool"), ("mean_accuracy", float("nan"), "strict JSON"), ("runs", {}, "runs")]
    for key, value, match in junk:
        with pytest.raises(ValueError, match=match):
            db.insert_result(conn, {**make_result(9), key: value})
    with pytest.raises(ValueError, match="whole result"):
        db.insert_result(conn, [1, 2])
    with pytest.raises(ValueError, match="no stored result #77"):
        db.get_result(conn, 77)
    assert count(conn, "results") == 1 and count(conn, "runs") == 3


def test_default_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPEEDRUN_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert db.default_db_path() == tmp_path / "xdg" / "speedrun" / "results.db"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # the XDG spec says to ignore it
    monkeypatch.setenv("HOME", str(tmp_path))
    assert db.default_db_path() == tmp_path / ".local" / "share" / "speedrun" / "results.db"
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "mine.db"))
    assert db.default_db_path() == tmp_path / "mine.db"
    db.connect().close()
    assert (tmp_path / "mine.db").is_file()


def test_red_team_findings(tmp_path, capsys):
    """A refused foreign database is left byte for byte; `--db` before `import` counts; unreadable or absurd files
    fail alone; a file's cost must be a number."""
    import subprocess
    import sys

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE t (x)")
    before = other.read_bytes()
    with pytest.raises(ValueError, match="another program"):
        db.connect(other)
    assert other.read_bytes() == before and not (tmp_path / "other.db-wal").exists()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(make_result(1)))
    done = subprocess.run([sys.executable, "-m", "speedrun", "results", "--db", str(tmp_path / "a.db"), "import",
                           str(good)], capture_output=True, text=True)
    assert done.returncode == 0 and (tmp_path / "a.db").exists(), done.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(make_result(2, n=2**70)))
    junk_cost = tmp_path / "cost.json"
    junk_cost.write_text(json.dumps(make_result(3, cost={"timed_usd_per_run": "lots"})))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    conn = db.connect(tmp_path / "a.db")
    done = db.import_files(conn, [fifo, huge, junk_cost, deep])
    assert [d.id for d in done] == [None] * 4
    assert "regular file" in done[0].error and "out of range" in done[1].error and "timed_usd" in done[2].error
    assert db.query(conn)[0]["id"] == 1  # listing still works


@pytest.mark.parametrize("kind", ["missing", "fifo", "device", "folder", "not json"])
def test_import_reads_its_files_before_it_makes_the_database(kind, tmp_path, capsys):
    """A file that cannot be imported makes no database (nor its folder): every file is read and checked before
    the database is opened, and only a file that passes opens it."""
    from speedrun.cli.program import main

    given = {"missing": tmp_path / "MISSING.json", "fifo": tmp_path / "fifo", "device": Path("/dev/zero"),
             "folder": tmp_path, "not json": tmp_path / "junk.json"}[kind]
    if kind == "fifo":
        os.mkfifo(given)
    if kind == "not json":
        given.write_text("not json\n")
    assert main(["results", "import", str(given), "--db", str(tmp_path / "new" / "x.db")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"speedrun: error: {given}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(make_result(1)))
    assert main(["results", "import", str(given), str(good), "--db", str(tmp_path / "new" / "x.db")]) == 2
    assert capsys.readouterr().out == f"imported {good} as #1\n"


def _sweep_report(**trial) -> dict:
    """A sweep report (instruments/sweep.py) of one complete trial, its fields replaced by `trial`."""
    row = {"number": 0, "state": "complete", "value": 0.5, "mean": 0.5, "ci95": [0.4, 0.6], "n": 2, "p": 0.2,
           "params": {"lr_per_1024": 8.0}, **trial}
    return {"benchmark": "sweep", "recipe": "cifar10-94", "dataset": "cifar10", "objective": "accuracy",
            "study": "s", "storage": "sqlite:///s.db", "trials": [row], "best": row, "results": [],
            "environment": {"timestamp_utc": "2026-11-01T12:00:00+00:00"}, "command": "speedrun sweep"}


@pytest.mark.parametrize("field, report", [
    ("trials[0].mean", _sweep_report(mean=1e308)),
    ("trials[0].value", _sweep_report(value=1e308)),
    ("trials[0].ci95", _sweep_report(ci95=[-1e308, 1e308])),
    ("trials[0].p", _sweep_report(p=7)),
    ("results", {**_sweep_report(), "results": {"a": 1}}),
    ("trials", {**_sweep_report(), "trials": {"0": {}}}),
    ("best", {**_sweep_report(), "best": [1]}),
])
def test_a_sweep_report_of_impossible_trials_is_refused_on_import(field, report, tmp_path, capsys):
    """The report's study section draws what a stored sweep report's trials say: one whose numbers no sweep can
    give (a mean of 1e308, drawn as "inf%"; an interval past the mean's range) or whose trials, best or carried
    results are of another shape is refused in one line naming the file and the field, and nothing is stored."""
    from speedrun.cli.program import main

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(report))
    assert main(["results", "import", str(path), "--db", str(tmp_path / "r.db")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"speedrun: error: {path}: ") and f"'{field}'" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.db").exists()
    path.write_text(json.dumps(_sweep_report()))  # the same report with possible values is taken
    assert main(["results", "import", str(path), "--db", str(tmp_path / "r.db")]) == 0
