"""`speedrun report`: the HTML page from the database (rendered in headless Chromium), the leaderboard's ranking,
and the generated Markdown sections of README.md and BENCHMARKS.md."""

import json
import os
import shutil
import struct

import pytest

import test_db
from conftest import load_benchmark
from speedrun.records import db as db
from speedrun.report import queries as report
from speedrun.cli.program import main

docs_report = load_benchmark("docs_report")

TINY = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
        "--set", "widths=8,16,16", "--set", "whiten_images=64"]
HOSTILE = "<script>alert(1)</script>$x$ \\mathrm{"


def make_result(i: int, accuracy: float, seconds: float, **changes) -> dict:
    """test_db's real result (distinct by `i`) with its means replaced (every run set to the mean: no spread)."""
    result = test_db.make_result(i)
    result.update(mean_accuracy=accuracy, std_accuracy=0.0, train_seconds={"mean": seconds, "std": 0.0})
    for run in result["runs"]:
        run.update(accuracy=accuracy, train_seconds=seconds)
    result["target"] = result["config"]["target_accuracy"]  # on the recipe's own data set (db.identity)
    result.update(changes)
    return result


def with_curve(result: dict, epochs: int = 3) -> dict:
    """`result` with each run evaluated after every epoch (eval_each_epoch): a history of `epochs` rows rising to
    its accuracy."""
    for run in result["runs"]:
        last = run["history"][-1]
        run["history"] = [{**last, "epoch": float(e), "val_acc": run["accuracy"] * (0.6 + 0.4 * e / epochs)}
                          for e in range(1, epochs + 1)]
    return result


@pytest.fixture(scope="module")
def filled_db(tmp_path_factory):
    """A database with five ranked results (two with learning curves), a smoke test, a bench setting, a hostile name,
    and a real (tiny) ablation, waterfall and --to-target search."""
    tmp = tmp_path_factory.mktemp("report")
    path = tmp / "r.db"
    conn = db.connect(path)
    target = 0.94
    for i, (acc, secs) in enumerate([(0.95, 9.0), (0.945, 3.0), (0.93, 1.0), (0.939, 2.0), (0.96, 5.0)]):
        result = make_result(i, acc, secs)  # the first two evaluated every epoch; the others once, at the end
        db.insert_result(conn, with_curve(result) if i < 2 else result)
    db.insert_result(conn, make_result(5, 0.99, 0.5, smoke_test=True))
    db.insert_result(conn, make_result(6, 0.99, 0.5, command="speedrun bench x  # setting lookahead=false"))
    db.insert_result(conn, make_result(7, 0.5, 4.0, recipe=HOSTILE, command=f"speedrun train {HOSTILE}</code>"))
    conn.close()
    for extra in ([], ["--waterfall", "whiten_init,lookahead"],
                  ["--to-target", "--max-probes", "2", "--set", "target_accuracy=0.3"]):
        assert main(["ablate", *TINY, "--runs", "2", *extra, "--db", str(path),
                     "--json", str(tmp / f"a{len(extra)}.json")]) in (0, 3)  # 3: a tiny run diverged
    assert target == json.loads(test_db.TEMPLATE.read_text())["config"]["target_accuracy"]
    return path


def test_the_leaderboard_ranks_reached_results_by_time_then_the_rest_by_accuracy(filled_db):
    conn = db.connect(filled_db)
    boards = report.leaderboards(conn)
    (board,) = [b for b in boards if b["target"] == 0.94 and b["dataset"] == "cifar10-jpeg"
                and b["family"] == "cifar"]
    ranked = [(r["accuracy"], r["seconds"]) for r in board["rows"]]
    # reached (>= 94%) fastest first, then the others most accurate first; smoke test and bench setting left out
    assert ranked == [(0.945, 3.0), (0.96, 5.0), (0.95, 9.0), (0.939, 2.0), (0.93, 1.0)]
    assert all(not r["command"].endswith("lookahead=false") for b in boards for r in b["rows"])
    # a recipe this version does not know is on a board of its own, not ranked against cifar10-94
    (other,) = [b for b in boards if b["family"] == "other"]
    assert [r["recipe"] for r in other["rows"]] == [HOSTILE]


def test_leaderboards_are_per_family_and_hold_complete_results_only(tmp_path):
    """Two families name different data alike ("synthetic"); an interrupted command's partial result is not a
    record (its --resume stores the same runs again, complete)."""
    conn = db.connect(tmp_path / "r.db")
    db.insert_result(conn, make_result(0, 0.95, 3.0, dataset="synthetic"))
    db.insert_result(conn, make_result(1, 0.97, 1.0, dataset="synthetic", recipe="imagenet-debug"))
    db.insert_result(conn, make_result(2, 0.99, 0.5, dataset="synthetic", complete=False, interrupted=True))
    assert report.leaderboards(conn) == []  # synthetic data measures speed only: no accuracy leaderboard
    boards = report.leaderboards(conn, synthetic=True)
    assert [(b["dataset"], b["family"], b["target"], [r["recipe"] for r in b["rows"]]) for b in boards] == [
        ("synthetic", "cifar", None, ["cifar10-94"]), ("synthetic", "imagenet", None, ["imagenet-debug"])]
    assert [report.board_name(b) for b in boards] == ["synthetic (cifar family)", "synthetic (imagenet family)"]


