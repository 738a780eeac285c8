"""Ensembles (run/ensemble.py): `eval --ensemble` reports each model's accuracy and that of the mean softmax, equal to
an average taken by hand; `predict --ensemble` prints the mean softmax; models that disagree, one model alone and
one model twice are refused in one line naming the models."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, save_tiny_cifar_models
from PIL import Image

from speedrun.recipes import cifar, cifar_resnet
from speedrun.run import ensemble as ens
from speedrun.run import export

DATA = "synthetic:train=256,test=64"
CFG = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8), batch_size=64, epochs=1.0, whiten_images=64,
                          eval_each_epoch=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: at these widths a step is a few ms of work, and more threads contend on a shared
    machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, _one_thread) -> tuple[list[Path], object]:
    """Three models of the cifar family, one tiny epoch each with seeds 0, 1, 2, saved as `train --save` saves
    them, and the data they were trained on."""
    return save_tiny_cifar_models(tmp_path_factory.mktemp("ensemble"), CFG, DATA, range(3))


def _mean_softmax_by_hand(stems, images: torch.Tensor) -> torch.Tensor:
    """Each model loaded alone, its logits (its card's TTA) through a softmax, then the plain mean: (N, K)."""
    with torch.no_grad():
        probs = [torch.softmax(export.load(s)(images).float(), dim=1) for s in stems]
    return torch.stack(probs).mean(0)


def test_eval_reports_each_model_and_the_mean_softmax(saved):
    stems, data = saved
    report = ens.evaluate_ensemble(stems, DATA, device="cpu", batch_size=24)  # 24: batches of 24, 24 and 16
    for stem, row in zip(stems, report["models"]):  # each as `speedrun eval MODEL` gives it alone
        alone = export.evaluate_saved(stem, DATA, device="cpu")
        assert (row["model"], row["accuracy"], row["tta_level"]) == (str(stem), alone["accuracy"], 2)
        assert row["seconds"] > 0
    probs = _mean_softmax_by_hand(stems, data.test_images)
    by_hand = float((probs.argmax(1) == data.test_labels).float().mean())
    e = report["ensemble"]
    assert (e["n_models"], report["n"], e["accuracy"]) == (3, 64, by_hand)
    assert torch.allclose(ens.Ensemble([export.load(s) for s in stems]).probabilities(data.test_images), probs,
                          rtol=0, atol=1e-6)
    single = [r["seconds"] for r in report["models"]]
    assert sum(single) <= e["seconds"] and e["extra_seconds"] == pytest.approx(e["seconds"] - np.mean(single))
    assert "untimed warm-up" in report["timed"]


def _scaled(stem: Path, dst: Path, factor: float) -> Path:
    """`stem`'s model with its logits times `factor` (the head has no bias): as sure of each answer as `factor`."""
    net = export.load(stem).net
    with torch.no_grad():
        net.head.weight *= factor
    return _variant(stem, dst, net=net)


def test_eval_averages_probabilities_not_logits(saved, tmp_path, monkeypatch):
    """One model far surer than two others that agree: the mean of the logits follows the sure one, the mean of
    the softmax the two. Labels set to the mean softmax's answers: the ensemble must score exactly 100%."""
    stems, data = saved
    models = [_scaled(stems[0], tmp_path / "sure", 40.0), _scaled(stems[1], tmp_path / "b", 4.0),
              _scaled(stems[2], tmp_path / "c", 4.0)]
    probs = _mean_softmax_by_hand(models, data.test_images)
    with torch.no_grad():
        mean_logits = torch.stack([export.load(m)(data.test_images) for m in models]).mean(0)
    assert (mean_logits.argmax(1) != probs.argmax(1)).any()  # else this test could not tell the two apart
    answers = dataclasses.replace(data, test_labels=probs.argmax(1))
    monkeypatch.setattr(export, "evaluation_data", lambda *args, **kwargs: answers)
    report = ens.evaluate_ensemble(models, DATA, device="cpu", batch_size=40)
    assert report["ensemble"]["accuracy"] == 1.0
    for path, row in zip(models, report["models"]):
        with torch.no_grad():
            alone = export.load(path)(data.test_images).argmax(1)
        assert row["accuracy"] == float((alone == answers.test_labels).float().mean())


def test_eval_command_table_and_json(saved, tmp_path, capsys):
    stems, _ = saved
    report = tmp_path / "e.json"
    code, out, err = run_cli(["eval", "--ensemble", *map(str, stems), "--dataset", DATA, "--device", "cpu",
                              "--json", str(report)], capsys)
    assert code == 0, err
    written = json.loads(report.read_text())
    lines = out.splitlines()
    assert lines[0] == "ensemble of 3 models on synthetic test (64 images, cpu)" and lines[1].split() == [
        "model", "TTA", "accuracy", "%", "eval", "s"]
    for line, row in zip(lines[2:5], written["models"]):
        assert line.split()[:3] == [row["model"], "2", f"{100 * row['accuracy']:.2f}"]
    assert lines[5].startswith("ensemble (mean softmax)") and len(lines) == 6
    assert f"{100 * written['ensemble']['accuracy']:.2f}" in lines[5] and "over one model's mean" in lines[5]
    assert "timed: per model" in err


def _variant(stem: Path, dst: Path, edit=None, net=None) -> Path:
    """`stem`'s model saved again at `dst` with its card edited (and another network, where given)."""
    model = export.load(stem)
    card = {k: v for k, v in model.card.items() if k not in ("format", "version", "speedrun_version",
                                                              "weights_sha256")}
    if edit is not None:
        edit(card)
    export.save_model(dst, model.net if net is None else net, card)
    return dst


def _resnet(card: dict) -> None:
    cfg = dataclasses.replace(cifar_resnet.cifar10_resnet18(), widths=(8, 8, 16, 16))
    card.update(recipe="cifar10-resnet18", family="cifar_resnet", config=dataclasses.asdict(cfg))


DISAGREE = {
    "family": (_resnet, lambda: cifar_resnet.build_model(
        dataclasses.replace(cifar_resnet.cifar10_resnet18(), widths=(8, 8, 16, 16)), 3, 10), "family: 'cifar'"),
    "class names": (lambda c: c.update(classes=[f"other{i}" for i in range(10)]), None, "classes: class 0"),
    "class order": (lambda c: c.update(classes=c["classes"][::-1]), None, "the same names in another order"),
    "class count": (lambda c: c.update(classes=c["classes"][:5]), lambda: cifar.build_model(CFG, 3, 5),
                    "classes: 10 against 5"),
    "image shape": (lambda c: c.update(image_shape=[1, 32, 32], mean=[0.5], std=[0.25]),
                    lambda: cifar.build_model(CFG, 1, 10), "image_shape: [3, 32, 32] against [1, 32, 32]"),
    "normalization": (lambda c: c.update(std=[0.3, 0.3, 0.3]), None, "normalization (std)"),
    "dataset": (lambda c: c.update(dataset="cifar10"), None, "dataset: 'synthetic:train=256,test=64' against "
                                                           "'cifar10'"),
}


@pytest.mark.parametrize("what", DISAGREE)
def test_models_that_disagree_are_refused_naming_both_and_the_field(saved, tmp_path, what):
    stems, _ = saved
    edit, net, why = DISAGREE[what]
    other = _variant(stems[2], tmp_path / "other", edit, None if net is None else net().eval())
    for order in ([stems[0], other], [stems[0], stems[1], other]):
        with pytest.raises(ValueError) as refused:
            ens.load_ensemble(order)
        message = str(refused.value)
        assert "\n" not in message and f"{stems[0]} and {other} cannot be averaged" in message, message
        assert why in message, message


def test_two_spellings_of_one_dataset_agree(saved, tmp_path, monkeypatch):
    stems, _ = saved
    (tmp_path / "data" / "cifar").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    a = _variant(stems[0], tmp_path / "a", lambda c: c.update(dataset="data/cifar"))
    b = _variant(stems[1], tmp_path / "b", lambda c: c.update(dataset=str(tmp_path / "data" / "cifar") + "/"))
    c = _variant(stems[2], tmp_path / "c", lambda c: c.update(dataset="./data/cifar"))
    assert len(ens.load_ensemble([a, b, c])) == 3


def test_one_model_and_the_same_model_twice_are_refused(saved, tmp_path, capsys):
    stems, _ = saved
    for paths in ([stems[0]], [], str(stems[0])):
        with pytest.raises(ValueError, match="an ensemble averages at least 2 saved models; got (one|none)"):
            ens.load_ensemble(paths)
    for twice in (stems[0], stems[0].with_suffix(".json"), stems[0].parent / "." / "m0.safetensors"):
        with pytest.raises(ValueError, match=f"^{re.escape(f'{stems[0]} and {twice}')} are the same saved model"):
            ens.load_ensemble([stems[0], stems[1], twice])
    for suffix in (".safetensors", ".json"):  # a copy: other files, the same weights
        shutil.copy(stems[0].with_suffix(suffix), tmp_path / f"copy{suffix}")
    with pytest.raises(ValueError, match=f"^{re.escape(f'{stems[0]} and {tmp_path}/copy')} hold the same weights"):
        ens.load_ensemble([stems[0], tmp_path / "copy"])
    for argv, why in ((["eval", "--ensemble", str(stems[0])], "at least 2 saved models"),
                      (["eval", str(stems[0]), "--ensemble", str(stems[1]), str(stems[2])], "not both"),
                      (["eval"], "give a saved model")):
        code, out, err = run_cli([*argv, "--dataset", DATA, "--device", "cpu"], capsys)
        assert (code, out) == (2, "") and err.count("\n") == 1 and why in err, err


def test_a_bad_file_is_refused_as_for_one_model(saved, tmp_path):
    stems, _ = saved
    for suffix in (".safetensors", ".json"):
        shutil.copy(stems[1].with_suffix(suffix), tmp_path / f"bad{suffix}")
    with open(tmp_path / "bad.safetensors", "r+b") as f:  # one weight byte flipped: the SHA-256 no longer matches
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ValueError, match=re.escape(f"saved model weights {tmp_path}/bad.safetensors are unusable: "
                                                   "its SHA-256")):
        ens.load_ensemble([stems[0], tmp_path / "bad"])
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        ens.load_ensemble([stems[0], tmp_path / "missing"])


