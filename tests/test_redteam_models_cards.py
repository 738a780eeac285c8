"""Saved models from elsewhere: a card's numbers in the ranges of what they are, distinct class names, a weights
file of another size refused before it is read, no non-finite probability or accuracy ever printed, and eval's
--image-size advice given only where it can work."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import make_tiny
from PIL import Image

from speedrun.cli.program import main
from speedrun.recipes import cifar
from speedrun.run import export as saved
from speedrun.run import model_files

CFG = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8), batch_size=64, epochs=1.0, whiten_images=64,
                          eval_each_epoch=False)
SYNTHETIC = "synthetic:train=64,test=32"  # 3x32x32 images of 10 classes


def _card(**changes) -> dict:
    card = {"recipe": "cifar10-94", "family": "cifar", "config": dataclasses.asdict(CFG),
            "classes": [str(i) for i in range(10)], "image_shape": [3, 32, 32], "mean": [0.5, 0.5, 0.5],
            "std": [0.25, 0.25, 0.25], "tta_level": 0, "dataset": "tiny", "accuracy": 0.5, "seed": 0}
    return {**card, **changes}


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return cifar.build_model(CFG, 3, 10).eval()  # untrained: these tests are about the files, not the numbers


@pytest.fixture
def stem(tmp_path, net) -> Path:
    saved.save_model(tmp_path / "m", net, _card())
    return tmp_path / "m"


def _edit_card(stem: Path, **changes) -> Path:
    path = stem.with_suffix(".json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def _refused(stem: Path, named: Path, call=saved.load, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        call(stem, **kwargs)
    message = str(err.value)
    assert "\n" not in message and str(named) in message, message
    return message


@pytest.mark.parametrize("changes,why", [
    ({"std": [1e-45] * 3}, "std must be 3 finite numbers"),  # a float32 subnormal: x / std is inf
    ({"std": [0.0] * 3}, "std must be"),
    ({"std": [1e-8, 0.2, 0.2]}, "std must be"),
    ({"std": [0.2, 0.2, 2.0]}, "std must be"),
    ({"std": [0.2, 0.2, 1e30]}, "std must be"),
    ({"mean": [1e30] * 3}, "mean must be 3 finite numbers"),
    ({"mean": [-0.1, 0.5, 0.5]}, "mean must be"),
    ({"mean": [0.5, 0.5, 1.5]}, "mean must be"),
    ({"mean": [0.5, 0.5, 10**400]}, "mean must be"),
    ({"classes": ["a", "a"] + [f"c{i}" for i in range(8)]}, "class 1 'a' is class 0's name again"),
    ({"classes": ["caf\u00e9", "cafe\u0301"] + [f"c{i}" for i in range(8)]}, "after Unicode NFC normalization"),
    ({"classes": [f"c{i}" for i in range(9)] + ["c3"]}, "class 9 'c3' is class 3's name again"),
    ({"accuracy": 5.0}, "accuracy must be a fraction in [0, 1]"),
    ({"accuracy": -0.01}, "accuracy must be a fraction"),
    ({"accuracy": 10**400}, "accuracy must be a fraction"),
    ({"seed": 10**400}, "seed must be an integer in [0, 2**63)"),
    ({"seed": 2**63}, "seed must be an integer in [0, 2**63)"),
    ({"seed": -1}, "seed must be an integer in [0, 2**63)"),
])
def test_a_cards_numbers_and_names_are_checked_against_what_they_are(stem, changes, why):
    card = _edit_card(stem, **changes)
    message = _refused(stem, card)
    assert why in message and "is unusable" in message


@pytest.mark.parametrize("changes", [{"std": [1e-6] * 3, "mean": [0.0, 1.0, 0.5]}, {"std": [1.0] * 3},
                                     {"seed": 2**63 - 1, "accuracy": 1.0}, {"seed": None, "accuracy": None},
                                     {"classes": ["caf\u00e9", "cafe"] + [f"c{i}" for i in range(8)]}])
def test_the_edges_of_each_range_load(stem, changes):
    _edit_card(stem, **changes)
    model = saved.load(stem)
    assert model.card["seed"] == changes.get("seed", 0) and len(model.classes) == 10


def test_every_card_a_run_writes_is_within_the_ranges(tmp_path, net):
    # a constant channel and a channel of half 0, half 255: loader.channel_stats' extremes
    data = make_tiny(n_train=8, n_test=4)
    data.train_images[:, 0] = 7  # a constant channel: std at channel_stats' floor
    data.train_images[::2, 1], data.train_images[1::2, 1] = 0, 255  # half 0, half 255: std 0.5
    card = {**_card(), **cifar.model_card(CFG, data)}
    assert saved.save_model(tmp_path / "m", net, card)
    saved.load(tmp_path / "m")


def _forge_weights(stem: Path, tensors: dict) -> Path:
    weights = stem.with_suffix(".safetensors")
    weights.unlink()
    safetensors.torch.save_file(tensors, weights)
    _edit_card(stem, weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest())
    return weights


@pytest.mark.parametrize("key,poison", [("head.weight", float("nan")), ("head.weight", float("inf")),
                                        ("groups.0.norms.0.running_var", -1.0)])  # finite, but its sqrt is NaN
def test_non_finite_scores_are_refused_by_predict_and_eval_naming_the_model(stem, net, tmp_path, key, poison,
                                                                           capsys):
    tensors = {k: v.clone() for k, v in net.state_dict().items()}
    tensors[key].view(-1)[0] = poison
    weights = _forge_weights(stem, tensors)
    model = saved.load(stem)
    with pytest.raises(ValueError, match=f"saved model {weights} gives non-finite scores"):
        model.predict(torch.full((2, 3, 32, 32), 200, dtype=torch.uint8))
    message = _refused(stem, weights, call=saved.evaluate_saved, dataset=SYNTHETIC, device="cpu")
    assert "non-finite scores (NaN or inf) for its evaluation images" in message
    Image.new("RGB", (32, 32), (200, 10, 30)).save(tmp_path / "x.png")
    assert main(["predict", str(stem), str(tmp_path / "x.png"), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "non-finite scores" in captured.err


def test_a_weights_file_of_another_size_is_refused_before_it_is_read(stem, monkeypatch):
    weights = stem.with_suffix(".safetensors")
    size = weights.stat().st_size

    class NoHash:
        def sha256(self, *args):
            raise AssertionError("the weights were hashed")

    monkeypatch.setattr(saved, "hashlib", NoHash())
    for new_size in (3 * 2**30, size + 64 * 2**10, 100, 0):  # sparse: 3 GiB take no disk
        os.truncate(weights, new_size)
        start = time.perf_counter()
        message = _refused(stem, weights)
        assert time.perf_counter() - start < 5
        assert f"{new_size:,} bytes" in message and "where its tensors and header take" in message
    low, high = model_files.weights_size_range(model_files.expected_state(
        model_files.parse_card({**_card(), "format": "speedrun-model", "version": 1, "weights_sha256": "0" * 64})))
    assert low <= size <= high and high - low < 16 * 2**10  # the margin is the header's, not the tensors'


def test_a_card_with_a_byte_order_mark_loads(stem):
    card = stem.with_suffix(".json")
    card.write_bytes(b"\xef\xbb\xbf" + card.read_bytes())
    assert saved.load(stem).classes == _card()["classes"]


def test_eval_gives_the_image_size_advice_only_where_it_can_work(tmp_path, net, monkeypatch):
    saved.save_model(tmp_path / "big", net, _card(image_shape=[3, 1024, 1024]))
    monkeypatch.setenv("SPEEDRUN_MAX_DATA_BYTES", str(10**9))  # 96 images at 1024x1024 take 302 MB: it fits
    message = _refused(tmp_path / "big", tmp_path / "big", call=saved.evaluate_saved, dataset=SYNTHETIC,
                       device="cpu")
    assert "takes 3x1024x1024 images" in message and "--image-size 1024)" in message
    monkeypatch.setenv("SPEEDRUN_MAX_DATA_BYTES", str(10**8))  # it does not
    message = _refused(tmp_path / "big", tmp_path / "big", call=saved.evaluate_saved, dataset=SYNTHETIC,
                       device="cpu")
    assert "would take 301,989,888 bytes, over the limit of 100,000,000" in message
    assert "resized to 1024x1024 by --image-size 1024" in message and "a folder of fewer images" in message
    # Other classes: resizing cannot help, and is not advised.
    saved.save_model(tmp_path / "k", cifar.build_model(CFG, 3, 5),
                     _card(classes=[f"c{i}" for i in range(5)], image_shape=[3, 64, 64]))
    message = _refused(tmp_path / "k", tmp_path / "k", call=saved.evaluate_saved, dataset=SYNTHETIC, device="cpu")
    assert "of 5 classes" in message and "--image-size" not in message
