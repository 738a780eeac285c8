"""The records rule: a result reaches its target only when a one-sided t-test of its runs' accuracies against the
target gives p < the threshold (0.01, or $SPEEDRUN_RECORD_P), with n >= 2. Checked against scipy.stats.ttest_1samp,
at its edges (zero spread, one run), in the leaderboard's order and its tables, on a row stored before the rule, in
the setting's refusals, and in `train`'s summary and result file."""

import contextlib
import math
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import test_db

from speedrun import dist
from speedrun.cli.program import main
from speedrun.engine.loop import RunResult
from speedrun.records import db as db
from speedrun.records import stats
from speedrun.records.stats import RECORD_ALPHA, one_sided_p, reaches_target, record_alpha, record_p_text, summarize
from speedrun.report import html as report_html
from speedrun.report import markdown
from speedrun.report import queries as report
from speedrun.run.display import Display
from speedrun.run.session import Result, Session

OLD = Path(__file__).parent / "fixtures" / "previous_version"
TARGET = 0.94
SAMPLES = [  # (accuracies, target): spreads from tiny to wide, n from 2 to 25, p from ~1e-12 to ~1
    ([0.9412, 0.9398, 0.9421, 0.9405, 0.9417], 0.94),
    ([0.95, 0.951, 0.949, 0.9505, 0.9502, 0.9498], 0.94),
    ([0.9425, 0.9375], 0.94),
    ([0.9301, 0.9356, 0.9412], 0.94),
    ([0.94 + 0.001 * math.sin(k) for k in range(25)], 0.9399),
    ([0.66, 0.672, 0.668], 0.5),
    ([0.2, 0.9], 0.1),
]


@pytest.fixture(autouse=True)
def no_setting(monkeypatch):
    """The threshold's setting unset, whatever the shell that runs the tests has."""
    monkeypatch.delenv(stats.RECORD_P_ENV, raising=False)


@pytest.mark.parametrize("accuracies, target", SAMPLES)
def test_p_is_scipy_one_sided_one_sample_t_test(accuracies, target):
    s = summarize(accuracies)
    p = one_sided_p(s.mean, s.std, s.n, target)
    expected = scipy.stats.ttest_1samp(accuracies, target, alternative="greater").pvalue
    assert p == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert reaches_target(s.mean, s.std, s.n, target) == (expected < 0.01, p)


def test_known_p_values_and_their_verdicts():
    # t = (mean - target) / (std / sqrt(n)); p = P(T_{n-1} >= t), by hand and from tables
    assert one_sided_p(0.95, 0.01, 4, 0.94) == pytest.approx(scipy.stats.t.sf(2.0, 3), rel=1e-12)
    assert one_sided_p(0.95, 0.01, 4, 0.94) == pytest.approx(0.0696, abs=1e-4)  # t = 2, df = 3
    assert one_sided_p(0.94, 0.01, 10, 0.94) == pytest.approx(0.5)  # mean on the target: even odds
    assert one_sided_p(0.93, 0.01, 4, 0.94) == pytest.approx(1 - 0.0696, abs=1e-4)  # below: p > 0.5
    # df = 1 (n = 2): Cauchy, p = 1/2 - atan(t) / pi
    assert one_sided_p(0.95, 0.01 * math.sqrt(2), 2, 0.94) == pytest.approx(0.25, rel=1e-12)
    assert reaches_target(0.95, 0.01, 4, 0.94) == (False, pytest.approx(0.0696, abs=1e-4))
    assert reaches_target(0.95, 0.01, 4, 0.94, alpha=0.1)[0] is True


def test_zero_spread_is_decided_by_the_mean():
    assert one_sided_p(0.95, 0.0, 3, 0.94) == 0.0 and reaches_target(0.95, 0.0, 3, 0.94) == (True, 0.0)
    assert one_sided_p(0.94, 0.0, 3, 0.94) == 1.0 and reaches_target(0.94, 0.0, 3, 0.94) == (False, 1.0)
    assert one_sided_p(0.93, 0.0, 5, 0.94) == 1.0
    # a std so small that std / sqrt(n) underflows is no spread either; a t past the float range is an end
    assert one_sided_p(0.95, 5e-324, 9, 0.94) == 0.0 and one_sided_p(0.93, 5e-324, 9, 0.94) == 1.0
    assert one_sided_p(0.95, 1e-320, 2, 0.94) == 0.0 and one_sided_p(0.93, 1e-320, 2, 0.94) == 1.0
    same = summarize([0.95, 0.95, 0.95])  # identical runs: scipy's p is NaN here, the rule's is 0
    assert same.std == 0.0 and same.mean == 0.95 and reaches_target(same.mean, same.std, same.n, 0.94) == (True, 0.0)


