"""The results database when it is not what a command expects: damaged, full, locked, read-only, not a file, or
named with a ~user that does not exist. Each class through the commands that touch the database: one line naming
the file and the fix, the file left as it came, and a training run's result kept whatever happens to its row."""

import contextlib
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_db import make_result

from speedrun.cli.parser import build_parser
from speedrun.cli.program import main
from speedrun.records import db

SMALL = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
         "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet"]


def parser_flags(argv: list[str]) -> set[str]:
    """The option strings of the (sub)command `argv` starts with (`results import`, `data prepare` included)."""
    parser, flags = build_parser(), set()
    for word in argv:
        actions = [a for a in parser._actions if a.choices and isinstance(a.choices, dict) and word in a.choices]
        if not actions:
            break
        parser = actions[0].choices[word]
        flags |= set(parser._option_string_actions)  # `results --db X import F` takes results' flags too
    return flags


def named_flags(message: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", message))


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    return err


def damaged(path: Path, results: int = 2) -> Path:
    """A results database of `results` rows, in WAL mode as speedrun leaves it, whose results table's root page
    is overwritten: opening it works, reading the results meets "database disk image is malformed"."""
    conn = db.connect(path)
    for i in range(results):
        db.insert_result(conn, make_result(i))
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'results'").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()  # the log is checkpointed into the file and removed: the file is the whole database
    assert not Path(f"{path}-wal").exists()
    with open(path, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xff" * 16)  # no b-tree page starts so
    return path


@pytest.fixture
def bad_db(tmp_path) -> Path:
    return damaged(tmp_path / "r.db")


@pytest.mark.parametrize("command", [["results"], ["results", "--json"], ["results", "--csv"],
                                     ["compare", "1", "2"], ["report", "--out", "r.html"],
                                     ["results", "import", "good.json"]], ids=lambda argv: " ".join(argv[:3]))
def test_a_damaged_database_is_one_line_naming_it_and_is_left_as_it_came(bad_db, tmp_path, capsys, monkeypatch,
                                                                         command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.json").write_text(json.dumps(make_result(7)))
    before = bad_db.read_bytes()
    assert main([*command, "--db", str(bad_db)]) == 2
    err = one_line(capsys)
    assert err.startswith(f"speedrun: error: the results database {bad_db} is damaged (database disk image is "
                          "malformed)"), err
    assert ".recover" in err and "move it aside" in err and "left as it is" in err
    assert named_flags(err) <= parser_flags(command), err  # advice names only flags this command has
    assert bad_db.read_bytes() == before
    assert not (tmp_path / "r.html").exists()
    if command[-1] == "good.json":
        assert "good.json and the files after it were not imported" in err


def test_a_damaged_database_costs_train_a_warning_never_its_result(bad_db, tmp_path, capsys):
    before = bad_db.read_bytes()
    out = tmp_path / "r.json"
    assert main(["train", "cifar10-94", *SMALL, "--db", str(bad_db), "--json", str(out)]) == 0
    err = capsys.readouterr().err
    [warning] = [line for line in err.splitlines() if "warning" in line]
    assert "was not stored" in warning and f"the results database {bad_db} is damaged" in warning
    assert f"it is in {out}" in warning and "results import" in warning
    assert json.loads(out.read_text())["n"] == 1  # the result, whole, in its file
    assert bad_db.read_bytes() == before


@pytest.fixture(scope="module")
def bench_on_a_damaged_database(tmp_path_factory):
    """One bench (two settings, one run each) whose database's results table is damaged after it was opened."""
    tmp = tmp_path_factory.mktemp("bench")
    path = damaged(tmp / "r.db")
    before = path.read_bytes()
    done = subprocess.run([sys.executable, "-m", "speedrun", "bench", "cifar10-94", *SMALL[:-1], "--runs", "1",
                           "--vary", "lookahead=false", "--db", str(path), "--json", str(tmp / "b.json")],
                          capture_output=True, text=True, timeout=600, cwd=tmp)
    return done, path, before, tmp / "b.json"


def test_bench_on_a_damaged_database_warns_naming_it_and_keeps_the_report(bench_on_a_damaged_database):
    """As train: the runs are done, so the database's fault costs a warning, never the report."""
    done, path, before, report = bench_on_a_damaged_database
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    [warning] = [line for line in done.stderr.splitlines() if "warning" in line]
    assert warning.startswith(f"speedrun: warning: the report was not stored in the results database (the results "
                              f"database {path} is damaged") and f"results import {report}" in warning
    assert named_flags(warning) <= parser_flags(["bench"])
    assert f"report: {report} (not stored in the results database)" in done.stderr
    assert path.read_bytes() == before


def test_bench_on_a_damaged_database_keeps_its_report_file(bench_on_a_damaged_database):
    _, _, _, report = bench_on_a_damaged_database
    assert report.exists() and len(json.loads(report.read_text())["order"]) == 2


def test_every_kind_of_sqlite_failure_is_a_refusal_naming_the_file(tmp_path, monkeypatch):
    """A full disk and a lock held too long, made for real; the other kinds from their SQLite errors."""
    path = tmp_path / "r.db"
    conn = db.connect(path)
    db.insert_result(conn, make_result(0))
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")  # this connection may not grow the file: SQLITE_FULL
    with pytest.raises(db.UnusableDatabase, match=f"^the disk holding the results database {re.escape(str(path))} "
                                                  "is full .*free space"):
        db.insert_result(conn, make_result(1, runs=[{**make_result(1)["runs"][0], "history": ["x" * 9000]}]))
    conn.close()

    monkeypatch.setattr(db, "BUSY_TIMEOUT_S", 0.05)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        conn = db.connect(path)
        with pytest.raises(db.UnusableDatabase, match=f"results database {re.escape(str(path))} stayed locked"):
            db.insert_result(conn, make_result(2))
        conn.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with contextlib.closing(db.connect(path)) as conn:
        assert [row["id"] for row in db.query(conn)] == [1]  # neither failure left a row

    errors = [(sqlite3.DatabaseError("database disk image is malformed"), "is damaged"),
              (sqlite3.DatabaseError("file is not a database"), "is not a SQLite database"),
              (sqlite3.OperationalError("database or disk is full"), "is full"),
              (sqlite3.OperationalError("attempt to write a readonly database"), "cannot write"),
              (sqlite3.OperationalError("disk I/O error"), "cannot read or write"),
              (sqlite3.OperationalError("database is locked"), "stayed locked"),
              (sqlite3.OperationalError("no such table: results"), "cannot use")]
    for error, fragment in errors:
        text = str(db.refusal(error, "/data/r.db"))
        assert fragment in text and "/data/r.db" in text and "\n" not in text, text
        assert "--db PATH" in text or "try again" in text or "free space" in text, text


def test_a_misuse_of_sqlite_stays_a_bug_and_one_that_escapes_is_named(tmp_path, capsys, monkeypatch):
    """ProgrammingError is this code's mistake (an internal error, exit 1); an engine error that got past db.py
    still reaches the user as the database's one line (the guard in main)."""
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        with pytest.raises(sqlite3.ProgrammingError):
            conn.execute("SELECT ?", ())
    from speedrun.cli import file_commands

    def locked(args):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(file_commands, "results_command", locked)
    assert main(["results", "--db", str(tmp_path / "x.db")]) == 2
    assert f"the results database {tmp_path / 'x.db'} stayed locked" in one_line(capsys)

    def misuse(args):
        raise sqlite3.ProgrammingError("Incorrect number of bindings supplied")

    monkeypatch.setattr(file_commands, "results_command", misuse)
    assert main(["results", "--db", str(tmp_path / "x.db")]) == 1
    assert "internal error: ProgrammingError" in capsys.readouterr().err


# --- paths that are not a regular file ------------------------------------------------------------------------

def _not_files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / "sock"))
    (tmp_path / "to-null").symlink_to("/dev/null")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    (tmp_path / "to-folder").symlink_to(tmp_path / "folder")
    return {"device": Path("/dev/null"), "folder": tmp_path / "folder", "fifo": tmp_path / "fifo",
            "socket": tmp_path / "sock", "symlink to a device": tmp_path / "to-null",
            "symlink to a fifo": tmp_path / "to-fifo", "symlink to a folder": tmp_path / "to-folder"}


@pytest.mark.parametrize("command", [["results"], ["compare", "1", "2"], ["report", "--out", "r.html"],
                                     ["results", "import", "good.json"], ["train", "cifar10-94", *SMALL],
                                     ["bench", "cifar10-94", "--vary", "lookahead=false", *SMALL[:-1]],
                                     ["ablate", "cifar10-94", *SMALL[:-1]]], ids=lambda argv: " ".join(argv[:3]))
def test_a_database_path_that_is_not_a_file_is_refused_before_sqlite_sees_it(tmp_path, capsys, monkeypatch,
                                                                              command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.json").write_text(json.dumps(make_result(7)))
    paths = _not_files(tmp_path)
    before = sorted(os.listdir(tmp_path))
    writes = ["--json", "r.json"] if command[0] in ("train", "bench", "ablate") else []
    for kind, path in paths.items():
        assert main([*command, "--db", str(path), *writes]) == 2, kind
        err = one_line(capsys)
        assert f"results database {path} is " in err and "not a file" in err and "--db PATH" in err, (kind, err)
        assert sorted(os.listdir(tmp_path)) == before, kind  # no -journal, -wal or result file beside it
    for suffix in ("-journal", "-wal", "-shm"):
        assert not os.path.exists(f"/dev/null{suffix}")


# --- read-only databases --------------------------------------------------------------------------------------

def _filled(path: Path) -> Path:
    with contextlib.closing(db.connect(path)) as conn:
        for i in range(2):
            db.insert_result(conn, make_result(i, runs=[{**run, "accuracy": 0.9 + i / 100 + j / 1000}
                                                        for j, run in enumerate(make_result(i)["runs"])]))
    return path


def test_read_only_commands_read_a_database_this_process_may_not_write(tmp_path, capsys, monkeypatch):
    """The decision, in process: os.access (the kernel's answer, which a read-only mount and the permissions
    give) says no to writing; SQLite itself can still write here (root), so this covers the choice of a read-only
    connection, not SQLite on a read-only mount (the next tests do that)."""
    path = _filled(tmp_path / "ro" / "r.db")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK and str(p).startswith(
        str(tmp_path / "ro")) else real(p, mode, **kw))
    before = path.read_bytes()
    assert main(["results", "--db", str(path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["compare", "1", "2", "--db", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "timed s" in out and err == f"not stored: this process may not write the results database {path}\n"
    assert main(["report", "--db", str(path), "--out", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()
    assert main(["results", "--db", str(path), "import", str(tmp_path / "r.html")]) == 2
    assert f"cannot write to the results database {path}: this process may not write it" in one_line(capsys)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM reports").fetchone()[0] == 0  # compare stored nothing
    assert path.read_bytes() == before


_READ_ALL = textwrap.dedent("""
    import json, sys
    from speedrun.cli.program import main
    path, out = sys.argv[1], sys.argv[2]
    codes = [main(["results", "--db", path]), main(["compare", "1", "2", "--db", path]),
             main(["report", "--db", path, "--out", out]), main(["results", "--db", path, "import", out])]
    print("CODES", json.dumps(codes), file=sys.stderr)
""")


def _read_all(prefix: list[str], folder: Path, out: Path) -> tuple[list[int], str]:
    script = folder.parent / "read_all.py"
    script.write_text(_READ_ALL)
    done = subprocess.run([*prefix, sys.executable, str(script), str(folder / "r.db"), str(out)],
                          capture_output=True, text=True, timeout=300)
    codes = [line for line in done.stderr.splitlines() if line.startswith("CODES ")]
    assert codes, done.stderr[-3000:]
    return json.loads(codes[0][6:]), done.stderr


def _read_only_mount(folder: Path) -> list[str]:
    """A command prefix that runs under a private mount namespace where `folder` is bind-mounted read-only (as
    root, with CAP_SYS_ADMIN; the system's mounts are not touched)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (root with CAP_SYS_ADMIN) for a read-only mount")
    return ["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{folder}" "{folder}" && exec "$0" "$@"']


def test_a_database_on_a_read_only_mount_is_read_by_the_reading_commands(tmp_path):
    folder = tmp_path / "mnt"
    path = _filled(folder / "r.db")
    before = path.read_bytes()
    codes, err = _read_all(_read_only_mount(folder), folder, tmp_path / "r.html")
    assert codes == [0, 0, 0, 2], err  # results, compare, report read it; import is refused in one line
    assert f"not stored: this process may not write the results database {path}" in err
    assert f"speedrun: error: cannot write to the results database {path}" in err and "Traceback" not in err
    assert path.read_bytes() == before and sorted(os.listdir(folder)) == ["r.db"]
    assert "<html" in (tmp_path / "r.html").read_text()


def test_a_read_only_folder_and_file_are_read_by_the_reading_commands(tmp_path):
    """chmod does not stop root: the commands run with root's override capabilities dropped (capsh), so the
    permissions count as for any user."""
    if shutil.which("capsh") is None:
        pytest.skip("needs capsh to drop root's permission override")
    folder = tmp_path / "ro"
    path = _filled(folder / "r.db")
    before = path.read_bytes()
    path.chmod(0o444)
    folder.chmod(0o555)
    try:
        prefix = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", 'exec "$0" "$@"']
        codes, err = _read_all(prefix, folder, tmp_path / "r.html")
    finally:
        folder.chmod(0o755)
    assert codes == [0, 0, 0, 2], err
    assert f"not stored: this process may not write the results database {path}" in err and "Traceback" not in err
    assert path.read_bytes() == before and sorted(os.listdir(folder)) == ["r.db"]


def test_a_read_only_folder_with_a_write_ahead_log_is_not_read_unlocked(tmp_path):
    """A -wal beside the database (a writer at work, or changes never checkpointed) rules out immutable=1: the
    read would skip them. One line saying what to do instead."""
    folder = tmp_path / "mnt"
    path = _filled(folder / "r.db")
    Path(f"{path}-wal").write_bytes(b"")
    codes, err = _read_all(_read_only_mount(folder), folder, tmp_path / "r.html")
    assert codes == [2, 2, 2, 2], err
    assert f"cannot read the results database {path} here" in err and "copy the database" in err
    assert "Traceback" not in err


# --- ~user paths that cannot be expanded ----------------------------------------------------------------------

_TILDE = "~nosuchuser4fd1"


@pytest.mark.parametrize("flag, env, name", [
    (["--db", f"{_TILDE}/r.db"], {}, "--db"),
    ([], {"SPEEDRUN_DB": f"{_TILDE}/r.db"}, "SPEEDRUN_DB"),
    (["--json", f"{_TILDE}/r.json"], {}, "--json"),
    (["--checkpoint-dir", f"{_TILDE}/c"], {}, "--checkpoint-dir"),
    (["--save", f"{_TILDE}/m"], {}, "--save"),
    ([], {"SPEEDRUN_RESULTS": f"{_TILDE}/results"}, "SPEEDRUN_RESULTS"),
    ([], {"SPEEDRUN_PRICES": f"{_TILDE}/prices.json"}, "SPEEDRUN_PRICES"),
    ([], {"SPEEDRUN_DATA": f"{_TILDE}/data"}, "SPEEDRUN_DATA"),
    (["--dataset", "cifar10", "--data-dir", f"{_TILDE}/data"], {}, "--data-dir"),
])
def test_a_tilde_of_no_user_is_one_line_naming_where_it_came_from(tmp_path, capsys, monkeypatch, flag, env, name):
    monkeypatch.chdir(tmp_path)
    for key in ("SPEEDRUN_DB", "SPEEDRUN_RESULTS", "SPEEDRUN_PRICES", "SPEEDRUN_DATA"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    own = {"--db": ["--db", str(tmp_path / "r.db")], "--json": ["--json", str(tmp_path / "r.json")]}
    if "SPEEDRUN_RESULTS" in env:
        own.pop("--json")
    if "SPEEDRUN_DB" in env:
        own.pop("--db")
    argv = ["train", "cifar10-94", *SMALL, *[w for key, words in own.items() if key not in flag for w in words],
            *flag]
    assert main(argv) == 2
    err = one_line(capsys)
    assert name in err and _TILDE in err and "give the path in full" in err, err
    assert not list(tmp_path.glob("*.json")) and not (tmp_path / "results").exists()


@pytest.mark.parametrize("command", [["results"], ["compare", "1", "2"], ["report"], ["results", "import", "x"]],
                         ids=" ".join)
def test_a_tilde_of_no_user_for_the_reading_commands_database(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--db", f"{_TILDE}/r.db"]) == 2
    err = one_line(capsys)
    assert "--db" in err and _TILDE in err and "give the path in full" in err, err
    monkeypatch.setenv("SPEEDRUN_DB", f"{_TILDE}/r.db")
    assert main(command) == 2
    err = one_line(capsys)
    assert "SPEEDRUN_DB" in err and "give the path in full" in err, err


# --- what `speedrun results` shows ----------------------------------------------------------------------------

def test_results_marks_what_stored_each_row_and_shows_hits_of_n(tmp_path, capsys):
    path = tmp_path / "r.db"
    commands = {"train": "speedrun train cifar10-94 --runs 3", "smoke": "speedrun train --smoke",
                "bench": "speedrun bench cifar10-94 --vary lookahead=false  # setting baseline",
                "ablate": "speedrun ablate cifar10-94  # setting lookahead=False",
                "waterfall": "speedrun ablate cifar10-94 --waterfall lookahead,ema  # setting + ema",
                "to-target": "torchrun --standalone --nproc_per_node=2 -m speedrun ablate --to-target  # setting "
                             "baseline, 2 epochs (20 steps)",
                "tune": "speedrun tune cifar10-94  # setting compile=true",
                "sweep": "speedrun sweep cifar10-94 --space lr_per_1024=8:14  # setting trial 3 of s: lr_per_1024=9",
                "python API": None}
    with contextlib.closing(db.connect(path)) as conn:
        for i, (kind, command) in enumerate(commands.items()):
            result = make_result(i, command=command, smoke_test=kind == "smoke", target=0.94)  # hits count
            db.insert_result(conn, result)
        conn.execute("UPDATE results SET hit_rate = 2.0 / 3, n = 3 WHERE id = 1")
        conn.execute("UPDATE results SET hit_rate = 1e300, n = 9223372036854775807 WHERE id = 2")  # from elsewhere
        rows = {row["id"]: row for row in db.query(conn)}
    expected = [kind if kind != "python API" else "train" for kind in commands]
    assert [rows[i + 1]["kind"] for i in range(len(commands))] == expected and set(expected) == set(db.KINDS)
    assert main(["results", "--db", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["ID", "KIND"]
    start, end = lines[0].index("HITS"), lines[0].index("COST $")  # the HITS column, by its place in the header
    kinds = {line.split()[0]: line.split()[1] for line in lines[1:]}
    hits = {line.split()[0]: line[start:end].strip() for line in lines[1:]}
    assert [kinds[str(i + 1)] for i in range(len(commands))] == expected
    assert hits["1"] == "2/3"
    assert "/" not in hits["2"] and hits["2"].startswith("1000000")  # no share of n: shown as stored
    assert hits["3"] == f"{round(make_result(2)['hit_rate'] * make_result(2)['n'])}/{make_result(2)['n']}"
    assert main(["results", "--db", str(path), "--json"]) == 0
    assert [r["kind"] for r in json.loads(capsys.readouterr().out)][::-1] == expected


@pytest.mark.parametrize("form", [[], ["--csv"], ["--json"]])
def test_stored_names_reach_the_terminal_escaped_in_every_form_of_results(tmp_path, capsys, form):
    path = tmp_path / "r.db"
    hostile = "data\x1b[31mset\nname\x07"
    with contextlib.closing(db.connect(path)) as conn:
        db.insert_result(conn, {**make_result(0), "dataset": hostile, "recipe": "cifar10-94\x1b]0;title\x07"})
    assert main(["results", "--db", str(path), *form]) == 0
    captured = capsys.readouterr()
    assert not any(c in captured.out + captured.err for c in "\x1b\x07"), captured.out
    assert "data" in captured.out and "set" in captured.out
