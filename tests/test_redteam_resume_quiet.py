"""What changes the meaning of a resumed result is shown with --quiet too: a checkpoint passed over as unusable (a
warning, as it happens) and the checkpoint the result continues (a warning once the resumed run has ended, after
every check of the checkpoint); a refusal is still its one line (run/resume.py's Plan.find, run/session.py)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest

import speedrun
from speedrun.cli.program import main
from speedrun.engine.checkpoint import list_checkpoints
from speedrun.errors import SpeedrunWarning

SMALL = ["train", "--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set",
         "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=64", "--checkpoint-every", "1",
         "--keep-checkpoints", "3"]


@pytest.fixture(autouse=True)
def _here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))


@contextlib.contextmanager
def _interrupted_in_run(index: int, at_step: int = 1):
    """Inside the block, the command is interrupted (as by Ctrl-C) once run `index` (from 0) saved its checkpoint
    of step `at_step`."""
    from speedrun.run.resume import Checkpoints

    real = Checkpoints.save

    def save(self, step, state):
        real(self, step, state)
        if (self.run, step) == (index, at_step):
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Checkpoints, "save", save)
        yield


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("speedrun: warning: ")]


@pytest.mark.parametrize("damage", [lambda p: p.write_bytes(p.read_bytes()[:1000]), lambda p: p.write_bytes(b""),
                                    lambda p: p.write_bytes(p.read_bytes()[:-1] + b"x")])
def test_with_quiet_a_passed_over_checkpoint_and_the_resume_are_warnings(damage, capsys):
    with _interrupted_in_run(1, at_step=2):
        assert main([*SMALL, "--quiet", "--runs", "2", "--checkpoint-dir", "ck"]) == 130
    newest, previous = list_checkpoints(Path("ck"))[:2]
    damage(newest)
    capsys.readouterr()
    assert main([*SMALL, "--quiet", "--runs", "2", "--checkpoint-dir", "ck", "--resume", "auto"]) == 0
    said = _warnings(capsys.readouterr().err)
    assert len(said) == 2, said
    assert said[0].startswith(f"speedrun: warning: checkpoint {newest.name} is unusable (") and \
        said[0].endswith("); trying the previous one")
    assert said[1] == f"speedrun: warning: resumed from {previous} (run 2 continued from it; run 1 is the checkpoint's)"


def test_verbose_output_says_resuming_once_and_a_python_caller_gets_no_line(capsys):
    with _interrupted_in_run(2):
        assert main([*SMALL, "--quiet", "--runs", "3", "--checkpoint-dir", "ck"]) == 130
    newest = list_checkpoints(Path("ck"))[0]
    capsys.readouterr()
    assert main([*SMALL, "--runs", "3", "--checkpoint-dir", "ck", "--resume", "auto", "--json", "v.json"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"resuming from {newest}") == 1 and "resumed from" not in err and not _warnings(err)
    with _interrupted_in_run(2):
        assert main([*SMALL, "--quiet", "--runs", "3", "--checkpoint-dir", "ck2"]) == 130
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        speedrun.train("cifar10-94", "synthetic:train=256,test=32", device="cpu", epochs=1, runs=3,
                       checkpoint_dir="ck2", checkpoint_every=1, resume="auto", batch_size=64, widths=(8, 16, 16),
                       whiten_images=64)
    assert not [w for w in caught if issubclass(w.category, SpeedrunWarning)]


def test_with_quiet_the_resumed_line_names_the_runs_the_checkpoint_holds(capsys):
    with _interrupted_in_run(2):
        assert main([*SMALL, "--quiet", "--runs", "3", "--checkpoint-dir", "ck"]) == 130
    newest = list_checkpoints(Path("ck"))[0]
    capsys.readouterr()
    assert main([*SMALL, "--quiet", "--runs", "3", "--checkpoint-dir", "ck", "--resume", "auto"]) == 0
    captured = capsys.readouterr()
    assert _warnings(captured.err) == [f"speedrun: warning: resumed from {newest} (run 3 continued from it; runs 1-2 "
                                       "are the checkpoint's)"]
    assert "n=3" in captured.out


def _malformed(path: Path) -> None:
    from speedrun.engine.checkpoint import load_checkpoint, save_checkpoint

    state, meta = load_checkpoint(path)
    state["seconds"] = -1.0
    run, step = (int(part) for part in path.stem.split("-")[1:])
    save_checkpoint(path.parent, run, step, state, meta, keep=10)


@pytest.mark.parametrize("older", ["unusable", "malformed"])
def test_with_quiet_a_refusal_is_still_one_line(older, capsys):
    """The newest checkpoint unusable, and the one before it too, or refused as it is checked: the refusal alone
    is said, not the checkpoint passed over on the way to it."""
    with _interrupted_in_run(1, at_step=2):
        assert main([*SMALL, "--quiet", "--runs", "2", "--checkpoint-dir", "ck"]) == 130
    newest, *rest = list_checkpoints(Path("ck"))
    newest.write_bytes(b"")
    for path in rest:
        if older == "unusable":
            path.write_bytes(b"")
        else:
            _malformed(path)
    capsys.readouterr()
    assert main([*SMALL, "--quiet", "--runs", "2", "--checkpoint-dir", "ck", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("speedrun: error: "), err
    assert ("no usable checkpoint in ck" if older == "unusable" else "does not fit this run") in err
