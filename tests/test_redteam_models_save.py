"""`train --save PATH` before training: the folder proved writable by making a file there, and a model the save
would refuse refused before any step; a failed write's advice names the real error."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import safetensors.torch
from conftest import make_tiny

from speedrun.cli.program import main
from speedrun.recipes import cifar, get_recipe
from speedrun.run import export as saved

TINY = ["--dataset", "synthetic:train=256,test=64", "--device", "cpu", "--smoke", "--set", "widths=8,8,8",
        "--set", "whiten_images=32"]
CFG = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8))
CARD = {"recipe": "cifar10-94", "family": "cifar", "config": dataclasses.asdict(CFG),
        "classes": [str(i) for i in range(10)], "image_shape": [3, 32, 32], "mean": [0.5] * 3, "std": [0.25] * 3,
        "tta_level": 0, "dataset": "tiny", "accuracy": 0.5, "seed": 0}


def _no_training(monkeypatch):
    def train_run(*args, **kwargs):
        raise AssertionError("training began")

    monkeypatch.setattr(cifar, "train_run", train_run)
    monkeypatch.setattr(cifar, "warmup", train_run)


@pytest.mark.parametrize("place", ["/proc/x", "/proc/new/deep/m", "/sys/m"])
def test_a_folder_where_no_file_can_be_made_is_refused_before_training(place, tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match=r"cannot save the model in .*: cannot make a file in /(proc|sys) \(") as err:
        saved.check_save_path(place)
    assert "free disk space" not in str(err.value)
    _no_training(monkeypatch)
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--save", place, "--json", str(out), "--db", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot make a file in" in err[0] and not out.exists()


@pytest.mark.parametrize("number,advice", [(errno.ENOSPC, "free disk space or choose another --save path"),
                                           (errno.EDQUOT, "free disk space"),
                                           (errno.EROFS, "choose a writable --save path"),
                                           (errno.EACCES, "choose a writable --save path"),
                                           (errno.ENOENT, "choose another --save path"),
                                           (errno.EIO, "choose another --save path")])
def test_the_advice_for_a_failed_write_names_the_real_error(number, advice, tmp_path, monkeypatch):
    reason = os.strerror(number)

    def fail(*args, **kwargs):
        raise OSError(number, reason)

    with monkeypatch.context() as patch:  # the up-front check
        patch.setattr(saved.tempfile, "mkstemp", fail)
        with pytest.raises(ValueError) as err:
            saved.check_save_path(tmp_path / "m")
    message = str(err.value)
    assert f"({reason}); {advice}" in message and ("free disk space" in message) == (advice.startswith("free"))
    monkeypatch.setattr(safetensors.torch, "save_file", fail)  # the write after training
    with pytest.raises(ValueError) as err:
        saved.save_model(tmp_path / "m", cifar.build_model(CFG, 3, 10), CARD)
    message = str(err.value)
    assert f"could not write the model {tmp_path / 'm.safetensors'} ({reason}); {advice}" in message
    assert ("free disk space" in message) == (advice.startswith("free"))
    assert sorted(os.listdir(tmp_path)) == []  # neither the probe nor a temp file is left


def test_the_check_leaves_no_file_and_makes_no_folder(tmp_path):
    assert saved.check_save_path(tmp_path / "a" / "b" / "m") == tmp_path / "a" / "b" / "m"
    assert saved.check_save_path(tmp_path / "m.json") == tmp_path / "m"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("change,why", [
    (lambda card: {**card, "classes": ["a", "a"] + card["classes"][2:]}, "class 1 'a' is class 0's name again"),
    (lambda card: {**card, "std": [0.0] * 3}, "std must be"),
    (lambda card: {**card, "classes": ["ok", "bad\x07"] + card["classes"][2:]}, "class 1 is 'bad\\x07'"),
])
def test_a_model_the_save_would_refuse_is_refused_before_training(change, why, tmp_path, capsys, monkeypatch):
    real = cifar.model_card
    monkeypatch.setattr(cifar, "model_card", lambda cfg, data: change(real(cfg, data)))
    _no_training(monkeypatch)
    assert main(["train", *TINY, "--save", str(tmp_path / "m"), "--db", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--save: this run's model could not be saved" in err[0] and why in err[0], err
    assert "leave out --save" in err[0] and not list(tmp_path.glob("m.*"))


def test_the_runs_own_card_passes_the_check():
    card = cifar.model_card(CFG, make_tiny(n_train=16, n_test=8))
    recipe = get_recipe("cifar10-94")
    saved.check_card(card, recipe, CFG, "tiny", False)
    with pytest.raises(ValueError, match=r"could not be saved: its card is not valid \(mean must be"):
        saved.check_card({**card, "mean": [2.0] * 3}, recipe, CFG, "tiny", False)
