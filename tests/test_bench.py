"""`speedrun bench --vary`: interleaved settings against the baseline, each reported, all stored."""

import json

import pytest

from speedrun import bench, db
from speedrun.cli import main

TINY = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
        "--set", "widths=8,16,16", "--set", "whiten_images=64"]


def test_bench_interleaves_its_runs_and_reports_every_setting(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", *TINY, "--runs", "2", "--vary", "lookahead=false", "--vary", "tta_level=0,1,2",
            "--db", str(tmp_path / "r.db"), "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    names = ["baseline", "lookahead=false", "tta_level=0", "tta_level=1"]  # tta_level=2 is the baseline's own
    assert [s["name"] for s in report["settings"]] == names
    assert [(o["round"], o["setting"], o["seed"]) for o in report["order"]] == [
        (r, name, r) for r in range(2) for name in names]  # A B C D A B C D
    base = report["results"][0]["config"]
    for setting, result in zip(report["settings"][1:], report["results"][1:]):
        key = setting["name"].split("=")[0]
        assert {k for k in base if base[k] != result["config"][k]} == {key}  # exactly that switch differs
        assert setting["n"] == 2 and set(setting["versus_baseline"]) == {"accuracy", "train_seconds"}
    text = capsys.readouterr().out
    assert all(name in text for name in names)
    with db.connect(tmp_path / "r.db") as conn:
        assert len(db.query(conn)) == 4  # each setting's runs as a training result, and the report beside them
        assert [r["kind"] for r in db.query_reports(conn)] == ["bench"]


@pytest.mark.parametrize("vary, fragment", [("lookahead", "expected KEY=V1,V2"), ("nope=1", "unknown config key"),
                                            ("tta_level=2", "equals the baseline"), ("tta_level=7", "tta_level")])
def test_bad_variations_are_one_line_before_any_run(vary, fragment, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", *TINY, "--vary", vary, "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and not out.exists()


def test_parse_vary():
    assert bench.parse_vary(["a=1,2", " b = x "]) == [("a", ["1", "2"]), ("b", ["x"])]