def test_the_page_is_self_contained_escaped_and_holds_every_chart(filled_db, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", "--db", str(filled_db), "--out", str(out)]) == 0
    text = out.read_text()
    assert "<script" not in text and "&lt;script&gt;" in text  # the hostile name is text, not markup
    assert "</code><" not in text.split("&lt;/code&gt;")[0][-20:]
    srcs = [part.split('"', 1)[0] for part in text.split(' src="')[1:]]
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)  # nothing from the network
    assert "http://" not in text and "https://" not in text
    kinds = [part.split('"', 1)[0] for part in text.split('data-chart="')[1:]]
    assert {"accuracy-vs-time", "learning-curves", "ablation", "waterfall", "to-target", "settings"} <= set(kinds)
    for section in ("leaderboard", "accuracy-time", "curves", "ablation", "reports"):
        assert f'id="{section}"' in text
    # --out replaces an earlier report, never another file
    assert main(["report", "--db", str(filled_db), "--out", str(out)]) == 0
    other = tmp_path / "notes.html"
    other.write_text("my notes")
    assert main(["report", "--db", str(filled_db), "--out", str(other)]) == 2
    assert other.read_text() == "my notes"


def _chromium() -> str:
    found = os.environ.get("SPEEDRUN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("SPEEDRUN_NO_BROWSER") == "1":
        pytest.skip("SPEEDRUN_NO_BROWSER=1: the browser check was turned off by hand")
    assert found, ("this test renders the report in headless Chromium: apt install chromium (.ci/run does), "
                   "set SPEEDRUN_CHROMIUM=PATH, or SPEEDRUN_NO_BROWSER=1 to skip it knowingly")
    return found


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_headless_chromium_shows_the_leaderboard_and_every_chart(filled_db, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' installs playwright")
    out, shot = tmp_path / "report.html", tmp_path / "report.png"
    assert main(["report", "--db", str(filled_db), "--out", str(out)]) == 0
    seen = docs_report.screenshot(out, shot, _chromium(), full_page=True)
    charts = seen["charts"]
    assert {c["kind"] for c in charts} >= {"accuracy-vs-time", "learning-curves", "ablation", "waterfall", "to-target",
                                           "settings"}
    assert all(c["done"] and c["w"] > 300 and c["h"] > 100 and c["shown"] > 300 for c in charts), charts
    assert seen["leaderboard_rows"] >= 5
    assert seen["requests"] and all(url.startswith(("file:", "data:")) for url in seen["requests"])
    width, height = _png_size(shot.read_bytes())
    # the whole page: every chart, at its shown size, fits in the screenshot's height
    assert width == 1280 and height > sum(c["h"] * c["shown"] / c["w"] for c in charts)
    docs_report.screenshot(out, shot, _chromium())  # docs/report.png's: the first screen only
    assert _png_size(shot.read_bytes()) == (1280, 900)


def test_the_markdown_sections_are_rewritten_between_their_markers_only(filled_db, tmp_path, capsys):
    readme, bench = tmp_path / "README.md", tmp_path / "BENCHMARKS.md"
    readme.write_text("# x\n\nbefore\n<!-- records:begin -->\nold table\n<!-- records:end -->\nafter ü\n")
    bench.write_text("head\n<!-- ablation:begin -->\n<!-- ablation:end -->\ntail\n")
    assert main(["report", "--db", str(filled_db), "--readme", str(readme), "--benchmarks", str(bench)]) == 0
    assert not (tmp_path / "speedrun-report.html").exists()  # no --out: only the Markdown files
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- records:begin -->\n| dataset |")
    assert text.endswith("<!-- records:end -->\nafter ü\n") and "old table" not in text
    assert "| 94% | cifar10-94 |" in text and "`speedrun train --seed 1`" in text
    table = bench.read_text()
    assert "#### Ablation:" in table and "#### Waterfall:" in table and "| + lookahead |" in table
    assert table.startswith("head\n") and table.endswith("tail\n")
    once = table
    assert main(["report", "--db", str(filled_db), "--benchmarks", str(bench)]) == 0
    assert bench.read_text() == once  # the same data, the same text
    bench.write_text("no markers here\n")
    capsys.readouterr()
    assert main(["report", "--db", str(filled_db), "--benchmarks", str(bench)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "<!-- ablation:begin -->" in err
    assert bench.read_text() == "no markers here\n"


def test_a_stored_name_does_not_become_a_link_or_end_its_cell(tmp_path):
    path, readme = tmp_path / "r.db", tmp_path / "README.md"
    with db.connect(path) as conn:
        # runs at 0.95, no spread: a record, so its row (and the name) is on the front page
        db.insert_result(conn, make_result(1, 0.95, 2.0, data={"name": "[click](https://example.com)\\| x"}))
    readme.write_text("<!-- records:begin -->\n<!-- records:end -->\n")
    assert main(["report", "--db", str(path), "--readme", str(readme)]) == 0
    row = next(line for line in readme.read_text().splitlines() if "click" in line)
    assert row.startswith("| \\[click\\](https\\://example.com)\\\\\\| x | ")  # no link, nor a bare URL


def test_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["report", "--db", str(tmp_path / "missing.db"), "--out", str(tmp_path / "r.html")]) == 2
    assert "no results database" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
    conn = db.connect(tmp_path / "empty.db")
    conn.close()
    (tmp_path / "dir.html").mkdir()
    assert main(["report", "--db", str(tmp_path / "empty.db"), "--out", str(tmp_path / "dir.html")]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["report", "--db", str(tmp_path / "empty.db"), "--out", str(tmp_path / "e.html")]) == 0
    assert "No result is stored yet" in (tmp_path / "e.html").read_text()
    db.insert_result(db.connect(tmp_path / "empty.db"), make_result(1, 0.9, 1.0))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)  # as if not installed
    capsys.readouterr()
    assert main(["report", "--db", str(tmp_path / "empty.db"), "--out", str(tmp_path / "m.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install matplotlib" in err and "speedrun[report]" not in err