@pytest.fixture
def pictures(saved, tmp_path) -> list[str]:
    _, data = saved
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"p{i}.png"))
        Image.fromarray(data.test_images[i].permute(1, 2, 0).numpy()).save(files[-1])
    return files


def test_predict_prints_the_mean_softmax_as_predict_does(saved, pictures, capsys):
    stems, data = saved
    models = [str(s) for s in stems[:2]]
    probs = _mean_softmax_by_hand(stems[:2], data.test_images[:3])  # the PNGs are lossless copies
    expected = []
    for file, row in zip(pictures, probs):
        values, indices = row.topk(3)
        expected.append(f"{file}: " + ", ".join(f"{data.classes[i]} {p:.3f}"
                                                for i, p in zip(indices.tolist(), values.tolist())))
    for argv in (["predict", "--top", "3", "--device", "cpu", "--ensemble", *models, "--", *pictures],
                 ["predict", *pictures, "--ensemble", *models, "--top", "3", "--device", "cpu"]):
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err
        assert out.splitlines() == expected
        assert err.startswith(f"note: an ensemble of 2 models ({models[0]}, {models[1]})")
    # One model alone: its own probabilities, not the ensemble's.
    code, out, _ = run_cli(["predict", models[0], pictures[0], "--top", "3", "--device", "cpu"], capsys)
    alone = torch.softmax(export.load(stems[0])(data.test_images[:1]), 1)[0].topk(3)
    assert out == f"{pictures[0]}: " + ", ".join(f"{data.classes[i]} {p:.3f}" for i, p in zip(
        alone.indices.tolist(), alone.values.tolist())) + "\n"


