"""The races against airbench94 (benchmarks/vs_airbench.py's reports) as the pages show them: speedrun.report.races
reads them hostile (each number checked, dry runs and unfinished races left out, the data set's name and never its
path), the HTML report shows them first, and README.md's front page shows them, then the records (results that
reach their target by the records rule), or one line saying no record is claimed yet."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
from conftest import load_benchmark
from test_report import make_result

from speedrun.records import db
from speedrun.records.result_file import portable
from speedrun.report import html, markdown, races

vs = load_benchmark("vs_airbench")


def race(ours_runs, anchor_runs, *, device="NVIDIA H100 80GB HBM3", on_cpu=False,
         date="2026-11-26T10:47:44+00:00", **changes) -> dict:
    """A report as vs_airbench.py writes it (its own side() and compare()), our runs and airbench94's each as
    (accuracy, timed seconds)."""
    ours = [{"seed": i, "accuracy": a, "train_seconds": t, "steps": 484} for i, (a, t) in enumerate(ours_runs)]
    anchor = [{"seed": i, "accuracy": a, "train_seconds": t} for i, (a, t) in enumerate(anchor_runs)]
    report = {"benchmark": "vs_airbench", "command": "PYTHONPATH=src:third_party/airbench-0.1.8 python "
              "benchmarks/vs_airbench.py --data /tmp/cifar10-jpeg --runs 3 --out /root/out/vs_airbench.json",
              "timed_region": vs.TIMED_REGION, "runs_planned": len(ours), "complete": True, "dry_run_cpu": False,
              "on_cpu": on_cpu, "schedule": None,
              "data": {"name": "cifar10-jpeg", "spec": "/tmp/secret/cifar10-jpeg", "train": 50000, "test": 10000},
              "ours": {"recipe": "cifar10-94", "precision": "bf16", **vs.side(ours)},
              "airbench": {"system": vs.AIRBENCH, **vs.side(anchor)}, "comparison": vs.compare(ours, anchor),
              "environment": {"device_name": device, "device_type": "cpu" if on_cpu else "cuda",
                              "timestamp_utc": date}}
    report.update(changes)
    return portable(report)


GPU = race([(0.906, 2.75), (0.907, 2.80), (0.905, 2.70)], [(0.906, 2.05), (0.905, 2.10), (0.907, 2.00)])
CPU_ONE_RUN = race([(0.9078, 3060.2)], [(0.9098, 2359.9)], device="AMD EPYC", on_cpu=True,
                   date="2026-11-22T16:34:17+00:00")
CPU_REDUCED = race([(0.80, 118.0), (0.81, 113.0), (0.81, 112.0)], [(0.81, 427.0), (0.81, 426.0), (0.81, 420.0)],
                   device="Intel(R) Xeon(R) Processor", on_cpu=True, date="2026-11-28T05:40:34+00:00",
                   schedule={"airbench_epochs": 2, "ours_epochs": 1.97, "steps": 96})
DRY_RUN = {**race([(0.1, 1.0), (0.1, 1.0)], [(0.1, 1.0), (0.1, 1.0)], date="2026-11-29T00:00:00+00:00"),
           "dry_run_cpu": True, "airbench": None, "comparison": None}
UNFINISHED = race([(0.9, 2.0), (0.9, 2.1)], [(0.9, 2.0)], complete=False, date="2026-11-27T00:00:00+00:00")


@pytest.fixture
def conn(tmp_path):
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        for report in (CPU_ONE_RUN, GPU, DRY_RUN, UNFINISHED, CPU_REDUCED):
            db.insert_result(conn, report)
        yield conn


def test_each_finished_race_is_a_row_gpu_first_with_checked_numbers(conn):
    left_out: list[str] = []
    rows = races.race_rows(conn, left_out)
    assert [(r["device"], r["schedule"]) for r in rows] == [
        ("NVIDIA H100 80GB HBM3", "full"), ("AMD EPYC (CPU)", "full"),
        ("Intel(R) Xeon(R) Processor (CPU)", "96 steps each")]
    gpu, one_run, reduced = rows
    ratio = GPU["comparison"]["time_ratio_ours_over_airbench"]
    assert (gpu["ratio"], gpu["ratio_low"], gpu["ratio_high"]) == (ratio["value"], ratio["ci95_low"],
                                                                  ratio["ci95_high"])
    assert races.ratio_cell(gpu) == f"{ratio['value']:.3f} ({ratio['ci95_low']:.3f} .. {ratio['ci95_high']:.3f})"
    assert races.race_label(gpu) == "cifar10-94 (bf16) vs airbench94" and races.runs_cell(gpu) == "3"
    assert gpu["date"] == "2026-11-26" and gpu["dataset"] == "cifar10-jpeg"
    assert "/tmp/" not in gpu["command"] and "/root/" not in gpu["command"] and "…/vs_airbench.json" in gpu["command"]
    # one run a side: no comparison stored, the ratio and difference of the means alone
    assert one_run["ratio"] == pytest.approx(3060.2 / 2359.9) and one_run["ratio_low"] is None
    assert races.ratio_cell(one_run) == "1.297 (no CI)" and races.diff_cell(one_run) == "-0.20 (no CI)"
    assert races.race_label(one_run) == "cifar10-94 (bf16) vs airbench94 (fp32)"  # airbench94 on a CPU: fp32
    assert reduced["diff"] == pytest.approx(CPU_REDUCED["comparison"]["accuracy_diff_ours_minus_airbench"]["value"])
    assert len(left_out) == 2 and any("a dry run" in line for line in left_out) and \
        any("did not finish" in line for line in left_out)


HOSTILE = [  # (what, a change to a stored race): each number checked, each text clipped, never a traceback
    ("a ratio as text", {"comparison": {"time_ratio_ours_over_airbench": {"value": "1.2", "ci95_low": 1,
                                                                          "ci95_high": 2}}}),
    ("an interval that misses its value", {"comparison": {"time_ratio_ours_over_airbench": {
        "value": 3.0, "ci95_low": 1.0, "ci95_high": 2.0}, "accuracy_diff_ours_minus_airbench": {
        "value": 5.0, "ci95_low": -1, "ci95_high": 9}}}),
    ("markup and paths in every text", {"environment": {"device_name": "<script>x</script> /tmp/a/b\n| c"},
                                        "data": {"name": "[click](http://x.example) " + "n" * 500,
                                                 "spec": "/home/me/data"},
                                        "command": "speedrun --db /home/me/r.db `x` <!-- records:end -->"}),
    ("sides that are not objects", {"ours": ["x"], "airbench": 5}),
    ("a run count that is no count", {"ours": {**GPU["ours"], "accuracy": {**GPU["ours"]["accuracy"], "n": True}}}),
    ("no environment, data or schedule", {"environment": None, "data": "x", "schedule": {"steps": -3}}),
    ("complete as text", {"complete": "true"}),
]


@pytest.mark.parametrize("what, change", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_race_is_shown_checked_or_named_as_not_shown(tmp_path, what, change):
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        db.insert_result(conn, {**GPU, **change})
        left_out: list[str] = []
        rows = races.race_rows(conn, left_out)
        assert len(rows) + len(left_out) == 1, (rows, left_out)
        for row in rows:
            assert row["ratio"] is None or row["ratio_low"] is None or \
                row["ratio_low"] <= row["ratio"] <= row["ratio_high"]
            assert row["diff"] is None or -1 <= row["diff"] <= 1
            assert all(len(row[k]) <= 60 for k in ("device", "dataset")) and "/home/" not in row["command"]
        readme = "\n".join(markdown.readme_lines(conn))
        page = html.page(conn)
    assert "<script>" not in readme and "<script>" not in page and "<!-- records:end -->" not in readme
    assert "/home/me" not in readme and "/home/me" not in page and "/tmp/a/b" not in page


def test_a_race_that_is_not_json_is_named_not_drawn(conn):
    conn.execute("UPDATE reports SET json = 'not json' WHERE id = (SELECT min(id) FROM reports)")
    left_out: list[str] = []
    assert len(races.race_rows(conn, left_out)) == 2
    assert any("not valid JSON" in line for line in left_out)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_the_front_page_shows_the_races_then_says_no_record_is_claimed(conn):
    db.insert_result(conn, make_result(1, 0.90, 3.0))  # a development run: short of its 94% target
    lines = markdown.readme_lines(conn)
    assert _cells(lines[0])[:4] == ["device", "race", "schedule", "time, ours / airbench94 (95% CI)"]
    rows = [_cells(line) for line in lines[2:5]]
    assert [row[0] for row in rows] == ["NVIDIA H100 80GB HBM3", "AMD EPYC (CPU)", "Intel(R) Xeon(R) Processor (CPU)"]
    assert all(row[-1] == "cifar10-jpeg" for row in rows)  # the data set's name, never its path
    claims = [line for line in lines if line.startswith("No record is claimed yet")]
    assert len(claims) == 1 and "records rule" in claims[0] and "own dataset" in claims[0]
    text = "\n".join(lines)
    assert "speedrun train --seed 1" not in text and "/tmp/" not in text and "/root/" not in text


def test_the_front_page_shows_the_records_that_reach_their_target_and_only_those(tmp_path):
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        db.insert_result(conn, make_result(1, 0.95, 3.0, command="speedrun train --seed 1 --db /tmp/w/r.db"))
        db.insert_result(conn, make_result(2, 0.90, 1.0))  # short of the target: the HTML report's
        lines = markdown.readme_lines(conn)
    assert _cells(lines[0]) == ["dataset", "target", "recipe", "device", "test acc %", "timed s", "n", "p", "date",
                                "command"]
    (row,) = [_cells(line) for line in lines[2:] if line.startswith("| ")]
    assert row[1:3] == ["94%", "cifar10-94"] and row[-1] == "`speedrun train --seed 1 --db …/r.db`"
    assert not any(line.startswith("No record") for line in lines)


def test_nothing_ranked_and_no_race_is_the_one_line_that_says_why(tmp_path):
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        assert markdown.readme_lines(conn) == ["No result is stored yet."]
        db.insert_result(conn, DRY_RUN)  # a dry run is no race
        assert markdown.readme_lines(conn) == ["No result is stored yet."]
        db.insert_result(conn, GPU)
        lines = markdown.readme_lines(conn)
    assert lines[0].startswith("| device |") and "No record is claimed yet. No result is stored yet." in lines


def test_the_html_report_shows_the_races_first(conn):
    db.insert_result(conn, make_result(1, 0.95, 3.0))
    page = html.page(conn)
    assert page.index('id="races"') < page.index('id="leaderboard"')
    section = page.split('id="races"')[1].split("<h2")[0]
    assert section.count("<tr") == 4  # the header and three races
    assert "cifar10-94 (bf16) vs airbench94 (fp32)" in section and "96 steps each" in section
    assert "/tmp/" not in page and "/root/" not in page and "…/vs_airbench.json" in section
    assert "a dry run" in section and "did not finish" in section  # named, not drawn


def test_a_page_without_races_has_no_race_section(tmp_path):
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        db.insert_result(conn, make_result(1, 0.95, 3.0))
        assert 'id="races"' not in html.page(conn)


def test_a_race_stored_by_import_is_the_same_row(tmp_path):
    """vs_airbench.py --db stores the report as `speedrun results import` stores its file: one report, once."""
    path = tmp_path / "race.json"
    path.write_text(json.dumps(GPU))
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        first = db.insert_result(conn, GPU)
        (imported,) = db.import_files(conn, [path])
        assert imported.id == first and not imported.new
        assert len(races.race_rows(conn)) == 1


def test_this_repository_s_results_give_a_front_page_of_its_races_and_no_machine_path(tmp_path):
    """`speedrun report --readme` on a database of every file under benchmarks/results/ (as
    benchmarks/docs_report.py fills it): the H100 race and the CPU races as rows side by side, no record claimed
    (no stored result is on the recipe's own data set), and no absolute path of the machines that measured them."""
    from speedrun.cli.program import main

    repo = Path(__file__).resolve().parents[1]
    files = sorted((repo / "benchmarks" / "results").rglob("*.json"))
    with contextlib.closing(db.connect(tmp_path / "r.db")) as conn:
        assert not [entry for entry in db.import_files(conn, files) if entry.error]
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- records:begin -->\n<!-- records:end -->\n")
    assert main(["report", "--db", str(tmp_path / "r.db"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    rows = [_cells(line) for line in text.splitlines() if line.startswith("| ") and "vs airbench94" in line]
    devices = [row[0] for row in rows]
    assert devices[0] == "NVIDIA H100 80GB HBM3" and any(device.endswith("(CPU)") for device in devices)
    h100 = next(row for row in rows if row[0].startswith("NVIDIA H100") and row[5] == "25")
    assert h100[3].startswith("1.326 (1.288 .. 1.364)")  # benchmarks/results/vs_airbench/h100-cifar10-jpeg-n25.json
    assert "No record is claimed yet" in text
    assert not re.search(r"(?<![\w.~])/(tmp|work|root|home|Users|mnt|scratch)/", text)