@pytest.mark.parametrize("n, std", [(1, 0.0), (1, None), (0, 0.0), (1, 0.01)])
def test_one_run_has_no_p_and_never_reaches(n, std):
    assert one_sided_p(0.99, std, n, 0.94) is None
    assert reaches_target(0.99, std, n, 0.94) == (False, None)
    assert reaches_target(0.99, std, n, 0.94, alpha=0.5) == (False, None)


def test_numpy_numbers_are_numbers():
    values = np.array([0.9412, 0.9398, 0.9421, 0.9405, 0.9417], dtype=np.float32)
    p = one_sided_p(values.mean(), values.std(ddof=1), np.int64(values.size), np.float32(0.94))
    assert p == pytest.approx(scipy.stats.ttest_1samp(values, np.float32(0.94), alternative="greater").pvalue,
                              rel=1e-5)


def test_an_unknown_std_has_no_p():
    assert reaches_target(0.99, None, 5, 0.94) == (False, None)


@pytest.mark.parametrize("args, fragment", [
    ((0.95, 0.01, 2.0, 0.94), "whole number"), ((0.95, 0.01, True, 0.94), "whole number"),
    ((math.nan, 0.01, 3, 0.94), "mean must be a finite"), ((0.95, math.inf, 3, 0.94), "std must be a finite"),
    ((0.95, -0.01, 3, 0.94), "std must be >= 0"), ((0.95, 0.01, 3, None), "target must be a finite"),
    ((0.95, 0.01, 3, "0.94"), "target must be a finite")])
def test_bad_inputs_are_refused_in_one_line(args, fragment):
    with pytest.raises(ValueError, match=fragment) as found:
        one_sided_p(*args)
    assert "\n" not in str(found.value)


def test_the_verdict_is_strictly_below_the_threshold():
    s = summarize([0.9425, 0.9375, 0.9445, 0.9431])
    p = one_sided_p(s.mean, s.std, s.n, 0.94)
    assert 0.01 < p < 0.5
    assert reaches_target(s.mean, s.std, s.n, 0.94, alpha=p)[0] is False  # p < alpha, not <=
    assert reaches_target(s.mean, s.std, s.n, 0.94, alpha=math.nextafter(p, 1))[0] is True


def test_the_threshold_setting(monkeypatch):
    assert record_alpha() == RECORD_ALPHA == 0.01
    monkeypatch.setenv("SPEEDRUN_RECORD_P", " 0.05 ")
    assert record_alpha() == 0.05
    assert record_alpha(0.001) == 0.001  # a value given wins over the setting
    assert reaches_target(0.95, 0.01, 4, 0.94, alpha=None)[0] is False  # p 0.07 against 0.05
    monkeypatch.setenv("SPEEDRUN_RECORD_P", "0.1")
    assert reaches_target(0.95, 0.01, 4, 0.94, alpha=None)[0] is True
    monkeypatch.setenv("SPEEDRUN_RECORD_P", "")
    assert record_alpha() == 0.01  # set empty: the default


@pytest.mark.parametrize("text", ["0", "-0.01", "0.6", "1", "nan", "inf", "abc", "1e-400", "0,01"])
def test_a_threshold_outside_0_to_half_is_refused(monkeypatch, text):
    monkeypatch.setenv("SPEEDRUN_RECORD_P", text)
    with pytest.raises(ValueError, match=r"SPEEDRUN_RECORD_P=.* is not a p-value threshold in \(0, 0.5\]") as found:
        record_alpha()
    assert "\n" not in str(found.value)
    monkeypatch.delenv("SPEEDRUN_RECORD_P")
    with pytest.raises(ValueError, match=r"alpha .* is not a p-value threshold in \(0, 0.5\]"):
        reaches_target(0.95, 0.01, 4, 0.94, alpha=text)


