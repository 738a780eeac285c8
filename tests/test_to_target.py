"""`speedrun ablate --to-target`: the bounded epoch search, alone on synthetic curves and through the CLI."""

import json
import math

import pytest
import torch

from speedrun.records import db as db
from speedrun.instruments import to_target as to_target
from speedrun.cli.program import main
from speedrun.engine.loop import Diverged, RunResult
from speedrun.engine.system import resolve_system
from speedrun.recipes import cifar

from test_ablate import RECORD_2025, TINY


def _threshold_curve(threshold: int):
    """A monotone accuracy curve over steps that first reaches 0.9 at `threshold` steps."""
    def measure(steps: int):
        accuracy = 0.9 * min(1.0, steps / threshold)
        return accuracy >= 0.9, accuracy
    return measure


def _check_probes(probes, floor, ceiling, max_probes):
    steps = [s for s, _, _ in probes]
    assert len(steps) == len(set(steps)), steps  # never the same step count twice
    assert 1 <= len(steps) <= max_probes
    assert all(floor <= s <= ceiling for s in steps)


@pytest.mark.parametrize("start", [1, 7, 16, 100, 484])
def test_with_probes_enough_the_search_finds_the_threshold_step(start):
    floor, ceiling = to_target.bounds(start, 10**9)
    for threshold in range(1, ceiling + 3, max(1, ceiling // 60)):
        probes = to_target.search(_threshold_curve(threshold), start, floor, ceiling, to_target.MAX_PROBES)
        _check_probes(probes, floor, ceiling, to_target.MAX_PROBES)
        reached = [s for s, ok, _ in probes if ok]
        missed = [s for s, ok, _ in probes if not ok]
        if threshold > ceiling:
            assert not reached and max(missed) == ceiling
        elif threshold <= floor:
            assert min(reached) == floor and not missed
        else:  # the bracket is closed to one step: the answer is the threshold itself
            assert min(reached) == threshold and max(missed) == threshold - 1, (threshold, probes)


@pytest.mark.parametrize("max_probes", [2, 3, 4, 5])
def test_a_small_budget_is_kept_and_the_answer_still_brackets_the_threshold(max_probes):
    start = 100
    floor, ceiling = to_target.bounds(start, 10**9)
    for threshold in range(1, 420, 7):
        probes = to_target.search(_threshold_curve(threshold), start, floor, ceiling, max_probes)
        _check_probes(probes, floor, ceiling, max_probes)
        assert all(s >= threshold for s, ok, _ in probes if ok)
        assert all(s < threshold for s, ok, _ in probes if not ok)


def test_reached_at_the_start_searches_down_then_bisects():
    probes = to_target.search(_threshold_curve(30), 100, 7, 400, 5)
    assert [s for s, _, _ in probes] == [100, 50, 25, 37, 31]  # halve, halve (miss), bisect, bisect
    assert [ok for _, ok, _ in probes] == [True, True, False, True, True]
    # reached at every probe down to the floor: it stops there, probes left over
    probes = to_target.search(_threshold_curve(1), 100, 7, 400, 10)
    assert [s for s, _, _ in probes] == [100, 50, 25, 12, 7]


def test_never_reached_stops_at_the_ceiling_with_the_best_accuracy_seen():
    def measure(steps):
        return False, 0.5 - 1 / steps  # rises with training but never to the target

    probes = to_target.search(measure, 10, 1, 40, 5)
    assert [s for s, _, _ in probes] == [10, 20, 40]  # doubling up to the ceiling, then no more
    assert max(info for _, _, info in probes) == pytest.approx(0.5 - 1 / 40)
    assert to_target.bounds(10, 10**9) == (1, 40)
    assert to_target.bounds(484, 10**9) == (math.ceil(484 / 16), 4 * 484)
    assert to_target.bounds(484, 1000) == (31, 1000)  # the ceiling stays within what --epochs allows


def _report(tmp_path, name="t.json"):
    return json.loads((tmp_path / name).read_text())


@pytest.mark.slow
def test_the_cli_searches_every_variant_interleaved_and_stores_each_probe(tmp_path, capsys):
    out, dbpath = tmp_path / "t.json", tmp_path / "r.db"
    assert main(["ablate", *TINY, "--runs", "1", "--to-target", "--max-probes", "3", "--set",
                 "target_accuracy=0.1", "--db", str(dbpath), "--json", str(out)]) == 0
    report = _report(tmp_path)
    assert report["benchmark"] == "to_target" and report["complete"] and not report["interrupted"]
    assert report["max_probes"] == 3 and report["target_accuracy"] == 0.1 and report["runs"] == 1
    names = [v["name"] for v in report["variants"]]
    # bf16 autocast is already off on a CPU without native bf16 (precision=auto is fp32 there), on with it
    off_here = {"cutout_px", "compile", *RECORD_2025, "half_weights", "index_free_eval_pool", "muon_ns_compile"} | (
        {"precision"} if resolve_system(cifar.cifar10_94(), torch.device("cpu")).precision == "fp32" else set())
    on = [key for key, off, _ in cifar.TRICKS if key not in off_here]
    assert [n.split("=")[0] for n in names] == ["baseline", *on]  # the variants ablate measures
    assert {o["trick"] for o in report["already_off"]} == off_here
    baseline_config = report["results"][report["variants"][0]["probes"][0]["result"]]["config"]
    for v in report["variants"]:
        probes = v["probes"]
        assert 1 <= len(probes) <= 3 and len({p["steps"] for p in probes}) == len(probes)
        assert probes[0]["epochs"] == 1.0 and probes[0]["steps"] == 4  # the recipe's --epochs first
        for p in probes:
            stored = report["results"][p["result"]]
            assert stored["config"]["epochs"] == p["epochs"] and stored["runs"][0]["steps"] == p["steps"]
            assert p["reached"] == (p["mean_accuracy"] >= 0.1) and p["accuracies"] == [stored["mean_accuracy"]]
        first = report["results"][probes[0]["result"]]["config"]
        changed = {k for k in first if first[k] != baseline_config[k]}
        assert changed == (set() if v["name"] == "baseline" else {v["name"].split("=")[0]})
        if len(probes) > 1:  # reached at the start: shorter next; missed: longer
            assert (probes[1]["steps"] < 4) == probes[0]["reached"]
        reached = [p for p in probes if p["reached"]]
        if reached:
            best = min(reached, key=lambda p: p["steps"])
            assert (v["epochs_needed"], v["seconds_needed"]) == (best["epochs"], best["mean_seconds"])
        else:
            assert v["epochs_needed"] is None and v["ceiling_epochs"] == 4.0
            assert v["best_accuracy"] == max(p["mean_accuracy"] for p in probes)
            assert v["searched_up_to_epochs"] == max(p["epochs"] for p in probes)
    # lockstep: round r trains every variant with an r-th probe (in an order balanced across rounds)
    rounds = max(len(v["probes"]) for v in report["variants"])
    assert sorted((o["round"], o["variant"], o["steps"]) for o in report["order"]) == sorted(
        (r, v["name"], v["probes"][r]["steps"]) for r in range(rounds) for v in report["variants"]
        if len(v["probes"]) > r)
    assert [o["round"] for o in report["order"]] == sorted(o["round"] for o in report["order"])
    text = capsys.readouterr().out
    assert "epochs needed" in text and "10.00%" in text and all(n[:28] in text for n in names)
    with db.connect(dbpath) as conn:
        [stored] = db.query_reports(conn, "to_target")
        assert db.get_result(conn, stored["id"])["variants"] == report["variants"]
        assert len(db.query(conn)) == len(report["results"])


def _fake_train_run(calls, *, interrupt_at=None, diverge_at=None):
    """Instant runs whose accuracy is steps / T, capped at 1, so the target 0.5 is first reached at T / 2 steps: 6
    for the recipe, 12 without Lookahead, 2 without whitening; never without TTA (accuracy 0). Call number
    `interrupt_at` raises KeyboardInterrupt, `diverge_at` Diverged."""
    def train_run(cfg, data, device, seed, **kw):
        calls.append((cfg, seed))
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        steps = math.ceil(cfg.epochs * len(data.train_labels) / cfg.batch_size)
        if len(calls) == diverge_at:
            raise Diverged(1, steps, float("nan"), 1.0, "lr_per_1024")
        full = 24 if not cfg.lookahead else 4 if not cfg.whiten_init else 12
        accuracy = 0.0 if cfg.tta_level == 0 else min(1.0, steps / full)
        return RunResult(seed=seed, accuracy=accuracy, train_seconds=0.01 * steps, epochs=cfg.epochs, steps=steps)
    return train_run


@pytest.fixture
def fixed_order(monkeypatch):
    """The search's tests count calls: no warm-up runs, and each round in variant order (bench.warm_up and
    bench.round_orders have tests of their own, tests/test_redteam_stats_bench.py)."""
    monkeypatch.setattr(to_target, "warm_up", lambda *args: 0.0)
    monkeypatch.setattr(to_target, "round_orders", lambda count, rounds, seed: [list(range(count))] * rounds)


# precision=fp32 named: the variants are then the same on a CPU with native bf16 (where auto is bf16) and without;
# drop_last_batch off: the 12 variants the call numbers below count
TARGET = ["--to-target", "--set", "target_accuracy=0.5", "--runs", "2", "--max-probes", "4", "--set", "precision=fp32",
          "--set", "drop_last_batch=false"]


def test_each_variant_gets_its_own_answer_and_a_diverged_run_makes_its_probe_a_miss(tmp_path, capsys, monkeypatch,
                                                                                     fixed_order):
    calls = []
    # call 2 is round 0, seed 0 of the second variant (whiten_init=false), at the recipe's 4 steps
    monkeypatch.setattr(cifar, "train_run", _fake_train_run(calls, diverge_at=2))
    assert main(["ablate", *TINY, *TARGET, "--db", str(tmp_path / "r.db"), "--json", str(tmp_path / "t.json")]) == 3
    captured = capsys.readouterr()
    assert "whiten_init=false: 1 run diverged" in captured.err
    report = _report(tmp_path)
    v = {row["name"]: row for row in report["variants"]}
    steps = {name: [p["steps"] for p in row["probes"]] for name, row in v.items()}
    assert steps["baseline"] == [4, 8, 6, 5]  # missed at the start: double, then bisect to one step
    assert (v["baseline"]["epochs_needed"], v["baseline"]["missed_epochs"]) == (1.5, 1.25)
    assert v["baseline"]["seconds_needed"] == pytest.approx(0.06) and v["baseline"]["search_complete"]
    assert steps["lookahead=false"] == [4, 8, 16, 12]  # the budget ends the bisection: (8, 12] is an upper bound
    assert (v["lookahead=false"]["epochs_needed"], v["lookahead=false"]["missed_epochs"]) == (3.0, 2.0)
    assert v["baseline"]["exact"] and not v["lookahead=false"]["exact"] and not v["tta_level=0"]["exact"]
    # the diverged run made the start a miss although the other seed reached (accuracy 1.0)
    first = v["whiten_init=false"]["probes"][0]
    assert first["reached"] is False and first["diverged"] == 1 and first["accuracies"] == [None, 1.0]
    assert steps["whiten_init=false"] == [4, 8, 6, 5] and v["whiten_init=false"]["epochs_needed"] == 1.25
    assert steps["tta_level=0"] == [4, 8, 16]  # up to the ceiling (4x), then it stops with probes left
    none = v["tta_level=0"]
    assert none["epochs_needed"] is None and none["best_accuracy"] == 0.0 and none["searched_up_to_epochs"] == 4.0
    assert all(p["seeds"] == [0, 1] for row in report["variants"] for p in row["probes"])
    names = [row["name"] for row in report["variants"]]  # a round runs seed by seed, A B C ... A B C ...
    assert [(o["variant"], o["seed"]) for o in report["order"][:24]] == [(n, r) for r in (0, 1) for n in names]
    assert [cfg.epochs for cfg, _ in calls[:24]] == [1.0] * 24 and calls[24][0].epochs == 2.0  # round 1: 8 steps
    assert len(calls) == len(report["order"]) == 2 * sum(len(row["probes"]) for row in report["variants"])
    text = captured.out
    line = next(line for line in text.splitlines() if line.startswith("lookahead=false"))
    assert line.split()[1:5] == ["3", "0.12", "2.000", "4"]  # epochs, seconds, vs baseline, probes
    assert "not reached at <= 4 epochs (best 0.00%)" in text and "in (2, 3] epochs; more --max-probes" in text


def test_reached_at_the_start_searches_shorter(tmp_path, monkeypatch, fixed_order):
    monkeypatch.setattr(cifar, "train_run", _fake_train_run([]))
    assert main(["ablate", *TINY, *TARGET, "--db", str(tmp_path / "r.db"), "--json", str(tmp_path / "t.json")]) == 0
    row = next(r for r in _report(tmp_path)["variants"] if r["name"] == "whiten_init=false")
    assert [p["steps"] for p in row["probes"]] == [4, 2, 1]  # halve, halve (miss): the bracket is one step wide
    assert (row["epochs_needed"], row["missed_epochs"], row["exact"]) == (0.5, 0.25, True)


def test_an_interrupt_keeps_the_finished_probes_as_a_partial_report(tmp_path, capsys, monkeypatch, fixed_order):
    calls = []
    # round 0 is 12 variants x 2 seeds; call 27 is round 1, seed 0 of the third variant
    monkeypatch.setattr(cifar, "train_run", _fake_train_run(calls, interrupt_at=27))
    out = tmp_path / "t.json"
    assert main(["ablate", *TINY, *TARGET, "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == f"speedrun: interrupted; 26 finished runs kept in {out}"
    report = _report(tmp_path)
    assert report["interrupted"] and not report["complete"] and len(report["order"]) == 26
    cut = [row["probes"][1] for row in report["variants"][:2]]
    assert all(p["reached"] is None and p["seeds"] == [0] for p in cut)  # one seed of two: no answer
    assert all(len(row["probes"]) == 1 for row in report["variants"][2:])
    assert not any(row["search_complete"] for row in report["variants"])
    with db.connect(tmp_path / "r.db") as conn:
        assert [r["kind"] for r in db.query_reports(conn)] == ["to_target"]
        kinds = {json.loads(text)["kind"] for text, in conn.execute("SELECT json FROM results")}
    assert kinds == {"to-target"}  # each finished probe's runs, as the search stored them


@pytest.mark.parametrize("extra, fragment", [(["--to-target", "--max-probes", "1"], "--max-probes"),
                                             (["--to-target", "--max-probes", "21"], "--max-probes"),
                                             (["--max-probes", "3"], "add --to-target"),
                                             (["--to-target", "--waterfall", "lookahead"], "--waterfall")])
def test_bad_flags_are_one_line_before_any_run(extra, fragment, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["ablate", *TINY, *extra, "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and not out.exists()
