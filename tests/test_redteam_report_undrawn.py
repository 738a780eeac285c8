"""`speedrun report` names every stored report it cannot draw (a red-team round's finding, a class): a report of
the wrong shape is never dropped in silence, "none stored" is said only when none is, an older report that can be
drawn is shown in its place, and nothing of it is an internal error."""

import sqlite3

import pytest
from test_report_hostile import ABLATE, TO_TARGET, WATERFALL

from speedrun.cli.program import main
from speedrun.records import db as db
from speedrun.report import queries

SUMMARY = {"mean": 0.9, "std": 0.01, "ci95_low": 0.88, "ci95_high": 0.92, "n": 2}
BENCH = {**ABLATE, "benchmark": "bench", "tricks": None, "command": "speedrun bench --vary lookahead",
         "settings": [{"name": "baseline", "n": 2, "accuracy": SUMMARY, "train_seconds": {**SUMMARY, "mean": 1.0,
                                                                                         "ci95_high": 1.1}},
                      {"name": "lookahead=false", "n": 2, "accuracy": SUMMARY, "train_seconds": SUMMARY,
                       "versus_baseline": None}]}
TUNE = {**ABLATE, "benchmark": "tune", "tricks": None, "command": "speedrun tune",
        "tune": {"rows": [{"setting": "channels_last=true", "guide": "g", "n": 3, "verdict": "faster",
                           "time": {"ratio": 0.9, "ratio_ci95": [0.8, 1.0], "p": 0.01}}], "recommended": {}}}

BROKEN = [  # (what, the report as stored, then the SQL that breaks it, what the page says of it)
    ("bench settings a string", BENCH, "json_set(json, '$.settings', 'x')", "settings is not a list"),
    ("bench settings missing", BENCH, "json_remove(json, '$.settings')", "settings is missing"),
    ("bench settings of numbers", BENCH, "json_set(json, '$.settings', json('[1, 2]'))",
     "no entry of settings has the numbers to draw"),
    ("ablate relabelled waterfall", ABLATE, "json_set(json, '$.benchmark', 'waterfall')",
     'its benchmark field is "waterfall", not "ablate"'),
    ("ablate relabelled a number", ABLATE, "json_set(json, '$.benchmark', 5)", "its benchmark field is 5"),
    ("ablate nothing measured", ABLATE, "json_set(json, '$.tricks[0].measured', json('false'))",
     "no entry of tricks has the numbers to draw"),
    ("waterfall steps an object", WATERFALL, "json_set(json, '$.waterfall', json('{}'))", "waterfall is not a list"),
    ("to_target variants empty", TO_TARGET, "json_set(json, '$.variants', json('[]'))",
     "no entry of variants has the numbers to draw"),
    ("tune rows null", TUNE, "json_set(json, '$.tune.rows', json('null'))", "tune.rows is missing"),
    ("not JSON", ABLATE, "'{not json'", "it is not valid JSON"),
    ("a JSON list", WATERFALL, "'[1, 2]'", "it is not a JSON object"),
    ("deeply nested", TUNE, "'" + "[" * 5000 + "]" * 5000 + "'", "it is not "),
]


def _database(path, report: dict, sql: str | None) -> tuple:
    conn = db.connect(path)
    report_id = db.insert_result(conn, report)
    conn.close()
    if sql is not None:
        raw = sqlite3.connect(path, isolation_level=None)
        raw.execute(f"UPDATE reports SET json = {sql} WHERE id = ?", (report_id,))
        raw.close()
    return path, report_id


@pytest.mark.parametrize("what, report, sql, said", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_report_that_cannot_be_drawn_is_named_never_called_missing(tmp_path, capsys, what, report, sql, said):
    path, report_id = _database(tmp_path / "r.db", report, sql)
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0, capsys.readouterr().err
    page = out.read_text().split('id="reports"')[0]  # the bench and ablation section, not the list of reports
    assert "No bench or ablation report is stored yet" not in page
    assert f"report #{report_id} ({report['benchmark']}, 2026-11-20) could not be drawn: " in page
    assert said.replace('"', "&quot;") in page, page[page.index('id="ablation"'):]
    if report["benchmark"] in ("ablate", "waterfall", "tune"):  # the BENCHMARKS.md tables name it too
        bench = tmp_path / "BENCHMARKS.md"
        bench.write_text("<!-- ablation:begin -->\n<!-- ablation:end -->\n")
        assert main(["report", "--db", str(path), "--benchmarks", str(bench)]) == 0
        text = bench.read_text()
        assert "No ablation or waterfall report is stored yet" not in text
        assert f"report #{report_id} (" in text and "could not be drawn" in text
    assert "Traceback" not in capsys.readouterr().err


def test_none_stored_is_said_only_when_none_is(tmp_path):
    conn = db.connect(tmp_path / "r.db")
    conn.close()
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(tmp_path / "r.db"), "--out", str(out)]) == 0
    assert "No bench or ablation report is stored yet" in out.read_text()
    assert "could not be drawn" not in out.read_text()


@pytest.mark.parametrize("report, broken, chart", [
    (BENCH, "json_set(json, '$.settings[0]', 3, '$.settings[1]', 4)", "settings"),
    (ABLATE, "json_set(json, '$.tricks', 'x')", "ablation"),
    (WATERFALL, "json_set(json, '$.benchmark', 'ablate')", "waterfall")])
def test_a_newer_broken_report_does_not_hide_an_older_one_that_draws(tmp_path, report, broken, chart):
    path, _ = _database(tmp_path / "r.db", report, None)
    newer = {**report, "environment": {"timestamp_utc": "2026-11-22T12:00:00+00:00"}, "command": "newer one"}
    _, newer_id = _database(path, newer, broken)
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0
    page = out.read_text().split('id="reports"')[0]
    assert f"report #{newer_id} ({report['benchmark']}, 2026-11-22) could not be drawn" in page
    assert report["command"] in page and f'data-chart="{chart}"' in page  # the older one, drawn


def test_the_names_are_bounded(tmp_path):
    conn = db.connect(tmp_path / "r.db")
    for i in range(queries.MAX_LEFT_OUT + 5):
        db.insert_result(conn, {**ABLATE, "tricks": "x", "command": f"speedrun ablate {i}"})
    conn.close()
    left_out = []
    with db.connect(tmp_path / "r.db") as conn:
        assert queries.newest_reports(conn, ("ablate",), left_out) == []
    assert len(left_out) == queries.MAX_LEFT_OUT + 1 and left_out[-1] == "5 more reports could not be drawn"
