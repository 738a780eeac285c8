"""`speedrun predict` and `eval` on the user's inputs: every file checked before any is decoded, what succeeded
printed when a later file fails, a batch that fits in memory, and a smoke test's model named as such."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny
from PIL import Image

from speedrun.cli import train_commands
from speedrun.data import folder, limits
from speedrun.recipes import cifar
from speedrun.run import export as saved

CFG = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8), batch_size=64, epochs=1.0, whiten_images=64,
                          eval_each_epoch=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    data = make_tiny()
    run = cifar.train_run(CFG, data, torch.device("cpu"), seed=0)
    card = {"recipe": "cifar10-94", "family": "cifar", "config": dataclasses.asdict(CFG),
            **cifar.model_card(CFG, data), "dataset": "tiny", "accuracy": run.accuracy, "seed": 0}
    root = tmp_path_factory.mktemp("models")
    saved.save_model(root / "m", run.model.eval(), card)
    saved.save_model(root / "smoke", run.model.eval(), {**card, "smoke_test": True})
    for i in range(5):
        Image.fromarray(data.test_images[i].permute(1, 2, 0).numpy()).save(root / f"good{i}.png")
    return root


def _bad_files(root: Path) -> dict[str, Path]:
    """Files that fail at the header (caught before any decode) and one that fails only when decoded."""
    (root / "text.png").write_text("not an image")
    (root / "empty.jpg").write_bytes(b"")
    (root / "folder.png").mkdir(exist_ok=True)
    huge = root / "huge.png"  # a valid header claiming 100,000 x 100,000 px
    Image.new("L", (1, 1)).save(huge)
    blob = bytearray(huge.read_bytes())
    blob[16:24] = (100_000).to_bytes(4, "big") * 2
    huge.write_bytes(bytes(blob))
    return {"text": root / "text.png", "empty": root / "empty.jpg", "folder": root / "folder.png",
            "missing": root / "missing.png", "huge": huge}


def test_every_file_is_checked_before_any_is_decoded(model_dir, monkeypatch):
    decoded = []
    real = folder.decode_one
    monkeypatch.setattr(folder, "decode_one", lambda *a, **k: decoded.append(a[0]) or real(*a, **k))
    good = [str(model_dir / f"good{i}.png") for i in range(5)] * 30  # 150 good files, then one bad one
    for name, bad in _bad_files(model_dir).items():
        decoded.clear()
        with pytest.raises(ValueError) as e:
            saved.predict_files(model_dir / "m", good + [str(bad)], device="cpu")
        assert decoded == [] and str(bad) in str(e.value) and "\n" not in str(e.value), (name, e.value)


def test_cli_prints_what_succeeded_before_a_file_that_fails_to_decode(model_dir, capsys):
    # A PNG whose header is whole but whose pixel data is cut short: only decoding finds it.
    cut = model_dir / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(cut)
    cut.write_bytes(cut.read_bytes()[:200])
    good = [str(model_dir / f"good{i}.png") for i in range(5)] * 26  # 130: more than one batch of 64
    args = argparse.Namespace(model=str(model_dir / "m"), images=good + [str(cut)], top=1, device="cpu")
    with pytest.raises(ValueError) as e:
        train_commands.predict_command(args)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 128 and all(line.startswith(str(model_dir)) for line in printed)  # two whole batches
    assert str(cut) in str(e.value) and "128 of 131 predictions printed above" in str(e.value)


def test_batch_shrinks_to_fit_memory_and_one_image_that_cannot_fit_is_refused(model_dir, monkeypatch):
    model = saved.load(model_dir / "m")
    per_image = saved.inference_bytes_per_image(model)
    # widths 8 at 32x32 with a 2x2 whitening stem (2*3*2*2 = 24 channels) at 31x31: its largest layer's in + out
    assert 4 * 24 * 31 * 31 <= per_image < 4 * 200 * 32 * 32
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 10 * per_image)
    assert saved.predict_batch_size(model) == 5  # half of what is available
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: None)
    assert saved.predict_batch_size(model) == 64
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: per_image // 2)
    with pytest.raises(ValueError, match="one 32x32 image through this model would take .* more than"):
        saved.predict_batch_size(model)


def test_a_large_image_model_takes_small_batches(model_dir):
    # A legal card: 3x1024x1024 images. 64 of them through even this narrow net would take gigabytes.
    card = {**json.loads((model_dir / "m.json").read_text()), "image_shape": [3, 1024, 1024]}
    with torch.device("meta"):
        net = cifar.build_model(CFG, 3, len(card["classes"]))
    model = saved.TrainedModel(net, card)
    per_image = saved.inference_bytes_per_image(model)
    assert per_image >= 4 * (24 + 8) * 1023 * 1023  # the whitened input and the first conv's output
    assert 1 <= saved.predict_batch_size(model) <= saved._PREDICT_BUDGET_BYTES // per_image < 64


def test_a_smoke_tests_model_says_so_in_its_card_eval_and_predict(model_dir, capsys, monkeypatch):
    assert json.loads((model_dir / "smoke.json").read_text())["smoke_test"] is True
    assert saved.load(model_dir / "smoke").smoke_test and not saved.load(model_dir / "m").smoke_test
    args = argparse.Namespace(model=str(model_dir / "smoke"), images=[str(model_dir / "good0.png")], top=1,
                              device="cpu")
    assert train_commands.predict_command(args) == 0
    captured = capsys.readouterr()
    assert "saved by a smoke test" in captured.err and captured.out.startswith(str(model_dir / "good0.png"))
    assert train_commands.predict_command(argparse.Namespace(**{**vars(args), "model": str(model_dir / "m")})) == 0
    assert "smoke" not in capsys.readouterr().err
    monkeypatch.setattr(train_commands, "evaluate_saved", lambda *a, **k: {
        "accuracy": 0.1, "n": 10, "tta_level": 0, "dataset": "d", "model": "smoke", "smoke_test": True})
    assert train_commands.eval_command(argparse.Namespace(model="smoke", dataset="d", data_dir=None,
                                                          image_size=None, device="cpu", json=None)) == 0
    captured = capsys.readouterr()
    assert "saved by a smoke test" in captured.err and "a smoke test's model" in captured.out


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_a_card_whose_smoke_flag_is_not_a_boolean_is_refused(model_dir, tmp_path, value):
    card = json.loads((model_dir / "m.json").read_text())
    (tmp_path / "x.safetensors").write_bytes((model_dir / "m.safetensors").read_bytes())
    (tmp_path / "x.json").write_text(json.dumps({**card, "smoke_test": value}))
    if value is None:
        assert not saved.load(tmp_path / "x").smoke_test
        return
    with pytest.raises(ValueError, match="smoke_test must be true, false or absent"):
        saved.load(tmp_path / "x")


def test_a_folder_given_as_the_model_is_named_a_folder_with_a_model_in_it(model_dir, tmp_path):
    """Not "FOLDER.json does not exist": the folder is what the user typed, and one saved model in it is offered."""
    with pytest.raises(FileNotFoundError, match=r"is a folder, not a saved model") as e:
        saved.load(model_dir)
    assert f"such as {model_dir}/" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"is a folder, not a saved model; give the PATH of a model saved"):
        saved.load(tmp_path)  # an empty folder: no example
    saved.load(model_dir / "m")  # a model beside a folder of its name still loads by PATH
    (model_dir / "m").mkdir()
    try:
        saved.load(model_dir / "m")  # m.json exists: the folder m/ is not what is meant
    finally:
        (model_dir / "m").rmdir()
