"""What the command line says and how it ends, held to the truth: a reader of the output that leaves (any command
ends quietly, 141), the recipes' table, the line that says where finished runs are kept, and advice that names
only flags the command has."""

import contextlib
import errno
import json
import os
import re
import sqlite3
import subprocess
import sys

import pytest
from test_db import make_result
from test_records_hostile_db import SMALL, named_flags, parser_flags

from speedrun.cli import program
from speedrun.cli.program import main
from speedrun.recipes import RECIPES, Recipe, recipe_lines
from speedrun.records import db

# --- a reader of the output that leaves -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "r.db"
    with contextlib.closing(db.connect(path)) as conn:
        for i in range(2):
            db.insert_result(conn, make_result(i))
    return path


@pytest.mark.parametrize("command", [["results"], ["results", "--json"], ["results", "--csv"], ["recipes"],
                                     ["compare", "1", "2"], ["compare", "1", "2", "--json"], ["--help"]],
                         ids=" ".join)
def test_every_command_ends_quietly_when_the_reader_of_its_output_leaves(two_results, command):
    if command != ["recipes"] and command != ["--help"]:
        command = [*command, "--db", str(two_results)]
    child = subprocess.Popen([sys.executable, "-m", "speedrun", *command], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # the reader leaves before a line is written (`| head -c 0`)
    err = child.stderr.read()
    code = child.wait(timeout=120)
    if command == ["--help"]:  # argparse prints and exits 0 by itself, before main's handlers, as quietly
        assert (code, err) == (0, ""), err
        return
    assert (code, err) == (141, ""), err


@pytest.fixture
def reader_left():
    """A pipe whose reading end is closed, for sys.stdout: every write fails with EPIPE, as under `| head`."""
    reader, writer = os.pipe()
    os.close(reader)
    stdout = os.fdopen(writer, "w")
    yield stdout
    with contextlib.suppress(OSError):
        stdout.close()


@pytest.mark.parametrize("command", [["train", "cifar10-94", *SMALL[:-1]],
                                     ["bench", "cifar10-94", *SMALL[:-1], "--runs", "1", "--vary",
                                      "lookahead=false"]], ids=lambda argv: " ".join(argv[:3]))
def test_a_training_command_whose_reader_left_ends_quietly_with_its_result_kept(tmp_path, capsys, monkeypatch,
                                                                                 reader_left, command):
    monkeypatch.setattr(sys, "stdout", reader_left)  # here: capsys sets its own stream as the test starts
    out = tmp_path / "r.json"
    assert main([*command, "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 141
    assert "error" not in capsys.readouterr().err
    assert json.loads(out.read_text())  # written before the table was
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        assert db.query(conn)


def test_a_broken_pipe_that_is_not_stdouts_is_an_error_line(tmp_path, capsys, monkeypatch):
    from speedrun.cli import file_commands

    def worker_pipe(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(file_commands, "results_command", worker_pipe)
    with open(tmp_path / "out.txt", "w") as stdout:  # stdout itself is fine: a file
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["results"]) == 2
    assert capsys.readouterr().err.startswith("speedrun: error: Broken pipe")
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w") as stdout:  # a pipe whose reader has gone
        monkeypatch.setattr(sys, "stdout", stdout)
        assert program._stdout_reader_left()
        monkeypatch.setattr(sys, "stdout", sys.__stderr__)


# --- the recipes' table ---------------------------------------------------------------------------------------

def test_recipe_descriptions_line_up_past_the_longest_name(capsys, monkeypatch):
    long_name = "a-recipe-name-of-thirty-two-chars"
    monkeypatch.setitem(RECIPES, long_name, Recipe(long_name, "cifar", "cifar10_94", "cifar10", "a long one"))
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == recipe_lines() and len(lines) == len(RECIPES)
    columns = {len(line) - len(recipe.description) for line, recipe in zip(lines, RECIPES.values())}
    assert columns == {len(long_name) + 2}  # one column for every description, two spaces past the longest name
    for line, name in zip(lines, RECIPES):
        assert line.startswith(name + " ")
    from speedrun.cli.parser import build_parser

    epilog = [a for a in build_parser()._actions if a.choices and "train" in a.choices][0].choices["train"].epilog
    assert all(f"  {line}" in epilog for line in lines)


# --- where the finished runs are kept -------------------------------------------------------------------------

def test_a_full_disk_part_way_says_how_many_runs_the_file_really_holds(tmp_path, capsys, monkeypatch):
    from speedrun.run import session

    real, calls = session.write_json, []

    def disk_fills(path, obj):
        calls.append(1)
        if len(calls) >= 3:  # the third run's rewrite, and every one after
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(session, "write_json", disk_fills)
    out = tmp_path / "r.json"
    code = main(["train", "cifar10-94", *SMALL, "--runs", "3", "--db", str(tmp_path / "r.db"), "--json", str(out)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert line.endswith(f"; 3 finished runs in the results database {tmp_path / 'r.db'} (#1); {out} holds 2: the "
                         "disk is full"), line
    assert "kept in" not in line
    assert len(json.loads(out.read_text())["runs"]) == 2
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        [row] = db.query(conn)
        assert row["n"] == 3  # the database has every run


def _stopped(kept, path, **more) -> BaseException:
    exc = OSError(errno.ENOSPC, "No space left on device")
    exc.runs_kept, exc.result_path = kept, path
    for key, value in more.items():
        setattr(exc, key, value)
    return exc


def test_the_kept_line_names_what_is_in_each_place(tmp_path):
    full, behind, empty = tmp_path / "full.json", tmp_path / "behind.json", tmp_path / "empty.json"
    for path, runs in ((full, 3), (behind, 2)):
        path.write_text(json.dumps({**make_result(0), "runs": make_result(0)["runs"][:1] * runs}))
    empty.write_text("")
    database = tmp_path / "r.db"
    db.connect(database).close()
    where = program._where_kept
    assert where(_stopped(0, full)) is None
    assert where(_stopped(3, full)) == f"3 finished runs kept in {full}"
    assert where(_stopped(3, None)) == "3 finished runs, no result file asked for"
    assert where(_stopped(3, database)) == f"3 finished runs kept in {database}"  # the database, as it was told
    assert where(_stopped(3, behind)) == f"3 runs finished; {behind} holds 2: the disk is full"
    assert where(_stopped(3, empty)) == f"3 runs finished; {empty} holds 0: the disk is full"
    stored = {"stored_as": (str(database), 7)}
    assert where(_stopped(3, behind, **stored)) == (f"3 finished runs in the results database {database} (#7); "
                                                     f"{behind} holds 2: the disk is full")
    assert where(_stopped(3, full, **stored)) == (f"3 finished runs kept in {full} and in the results database "
                                                   f"{database} (#7)")
    assert where(_stopped(3, database, **stored)) == f"3 finished runs in the results database {database} (#7)"
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"benchmark": "bench", "order": [1, 2, 3, 4]}))
    assert where(_stopped(4, report)) == f"4 finished runs kept in {report}"  # written once, whole


def test_an_interrupt_says_the_same_about_kept_runs(tmp_path, capsys, monkeypatch):
    behind = tmp_path / "r.json"
    behind.write_text(json.dumps({**make_result(0), "runs": make_result(0)["runs"][:1]}))
    from speedrun.cli import file_commands

    def interrupted(args):
        exc = KeyboardInterrupt()
        exc.runs_kept, exc.result_path = 2, behind
        raise exc

    monkeypatch.setattr(file_commands, "results_command", interrupted)
    assert main(["results"]) == 130
    assert capsys.readouterr().err == f"speedrun: interrupted; 2 runs finished; {behind} holds 1\n"


# --- advice names only the command's own flags ----------------------------------------------------------------

ARGV = {"train": ["train"], "bench": ["bench", "--vary", "lookahead=false"], "ablate": ["ablate"],
        "eval": ["eval", "m", "--dataset", "d"], "predict": ["predict", "m", "i.png"],
        "bench-loader": ["bench-loader", "d"], "profile": ["profile"], "tune": ["tune"], "peak": ["peak"],
        "results": ["results"], "results import": ["results", "import", "f.json"], "compare": ["compare", "1", "2"],
        "report": ["report"], "data": ["data", "prepare", "a", "b"], "recipes": ["recipes"],
        "sweep": ["sweep", "--space", "lr_per_1024=8:14"]}


def test_every_command_is_covered():
    assert {argv[0] for argv in ARGV.values()} == set(program._COMMANDS)
    assert set(program._COMMANDS) - {"recipes"} <= set(program._MEMORY_ADVICE)


@pytest.mark.parametrize("name", list(ARGV))
def test_out_of_memory_advice_names_only_flags_the_command_has(name, capsys, monkeypatch):
    def out_of_memory(*args):
        raise MemoryError("tried to allocate 9 GB")

    module, function, takes_argv = program._COMMANDS[ARGV[name][0]]
    function = "import_command" if name == "results import" else function
    if module is None:
        monkeypatch.setitem(program._COMMANDS, name, (None, out_of_memory, takes_argv))
    else:
        import importlib

        monkeypatch.setattr(importlib.import_module(f"speedrun.cli.{module}"), function, out_of_memory)
    assert main(ARGV[name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speedrun: error: out of memory (tried to allocate 9 GB); ") and err.count("\n") == 1
    flags = named_flags(err)
    assert flags <= parser_flags(ARGV[name]), (name, flags - parser_flags(ARGV[name]))
    if "--set" in flags:  # and each key it names is a field of the command's (default) recipe
        from speedrun.config import field_types

        keys = set(field_types(type(RECIPES["cifar10-94"].make_config())))
        assert set(re.findall(r"--set (\w+)=", err)) <= keys


@pytest.mark.parametrize("name", [name for name in ARGV if "--db" in parser_flags(ARGV[name])])
def test_database_refusals_name_only_flags_the_command_has(name, tmp_path):
    for error in ("database disk image is malformed", "database or disk is full", "database is locked",
                  "attempt to write a readonly database", "disk I/O error", "file is not a database"):
        text = str(db.refusal(sqlite3.OperationalError(error), str(tmp_path / "r.db")))
        assert named_flags(text) <= parser_flags(ARGV[name]), (name, text)