def test_predict_refuses_images_taken_as_models_and_no_images(saved, pictures, capsys):
    stems, _ = saved
    models = [str(s) for s in stems[:2]]
    for argv, why in ((["--ensemble", *models, *pictures], f"--ensemble took the image {pictures[0]} as a model"),
                      (["--ensemble", *models], "give image files"),
                      ([models[0]], "give a saved model and image files"),
                      (["--ensemble", models[0], "--", *pictures], "at least 2 saved models")):
        code, out, err = run_cli(["predict", "--device", "cpu", *argv], capsys)
        assert (code, out) == (2, "") and err.count("\n") == 1 and why in err, err


def test_predict_streams_a_batch_at_a_time(saved, pictures, monkeypatch):
    stems, _ = saved
    decoded = []
    monkeypatch.setattr(export, "predict_batch_size", lambda model: 1)
    monkeypatch.setattr(export, "read_image", lambda f, c, h, w: decoded.append(f) or np.zeros((c, h, w), np.uint8))
    predictions = ens.iter_ensemble_predictions(stems, pictures, top=2, device="cpu")
    first, _ = next(predictions)
    assert first == pictures[0] and decoded == pictures[:1]  # the others not yet read
    assert [f for f, _ in predictions] == pictures[1:] and decoded == pictures


