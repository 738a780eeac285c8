"""Every way out a refused resume names works when followed: a mismatched, malformed or unusable checkpoint under
--resume auto, a checkpoint file given to --resume (with a checkpoint folder or without), a --resume path that holds
no checkpoint, and a folder that already holds checkpoints. Each test follows each piece of advice of the line, as
written, and the command then runs (run/resume.py's Plan.afresh, engine/checkpoint.py's AFRESH)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from speedrun.cli.program import main
from speedrun.engine.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

# 256 images at batch 64, one epoch: 4 steps, a checkpoint at each; the newest two kept (steps 3 and 4).
SMALL = ["train", "--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set",
         "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet"]
CHANGED = ["--set", "lr_per_1024=10"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("made")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(where)
        m.setenv("SPEEDRUN_RESULTS", str(where / "results"))
        assert main([*SMALL, "--checkpoint-dir", "ck", "--checkpoint-every", "1"]) == 0
    assert [p.name for p in list_checkpoints(where / "ck")] == ["ckpt-00000-000000004.safetensors",
                                                                 "ckpt-00000-000000003.safetensors"]
    return where / "ck"


@pytest.fixture(autouse=True)
def ck(tmp_path, monkeypatch, made) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    shutil.copytree(made, tmp_path / "ck")
    return tmp_path / "ck"


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _runs(argv, capsys) -> None:
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err


def _remove_checkpoints(folder: Path) -> None:
    for path in list_checkpoints(folder):
        path.unlink()


def _restore(ck: Path, made: Path) -> None:
    shutil.rmtree(ck, ignore_errors=True)
    shutil.copytree(made, ck)


@pytest.mark.parametrize("mismatch", [CHANGED, ["--seed", "3"],
                                      ["--dataset", "synthetic:train=256,test=32,seed=7"]])
def test_a_mismatched_checkpoint_under_resume_auto(mismatch, ck, made, capsys):
    argv = [*SMALL, *mismatch, "--checkpoint-dir", "ck", "--resume", "auto"]
    err = _refused(argv, capsys)
    assert "resume with the same settings, or start afresh in a new --checkpoint-dir (or remove the checkpoints " \
           "in ck)" in err
    _runs([*SMALL, "--checkpoint-dir", "ck", "--resume", "auto"], capsys)  # the same settings
    _runs([*argv[:-4], "--checkpoint-dir", "new", "--resume", "auto"], capsys)  # a new --checkpoint-dir
    _remove_checkpoints(ck)
    _runs(argv, capsys)  # the checkpoints in ck removed


def test_a_folder_holding_checkpoints_without_resume_leads_out_in_two_steps(ck, made, capsys):
    """Without --resume the line says "add --resume auto"; with a changed setting that is refused in turn, and
    that line's advice ends it: the advice never leads back."""
    err = _refused([*SMALL, *CHANGED, "--checkpoint-dir", "ck"], capsys)
    assert "add --resume auto to continue from them, or choose a new --checkpoint-dir" in err
    err = _refused([*SMALL, *CHANGED, "--checkpoint-dir", "ck", "--resume", "auto"], capsys)
    assert "start afresh in a new --checkpoint-dir (or remove the checkpoints in ck)" in err
    _runs([*SMALL, *CHANGED, "--checkpoint-dir", "other"], capsys)
    _remove_checkpoints(ck)
    _runs([*SMALL, *CHANGED, "--checkpoint-dir", "ck"], capsys)


@pytest.mark.parametrize("with_folder", [True, False])
def test_a_mismatched_checkpoint_file_given_to_resume(with_folder, ck, made, capsys):
    file = str(list_checkpoints(ck)[0])
    folder = ["--checkpoint-dir", "ck"] if with_folder else []
    err = _refused([*SMALL, *CHANGED, *folder, "--resume", file], capsys)
    if with_folder:
        assert "start afresh without --resume, in a new --checkpoint-dir (or remove the checkpoints in ck)" in err
        _runs([*SMALL, *CHANGED, "--checkpoint-dir", "new"], capsys)
        _remove_checkpoints(ck)
        _runs([*SMALL, *CHANGED, *folder], capsys)
    else:
        assert err.rstrip().endswith("or start afresh without --resume"), err
        _runs([*SMALL, *CHANGED], capsys)


def _malformed(ck: Path) -> Path:
    newest = list_checkpoints(ck)[0]
    state, meta = load_checkpoint(newest)
    state["seconds"] = -1.0
    return save_checkpoint(ck, 0, 4, state, meta, keep=10)


def test_a_malformed_checkpoint_found_by_auto(ck, made, capsys):
    newest = _malformed(ck)
    # Two runs: the job is not finished (a finished one is reported as such, its checkpoints unused).
    argv = [*SMALL, "--runs", "2", "--checkpoint-dir", "ck", "--resume", "auto"]
    err = _refused(argv, capsys)
    assert ("delete it to resume from the one before, or start afresh in a new --checkpoint-dir (or remove the "
            "checkpoints in ck)") in err
    _runs([*argv[:-4], "--checkpoint-dir", "new", "--resume", "auto"], capsys)
    newest.unlink()
    _runs(argv, capsys)  # from the one before
    _restore(ck, made)
    _malformed(ck)
    _remove_checkpoints(ck)
    _runs(argv, capsys)


@pytest.mark.parametrize("given", ["--checkpoint-dir", "--resume"])
def test_a_folder_of_unusable_checkpoints(given, ck, capsys):
    for path in list_checkpoints(ck):
        path.write_bytes(b"not a checkpoint")
    argv = [*SMALL, "--checkpoint-dir", "ck", "--resume", "auto"] if given == "--checkpoint-dir" else \
        [*SMALL, "--resume", "ck"]
    err = _refused(argv, capsys)
    assert "no usable checkpoint in ck" in err
    if given == "--checkpoint-dir":
        assert "start afresh in a new --checkpoint-dir (or remove the checkpoints in ck)" in err
        _runs([*SMALL, "--checkpoint-dir", "new", "--resume", "auto"], capsys)
        _remove_checkpoints(ck)
        _runs(argv, capsys)
    else:
        assert err.rstrip().endswith("start afresh without --resume"), err
        _runs(SMALL, capsys)


@pytest.mark.parametrize("folder", [None, "empty", "ck"])
def test_a_resume_path_without_checkpoints(folder, ck, capsys):
    """--resume names a path with no checkpoint: the line's ways out are those this folder allows."""
    if folder == "empty":
        Path("empty").mkdir()
    given = [] if folder is None else ["--checkpoint-dir", folder]
    err = _refused([*SMALL, *given, "--resume", "nonexist"], capsys)
    assert "no checkpoint in nonexist to resume; give --resume an existing checkpoint file or a folder" in err
    _runs([*SMALL, *given, "--resume", str(list_checkpoints(ck)[-1])], capsys)  # an existing file
    if folder is None:
        assert "--resume auto" not in err and err.rstrip().endswith("or start afresh without --resume"), err
        _runs(SMALL, capsys)
    elif folder == "empty":
        assert "or start afresh (without --resume, or with --resume auto)" in err
        _remove_checkpoints(Path("empty"))  # the file resumed above wrote its own there
        _runs([*SMALL, *given], capsys)
        _remove_checkpoints(Path("empty"))
        _runs([*SMALL, *given, "--resume", "auto"], capsys)
    else:
        assert ("or --resume auto to continue from the newest checkpoint in ck, or start afresh without --resume "
                "in a new --checkpoint-dir") in err
        _runs([*SMALL, *given, "--resume", "auto"], capsys)
        _runs([*SMALL, "--checkpoint-dir", "new"], capsys)
