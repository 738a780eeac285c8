"""Saved models (saved.py, saved_files.py): round trips, the loaded model's logits, eval and predict on files, and
hostile cards, weights and images, each refused with one line naming the file."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import make_tiny
from PIL import Image

from speedrun.cli import train_commands
from speedrun.run import export as saved
from speedrun.data.loader import Normalization, normalize
from speedrun.engine.loop import evaluate
from speedrun.recipes import cifar
from speedrun.tricks.tta import tta_logits

CFG = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8), batch_size=64, epochs=1.0, whiten_images=64,
                          eval_each_epoch=False)


@pytest.fixture(scope="module")
def trained():
    """(data, net, card): one tiny epoch of the cifar family (~1 s), and the card the runner would write."""
    data = make_tiny()
    run = cifar.train_run(CFG, data, torch.device("cpu"), seed=0)
    card = {"recipe": "cifar10-94", "family": "cifar", "config": dataclasses.asdict(CFG),
            **cifar.model_card(CFG, data), "dataset": "tiny", "accuracy": run.accuracy, "seed": 0}
    return data, run.model.eval(), card


@pytest.fixture
def stem(tmp_path, trained) -> Path:
    saved.save_model(tmp_path / "m", trained[1], trained[2])
    return tmp_path / "m"


def _refused(stem_or_path, named: Path, *, exc=ValueError, load=saved.load, **kwargs) -> str:
    with pytest.raises(exc) as err:
        load(stem_or_path, **kwargs)
    message = str(err.value)
    assert type(err.value) is exc and "\n" not in message and str(named) in message, message
    return message


def test_round_trip_with_and_without_suffix(tmp_path, trained):
    data, net, card = trained
    assert saved.save_model(tmp_path / "m", net, card) == f"{tmp_path}/m.safetensors + {tmp_path}/m.json"
    written = json.loads((tmp_path / "m.json").read_text())
    assert written["weights_sha256"] == hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest()
    assert (written["format"], written["version"], written["classes"]) == ("speedrun-model", 1, data.classes)
    x = data.test_images[:16]  # (16, 3, 32, 32) uint8
    mean, std = torch.tensor(card["mean"]), torch.tensor(card["std"])
    with torch.no_grad():
        trained_logits = tta_logits(net, normalize(x, mean, std, torch.float32), card["tta_level"])
        # The trained net is channels_last (engine.setup_system): the same weights in the default layout give
        # the loaded model's logits bit for bit, and the trained net's within float32 rounding.
        plain = copy.deepcopy(net).to(memory_format=torch.contiguous_format)
        reference = tta_logits(plain, normalize(x, mean, std, torch.float32), card["tta_level"])
        assert torch.allclose(reference, trained_logits, rtol=0, atol=1e-6)
        for name in ("m", "m.safetensors", "m.json", str(tmp_path / "m")):
            model = saved.load(tmp_path / name if name[0] == "m" else name)
            assert torch.equal(model(x), reference)
            assert torch.allclose(model(x.float() / 255), reference, rtol=0, atol=1e-6)
    for key, value in net.state_dict().items():
        assert torch.equal(model.net.state_dict()[key], value), key
    assert (model.classes, model.image_shape, model.tta_level) == (data.classes, (3, 32, 32), 2)
    assert not model.train().net.training  # inference only: BatchNorm keeps its running statistics
    for bad in (x[:, :, :16], x[0], x.int()):
        with pytest.raises(ValueError, match="model takes images of shape|uint8 .* or floating"):
            model(bad)
    assert saved.model_paths("~/a/m.v2") == (Path.home() / "a/m.v2.safetensors", Path.home() / "a/m.v2.json")


def test_predict_gives_sorted_probabilities_of_named_classes(stem, trained):
    data, _, _ = trained
    model = saved.load(stem)
    x = data.test_images[:4]
    with torch.no_grad():
        probs = torch.softmax(model(x), 1)
    for row, p in zip(model.predict(x, top=3), probs):
        assert [name for name, _ in row] == [data.classes[i] for i in p.topk(3).indices]
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True) and sum(values) <= 1 + 1e-6
        assert values[0] == pytest.approx(float(p.max()), abs=1e-6)
    full = model.predict(x[:1], top=100)[0]
    assert len(full) == 10 and sum(v for _, v in full) == pytest.approx(1, abs=1e-5)
    with pytest.raises(ValueError, match="top must be"):
        model.predict(x, top=0)


def test_a_file_is_never_replaced(tmp_path, trained, monkeypatch):
    _, net, card = trained
    (tmp_path / "m.json").write_text("mine")
    for call in (lambda: saved.check_save_path(tmp_path / "m.safetensors"), lambda: saved.save_model(tmp_path / "m",
                                                                                                      net, card)):
        with pytest.raises(ValueError, match=f"{tmp_path}/m.json already exists and is never replaced"):
            call()
    assert (tmp_path / "m.json").read_text() == "mine" and not (tmp_path / "m.safetensors").exists()
    assert saved.check_save_path(tmp_path / "new" / "deep" / "m.json") == tmp_path / "new" / "deep" / "m"
    assert not (tmp_path / "new").exists()  # checked, not created
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path}/file is a file, not a folder"):
        saved.check_save_path(tmp_path / "file" / "m")
    # The card appears between the check and the write: the weights already linked are taken back, theirs stays.
    monkeypatch.setattr(saved, "check_save_path", lambda path: tmp_path / "r")
    (tmp_path / "r.json").write_text("theirs")
    with pytest.raises(ValueError, match=f"{tmp_path}/r.json appeared while the model was being saved"):
        saved.save_model(tmp_path / "r", net, card)
    assert (tmp_path / "r.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m.json", "r.json"]  # no temp file left


def _image_folder(root: Path, data) -> Path:
    """data as ROOT/{train,test}/<class>/<i>.png (lossless), the layout load_dataset reads."""
    for split, images, labels in (("train", data.train_images, data.train_labels),
                                  ("test", data.test_images, data.test_labels)):
        for name in data.classes:
            (root / split / name).mkdir(parents=True)
        for i, (image, label) in enumerate(zip(images, labels)):
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(root / split / data.classes[label] / f"{i:04d}.png")
    return root


def test_evaluate_saved_matches_engine_evaluate(stem, trained, tmp_path, monkeypatch, capsys):
    data, net, card = trained
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    root = _image_folder(tmp_path / "pics", data)
    expected = evaluate(net, data.test_images, data.test_labels,
                        normalization=Normalization(torch.tensor(card["mean"]), torch.tensor(card["std"])), tta_level=2)
    result = saved.evaluate_saved(stem, str(root), device="cpu")
    assert result["accuracy"] == expected and (result["n"], result["tta_level"], result["model"]) == (64, 2, str(stem))
    args = argparse.Namespace(model=str(stem), dataset=str(root), data_dir=None, image_size=None, device="cpu",
                              json=str(tmp_path / "r.json"), quiet=True)
    assert train_commands.eval_command(args) == 0
    line = f"accuracy {100 * expected:.2f}% on {result['dataset']} test (64 images, TTA level 2)\n"
    assert capsys.readouterr().out == line
    assert json.loads((tmp_path / "r.json").read_text())["accuracy"] == expected
    message = _refused(stem, stem, load=saved.evaluate_saved, dataset=str(root), image_size=16, device="cpu")
    assert "takes 3x32x32 images of 10 classes" in message and "3x16x16" in message and "--image-size 32" in message


def _same(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    """The same classes in the same order, probabilities equal up to float32 rounding (batches differ in size)."""
    return [n for n, _ in a] == [n for n, _ in b] and np.allclose([p for _, p in a], [p for _, p in b], atol=1e-6)


def test_predict_files_rgb_grey_and_other_sizes(stem, trained, tmp_path, capsys):
    data, net, card = trained
    model = saved.load(stem)
    rgb = data.test_images[0].permute(1, 2, 0).numpy()  # (32, 32, 3)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    grey = np.array(Image.fromarray(rgb).convert("L"))  # Pillow's luma
    Image.fromarray(grey).save(tmp_path / "grey.png")
    Image.fromarray(np.tile(rgb, (2, 2, 1))[:48]).save(tmp_path / "wide.png")  # 64x48: scaled to 43x32, cropped
    files = [str(tmp_path / n) for n in ("rgb.png", "grey.png", "wide.png")]
    result = saved.predict_files(stem, files, top=3, device="cpu")
    assert [f for f, _ in result] == files and all(len(top) == 3 for _, top in result)
    assert _same(result[0][1], model.predict(data.test_images[:1], top=3)[0])
    assert _same(result[1][1], model.predict(torch.from_numpy(grey).expand(1, 3, 32, 32), top=3)[0])  # replicated
    assert train_commands.predict_command(argparse.Namespace(model=str(stem), images=files, top=2, device="cpu")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == files and lines[0].count(",") == 1
    # A grey model takes RGB files as Pillow's "L" would.
    net1 = cifar.build_model(CFG, 1, 10).eval()
    saved.save_model(tmp_path / "g", net1, {**card, "image_shape": [1, 32, 32], "mean": [0.5], "std": [0.25]})
    model1 = saved.load(tmp_path / "g")
    assert _same(saved.predict_files(tmp_path / "g", files[:1], device="cpu")[0][1],
                 model1.predict(torch.from_numpy(grey)[None, None])[0])


def _edit_card(stem: Path, edit) -> Path:
    path = stem.with_suffix(".json")
    card = json.loads(path.read_text())
    edit(card)
    path.write_text(json.dumps(card))
    return path


@pytest.mark.parametrize("edit, why", [
    (lambda c: c["config"].update(bogus=1), "config: unknown config key 'bogus'; valid keys:"),
    (lambda c: c["config"].update(widths="8,x"), "config: widths=8,x: expected comma-separated ints"),
    (lambda c: c["config"].update(widths=[8, 8, 10**6]), "config: bad config: widths must be"),
    (lambda c: c.update(family="imagenet"), "recipe cifar10-94 is of the cifar family, not 'imagenet'"),
    (lambda c: c.update(recipe="os.system"), "unknown recipe 'os.system'"),
    (lambda c: c.update(format="other"), "not a speedrun model card"),
    (lambda c: c.update(version=2), "card version 2"),
    (lambda c: c.update(classes=[f"c{i}" for i in range(10**6)]), "classes must be a list of 2 to 100,000 names"),
    (lambda c: c["classes"].__setitem__(3, "\x1b[2J"), "class 3 is '\\x1b[2J'"),
    (lambda c: c["std"].__setitem__(0, -0.1), "std must be 3 finite numbers (one per channel, > 0)"),
    (lambda c: c["mean"].__setitem__(0, float("nan")), "mean must be 3 finite numbers"),
    (lambda c: c.update(image_shape=[3, 10**5, 10**5]), "image_shape must be [C, H, W]"),
    (lambda c: c.update(image_shape=[3, 4, 4]), "its network cannot take 3x4x4 images"),
    (lambda c: c.update(tta_level=7), "tta_level must be 0, 1 or 2"),
    (lambda c: c.update(weights_sha256=None), "weights_sha256 is not 64 hexadecimal digits"),
])
def test_hostile_cards_are_refused_naming_the_card(stem, edit, why):
    path = _edit_card(stem, edit)
    assert why in _refused(stem, path)


def test_unreadable_cards(stem):
    card = stem.with_suffix(".json")
    card.write_text('{"format": ' * 100_000)
    assert "not valid JSON" in _refused(stem, card)
    card.write_bytes(b" " * (17 * 2**20))
    assert "over the 16,777,216 a model card may take" in _refused(stem, card)
    card.unlink()
    assert "does not exist" in _refused(stem, card, exc=FileNotFoundError)


def _forge(stem: Path, blob: bytes) -> Path:
    """Weights `blob` under a card whose weights_sha256 matches, so the checks after the checksum are reached."""
    weights = stem.with_suffix(".safetensors")
    weights.write_bytes(blob)
    _edit_card(stem, lambda c: c.update(weights_sha256=hashlib.sha256(blob).hexdigest()))
    return weights


class _Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling would create the marker file
        return (open, (self.marker, "w"))


def test_hostile_weights_are_refused_naming_the_file(stem, tmp_path):
    weights = stem.with_suffix(".safetensors")
    blob = weights.read_bytes()
    weights.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert "SHA-256 is not the card's weights_sha256" in _refused(stem, weights)
    weights.write_bytes(blob[:-100])
    assert "SHA-256" in _refused(stem, weights)
    _forge(stem, blob[:-100])
    assert "not a valid safetensors file" in _refused(stem, weights)
    torch.save({"x": _Evil(tmp_path / "marker")}, tmp_path / "evil.pt")
    _forge(stem, (tmp_path / "evil.pt").read_bytes())
    assert "not a valid safetensors file" in _refused(stem, weights)
    assert not (tmp_path / "marker").exists()
    good = safetensors.torch.load(blob)
    for change, named in [(lambda t: t.__setitem__("head.weights", t.pop("head.weight")), "lacks the tensor "
                           "'head.weight'"),
                          (lambda t: t.__setitem__("head.weight", torch.zeros(11, 8)), "tensor 'head.weight' is "
                           "torch.float32 [11, 8]; the card's network has torch.float32 [10, 8]"),
                          (lambda t: t.__setitem__("whiten.bias", t["whiten.bias"].double()), "'whiten.bias' is "
                           "torch.float64"),
                          (lambda t: t.__setitem__("extra", torch.zeros(1)), "holds a tensor 'extra'")]:
        tensors = dict(good)
        change(tensors)
        _forge(stem, safetensors.torch.save(tensors))
        assert named in _refused(stem, weights)
    weights.unlink()
    weights.mkdir()
    assert "not a regular file" in _refused(stem, weights)
    weights.rmdir()
    assert "does not exist" in _refused(stem, weights, exc=FileNotFoundError)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _zlib_bomb(side: int) -> bytes:
    """A grey side x side PNG whose IDAT really inflates to side * (side + 1) zero bytes (as test_hostile_folder)."""
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(bytes(side + 1)) for _ in range(side)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))


def test_hostile_predict_images_are_refused_naming_the_file(stem, tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    (tmp_path / "bomb.png").write_bytes(_zlib_bomb(7000))  # 49 Mpx of zeros from ~50 kB
    (tmp_path / "dir.png").mkdir()
    cases = {"notes.png": "is not a JPEG or PNG image", "missing.png": "does not exist",
             "bomb.png": "claims 7000x7000 pixels, over the limit", "dir.png": "is not a regular file"}
    for name, why in cases.items():
        path = tmp_path / name
        message = _refused(stem, path, load=saved.predict_files, images=[str(path)], device="cpu")
        assert why in message, message
    for bad in ([], str(tmp_path / "notes.png")):
        with pytest.raises(ValueError, match="one or more image files"):
            saved.predict_files(stem, bad, device="cpu")
    with pytest.raises(ValueError, match="top \\(--top\\) must be"):
        saved.predict_files(stem, [str(tmp_path / "notes.png")], top=0, device="cpu")


def test_a_model_trained_with_selective_tta_is_scored_with_it(tmp_path, trained, monkeypatch):
    """A card whose config selects TTA (tta_select) scores a test set as its training run did (the least confident
    quarter of the whole set gets the views, at any batch size), while a prediction gives every image the full TTA
    (it must not depend on the other images of the call)."""
    data, net, card = trained
    card = {**card, "config": {**card["config"], "tta_select": 0.25}}
    saved.save_model(tmp_path / "sel", net, card)
    model = saved.load(tmp_path / "sel")
    assert model.tta_select == 0.25
    # normalized as TrainedModel.forward does it
    x = (data.test_images.float() / 255 - torch.tensor(card["mean"]).view(1, -1, 1, 1)) / \
        torch.tensor(card["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(model(data.test_images), tta_logits(model.net, x, 2), rtol=0, atol=0)
        one = model(data.test_images[:1])
        torch.testing.assert_close(one, model(data.test_images)[:1], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    root = _image_folder(tmp_path / "pics", data)
    kwargs = dict(normalization=Normalization(torch.tensor(card["mean"]), torch.tensor(card["std"])), tta_level=2)
    expected = evaluate(net, data.test_images, data.test_labels, tta_select=0.25, **kwargs)
    for batch in (1, 5, 2000):
        assert saved.evaluate_saved(tmp_path / "sel", str(root), device="cpu", batch_size=batch)["accuracy"] == expected


def test_train_save_reports_both_files_as_the_user_would_type_them(tmp_path, monkeypatch, capsys):
    """`train --save ../m1`: the card is beside the weights, in ../, and the line says so for both."""
    from speedrun.cli.program import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = main(["train", "--dataset", "synthetic:train=128,test=32", "--device", "cpu", "--smoke", "--set",
                 "widths=8,8,8", "--save", "../m1", "--json", "r.json", "--db", "r.db"])
    err = capsys.readouterr().err
    assert code == 0 and "saved model: ../m1.safetensors + ../m1.json\n" in err, err
    assert (tmp_path / "m1.safetensors").is_file() and (tmp_path / "m1.json").is_file()
    assert json.loads((work / "r.json").read_text())["saved_model"] == "../m1.safetensors + ../m1.json"
