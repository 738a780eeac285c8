"""speedrun sweep: the space's refusals, trials stored with their CI attributes, --resume, two processes on one
storage, pruning, the time objective's penalty, the settings file train reads, and the report's study section."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest

optuna = pytest.importorskip("optuna")

import speedrun  # noqa: E402
from speedrun.cli.program import main  # noqa: E402
from speedrun.engine.loop import RunResult  # noqa: E402
from speedrun.instruments import sweep as sweeping  # noqa: E402
from speedrun.recipes import get_recipe  # noqa: E402
from speedrun.records import db  # noqa: E402
from speedrun.report import html  # noqa: E402

DATA = ["--dataset", "synthetic:train=64,test=16", "--device", "cpu"]
TINY = [*DATA, "--epochs", "2", "--set", "batch_size=32", "--set", "widths=8,16,16", "--set", "whiten_images=32",
        "--set", "cpu_threads=1"]
REC = get_recipe("cifar10-94")


def _sweep(tmp_path, *extra, quiet=True):
    args = ["sweep", "cifar10-94", *TINY, "--db", str(tmp_path / "r.db"), *(["--quiet"] if quiet else []), *extra]
    return main(args)


@pytest.fixture
def fake_training(monkeypatch):
    """The family's train_run replaced by one that reports `accuracy(call)` at epoch 1 and returns it, in
    microseconds: call counts the runs given an on_epoch hook (a trial's runs; the warm-up passes none)."""
    family = REC.module()
    calls = {"n": 0, "accuracy": lambda call, cfg, seed: 0.5 + cfg.label_smoothing}

    def train_run(cfg, data, device, seed, *, world=None, hooks=None, resume=None):
        on_epoch = None if hooks is None else hooks.on_epoch
        accuracy = calls["accuracy"](calls["n"], cfg, seed)
        if on_epoch is not None:
            calls["n"] += 1
            row = {"train_loss": 1.0, "train_acc": 0.5, "val_acc": accuracy}  # as the per-epoch table's rows
            on_epoch({**row, "epoch": 1.0, "step": 2, "train_seconds": 0.5})
            on_epoch({**row, "epoch": cfg.epochs, "step": 4, "train_seconds": 1.0})
        return RunResult(seed=seed, accuracy=accuracy, train_seconds=1.0 + 0.1 * seed, epochs=cfg.epochs, steps=4,
                         history=[])

    monkeypatch.setattr(family, "train_run", train_run)
    return calls


@pytest.mark.parametrize("space,fragment", [
    ("lr=1:2", "unknown config key 'lr'"),
    ("seed=1:2", "seed is not a config key: use --seed"),
    ("lr_per_1024=8:", "LOW and HIGH must be finite numbers"),
    ("lr_per_1024=a:b", "LOW and HIGH must be finite numbers"),
    ("lr_per_1024=8:14:lin", "a range is LOW:HIGH or LOW:HIGH:log"),
    ("lr_per_1024=14:8", "LOW must be below HIGH"),
    ("lr_per_1024=8:8", "LOW must be below HIGH"),
    ("lr_per_1024=0:1:log", "a log range needs LOW > 0"),
    ("momentum=-1:0.5:log", "a log range needs LOW > 0"),
    ("translate_px=1.5:3", "LOW and HIGH must be integers"),
    ("label_smoothing=0:1.5", "label_smoothing must be in [0, 1)"),
    ("label_smoothing=0", "give two or more values"),
    ("label_smoothing=0,0.1,0", "0 is given twice"),
    ("label_smoothing=0,x", "label_smoothing=x: expected float"),
    ("lookahead=true,maybe", "expected a boolean"),
    ("flip=none,sideways", "expected one of"),
    ("label_smoothing=0,", "an empty value"),
    ("lookahead", "expected KEY=LOW:HIGH[:log] or KEY=A,B,C"),
    ("=1:2", "expected KEY=LOW:HIGH[:log] or KEY=A,B,C"),
    ("widths=8,16,16;16,32,32", "--set widths both set it"),
])
def test_space_refusals_are_one_line_before_any_work(space, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", space) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fragment in err, err
    assert not list(tmp_path.iterdir())  # no database, storage or report file was made


@pytest.mark.parametrize("argv,fragment", [
    (["--space", "label_smoothing=0,0.1", "--space", "label_smoothing=0.2,0.3"], "given twice"),
    (["--space", "label_smoothing=0,0.1", "--objective", "time", "--runs", "1"], "needs n >= 2"),
    (["--space", "label_smoothing=0,0.1", "--trials", "0"], "trials (--trials) must be an integer"),
    (["--space", "lr_per_1024=8:14", "--sampler", "grid"], "--sampler grid needs a list of values"),
    (["--space", "label_smoothing=0,0.1", "--prune", "--set", "eval_each_epoch=false"], "add --set eval_each_epoch"),
    (["--space", "label_smoothing=0,0.1", "--storage", "nonsense"], "not a database URL"),
])
def test_other_refusals(argv, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fragment in err, err


def test_space_kinds():
    params = sweeping.parse_space(["lr_per_1024=8:14", "batch_size=32:64", "momentum=0.5:0.9:log",
                                   "label_smoothing=0,0.1,0.2", "widths=8,16,16;16,32,32", "lookahead=true,false"],
                                  REC, None, {})
    kinds = {p.key: (p.kind, p.low, p.high, p.log, p.choices) for p in params}
    assert kinds["lr_per_1024"] == ("float", 8.0, 14.0, False, ())
    assert kinds["batch_size"] == ("int", 32, 64, False, ())
    assert kinds["momentum"][:4] == ("float", 0.5, 0.9, True)
    assert kinds["label_smoothing"][4] == (0.0, 0.1, 0.2)
    assert kinds["widths"][4] == ("8,16,16", "16,32,32")
    assert kinds["lookahead"][4] == (True, False)


def _trials_in(storage: str, name: str):
    return optuna.load_study(study_name=name, storage=storage).trials


def _study_name(tmp_path) -> str:
    conn = db.connect(tmp_path / "r.db")
    try:
        text = conn.execute("SELECT json FROM reports WHERE kind = 'sweep' ORDER BY id DESC").fetchone()[0]
    finally:
        conn.close()
    return json.loads(text)["study"]


def test_the_issue_command_on_synthetic_data(tmp_path, capsys, monkeypatch):
    """Real training: every trial stored with its runs, the CI attributes, the table; --resume adds trials; the
    settings file trains; the report draws the study."""
    monkeypatch.chdir(tmp_path)
    space = ["--space", "lr_per_1024=8:14", "--space", "label_smoothing=0,0.1,0.2"]
    assert _sweep(tmp_path, *space, "--trials", "3", "--runs", "2", "--no-prune", "--write-settings", "best.json",
                  quiet=False) == 0
    captured = capsys.readouterr()
    assert "best: trial" in captured.out and "parameter importances" in captured.out
    name = _study_name(tmp_path)
    storage = f"sqlite:///{tmp_path / 'r.sweeps.db'}"
    trials = _trials_in(storage, name)
    assert [t.number for t in trials] == [0, 1, 2]
    conn = db.connect(tmp_path / "r.db")
    rows = {row[0]: row for row in conn.execute("SELECT id, n, mean_accuracy, command, json FROM results")}
    conn.close()
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        a = t.user_attrs
        assert a["n"] == 2 and len(a["ci95"]) == 2 and a["ci95"][0] <= a["mean"] <= a["ci95"][1]
        assert 0.0 <= a["p"] <= 1.0 and a["reached"] is False  # chance level on synthetic data
        row = rows[a["result_id"]]
        stored = json.loads(row[4])
        assert row[1] == 2 and f"# setting trial {t.number} of {name}" in row[3]
        assert t.value == pytest.approx(sum(r["accuracy"] for r in stored["runs"]) / 2) == pytest.approx(row[2])
        assert stored["config"]["lr_per_1024"] == pytest.approx(t.params["lr_per_1024"])
        assert stored["config"]["label_smoothing"] == t.params["label_smoothing"]

    # --resume adds trials to the same study; without it, and for a study that is not there, one line each
    assert _sweep(tmp_path, *space, "--trials", "2", "--runs", "2", "--no-prune") == 2
    assert "already exists" in capsys.readouterr().err and len(_trials_in(storage, name)) == 3
    assert _sweep(tmp_path, *space, "--trials", "1", "--runs", "2", "--no-prune", "--resume", "--study", "other") == 2
    assert "there is no study 'other'" in capsys.readouterr().err
    assert _sweep(tmp_path, *space, "--space", "momentum=0.5:0.9", "--trials", "1", "--runs", "2", "--no-prune",
                  "--resume", "--study", name) == 2
    assert "asks another question (it differs in space;" in capsys.readouterr().err
    assert _sweep(tmp_path, *space, "--trials", "2", "--runs", "2", "--no-prune", "--resume") == 0
    assert [t.number for t in _trials_in(storage, name)] == [0, 1, 2, 3, 4]

    # the best trial's configuration trains through --settings, recorded in the result
    settings = json.loads((tmp_path / "best.json").read_text())
    assert settings["written_by"] == "sweep" and settings["measured"]["study"] == name
    best = settings["settings"]
    result = speedrun.train("cifar10-94", "synthetic:train=64,test=16", device="cpu", epochs=2.0,
                            settings=tmp_path / "best.json")
    assert result.config["lr_per_1024"] == pytest.approx(float(best["lr_per_1024"]))
    assert tuple(result.config["widths"]) == (8, 16, 16) and result.settings["written_by"] == "sweep"

    # the report's study section
    conn = db.connect(tmp_path / "r.db", readonly=True)
    page = html.page(conn)
    conn.close()
    assert 'id="sweeps"' in page and name in page and 'data-chart="study-trials"' in page
    assert "Parameter importances: none" in page or "<th>importance</th>" in page


def test_results_database_and_study_storage_are_separate_files(tmp_path, fake_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--trials", "2", "--runs", "2") == 0
    assert sweeping.default_storage(tmp_path / "r.db") == f"sqlite:///{tmp_path / 'r.sweeps.db'}"
    with sqlite3.connect(tmp_path / "r.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"results", "runs", "reports"}
    with sqlite3.connect(tmp_path / "r.sweeps.db") as conn:
        assert conn.execute("SELECT count(*) FROM trials").fetchone()[0] == 2
    db.connect(tmp_path / "r.db").close()  # still speedrun's, of the current version


def test_each_trials_stored_runs_say_that_a_sweep_stored_them(tmp_path, fake_training, monkeypatch):
    """Every trial's training result is of kind "sweep" in its JSON (records/db.py KINDS), and its command still
    names the trial."""
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--sampler", "grid", "--trials", "2",
                  "--runs", "1") == 0
    with sqlite3.connect(tmp_path / "r.db") as conn:
        rows = [json.loads(text) for text, in conn.execute("SELECT json FROM results ORDER BY id")]
    assert [r["kind"] for r in rows] == ["sweep", "sweep"]
    assert [r["command"].split("  # setting ")[1].split(" of ")[0] for r in rows] == ["trial 0", "trial 1"]


def test_pruning_stops_a_trial_below_the_median_and_keeps_its_finished_runs(tmp_path, fake_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweeping, "PRUNE_STARTUP_TRIALS", 2)
    # trials 0-2 score 0.8 at every epoch; trial 3 matches them in its first run, and falls to 0.1 in its second
    fake_training["accuracy"] = lambda call, cfg, seed: 0.1 if call == 7 else 0.8 + 0.001 * call
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--trials", "4", "--runs", "2", "--prune") == 0
    trials = _trials_in(f"sqlite:///{tmp_path / 'r.sweeps.db'}", _study_name(tmp_path))
    states = [t.state for t in trials]
    assert states[:3] == [optuna.trial.TrialState.COMPLETE] * 3 and states[3] == optuna.trial.TrialState.PRUNED
    pruned = trials[3]
    assert pruned.user_attrs["pruned_at_epoch"] == 1 and pruned.user_attrs["n"] == 1
    conn = db.connect(tmp_path / "r.db")
    n, command = conn.execute("SELECT n, command FROM results WHERE id = ?", (pruned.user_attrs["result_id"],)
                              ).fetchone()
    conn.close()
    assert n == 1 and "# setting trial 3 of" in command


def test_the_reporter_prunes_a_clearly_bad_trial(monkeypatch):
    monkeypatch.setattr(sweeping, "PRUNE_STARTUP_TRIALS", 2)
    study = optuna.create_study(direction="maximize", pruner=sweeping._pruner(optuna))
    for accuracy in (0.90, 0.92, 0.91):
        trial = study.ask()
        sweeping._reporter(trial, 0, "accuracy")({"epoch": 1.0, "val_acc": accuracy})
        study.tell(trial, accuracy)
    good, bad = study.ask(), study.ask()
    sweeping._reporter(good, 0, "accuracy")({"epoch": 1.0, "val_acc": 0.95})  # above the median: goes on
    with pytest.raises(sweeping._Pruned):
        sweeping._reporter(bad, 0, "accuracy")({"epoch": 1.0, "val_acc": 0.20})
    # the time objective minimizes: the error rate is reported, so a low accuracy is still the bad one
    study = optuna.create_study(direction="minimize", pruner=sweeping._pruner(optuna))
    for accuracy in (0.90, 0.92, 0.91):
        trial = study.ask()
        sweeping._reporter(trial, 1, "time")({"epoch": 2.0, "val_acc": accuracy})
        study.tell(trial, 1.0)
    sweeping._reporter(study.ask(), 1, "time")({"epoch": 2.0, "val_acc": 0.95})
    with pytest.raises(sweeping._Pruned):
        sweeping._reporter(study.ask(), 1, "time")({"epoch": 2.0, "val_acc": 0.20})


def _runs(accuracies, seconds=1.0):
    return [RunResult(seed=i, accuracy=a, train_seconds=seconds + 0.01 * i, epochs=1.0, steps=1)
            for i, a in enumerate(accuracies)]


def test_the_time_objective_penalizes_a_trial_that_misses_the_target():
    reached = sweeping._score("time", _runs([0.951, 0.949, 0.952, 0.95], 5.0), 0.94)
    assert reached["reached"] and not reached["penalized"] and reached["p"] < 0.01
    assert reached["value"] == pytest.approx(5.015) and reached["ci95"][0] <= 5.015 <= reached["ci95"][1]
    close = sweeping._score("time", _runs([0.93, 0.935], 1.0), 0.94)   # fast, below the target
    above = sweeping._score("time", _runs([0.95, 0.93], 1.0), 0.94)    # mean above it, p not below 0.01
    far = sweeping._score("time", _runs([0.50, 0.52], 1.0), 0.94)
    for missed in (close, above, far):
        assert missed["penalized"] and not missed["reached"] and missed["value"] > reached["value"] + 1e5
    assert close["value"] < far["value"] and above["value"] < close["value"]
    diverged = _runs([0.96, 0.96, 0.96], 1.0)
    diverged[1] = RunResult(seed=1, accuracy=None, train_seconds=None, epochs=1.0, steps=1, diverged={"step": 1})
    assert sweeping._score("time", diverged, 0.94)["penalized"]  # a diverged run counts as accuracy 0
    assert sweeping._score("accuracy", diverged, 0.94)["value"] == pytest.approx(0.64)


def test_time_objective_end_to_end(tmp_path, fake_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_training["accuracy"] = lambda call, cfg, seed: (0.96 if cfg.label_smoothing else 0.5) + 0.001 * seed
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--sampler", "grid", "--trials", "2", "--runs", "3",
                  "--objective", "time", "--set", "target_accuracy=0.94") == 0
    trials = _trials_in(f"sqlite:///{tmp_path / 'r.sweeps.db'}", _study_name(tmp_path))
    by_ls = {t.params["label_smoothing"]: t for t in trials}
    assert by_ls[0.1].user_attrs["reached"] and by_ls[0.1].value == pytest.approx(1.1)
    assert by_ls[0.0].user_attrs["penalized"] and by_ls[0.0].value > 1e6


def test_two_sweeps_on_one_study_keep_every_trial(tmp_path, fake_training, monkeypatch):
    """Threads here (the storage's locking is the same across processes: test_two_processes_... runs those)."""
    import threading

    monkeypatch.chdir(tmp_path)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    space = ["--space", "label_smoothing=0,0.1,0.2", "--storage", storage, "--study", "shared", "--runs", "1",
             "--no-prune"]
    assert _sweep(tmp_path, *space, "--trials", "1") == 0
    done = []

    def work(i):  # the API: the CLI's signal handlers belong to the main thread
        spec = sweeping.SweepSpec("cifar10-94", space=("label_smoothing=0,0.1,0.2",), trials=4, runs=1,
                                  dataset="synthetic:train=64,test=16", device="cpu", epochs=2.0,
                                  overrides={"batch_size": "32", "widths": "8,16,16", "whiten_images": "32",
                                             "cpu_threads": "1"},
                                  storage_url=storage, study_name="shared", resume=True, db_path=tmp_path / "r.db",
                                  prune=False)
        report, _, _ = sweeping.sweep(spec, log=lambda line: None)
        done.append(report["trials_this_process"])

    workers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    trials = _trials_in(storage, "shared")
    assert sorted(n for mine in done for n in mine) == list(range(1, 9))
    assert sorted(t.number for t in trials) == list(range(9))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


@pytest.mark.slow
def test_two_processes_on_one_storage_keep_every_trial(tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    base = [sys.executable, "-m", "speedrun.cli", "sweep", "cifar10-94", *TINY, "--space", "label_smoothing=0,0.1,0.2",
            "--storage", storage, "--study", "shared", "--runs", "1", "--no-prune", "--quiet", "--db",
            str(tmp_path / "r.db")]
    env = {**os.environ, "SPEEDRUN_RESULTS": str(tmp_path / "results")}
    subprocess.run([*base, "--trials", "1"], check=True, env=env, capture_output=True)
    workers = [subprocess.Popen([*base, "--trials", "3", "--resume"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    for w in workers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err.decode()
    trials = _trials_in(storage, "shared")
    assert sorted(t.number for t in trials) == list(range(7))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


def test_settings_file_of_a_sweep(tmp_path, fake_training, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--sampler", "grid", "--trials", "2", "--runs", "2",
                  "--write-settings", "best.json") == 0
    obj = json.loads((tmp_path / "best.json").read_text())
    assert obj["settings"]["label_smoothing"] == "0.1" and obj["settings"]["widths"] == "8,16,16"
    # from $SPEEDRUN_SETTINGS (set once for every command) a sweep's file is skipped: it changes what is trained
    monkeypatch.setenv("SPEEDRUN_SETTINGS", str(tmp_path / "best.json"))
    with pytest.warns(UserWarning, match="applies only when given with --settings"):
        result = speedrun.train("cifar10-94", "synthetic:train=64,test=16", device="cpu", epochs=1.0,
                                batch_size=32, widths=(8, 16, 16))
    assert result.settings is None and result.config["label_smoothing"] != 0.1
    monkeypatch.delenv("SPEEDRUN_SETTINGS")
    for change, fragment in [({"recipe": "cifar10-airbench94"}, "was measured for 'cifar10-airbench94'"),
                             ({"settings": {"no_such_key": "1"}}, "unknown config key 'no_such_key'"),
                             ({"written_by": "someone"}, "written_by is 'someone'"),
                             ({"settings": {"label_smoothing": "2"}}, "label_smoothing must be in [0, 1)")]:
        bad = tmp_path / f"bad{len(fragment)}.json"
        bad.write_text(json.dumps({**obj, **change}))
        with pytest.raises(ValueError, match=None) as e:
            speedrun.train("cifar10-94", "synthetic:train=64,test=16", device="cpu", epochs=1.0, settings=bad)
        assert fragment in str(e.value) and str(bad) in str(e.value)
    # --write-settings never replaces a file, and is claimed before any work
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--write-settings", "best.json") == 2
    assert "best.json" in capsys.readouterr().err


def test_the_report_names_a_sweep_report_it_cannot_draw(tmp_path, fake_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--trials", "2", "--runs", "2") == 0
    conn = db.connect(tmp_path / "r.db")
    # a row insert_result refuses (check_sweep_report), as a database from elsewhere or an edited one may hold
    conn.execute("INSERT INTO reports (id, kind, created_utc, command, sha256, json) VALUES (99, 'sweep', "
                 "'2026-01-01T00:00:00+00:00', 'x', 'x', ?)", (json.dumps({
                     "benchmark": "sweep", "command": "x", "objective": "accuracy", "trials": "not a list",
                     "environment": {"timestamp_utc": "2026-01-01T00:00:00+00:00"}}),))
    page = html.page(conn)
    conn.close()
    assert 'data-chart="study-trials"' in page and "could not be drawn" in page


def test_optuna_is_imported_only_by_a_sweep(monkeypatch):
    code = ("import sys, speedrun, speedrun.cli.sweep_command, speedrun.report.html; "
            "assert 'optuna' not in sys.modules, 'imported at import time'")
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'speedrun\[sweep\]'"):
        sweeping.sweep(sweeping.SweepSpec("cifar10-94", space=("label_smoothing=0,0.1",)))


def test_tensorboard_gets_each_run_of_each_trial(tmp_path, fake_training, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--trials", "2", "--runs", "2",
                  "--tensorboard", "tb") == 0
    (command_folder,) = (tmp_path / "tb").iterdir()
    runs = sorted(str(p.parent.relative_to(command_folder)) for p in command_folder.rglob("events.out.tfevents.*"))
    assert runs == ["trial-0/seed-0", "trial-0/seed-1", "trial-1/seed-0", "trial-1/seed-1"]


def test_each_trial_is_warmed_up_in_its_own_configuration_before_its_runs(tmp_path, fake_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    events = []
    monkeypatch.setattr(sweeping, "warm_up", lambda family, cfg, *a: events.append(("warm", cfg.label_smoothing,
                                                                                    cfg.lr_per_1024)) or 0.25)
    fake_training["accuracy"] = lambda call, cfg, seed: events.append(("run", cfg.label_smoothing,
                                                                       cfg.lr_per_1024)) or 0.5
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1,0.2", "--space", "lr_per_1024=8,9", "--sampler",
                  "grid", "--trials", "6", "--runs", "2") == 0
    for k in range(6):  # each trial: its own warm-up, then its runs in the same configuration
        warm, first, second = events[3 * k: 3 * k + 3]
        assert warm[0] == "warm" and first == second == ("run", *warm[1:])
    assert len({e[1:] for e in events}) == 6
    trials = _trials_in(f"sqlite:///{tmp_path / 'r.sweeps.db'}", _study_name(tmp_path))
    assert all(t.user_attrs["warmup_seconds"] == 0.25 for t in trials)


@pytest.mark.parametrize("argv,fragment", [
    (["--space", "target_accuracy=0.01,0.9", "--objective", "time", "--runs", "2"], "--space target_accuracy"),
    (["--space", "target_accuracy=0.5:0.9"], "--space target_accuracy"),
    (["--space", "eval_each_epoch=true,false"], "--space eval_each_epoch"),
    (["--space", "eval_each_epoch=true,false", "--objective", "time", "--runs", "2"], "--space eval_each_epoch"),
    (["--space", "label_smoothing=0,0.1", "--space", "target_accuracy=0.5,0.6"], "--space target_accuracy"),
])
def test_the_space_refuses_what_defines_the_measure(argv, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, *argv, "--write-settings", "best.json") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fragment in err and "defines what the sweep measures" in err, err
    assert not list(tmp_path.iterdir())
    # the budget defines the accuracy objective's measure, not the time objective's
    with pytest.raises(ValueError, match="--space epochs: epochs defines what the sweep measures"):
        sweeping.parse_space(["epochs=1:3"], REC, None, {}, "accuracy")
    assert sweeping.parse_space(["epochs=1:3"], REC, None, {}, "time")[0].key == "epochs"


@pytest.mark.parametrize("value", ["2", "0", "nan", "x"])
def test_a_bad_record_p_is_refused_before_any_work(value, tmp_path, capsys, monkeypatch, fake_training):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEEDRUN_RECORD_P", value)
    for objective in (["--objective", "time", "--runs", "2"], []):
        assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", *objective) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "SPEEDRUN_RECORD_P" in err, err
    assert not list(tmp_path.iterdir()) and fake_training["n"] == 0


def test_a_resume_must_repeat_runs_seed_and_threshold(tmp_path, capsys, monkeypatch, fake_training):
    monkeypatch.chdir(tmp_path)
    space = ["--space", "label_smoothing=0,0.1", "--trials", "1", "--objective", "time"]
    assert _sweep(tmp_path, *space, "--runs", "2", "--seed", "4") == 0
    name = _study_name(tmp_path)
    capsys.readouterr()
    for extra, fragment in [(["--runs", "3", "--seed", "4"], "differs in runs; the study's: runs 2)"),
                            (["--runs", "2", "--seed", "5"], "differs in seed; the study's: seed 4)"),
                            (["--runs", "3"], "differs in runs, seed; the study's: runs 2; seed 4)")]:
        assert _sweep(tmp_path, *space, *extra, "--resume") == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and fragment in err, err
    monkeypatch.setenv("SPEEDRUN_RECORD_P", "0.05")
    assert _sweep(tmp_path, *space, "--runs", "2", "--seed", "4", "--resume") == 2
    assert "differs in record_p; the study's: record_p 0.01)" in capsys.readouterr().err
    monkeypatch.delenv("SPEEDRUN_RECORD_P")
    assert _sweep(tmp_path, *space, "--runs", "2", "--seed", "4", "--resume") == 0
    assert len(_trials_in(f"sqlite:///{tmp_path / 'r.sweeps.db'}", name)) == 2


def test_an_interrupted_sweep_keeps_its_bookkeeping_and_writes_settings(tmp_path, capsys, monkeypatch,
                                                                          fake_training):
    monkeypatch.chdir(tmp_path)

    def accuracy(call, cfg, seed):  # trial 0: runs 0, 1; trial 1: run 2 finishes, Ctrl-C in run 3
        if call == 3:
            raise KeyboardInterrupt
        return 0.5 + cfg.label_smoothing

    fake_training["accuracy"] = accuracy
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--sampler", "grid", "--trials", "2", "--runs", "2",
                  "--write-settings", "best.json", quiet=False) == 130
    captured = capsys.readouterr()
    assert "3 finished runs" in captured.err, captured.err
    assert "the best of the trials completed before the sweep stopped" in captured.err
    trials = _trials_in(f"sqlite:///{tmp_path / 'r.sweeps.db'}", _study_name(tmp_path))
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]
    stopped = trials[1].user_attrs
    assert stopped["n"] == 1 and stopped["mean"] is not None and stopped["result_id"] is not None
    assert "KeyboardInterrupt" in stopped["error"]
    row = [line for line in captured.out.splitlines() if line.strip().startswith("1 fail")][0]
    assert " n/a " not in row and " 1 " in row
    conn = db.connect(tmp_path / "r.db")
    assert conn.execute("SELECT sum(n) FROM results").fetchone()[0] == 3
    conn.close()
    settings = json.loads((tmp_path / "best.json").read_text())
    assert settings["measured"]["trial"] == 0 and settings["measured"]["complete"] is False


def test_an_interrupt_before_any_trial_completed_writes_no_settings(tmp_path, capsys, monkeypatch, fake_training):
    monkeypatch.chdir(tmp_path)

    def accuracy(call, cfg, seed):
        if call == 1:
            raise KeyboardInterrupt
        return 0.5

    fake_training["accuracy"] = accuracy
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", "--trials", "2", "--runs", "2",
                  "--write-settings", "best.json") == 130
    err = capsys.readouterr().err
    assert "none written to best.json" in err and "1 finished run" in err, err
    assert not (tmp_path / "best.json").exists()


@pytest.mark.parametrize("argv,fragment", [
    (["--storage", "sqlite://"], "an in-memory database ends with this process"),
    (["--storage", "sqlite:///"], "an in-memory database ends with this process"),
    (["--storage", "sqlite:///:memory:"], "an in-memory database ends with this process"),
    (["--storage", "sqlite+pysqlite:///:memory:"], "an in-memory database ends with this process"),
    (["--storage", "sqlite:///file:db?mode=memory&uri=true"], "an in-memory database ends with this process"),
    (["--study", ""], "--study: give a name of 1 to 200 characters, not blank"),
    (["--study", "   "], "--study: give a name of 1 to 200 characters, not blank"),
    (["--study", "x" * 201], "--study: give a name of 1 to 200 characters"),
])
def test_a_study_must_outlive_the_process_and_have_a_name(argv, fragment, tmp_path, capsys, monkeypatch,
                                                          fake_training):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--space", "label_smoothing=0,0.1", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fragment in err, err
    assert not list(tmp_path.iterdir()) and fake_training["n"] == 0


@pytest.mark.parametrize("options,message", [
    ({"objective": "speed"}, "--objective 'speed': choose accuracy or time"),
    ({"sampler": "cmaes"}, "--sampler 'cmaes': choose tpe, random, grid"),
    ({"trials": 0}, "trials (--trials) must be an integer in [1, 100000], got 0"),
    ({"runs": True}, "runs (--runs) must be an integer in [1, 10000], got True"),
    ({"seed": 2**32 - 1, "runs": 2}, "give --seed from 0 to 4294967294 with --runs 2"),
    ({"objective": "time", "runs": 1}, "a t-test that needs n >= 2: give --runs 2 or more"),
    ({"study_name": " "}, "--study: give a name of 1 to 200 characters, not blank"),
    ({"study_name": "a\nb"}, "--study a\\nb: the name holds a control or other unprintable character"),
])
def test_a_sweep_spec_is_checked_in_one_place_before_anything_is_opened(options, message, tmp_path, monkeypatch):
    """SweepSpec.check() refuses each bad option in the CLI's words; sweep() calls it before any file is made."""
    monkeypatch.chdir(tmp_path)
    spec = sweeping.SweepSpec("cifar10-94", space=("label_smoothing=0,0.1",), db_path=tmp_path / "r.db", **options)
    with pytest.raises(ValueError) as refused:
        spec.check()
    assert message in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError) as again:
        sweeping.sweep(spec, log=lambda line: None)
    assert str(again.value) == str(refused.value) and not list(tmp_path.iterdir())
    sweeping.SweepSpec("cifar10-94", space=("label_smoothing=0,0.1",)).check()  # the defaults pass


def test_a_sweep_spec_holds_what_it_was_built_with():
    """The spec keeps copies: a caller's list or dict changed later leaves it as it was built, and it is frozen."""
    space, overrides = ["label_smoothing=0,0.1"], {"batch_size": "32"}
    spec = sweeping.SweepSpec("cifar10-94", space=space, overrides=overrides)
    space.append("lr_per_1024=8:9")
    overrides["widths"] = "8,16,16"
    assert spec.space == ("label_smoothing=0,0.1",) and spec.overrides == {"batch_size": "32"}
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        spec.trials = 3
