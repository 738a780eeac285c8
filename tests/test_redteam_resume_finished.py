"""--resume auto in a job that already finished (a requeued job script) reports the job's result and runs and
stores nothing again; a job with anything left to run (its result not written, more runs asked for, a result file
that does not prove it finished) resumes as before (run/resume.py's Plan.finished_job)."""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

import speedrun
from speedrun.cli.program import main
from speedrun.engine.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from speedrun.errors import SpeedrunWarning
from speedrun.recipes.cifar import loop as cifar_loop
from speedrun.recipes.in_memory import loop as in_memory_loop
from speedrun.run import runner

pytestmark = pytest.mark.skipif("finished_job" not in inspect.getsource(runner),
                                reason="runner.train does not yet ask resume.Plan.finished_job before claiming")

SMALL = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "2", "--set", "batch_size=64",
         "--set", "widths=8,16,16", "--set", "whiten_images=64", "--runs", "2", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory) -> Path:
    """A 2-run job run to its end: ck (its last checkpoint is run 2's last step), r.json, its row in r.db."""
    where = tmp_path_factory.mktemp("job")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(where)
        m.setenv("SPEEDRUN_RESULTS", str(where / "results"))
        m.setenv("SPEEDRUN_DB", str(where / "r.db"))
        assert main(["train", *SMALL, "--quiet", "--checkpoint-dir", "ck", "--json", "r.json"]) == 0
    return where


@pytest.fixture
def job(tmp_path, monkeypatch, finished_job) -> Path:
    """A copy of the finished job in tmp_path, its checkpoint naming the copy of its result file."""
    for name in ("ck", "r.json", "r.db"):
        (shutil.copytree if name == "ck" else shutil.copy)(finished_job / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "r.db"))
    newest = list_checkpoints(tmp_path / "ck")[0]
    state, meta = load_checkpoint(newest)
    meta["result_path"] = str((tmp_path / "r.json").resolve())
    run, step = (int(part) for part in newest.stem.split("-")[1:])
    save_checkpoint(tmp_path / "ck", run, step, state, meta, keep=10)
    return tmp_path


@pytest.fixture
def steps_taken(monkeypatch) -> list:
    taken = []
    real = cifar_loop.train_step
    monkeypatch.setattr(cifar_loop, "train_step", lambda *a, **k: taken.append(1) or real(*a, **k))
    return taken


def _rows(db: Path) -> list[int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM results ORDER BY id")]


def _evaluations(monkeypatch) -> list:
    """Every final evaluation the cifar family scores (a resumed run's last step checkpointed: only that)."""
    scored = []
    real = in_memory_loop.evaluate  # the shared loop scores the cifar family's runs
    monkeypatch.setattr(in_memory_loop, "evaluate", lambda *a, **k: scored.append(1) or real(*a, **k))
    return scored


@pytest.mark.parametrize("json_arg, quiet", [(["--json", "r.json"], ["--quiet"]), ([], ["--quiet"]),
                                             (["--json", "other.json"], []), (["--json", "auto"], [])])
def test_a_requeued_finished_job_reports_its_result_and_runs_and_stores_nothing(json_arg, quiet, job, steps_taken,
                                                                               capsys, monkeypatch):
    before, rows = (job / "r.json").read_bytes(), _rows(job / "r.db")
    scored = _evaluations(monkeypatch)
    for _ in range(2):  # requeued again and again: the same answer
        assert main(["train", *SMALL, *quiet, "--checkpoint-dir", "ck", "--resume", "auto", *json_arg]) == 0
        captured = capsys.readouterr()
        line = f"the job in ck finished: its result is {(job / 'r.json').resolve()} (#{rows[0]})"
        assert line in captured.err and "Traceback" not in captured.err
        assert "n=2" in captured.out  # the summary table: the job's result
    assert not steps_taken and not scored
    assert (job / "r.json").read_bytes() == before and _rows(job / "r.db") == rows
    assert not (job / "other.json").exists() and not (job / "results").exists()


def test_the_python_api_returns_the_finished_jobs_result(job, steps_taken):
    stored = json.loads((job / "r.json").read_text())
    with pytest.warns(SpeedrunWarning, match="the job in ck finished"):
        result = speedrun.train("cifar10-94", "synthetic:train=256,test=32", device="cpu", epochs=2, runs=2,
                                checkpoint_dir="ck", checkpoint_every=2, resume="auto", json_path="auto",
                                batch_size=64, widths=(8, 16, 16), whiten_images=64)
    assert result.complete and result.accuracies == [r["accuracy"] for r in stored["runs"]] and not steps_taken
    assert result.to_dict()["runs"] == stored["runs"] and result.to_dict()["mfu"] == stored["mfu"]


# Each change to the result file leaves it short of proving the job finished.
NOT_PROVEN = {
    "killed in the last final evaluation": lambda r: r.update(runs=r["runs"][:1], complete=False),
    "fewer runs asked for": lambda r: r.update(runs_requested=1),
    "a run not the checkpoint's": lambda r: r["runs"][0].update(accuracy=0.5),
    "the last run ended elsewhere": lambda r: r["runs"][1].update(steps=r["runs"][1]["steps"] + 1),
    "another seed": lambda r: r["runs"][1].update(seed=7),
    "another config": lambda r: r["config"].update(lr_per_1024=1.0),
    "not a result": lambda r: r.clear(),
}


@pytest.mark.parametrize("why", list(NOT_PROVEN))
def test_a_result_file_that_does_not_prove_the_job_finished_resumes_it(why, job, steps_taken, capsys,
                                                                        monkeypatch):
    """The newest checkpoint is run 2's last step: what resuming it costs is run 2's final evaluation, once."""
    result = json.loads((job / "r.json").read_text())
    NOT_PROVEN[why](result)
    (job / "r.json").write_text(json.dumps(result))
    scored = _evaluations(monkeypatch)
    assert main(["train", *SMALL, "--quiet", "--checkpoint-dir", "ck", "--resume", "auto", "--json", "r2.json"]) == 0
    assert "finished:" not in capsys.readouterr().err
    assert not steps_taken and scored
    assert json.loads((job / "r2.json").read_text())["complete"] is True


def test_more_runs_than_the_job_ran_continue_it(job, steps_taken, capsys):
    assert main(["train", *SMALL[:-4], "--runs", "3", "--checkpoint-every", "2", "--quiet", "--checkpoint-dir",
                 "ck", "--resume", "auto", "--json", "r3.json"]) == 0
    assert "finished:" not in capsys.readouterr().err and steps_taken
    assert [r["seed"] for r in json.loads((job / "r3.json").read_text())["runs"]] == [0, 1, 2]


def test_a_changed_setting_is_named_not_taken_for_the_finished_job(job, capsys):
    assert main(["train", *SMALL, "--quiet", "--set", "lr_per_1024=10", "--checkpoint-dir", "ck", "--resume",
                 "auto"]) == 2
    err = capsys.readouterr().err
    assert "lr_per_1024=11.5" in err and "finished" not in err and err.count("\n") == 1