@pytest.mark.parametrize("value", [0.0, 0.51, -1.0, True, math.nan, "0.0"])
def test_a_bad_alpha_argument_is_refused(value):
    with pytest.raises(ValueError, match="is not a p-value threshold"):
        reaches_target(0.95, 0.01, 4, 0.94, alpha=value)


def test_p_text():
    assert [record_p_text(p) for p in (None, 0.0, 1.0, 0.5, 0.1234, 0.0312, 0.0031, 3.1e-4, 1e-20)] == [
        "-", "0", "1", "0.5", "0.12", "0.031", "0.0031", "3.1e-04", "1.0e-20"]


def spread_result(i: int, accuracies: list[float], seconds: float, **changes) -> dict:
    """test_db's real result (distinct by `i`) with these runs' accuracies, its means and std (ddof=1) as a
    Result.to_dict() writes them."""
    result = test_db.make_result(i)
    runs = [dict(result["runs"][0], accuracy=a, train_seconds=seconds, seed=k) for k, a in enumerate(accuracies)]
    s = summarize(accuracies)
    result.update(runs=runs, n=len(runs), mean_accuracy=s.mean, std_accuracy=s.std,
                  train_seconds={"mean": seconds, "std": 0.0 if len(runs) > 1 else None},
                  hit_rate=sum(a >= TARGET for a in accuracies) / len(accuracies))
    result.pop("record", None)
    result["target"] = TARGET  # as a result on the recipe's own data set records it (db.identity)
    result.update(changes)
    return result


NOISY = [0.9205, 0.9600, 0.9410]  # mean 0.9405, above the target, but std 0.0198: p = 0.48
TIGHT = [0.9451, 0.9448, 0.9452, 0.9449, 0.9450]  # mean 0.945, std 0.00016: p ~ 1e-8
FLAT = [0.95, 0.95, 0.95]  # no spread, above: p = 0
ONE = [0.99]  # one run: no p


@pytest.fixture
def ranked_db(tmp_path):
    path = tmp_path / "r.db"
    conn = db.connect(path)
    for i, (accuracies, seconds) in enumerate([(NOISY, 1.0), (TIGHT, 5.0), (ONE, 0.5), (FLAT, 9.0),
                                               ([0.93, 0.931], 0.7)]):
        db.insert_result(conn, spread_result(i, accuracies, seconds))
    conn.close()
    return path


def _board(conn, **kwargs) -> dict:
    (board,) = [b for b in report.leaderboards(conn, **kwargs) if b["target"] == TARGET]
    return board


def test_the_leaderboard_ranks_by_the_rule_not_by_the_mean(ranked_db, monkeypatch):
    conn = db.connect(ranked_db)
    board = _board(conn)
    assert board["alpha"] == 0.01
    order = [(r["n"], r["reached"]) for r in board["rows"]]
    # reached: TIGHT (5 s) then FLAT (9 s); then the rest most accurate first: ONE (0.99, n=1), NOISY (0.9405)
    # although both have a mean above the target and are faster, then the 0.9305 one
    assert [r["accuracy"] for r in board["rows"]] == pytest.approx([0.945, 0.95, 0.99, 0.9405, 0.9305])
    assert order == [(5, True), (3, True), (1, False), (3, False), (2, False)]
    noisy = board["rows"][3]
    assert noisy["p"] == pytest.approx(scipy.stats.ttest_1samp(NOISY, TARGET, alternative="greater").pvalue)
    assert 0.4 < noisy["p"] < 0.5 and board["rows"][2]["p"] is None and board["rows"][1]["p"] == 0.0
    assert [report.has_reached(r) for r in board["rows"]] == [True, True, False, False, False]
    # at threshold 0.5 the noisy result reaches too, and ranks by time ahead of the others
    for kwargs in ({"alpha": 0.5}, {}):
        monkeypatch.setenv("SPEEDRUN_RECORD_P", "0.5")
        loose = _board(conn, **kwargs)
        assert loose["alpha"] == 0.5
        assert [r["accuracy"] for r in loose["rows"][:3]] == pytest.approx([0.9405, 0.945, 0.95])


