"""`speedrun bench --vary`: interleaved settings against the baseline, each reported, all stored."""

import json

import pytest

from speedrun.instruments import bench as bench
from speedrun.records import db as db
from speedrun.cli.program import main

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
    rounds = [[o["setting"] for o in report["order"] if o["round"] == r] for r in range(2)]
    assert all(sorted(r) == sorted(names) for r in rounds) and all(o["seed"] == o["round"] for o in report["order"])
    assert rounds[0][0] != rounds[1][0]  # balanced: another setting runs first in the next round
    assert all(s["warmup_seconds"] > 0 for s in report["settings"])  # each warmed up, on a CPU too
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


def test_each_settings_stored_runs_say_that_a_bench_stored_them(tmp_path):
    """Every setting's training result is of kind "bench" in its JSON (records/db.py KINDS), in the database and the
    report alike, and its command still names the setting."""
    out = tmp_path / "b.json"
    assert main(["bench", *TINY, "--runs", "1", "--vary", "lookahead=false", "--db", str(tmp_path / "r.db"),
                 "--json", str(out)]) == 0
    with db.connect(tmp_path / "r.db") as conn:
        rows = [json.loads(text) for text, in conn.execute("SELECT json FROM results ORDER BY id")]
    assert [r["kind"] for r in rows] == ["bench", "bench"]
    assert [r["command"].split("  # setting ")[1] for r in rows] == ["baseline", "lookahead=false"]
    assert [r["kind"] for r in json.loads(out.read_text())["results"]] == ["bench", "bench"]


def test_parse_vary():
    assert bench.parse_vary(["a=1,2", " b = x "]) == [("a", ["1", "2"]), ("b", ["x"])]


def test_an_interrupt_keeps_the_finished_runs_and_a_divergence_is_exit_3(tmp_path, capsys, monkeypatch):
    from speedrun.engine.loop import Diverged
    from speedrun.recipes import cifar

    real, calls = cifar.train_run, []

    def fifth_diverges_seventh_interrupted(cfg, data, device, seed, **kw):
        calls.append(1)  # calls 1 and 2: the two settings' warm-ups; then the timed runs, two a round
        if len(calls) == 5:
            raise Diverged(2, 4, float("nan"), 1.0, "lr_per_1024")
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(cfg, data, device, seed, **kw)

    monkeypatch.setattr(cifar, "train_run", fifth_diverges_seventh_interrupted)
    out = tmp_path / "b.json"
    assert main(["bench", *TINY, "--runs", "5", "--vary", "lookahead=false", "--db", str(tmp_path / "r.db"),
                 "--json", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == f"speedrun: interrupted; 4 finished runs kept in {out}"
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["complete"] is False and len(report["order"]) == 4
    first_of_round_1 = report["order"][2]["setting"]  # the fifth call's setting
    assert {s["name"]: s["diverged"] for s in report["settings"]} == {
        s["name"]: int(s["name"] == first_of_round_1) for s in report["settings"]}
    with db.connect(tmp_path / "r.db") as conn:  # the partial report's settings, stored as a whole one's
        assert [json.loads(text)["kind"] for text, in conn.execute("SELECT json FROM results")] == ["bench", "bench"]
    def every_other_diverges(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2:
            raise Diverged(1, 4, float("inf"), 1.0, "lr_per_1024")
        return real(*args, **kwargs)

    monkeypatch.setattr(cifar, "train_run", every_other_diverges)
    assert main(["bench", *TINY, "--runs", "2", "--vary", "lookahead=false", "--db", str(tmp_path / "r.db"),
                 "--json", str(tmp_path / "d.json")]) == 3
    assert "diverged (NaN/inf loss)" in capsys.readouterr().err


def test_a_tuple_key_takes_semicolons_between_values(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", *TINY, "--runs", "1", "--vary", "widths=8,16,32;8,8,8", "--db", str(tmp_path / "r.db"),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["config"]["widths"] for r in report["results"]] == [[8, 16, 16], [8, 16, 32], [8, 8, 8]]
    assert main(["ablate", *TINY, "--waterfall", "", "--db", str(tmp_path / "r.db")]) == 2  # not a full ablate
