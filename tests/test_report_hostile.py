"""`speedrun report` against databases and files from elsewhere (a red-team round's findings, each a class):
anything stored draws a bounded page or gives one line; a refused file, and the user's Markdown, stay as they came."""

import os
import shutil
import sqlite3
import stat

import pytest

from speedrun.records import db as db
from speedrun.cli.program import main
from test_report import make_result

ABLATE = {"benchmark": "ablate", "recipe": "cifar10-94", "dataset": "d", "device": "cpu", "runs": 2,
          "complete": True, "interrupted": False, "command": "speedrun ablate",
          "environment": {"timestamp_utc": "2026-11-20T12:00:00+00:00"},
          "tricks": [{"trick": "lookahead", "off": False, "what": "w", "measured": True, "gain_accuracy": 0.01,
                      "gain_ci95": [0.0, 0.02], "p": 0.04, "time_ratio_off": 1.0}]}
WATERFALL = {**ABLATE, "benchmark": "waterfall", "tricks": None,
             "waterfall": [{"step": "plain", "accuracy": {"mean": 0.5, "std": 0.01}, "bought": None},
                           {"step": "+ lookahead", "accuracy": {"mean": 0.6, "std": 0.01},
                            "bought": {"accuracy": {"diff": 0.1, "ci95": [0.05, 0.15], "p": 0.01}}}]}
TO_TARGET = {**ABLATE, "benchmark": "to_target", "tricks": None,
             "variants": [{"name": "baseline", "epochs_needed": 2.0, "seconds_needed": 3.0, "search_complete": True,
                           "probes": [{"epochs": 2.0}, {"epochs": 1.0}]},
                          {"name": "lookahead=false", "epochs_needed": None, "search_complete": True,
                           "probes": [{"epochs": 4.0}]}]}


def base_db(path):
    conn = db.connect(path)
    for i in range(3):
        db.insert_result(conn, make_result(i, 0.9 + i / 100, 1.0 + i))
    for report in (ABLATE, WATERFALL, TO_TARGET):
        db.insert_result(conn, report)
    conn.close()
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_db(tmp_path_factory.mktemp("hostile") / "base.db")


def tampered(base, tmp_path, *sql):
    path = tmp_path / "t.db"
    shutil.copy(base, path)
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in sql:
        conn.execute(statement)
    conn.execute("PRAGMA journal_mode = DELETE")  # everything in the one file, whose bytes the tests compare
    conn.close()
    return path


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


DEEP = "[" * 3000 + "]" * 3000
CONTENT = [  # (what, SQL): every one draws a page (the bad value or row left out)
    ("results.json not JSON", "UPDATE results SET json = 'not json' WHERE id = 1"),
    ("results.json NaN", "UPDATE results SET json = 'NaN' WHERE id = 1"),
    ("results.json deep", f"UPDATE results SET json = '{DEEP}' WHERE id = 1"),
    ("n a string", "UPDATE results SET n = 'many' WHERE id = 1"),
    ("n huge, hit rate huge", "UPDATE results SET n = 9223372036854775807, hit_rate = 1e300 WHERE id = 1"),
    ("accuracy 500%", "UPDATE results SET mean_accuracy = 5.0 WHERE id = 1"),
    ("negative spreads and seconds", "UPDATE results SET std_accuracy = -1, std_seconds = -2, mean_seconds = -3"),
    ("cost huge", "UPDATE results SET cost = 1e300"),
    ("recipe not UTF-8", "UPDATE results SET recipe = CAST(x'ff41' AS TEXT) WHERE id = 1"),
    ("history a number", "UPDATE runs SET history = '5'"),
    ("history not UTF-8", "UPDATE runs SET history = CAST(x'ff5b5d' AS TEXT)"),
    ("report lists are numbers", "UPDATE reports SET json = json_set(json, '$.tricks', 5, '$.waterfall', 5, "
                                 "'$.variants', 5)"),
    ("probes a number", "UPDATE reports SET json = json_set(json, '$.variants[0].probes', 5)"),
    ("interval not holding its value", "UPDATE reports SET json = json_set(json, '$.tricks[0].gain_ci95', "
                                       "json('[0.5, 0.6]'))"),
    ("waterfall std negative", "UPDATE reports SET json = json_set(json, '$.waterfall[0].accuracy.std', -1)"),
    ("report json not UTF-8", "UPDATE reports SET json = CAST(x'ff7b7d' AS TEXT), command = CAST(x'ff' AS TEXT)"),
]


@pytest.mark.parametrize("what, sql", CONTENT, ids=[c[0] for c in CONTENT])
def test_hostile_content_draws_a_page_without_it(base, tmp_path, capsys, what, sql):
    path = tampered(base, tmp_path, sql)
    before = path.read_bytes()
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "warning" not in err and "Traceback" not in err  # a library's note on odd data is not shown
    text = out.read_text()
    assert "$1000000" not in text and "500.00" not in text  # implausible values are not shown as numbers
    assert path.read_bytes() == before  # report only reads


