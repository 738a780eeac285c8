"""Checkpoints, resume and saved models through the command, in one process (the multi-process and signal cases
are in test_dist.py; the file formats' hostile cases in test_checkpoint.py and test_saved.py)."""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image

import speedrun
from speedrun.engine.checkpoint import list_checkpoints
from speedrun.cli.program import main
from speedrun.recipes.cifar import loop as cifar_loop

SMALL = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "2", "--set", "batch_size=64",
         "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet"]


@pytest.fixture(autouse=True)
def _results(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_checkpoint_of_another_config_is_refused_naming_the_field(capsys):
    assert main(["train", *SMALL, "--checkpoint-dir", "ck"]) == 0
    assert main(["train", *SMALL, "--set", "lr_per_1024=10", "--checkpoint-dir", "ck", "--resume", "auto"]) == 2
    err = _error(capsys)
    assert "lr_per_1024=11.5" in err and "lr_per_1024=10.0" in err and "ck" in err
    assert main(["train", *SMALL, "--seed", "3", "--checkpoint-dir", "ck", "--resume", "auto"]) == 2
    assert "seed=0" in _error(capsys)
    other_data = [a.replace("train=256", "train=320") for a in SMALL]
    assert main(["train", *other_data, "--checkpoint-dir", "ck", "--resume", "auto"]) == 2
    assert "data.num_train=256" in _error(capsys)
    # What only changes speed may differ: the finished checkpoint resumes and re-scores the run.
    assert main(["train", *SMALL, "--set", "check_finite_loss=false", "--checkpoint-dir", "ck", "--resume",
                 "auto"]) == 0


def test_a_pickle_posing_as_a_checkpoint_runs_no_code(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "ck").mkdir()
    bad = tmp_path / "ck" / "ckpt-00000-000000004.safetensors"
    bad.write_bytes(pickle.dumps({"state": Payload()}))
    assert main(["train", *SMALL, "--checkpoint-dir", "ck", "--resume", str(bad)]) == 2
    assert "ckpt-00000-000000004" in _error(capsys)
    assert main(["train", *SMALL, "--checkpoint-dir", "ck", "--resume", "auto"]) == 2  # the only one is unusable
    assert "no usable checkpoint" in _error(capsys)
    assert not marker.exists()


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(capsys):
    assert main(["train", *SMALL, "--checkpoint-dir", "ck", "--checkpoint-every", "2",
                 "--keep-checkpoints", "3"]) == 0
    newest, previous = list_checkpoints(Path("ck"))[:2]
    newest.write_bytes(newest.read_bytes()[:1000])
    assert main(["train", *SMALL[:-1], "--checkpoint-dir", "ck", "--resume", "auto", "--json", "r.json"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newest.name} is unusable" in err and f"resuming from {previous}" in err
    assert json.loads(Path("r.json").read_text())["resumed_from"] == [str(previous)]


def test_resume_flags_without_a_folder_are_one_line(capsys):
    assert main(["train", *SMALL, "--resume", "auto"]) == 2
    assert "--checkpoint-dir" in _error(capsys)
    assert main(["train", *SMALL, "--checkpoint-every", "5"]) == 2
    assert "--checkpoint-dir" in _error(capsys)
    Path("afile").write_text("mine")
    assert main(["train", *SMALL, "--checkpoint-dir", "afile"]) == 2
    assert "is a file" in _error(capsys) and Path("afile").read_text() == "mine"


def test_save_eval_predict_and_load_round_trip(tmp_path, capsys):
    folder = tmp_path / "imgs"
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 48), ("test", 16)):
        for i in range(n):
            label = i % 2
            where = folder / split / ("cat", "dog")[label]
            where.mkdir(parents=True, exist_ok=True)
            pixels = torch.randint(0, 100, (16, 16, 3), generator=g, dtype=torch.uint8) + 120 * label
            Image.fromarray(pixels.numpy()).save(where / f"{i}.png")
    train = ["--dataset", str(folder), "--device", "cpu", "--epochs", "2", "--set", "batch_size=16", "--set",
             "widths=8,16", "--set", "whiten_images=32", "--quiet", "--json", "r.json"]
    assert main(["train", *train, "--save", "model.safetensors"]) == 0
    assert Path("model.safetensors").exists() and Path("model.json").exists()
    result = json.loads(Path("r.json").read_text())
    assert result["saved_model"] == "model.safetensors + model.json"
    capsys.readouterr()
    assert main(["eval", "model", "--dataset", str(folder), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"{100 * result['runs'][0]['accuracy']:.2f}%" in out  # the same test set, the same TTA: the same score
    image = folder / "test" / "dog" / "1.png"
    assert main(["predict", "model.json", str(image), "--top", "2", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{image}: ") and {"cat", "dog"} <= set(line.replace(",", " ").split())
    model = speedrun.load("model")
    assert not model.training and model.classes == ["cat", "dog"]
    x = torch.tensor(__import__("numpy").array(Image.open(image))).permute(2, 0, 1)[None]
    (top,) = model.predict(x, top=2)
    assert [c for c, _ in top] == sorted(["cat", "dog"], key=lambda c: -dict(top)[c])
    assert abs(sum(p for _, p in top) - 1) < 1e-5
    assert main(["train", *train[:-2], "--save", "model"]) == 2  # never replaced
    assert "already exists" in _error(capsys)


@contextlib.contextmanager
def _interrupted_at_run(n: int, monkeypatch):
    """Inside the block, the command is interrupted (as by Ctrl-C) when run n starts."""
    from speedrun.recipes import cifar

    real, calls = cifar.train_run, []

    def run(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cifar, "train_run", run)
    yield
    monkeypatch.setattr(cifar, "train_run", real)


def _craft(directory: str, change) -> Path:
    """The newest checkpoint in `directory`, changed by `change(state, meta)` and written again: a valid file
    (checksum and all) whose content is wrong, as a hostile or buggy writer could make it."""
    from speedrun.engine.checkpoint import load_checkpoint, save_checkpoint

    newest = list_checkpoints(Path(directory))[0]
    state, meta = load_checkpoint(newest)
    change(state, meta)
    run, step = (int(part) for part in newest.stem.split("-")[1:])  # the file's own name, whatever meta says now
    return save_checkpoint(directory, run, step, state, meta, keep=10)


@pytest.mark.parametrize("change, fragment", [
    (lambda s, m: s.update(step=10**30), "does not fit this run"),
    (lambda s, m: s.update(step="8"), "does not fit this run"),
    (lambda s, m: s.update(seconds=-1e9), "does not fit this run"),
    (lambda s, m: s.update(history="abc"), "does not fit this run"),
    (lambda s, m: s.pop("model"), "does not fit this run"),
    (lambda s, m: s.update(optimizers=[]), "does not fit this run"),
    (lambda s, m: s["rng"].update(python=(3, (1, 2), None)), "does not fit this run"),
    (lambda s, m: m["finished"][0].update(accuracy="nope"), "malformed run records"),
    (lambda s, m: m["finished"][0].update(seed=None), "malformed run records"),
    (lambda s, m: m.update(finished="x"), "malformed run records"),
    (lambda s, m: m.update(run="x"), "malformed run records"),
])
def test_a_well_formed_checkpoint_with_wrong_content_is_one_line_before_training(change, fragment, capsys,
                                                                                   monkeypatch):
    from speedrun.recipes import cifar

    argv = ["train", *SMALL, "--runs", "3", "--checkpoint-dir", "ck", "--checkpoint-every", "2"]
    with _interrupted_at_run(3, monkeypatch):
        assert main(argv) == 130
    _craft("ck", change)
    trained = []
    real_step = cifar.train_step
    monkeypatch.setattr(cifar_loop, "train_step", lambda *a, **k: trained.append(1) or real_step(*a, **k))
    capsys.readouterr()
    assert main([*argv, "--resume", "auto"]) == 2
    assert fragment in _error(capsys) and not trained


def test_a_resumed_command_never_continues_another_commands_result(tmp_path, capsys, monkeypatch):
    """The checkpoint names a result file; a file of that name holding another experiment is left alone."""
    with _interrupted_at_run(2, monkeypatch):
        assert main(["train", *SMALL, "--runs", "2", "--checkpoint-dir", "ck", "--json", "r.json"]) == 130
    theirs = json.loads(Path("r.json").read_text())
    theirs["config"]["lr_per_1024"] = 5.0  # now the partial result of another experiment, same name
    Path("r.json").write_text(json.dumps(theirs))
    before = Path("r.json").read_text()
    assert main(["train", *SMALL, "--runs", "2", "--checkpoint-dir", "ck", "--resume", "auto"]) == 0
    assert Path("r.json").read_text() == before
    (mine,) = Path("results").iterdir()
    assert [r["seed"] for r in json.loads(mine.read_text())["runs"]] == [0, 1]


def test_setups_that_would_lose_work_are_refused_before_any_data(capsys):
    assert main(["train", *SMALL, "--checkpoint-dir", "ck"]) == 0
    # A fresh command into a folder holding checkpoints would replace and rotate them away.
    assert main(["train", *SMALL, "--set", "lr_per_1024=5", "--checkpoint-dir", "ck"]) == 2
    assert "already holds checkpoints" in _error(capsys)
    # The same counts of other images: the data's SHA-256 differs.
    other = [a.replace("train=256,test=32", "train=256,test=32,seed=7") for a in SMALL]
    assert main(["train", *other, "--checkpoint-dir", "ck", "--resume", "auto"]) == 2
    assert "data.sha256=" in _error(capsys)
    # --save whose card would take the result file's name: refused before training, not after.
    assert main(["train", *SMALL, "--save", "same", "--json", "same.json"]) == 2
    assert "--json and --save name the same file ('same.json' and 'same'" in _error(capsys)
    assert main(["train", *SMALL, "--resume", str(Path("ck") / "nope.safetensors")]) == 2
    _error(capsys)
    Path("mine.json").write_text("{}")
    assert main(["train", *SMALL, "--resume", "mine.json"]) == 2
    err = _error(capsys)
    assert "is not a usable speedrun checkpoint" in err and "delete" not in err
    assert Path("mine.json").read_text() == "{}"