def test_the_tables_show_p_and_the_rule(ranked_db):
    conn = db.connect(ranked_db)
    lines = markdown.readme_lines(conn, per_board=5)
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[6:8] == ["n", "p"]
    # the README's records: the two results that reach the target, none of the three that do not
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:] if line.startswith("| ")]
    assert [(c[6], c[7]) for c in cells] == [("5", record_p_text(_board(conn)["rows"][0]["p"])), ("3", "0")]
    assert "e-" in cells[0][7]  # a small p in exponent form
    assert any("p < 0.01" in line and "one-sided t-test" in line for line in lines)
    page = report_html.page(conn)
    table = page.split('id="leaderboard"')[1].split("</table>")[0]
    assert "<th>n</th><th>p</th><th>hit</th>" in table
    assert '<td class="num">0.48</td>' in table and '<td class="num">-</td>' in table
    assert table.count('<tr class="reached">') == 2 and "p &lt; 0.01" in page
    loose = report_html.page(conn, alpha=0.5).split('id="leaderboard"')[1].split("</table>")[0]
    assert loose.split('<td class="num">0.48</td>')[0].rsplit("<tr", 1)[1].startswith(' class="reached">')


def test_a_row_stored_before_the_rule_is_judged_by_it(tmp_path):
    """The previous version's database (no p anywhere in its rows): its result, moved to real data with a mean
    just above the target, is judged from its stored mean, std and n as it is read."""
    path = tmp_path / "old.db"
    shutil.copy(OLD / "results-v2.db", path)
    runs = [0.9445, 0.9375]  # mean 0.941 >= 0.94: the mean alone would call it reached
    s = summarize(runs)
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:  # still version 2: its target rule applies
        raw.execute("UPDATE results SET dataset = 'cifar10', mean_accuracy = ?, std_accuracy = ? "
                    "WHERE recipe = 'cifar10-94'", (s.mean, s.std))
    conn = db.connect(path)  # migrated; the row's JSON is kept as it was
    (old_json,) = conn.execute("SELECT json FROM results WHERE recipe = 'cifar10-94'").fetchone()
    assert '"record"' not in old_json
    (row,) = _board(conn)["rows"]
    expected = scipy.stats.ttest_1samp(runs, TARGET, alternative="greater").pvalue
    assert row["n"] == 2 and row["p"] == pytest.approx(expected, rel=1e-9) and row["reached"] is False
    assert _board(conn, alpha=0.5)["rows"][0]["reached"] is True