SHAPES = [  # (what, SQL): not speedrun's tables: one line, the file unchanged
    ("negative version", "PRAGMA user_version = -2"),
    ("runs replaced by a view", "DROP TABLE runs", "CREATE VIEW runs AS SELECT 1 AS x"),
    ("a column missing", "ALTER TABLE results DROP COLUMN cost"),
    ("reports missing", "DROP TABLE reports"),
]


@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
@pytest.mark.parametrize("command", [["report", "--out", "r.html"], ["results"]])
def test_a_database_of_another_shape_is_refused_and_left_as_it_came(base, tmp_path, capsys, case, command,
                                                                   monkeypatch):
    path = tampered(base, tmp_path, *case[1:])
    before = path.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--db", str(path)]) == 2
    assert "not speedrun's" in one_line(capsys)
    assert path.read_bytes() == before and not (tmp_path / "t.db-wal").exists()


def test_a_read_only_database_is_read(base, tmp_path):
    path = tmp_path / "ro.db"
    shutil.copy(base, path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    path.chmod(0o444)
    assert main(["report", "--db", str(path), "--out", str(tmp_path / "r.html")]) == 0
    assert "#### Ablation" not in (tmp_path / "r.html").read_text() and "lookahead" in (tmp_path / "r.html").read_text()


def test_an_empty_file_is_not_made_a_database(tmp_path, capsys):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    assert main(["report", "--db", str(path), "--out", str(tmp_path / "r.html")]) == 2
    assert "empty file" in one_line(capsys) and path.read_bytes() == b""


@pytest.mark.slow
def test_the_page_is_bounded_whatever_the_database_holds(base, tmp_path):
    many = {**TO_TARGET, "variants": [{"name": f"v{i}", "epochs_needed": 1.0 + i, "search_complete": True,
                                       "probes": [{"epochs": 1.0 + i}]} for i in range(3000)]}
    path = tmp_path / "big.db"
    shutil.copy(base, path)
    conn = db.connect(path)
    db.insert_result(conn, many)
    for i in range(60):  # 60 datasets: more leaderboards than a page shows
        db.insert_result(conn, make_result(10 + i % 15, 0.95, 1.0, dataset=f"set{i}", command=f"c{i}"))
    conn.close()
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert len(text) < 8_000_000 and text.count("<h3>") < 80 and "more leaderboards not shown" in text


def test_markdown_files_keep_their_link_mode_and_refuse_what_is_not_theirs(base, tmp_path, capsys):
    real = tmp_path / "docs" / "README.md"
    real.parent.mkdir()
    real.write_text("<!-- records:begin -->\n<!-- records:end -->\n")
    real.chmod(0o640)
    link = tmp_path / "README.md"
    link.symlink_to(real)
    assert main(["report", "--db", str(base), "--readme", str(link)]) == 0
    assert link.is_symlink() and "No record is claimed yet" in real.read_text()  # none of base_db's reaches
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    real.chmod(0o444)
    before = real.read_text()
    capsys.readouterr()
    if os.geteuid() != 0:  # root may write a 0444 file; the check asks os.access, which says so
        assert main(["report", "--db", str(base), "--readme", str(real)]) == 2
        assert "read-only" in one_line(capsys)
    real.chmod(0o644)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag in ("--readme", "--benchmarks", "--out"):  # a FIFO would block forever
        assert main(["report", "--db", str(base), flag, str(fifo)]) == 2
        one_line(capsys)
        assert main(["report", "--db", str(base), flag, ""]) == 2
        assert "needs a file name" in one_line(capsys)
    assert real.read_text() == before and not (tmp_path / "speedrun-report.html").exists()


def test_stored_text_never_becomes_markup_or_a_marker(base, tmp_path):
    evil = "x <!-- records:end --> <img src=x onerror=alert(1)> <script>"
    # each result made to reach its target too: the README's records show only those
    path = tampered(base, tmp_path, f"UPDATE results SET recipe = '{evil}', command = 'a <!-- records:begin --> b', "
                    "mean_accuracy = 0.99")
    readme = tmp_path / "README.md"
    readme.write_text("top\n<!-- records:begin -->\n<!-- records:end -->\nend\n")
    for _ in range(2):  # the second run finds its markers again
        assert main(["report", "--db", str(path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.count("<!-- records:begin -->") == 1 and text.count("<!-- records:end -->") == 1
    assert "<img" not in text and "<script" not in text and "&lt;img" in text
    assert "| 2026-11-01 |" in text  # the date whole


def test_an_interrupted_search_is_shown_as_such_and_never_hides_a_complete_one(base, tmp_path):
    partial = {**TO_TARGET, "complete": False, "interrupted": True, "command": "speedrun ablate --to-target cut",
               "environment": {"timestamp_utc": "2026-11-21T12:00:00+00:00"},
               "variants": [{"name": "baseline", "epochs_needed": None, "search_complete": False,
                             "probes": [{"epochs": 1.0}]}]}
    path = tmp_path / "p.db"
    conn = db.connect(path)
    db.insert_result(conn, partial)
    conn.close()
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "unfinished" in text and "partial: the command was interrupted" in text and "not reached" not in text
    conn = db.connect(path)
    db.insert_result(conn, TO_TARGET)  # older, but complete: it is the one shown
    conn.close()
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "--to-target cut" not in text.split('id="reports"')[0] and "not reached" in text
