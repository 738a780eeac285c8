"""`speedrun compare A B`: two stored results, B against baseline A, with scipy's Welch test."""

import json

import pytest
from scipy import stats as scipy_stats

from speedrun.instruments import compare as compare
from speedrun.records import db as db
from speedrun.cli.program import main

ONE = "benchmarks/results/issue7/cpu-cifar10jpeg-epochs1-1proc.json"
TWO = "benchmarks/results/issue7/cpu-cifar10jpeg-epochs1-2proc.json"


@pytest.fixture(autouse=True)
def _repo(monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])


def _runs(path, key):
    return [r[key] for r in json.load(open(path))["runs"]]


def test_the_numbers_are_welchs_and_the_ratio_is_b_over_a(tmp_path, capsys):
    assert main(["compare", ONE, TWO, "--json", "--db", str(tmp_path / "r.db")]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("accuracy", "train_seconds"):
        a, b = _runs(ONE, key), _runs(TWO, key)
        test = report["metrics"][key]["test"]
        assert test["p"] == pytest.approx(scipy_stats.ttest_ind(b, a, equal_var=False).pvalue, rel=1e-9)
        assert test["diff"] == pytest.approx(sum(b) / 3 - sum(a) / 3, rel=1e-12)
        assert test["ratio"] == pytest.approx(sum(b) / sum(a), rel=1e-12)
        assert test["ci95"][0] < test["diff"] < test["ci95"][1]
    assert report["caveats"] == []  # same recipe, dataset and device
    with db.connect(tmp_path / "r.db") as conn:
        stored = db.get_result(conn, report["id"])
        assert stored["benchmark"] == "compare"
        # the command as given to main, not the host program's sys.argv (pytest's here)
        assert stored["command"] == f"speedrun compare {ONE} {TWO} --json --db {tmp_path / 'r.db'}"


def test_ids_from_the_database_and_one_run_a_side(tmp_path, capsys):
    with db.connect(tmp_path / "r.db") as conn:
        a = db.insert_result(conn, json.load(open(ONE)))
        single = json.load(open(TWO))
        single["runs"], single["n"], single["dataset"] = single["runs"][:1], 1, "other"
        b = db.insert_result(conn, single)
    assert main(["compare", f"#{a}", str(b), "--db", str(tmp_path / "r.db")]) == 0
    out = capsys.readouterr().out
    assert "caveat: dataset differs" in out and "n/a (needs 2+ runs a side)" in out


@pytest.mark.parametrize("ref", ["999", "nope.json", "benchmarks/results/issue7/ab-commits-cpu.json"])
def test_a_reference_that_is_not_a_training_result_is_one_line(ref, tmp_path, capsys):
    assert main(["compare", ONE, ref, "--db", str(tmp_path / "r.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("speedrun: error:") and "Traceback" not in err


def test_compare_keeps_its_labels():
    report = compare.compare(json.load(open(ONE)), json.load(open(ONE)), ("x", "y"))
    assert report["metrics"]["accuracy"]["test"]["diff"] == 0 and report["a"] == "x"


def test_hostile_run_records_are_named_and_caveats_given(tmp_path, capsys):
    good = json.load(open(ONE))
    for change, fragment in ((lambda r: r["runs"][1].update(accuracy="0.9"), "run 2 has accuracy='0.9'"),
                             (lambda r: r["runs"][0].update(accuracy=1e308), "run 1 has accuracy=1e+308"),
                             (lambda r: r["runs"][2].update(diverged=False), "run 3 is not a run record"),
                             (lambda r: r.update(runs=[5, "x"]), "run 1 is not a run record")):
        bad = json.loads(json.dumps(good))
        change(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        assert main(["compare", ONE, str(path), "--db", str(tmp_path / "r.db")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err and str(path) in err
    cut = json.loads(json.dumps(good))
    cut.update(complete=False, interrupted=True)
    cut["runs"][0]["diverged"], cut["runs"][0]["accuracy"] = {"step": 3}, None
    report = compare.compare(good, cut)
    assert any("incomplete" in c for c in report["caveats"])
    assert any("1 run diverged and is left out" in c for c in report["caveats"])
    assert any("same result" in c for c in compare.compare(good, good)["caveats"])