def test_report_refuses_a_bad_threshold_in_one_line(ranked_db, tmp_path, monkeypatch, capsys):
    out = tmp_path / "page.html"
    for text in ("0.7", "zero"):
        monkeypatch.setenv("SPEEDRUN_RECORD_P", text)
        assert main(["report", "--db", str(ranked_db), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"speedrun: error: SPEEDRUN_RECORD_P={text} is not a p-value")
        assert not out.exists()
    monkeypatch.setenv("SPEEDRUN_RECORD_P", "0.05")
    assert main(["report", "--db", str(ranked_db), "--out", str(out)]) == 0
    assert "p &lt; 0.05" in out.read_text()


def make_result(accuracies: list[float | None], target: float = TARGET) -> Result:
    runs = [RunResult(seed=k, accuracy=a, train_seconds=None if a is None else 2.0 + k, epochs=1.0, steps=10,
                      diverged=None if a is not None else {"step": 3}) for k, a in enumerate(accuracies)]
    return Result(recipe="cifar10-94", dataset="cifar10", device="cpu", config={"target_accuracy": target},
                  runs=runs, environment={}, runs_requested=len(runs), complete=True)


def summary_caption(result: Result, capsys) -> str:
    Display(verbose=False, summary=True).summary(result)
    return " ".join(capsys.readouterr().out.split())


def test_the_train_summary_and_result_file_carry_p_and_the_threshold(capsys):
    result = make_result(TIGHT)
    expected = scipy.stats.ttest_1samp(TIGHT, TARGET, alternative="greater").pvalue
    record = result.to_dict()["record"]
    assert record["reached"] is True and record["threshold"] == 0.01 and record["n"] == 5
    assert record["p"] == pytest.approx(expected, rel=1e-9)
    assert (f"5/5 runs reached the target 94.00%, and a one-sided t-test puts their mean above it with p = "
            f"{record_p_text(expected)} < 0.01 (n=5): a record by the records rule." in summary_caption(result, capsys))
    noisy = make_result(NOISY)
    assert noisy.to_dict()["record"]["reached"] is False
    # two runs of three reached the target and the mean is above it: said once, with what a record needs
    caption = summary_caption(noisy, capsys)
    assert ("2/3 runs reached the target 94.00% and their mean is above it, but not surely enough for a record: a "
            "one-sided t-test gives p = 0.48, and a record needs p < 0.01 (n=3); more runs would tell." in caption)
    assert caption.count("target") == 1
    one = make_result([0.99])
    assert one.to_dict()["record"] == {**one.to_dict()["record"], "reached": False, "p": None, "n": 1}
    caption = summary_caption(one, capsys)
    assert ("The run reached the target 94.00%; a record needs at least 2 runs (--runs N) whose mean accuracy a "
            "one-sided t-test puts above the target with p < 0.01." in caption)
    low = summary_caption(make_result([0.95, 0.90, 0.91]), capsys)
    assert ("1/3 runs reached the target 94.00%, but their mean is not above it: not a record, which needs the mean "
            "above the target with p < 0.01 in a one-sided t-test (here p = 0.84, n=3)." in low)
    smoke = make_result([0.99])
    smoke.smoke_test = True
    assert ("A smoke test checks that the pipeline runs: its accuracy is not judged against the target 94.00%."
            in summary_caption(smoke, capsys))
    # a diverged run is in the test as accuracy 0: three runs, and 0.95, 0, 0.95 do not show 94% reached
    mixed = make_result([0.95, None, 0.95]).to_dict()["record"]
    assert mixed["reached"] is False and mixed["n"] == 3 and mixed["p"] > 0.5
    assert make_result([None]).to_dict()["record"] is None
    none = summary_caption(make_result([None]), capsys)
    assert "No run finished: nothing to judge against the target 94.00%." in none


def test_the_session_records_the_threshold_the_summary_shows(monkeypatch, capsys):
    def session(result):
        return Session(result, json_path=None, database=None, db=None, world=dist.World(),
                       show=Display(verbose=False, summary=True), began=0.0)

    monkeypatch.setenv("SPEEDRUN_RECORD_P", "0.5")
    noisy = make_result(NOISY)
    session(noisy)
    assert noisy.to_dict()["record"]["threshold"] == 0.5 and noisy.to_dict()["record"]["reached"] is True
    assert "their mean above it with p = 0.48 < 0.5 (n=3): a record" in summary_caption(noisy, capsys)
    # a result file read back is judged at the reader's threshold, not the one it was written with
    monkeypatch.setenv("SPEEDRUN_RECORD_P", "0.01")
    assert Result.from_dict(noisy.to_dict()).record()["reached"] is False
    monkeypatch.setenv("SPEEDRUN_RECORD_P", "2")
    with pytest.raises(ValueError, match="SPEEDRUN_RECORD_P=2 is not a p-value threshold"):
        session(make_result([]))


@pytest.mark.parametrize("text", ["0.9", "1%"])
def test_train_refuses_a_bad_threshold_before_any_work(tmp_path, monkeypatch, capsys, text):
    monkeypatch.setenv("SPEEDRUN_RECORD_P", text)
    out = tmp_path / "r.json"
    assert main(["train", "--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"speedrun: error: SPEEDRUN_RECORD_P={text} is not a p-value threshold in (0, 0.5]; give "
                            "e.g. 0.01 (the records rule's default, modded-nanogpt's)\n")  # no warning before it
    assert captured.out == "" and not out.exists()


def test_the_leaderboard_counts_a_diverged_run_as_accuracy_zero():
    """A stored row keeps the finished runs' n, mean and std; the runs table knows the diverged ones: the rule pools
    them in as zeros, giving scipy's p of every run's accuracy."""
    from speedrun.report.queries import judge

    finished = [0.95, 0.951, 0.95]
    row = {"target": 0.94, "accuracy": float(np.mean(finished)), "std_accuracy": float(np.std(finished, ddof=1)),
           "n": 3, "diverged": 7}
    reached, p = judge(row, 0.01)
    expected = scipy.stats.ttest_1samp(finished + [0.0] * 7, 0.94, alternative="greater").pvalue
    assert reached is False and p == pytest.approx(expected, rel=1e-9)
    assert judge({**row, "diverged": 0}, 0.01)[0] is True
    one = judge({"target": 0.5, "accuracy": 0.9, "std_accuracy": None, "n": 1, "diverged": 1}, 0.01)
    assert one[1] == pytest.approx(scipy.stats.ttest_1samp([0.9, 0.0], 0.5, alternative="greater").pvalue)
