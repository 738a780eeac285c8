"""What `speedrun results` and `speedrun compare` print for stored text (a red-team round's findings, each a
class): every cell of the terminal table and every line of a comparison is bounded whatever a stored name holds (the
whole value stays in --json and --csv); a filter that leaves nothing says so, and how to widen it, where the
database holds results."""

import csv
import io
import json
import sqlite3

import pytest
from test_report import make_result

from speedrun.cli import file_commands
from speedrun.cli.program import main
from speedrun.records import db as db

LONG = 200_000  # characters of a stored name: far more than a terminal line
VALUES = [  # (column, the stored value)
    ("recipe", "x" * LONG),
    ("dataset", "/data/" + "d" * LONG),
    ("device_name", "GPU \x1b[31m" + "é" * LONG),
    ("device", "\n" * LONG),
    ("git_commit", "c" * LONG),
]


def _database(path, column=None, value=None):
    conn = db.connect(path)
    first = db.insert_result(conn, make_result(1, 0.9, 1.0))
    db.insert_result(conn, make_result(2, 0.92, 2.0))
    conn.close()
    if column is not None:
        raw = sqlite3.connect(path, isolation_level=None)
        raw.execute(f"UPDATE results SET {column} = ? WHERE id = ?", (value, first))
        if column in ("recipe", "dataset", "device"):  # compare reads the stored JSON
            raw.execute(f"UPDATE results SET json = json_set(json, '$.{column}', ?) WHERE id = ?", (value, first))
        raw.close()
    return path


@pytest.mark.parametrize("column, value", VALUES, ids=[v[0] for v in VALUES])
def test_every_cell_of_the_results_table_is_bounded(tmp_path, capsys, column, value):
    path = _database(tmp_path / "r.db", column, value)
    assert main(["results", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 3 and all(line.isprintable() for line in lines)
    # 12 columns of at most CELL_CHARS characters and their gaps
    assert max(len(line) for line in lines) <= 12 * (file_commands.CELL_CHARS + 2), max(map(len, lines))
    assert "…" in out or column in ("device", "git_commit")  # the table shows the name, the commit's start
    assert main(["results", "--db", str(path), "--json"]) == 0  # the whole value stays in --json
    assert len([r for r in json.loads(capsys.readouterr().out) if r[column] == value]) == 1
    assert main(["results", "--db", str(path), "--csv"]) == 0  # and in --csv (escaped, as ever)
    limit = csv.field_size_limit(10 * LONG)
    try:
        rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    finally:
        csv.field_size_limit(limit)
    assert max(len(cell) for r in rows for cell in r) >= LONG


@pytest.mark.parametrize("text, shown", [("short", "short"), ("a" * 60, "a" * 60), ("a" * 61, "a" * 59 + "…"),
                                         ("\x1b" * 30, "\\x1b" * 14 + "\\x1…"), ("é\n", "é\\n")])
def test_a_cell_is_escaped_then_cut(text, shown):
    assert file_commands._clip(text) == shown


@pytest.mark.parametrize("column", ["recipe", "dataset", "device"])
def test_compare_lines_are_bounded(tmp_path, capsys, column):
    path = _database(tmp_path / "r.db", column, "\x07" + "n" * LONG + "-end")
    assert main(["compare", "1", "2", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    caveats = [line for line in out.splitlines() if line.startswith(f"caveat: {column} differs")]
    assert caveats and all(len(line) <= file_commands.LINE_CHARS + 40 for line in out.splitlines())
    assert "-end'" in caveats[0] and "characters]" in caveats[0]  # both ends of the caveat kept
    assert all(line.isprintable() for line in out.splitlines())


FILTERS = [["--recipe", "nosuch"], ["--dataset", "elsewhere"], ["--device", "tpu"], ["--command", "never typed"],
           ["--since", "2030-01-01"], ["--until", "2000-01-01"], ["--recipe", "cifar10-94", "--device", "tpu"]]


@pytest.mark.parametrize("filters", FILTERS, ids=[" ".join(f) for f in FILTERS])
def test_filters_that_leave_nothing_say_so_and_how_to_widen_them(tmp_path, capsys, filters):
    path = _database(tmp_path / "r.db")
    assert main(["results", "--db", str(path), *filters]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"no stored result matches {' '.join(filters).replace('never typed', repr('never typed'))};" \
        in captured.err, captured.err
    assert "widen" in captured.err and "import" not in captured.err
    empty = db.connect(tmp_path / "empty.db")
    empty.close()
    assert main(["results", "--db", str(tmp_path / "empty.db"), *filters]) == 0  # an empty database: import advice
    err = capsys.readouterr().err
    assert "holds none yet" in err and "`speedrun results import FILE`" in err and "widen" not in err


def test_a_long_filter_is_named_bounded(tmp_path, capsys):
    path = _database(tmp_path / "r.db")
    assert main(["results", "--db", str(path), "--command", "z" * 100_000]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 400 and "--command " in err
