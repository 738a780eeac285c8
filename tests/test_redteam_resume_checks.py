"""A checkpoint is checked whole before anything of it is adopted: a refused one (hostile or edited meta, finished
runs, history rows, training state) keeps nothing, neither result file content nor a database row, and the
--json path it claimed is released (run/resume.py's check_found, run/session.py's keep_failed)."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from speedrun.cli.program import main
from speedrun.engine.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from speedrun.recipes.cifar import loop as cifar_loop

SMALL = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "2", "--set", "batch_size=64",
         "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet", "--runs", "3", "--checkpoint-every", "2"]
HOSTILE_TEXT = "<img src=x onerror=alert(1)>"


@contextlib.contextmanager
def _interrupted_after_a_checkpoint_of_run(index: int):
    """Inside the block, the command is interrupted (as by Ctrl-C) once the first checkpoint of run `index` (from 0)
    is written: its finished runs are those before it."""
    from speedrun.run.resume import Checkpoints

    real = Checkpoints.save

    def save(self, step, state):
        real(self, step, state)
        if self.run == index:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Checkpoints, "save", save)
        yield


@pytest.fixture(scope="module")
def two_runs_done(tmp_path_factory) -> Path:
    """A checkpoint folder of a 3-run command interrupted in run 3: its newest checkpoint lists 2 finished runs
    (made once for the module; each test copies it)."""
    where = tmp_path_factory.mktemp("made")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(where)
        m.setenv("SPEEDRUN_RESULTS", str(where / "results"))
        m.setenv("SPEEDRUN_DB", str(where / "made.db"))
        with _interrupted_after_a_checkpoint_of_run(2):
            assert main(["train", *SMALL, "--checkpoint-dir", "ck"]) == 130
    return where / "ck"


@pytest.fixture
def here(tmp_path, monkeypatch, two_runs_done) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "r.db"))
    shutil.copytree(two_runs_done, tmp_path / "ck")
    return tmp_path


def _craft(change) -> Path:
    """The newest checkpoint in ck, changed by `change(state, meta)` and written again under its own name: a valid
    file (checksum and all) whose content is wrong, as a hostile or buggy writer could make it."""
    newest = list_checkpoints(Path("ck"))[0]
    state, meta = load_checkpoint(newest)
    change(state, meta)
    run, step = (int(part) for part in newest.stem.split("-")[1:])
    return save_checkpoint("ck", run, step, state, meta, keep=10)


def _rows(db: Path) -> int:
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT count(*) FROM results").fetchone()[0]


def _history_row(run: int, **values):
    def change(state, meta):
        meta["finished"][run]["history"][0].update(values)
    return change


def _state(**values):
    return lambda state, meta: state.update(values)


# Damage to what resuming adopts: the finished runs' fields and history rows (the result's runs), the meta's run
# index, and the state's bookkeeping and rows (the resumed run's history).
DAMAGE = {
    "row epoch markup": _history_row(0, epoch=HOSTILE_TEXT),
    "row step escape": _history_row(1, step="\x1b[31m"),
    "row accuracy negative": _history_row(0, train_acc=-5),
    "row seconds negative": _history_row(0, train_seconds=-100),
    "row test accuracy markup": _history_row(0, val_acc="<b>bold</b>"),
    "row loss a string": _history_row(0, train_loss="nan"),
    "row step past the run": _history_row(0, step=10**6),
    "row column no loop writes": _history_row(0, **{"\x1b]0;pwned\x07": 1}),
    "row not a dict": lambda s, m: m["finished"][0]["history"].append("row"),
    "run field unknown": lambda s, m: m["finished"][0].update(extra_field="\x1b]0;pwned\x07"),
    "run seconds negative": lambda s, m: m["finished"][0].update(train_seconds=-100.0),
    "run accuracy above 1": lambda s, m: m["finished"][1].update(accuracy=1.5),
    "run steps negative": lambda s, m: m["finished"][1].update(steps=-1),
    "run divergence malformed": lambda s, m: m["finished"][1].update(diverged={"message": 5}, accuracy=None,
                                                                     train_seconds=None),
    "runs fewer than the index": lambda s, m: m["finished"].pop(),
    "run index a bool": lambda s, m: m.update(run=True),
    "state seconds negative": _state(seconds=-1000.0),
    "state seconds infinite": _state(seconds=float("inf")),
    "state step not the checkpoint's": _state(step=3),
    "state epochs negative": _state(epochs_done=-1),
    "state row epoch a string": _state(history=[{"epoch": "zz", "step": 0, "train_loss": 1.0, "train_acc": 0.1,
                                                 "val_acc": None, "train_seconds": 0.0}]),
    "state row markup": _state(history=[{"epoch": 1.0, "step": 1, "train_loss": 1.0, "train_acc": 0.1,
                                         "val_acc": "<script>x</script>", "train_seconds": 0.0}]),
    "state last batch partial": _state(last_batch={"epoch": 1.0}),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_refused_checkpoint_keeps_nothing_of_its_runs(damage, here, capsys, monkeypatch):
    change = DAMAGE[damage]
    _craft(change)
    before = {p: p.read_bytes() for p in Path("ck").iterdir()}
    trained = []
    real_step = cifar_loop.train_step
    monkeypatch.setattr(cifar_loop, "train_step", lambda *a, **k: trained.append(1) or real_step(*a, **k))
    capsys.readouterr()
    assert main(["train", *SMALL, "--checkpoint-dir", "ck", "--resume", "auto", "--json", "rh.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "malformed run records" in err or "does not fit this run" in err, err
    assert "kept" not in err and "\x1b" not in err and not trained
    assert not Path("rh.json").exists() and _rows(here / "r.db") == 0  # no result, no row, the path released
    assert {p: p.read_bytes() for p in Path("ck").iterdir()} == before  # the checkpoints left as they were


@pytest.mark.parametrize("change", [
    lambda s, m: s.pop("model"),
    lambda s, m: s.update(optimizers=[]),
    lambda s, m: s["rng"].update(python=(3, (1, 2), None)),
])
def test_a_checkpoint_the_family_refuses_as_it_restores_keeps_nothing_either(change, here, capsys):
    """The family's own parts are checked as the family loads them, after the result holds the checkpoint's runs:
    the refusal still keeps none of them (no file, no row), whatever the --json asked."""
    _craft(change)
    _, meta = load_checkpoint(list_checkpoints(Path("ck"))[0])
    partial = Path(meta["result_path"]).read_bytes()  # the interrupted command's result, which auto continues
    for json_arg in (["--json", "r.json"], []):
        capsys.readouterr()
        assert main(["train", *SMALL, "--checkpoint-dir", "ck", "--resume", "auto", *json_arg]) == 2
        err = capsys.readouterr().err
        assert "does not fit this run" in err and "kept" not in err and err.count("\n") == 1, err
        assert not Path("r.json").exists() and not list(Path("results").glob("*.json"))
        assert _rows(here / "r.db") == 0 and Path(meta["result_path"]).read_bytes() == partial


def test_the_runs_adopted_from_a_sound_checkpoint_are_stored_checked(here, capsys):
    """The control: the same checkpoint unchanged resumes, and its finished runs' rows are the ones saved."""
    _, meta = load_checkpoint(list_checkpoints(Path("ck"))[0])
    assert main(["train", *SMALL, "--checkpoint-dir", "ck", "--resume", "auto", "--json", "r.json"]) == 0
    runs = json.loads(Path("r.json").read_text())["runs"]
    assert [r["history"] for r in runs[:2]] == [r["history"] for r in meta["finished"]]
    assert _rows(here / "r.db") == 1