def test_eval_shows_its_progress_and_the_time_left_on_stderr_unless_quiet(saved, capsys):
    """Not a terminal (capsys): a line at every tenth of the work, each model's warm-up and pass in images, an
    estimate of the time left until the last; --quiet: the table alone."""
    stems, _ = saved
    code, out, err = run_cli(["eval", "--ensemble", *map(str, stems[:2]), "--dataset", DATA, "--device", "cpu"],
                             capsys)
    assert code == 0, err
    progress = [line for line in err.splitlines() if line.startswith("eval: ")]
    # 64 images in one batch, TTA level 2: a warm-up and a pass per model, a quarter of the work each
    # and a first line at once, before any work (no estimate yet)
    stages = [f"model 1/2 ({stems[0]}) warm-up at 0/64 images",
              f"model 1/2 ({stems[0]}) warm-up at 64/64 images", f"model 1/2 ({stems[0]}) at 64/64 images",
              f"model 2/2 ({stems[1]}) warm-up at 64/64 images", f"model 2/2 ({stems[1]}) at 64/64 images"]
    assert [line.split(" (", 1)[1].rsplit("), ", 1)[0] for line in progress] == stages
    assert [line.split()[1] for line in progress] == ["0%", "25%", "50%", "75%", "100%"]
    assert re.search(r"\), \d+ s$", progress[0]), progress[0]
    assert all(re.search(r"\), \d+ s, about \d+ s left$", line) for line in progress[1:4]), progress
    assert re.search(r"\), \d+ s$", progress[4]), progress[4]
    code, quiet_out, quiet_err = run_cli(["eval", "--ensemble", *map(str, stems[:2]), "--dataset", DATA, "--device",
                                          "cpu", "--quiet"], capsys)
    assert code == 0 and quiet_err == "" and quiet_out.splitlines()[0] == out.splitlines()[0]
    code, out, err = run_cli(["eval", str(stems[0]), "--dataset", DATA, "--device", "cpu"], capsys)
    assert code == 0 and f"eval: 100% ({stems[0]} at 64/64 images)" in err, err


def _interrupted_at(call: int, monkeypatch) -> None:
    """EvalProgress.advance raises KeyboardInterrupt (Ctrl-C) at its `call`th call, before counting that batch."""
    from speedrun.run import display

    calls, advance = [0], display.EvalProgress.advance

    def interrupting(self, passes):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        advance(self, passes)
    monkeypatch.setattr(display.EvalProgress, "advance", interrupting)


def test_an_interrupted_eval_says_how_far_it_got_and_writes_nothing(saved, tmp_path, capsys, monkeypatch):
    stems, _ = saved
    report = tmp_path / "e.json"
    _interrupted_at(4, monkeypatch)  # the second model's pass: its warm-up is done
    code, out, err = run_cli(["eval", "--ensemble", *map(str, stems[:2]), "--dataset", DATA, "--device", "cpu",
                              "--json", str(report)], capsys)
    assert code == 130 and out == ""
    assert err.splitlines()[-1] == (f"speedrun: interrupted; evaluation of 2 models stopped at model 2/2 ({stems[1]}) "
                                    "at 0/64 images; nothing was written")
    assert not report.exists()
    _interrupted_at(1, monkeypatch)
    code, out, err = run_cli(["eval", str(stems[0]), "--dataset", DATA, "--device", "cpu", "--quiet"], capsys)
    assert (code, out) == (130, "")
    assert err == f"speedrun: interrupted; evaluation of {stems[0]} stopped at 0/64 images; nothing was written\n"


def test_an_interrupt_carries_the_images_scored_of_the_model_it_stopped(saved, monkeypatch):
    stems, _ = saved
    _interrupted_at(7, monkeypatch)  # batches of 24, 24 and 16: the first model's 1 + 3, the second's 1 + 1, then
    with pytest.raises(KeyboardInterrupt) as stopped:
        ens.evaluate_ensemble(stems[:2], DATA, device="cpu", batch_size=24)
    assert stopped.value.stopped_at == f"evaluation of 2 models stopped at model 2/2 ({stems[1]}) at 24/64 images"
