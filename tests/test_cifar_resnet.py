"""The cifar_resnet family (recipe cifar10-resnet18): the network, the family contract, its tricks, and the
command's paths (train, save and load, resume, ablate, torchrun) on tiny widths and synthetic data."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import speedrun
from speedrun.cli import main
from speedrun.engine.checkpoint import list_checkpoints
from speedrun.recipes import FAMILIES, RECIPES, cifar_resnet
from speedrun.recipes.cifar_resnet.loop import lr_mult
from speedrun.recipes.family import mismatches

DATA = "synthetic:train=256,test=64"
# 256 images at batch 64: 4 steps an epoch. Width 8 makes a step a few milliseconds of work on one CPU thread.
TINY = ["--dataset", DATA, "--device", "cpu", "--set", "batch_size=64", "--set", "widths=8,8,16,16", "--set",
        "whiten_images=64"]


pytestmark = pytest.mark.usefixtures("in_tmp")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: at these widths a step is a few ms of work, and two threads contending with the rest
    of a shared machine make it ten times slower, not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_resnet18_has_the_published_size_and_shapes():
    net = cifar_resnet.build_model(cifar_resnet.cifar10_resnet18(), 3, 10)
    # kuangliu/pytorch-cifar's ResNet18 at 10 classes
    assert sum(p.numel() for p in net.parameters()) == 11_173_962 == cifar_resnet.parameter_count(3, 10,
                                                                                                (64, 128, 256, 512))
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    small = cifar_resnet.CifarResNet(1, 7, (8, 8, 16, 16))
    assert sum(p.numel() for p in small.parameters()) == cifar_resnet.parameter_count(1, 7, (8, 8, 16, 16))
    assert small(torch.zeros(3, 1, 28, 28)).shape == small(torch.zeros(3, 1, 5, 3)).shape == (3, 7)


def test_whitening_fills_pairs_of_stem_filters_and_leaves_the_rest():
    images = torch.randn(16, 3, 32, 32)
    for width, filled in ((64, 54), (8, 8), (9, 8)):
        stem = cifar_resnet.CifarResNet(3, 10, (width, 8, 8, 8)).stem
        before = stem.weight.clone()
        assert cifar_resnet.whiten_stem_(stem, images, 5e-4) == filled
        pairs = filled // 2
        torch.testing.assert_close(stem.weight[pairs:filled], -stem.weight[:pairs])  # each filter and its negative
        assert torch.equal(stem.weight[filled:], before[filled:])
        # The filters whiten: the patches they see have about unit variance along each (eps is small).
        out = torch.nn.functional.conv2d(images.double(), stem.weight[:pairs].double())
        assert out.var(dim=(0, 2, 3)).sub(1).abs().max() < 0.05


def test_the_family_is_registered_and_conforms():
    assert FAMILIES["cifar_resnet"] == "speedrun.recipes.cifar_resnet"
    assert RECIPES["cifar10-resnet18"].module() is cifar_resnet
    assert mismatches(cifar_resnet) == []
    cfg = RECIPES["cifar10-resnet18"].make_config()
    cfg.validate()
    assert (cfg.target_accuracy, cfg.widths, cfg.translate_px) == (0.9302, (64, 128, 256, 512), 4)
    assert cifar_resnet.with_epochs(cfg, 3.0) == dataclasses.replace(cfg, epochs=3.0)


def test_every_trick_has_a_valid_off_value_that_differs_from_the_recipe():
    cfg = cifar_resnet.cifar10_resnet18()
    keys = [key for key, _, _ in cifar_resnet.TRICKS]
    assert len(keys) == len(set(keys))
    assert {"whiten_init", "label_smoothing", "flip", "lookahead", "tta_level", "lr_schedule", "nesterov",
            "channels_last", "compile", "precision"} == set(keys)
    for key, off, _ in cifar_resnet.TRICKS:
        changed = dataclasses.replace(cfg, **{key: off})
        changed.validate()
        if key != "compile":  # compile is off in every recipe by default; ablate reports it as already off
            assert getattr(cfg, key) != off, key


@pytest.mark.parametrize("key, value, fragment", [
    ("batch_size", 0, "batch_size"), ("epochs", 0.0, "epochs"), ("widths", (64, 128, 256), "widths"),
    ("widths", (64, 128, 256, 10**6), "widths"), ("lr", 0.0, "lr"), ("lr", 1e300, "lr"),
    ("momentum", 1.0, "momentum"), ("weight_decay", -1.0, "weight_decay"), ("translate_px", 65, "translate_px"),
    ("lr_drop1_frac", 0.9, "lr_drop1_frac"), ("lr_peak_frac", 1.5, "lr_peak_frac"),
    ("whiten_images", 0, "whiten_images"), ("tta_level", 3, "tta_level"), ("label_smoothing", 1.0, "label"),
    ("eval_batch_size", 0, "eval_batch_size"), ("target_accuracy", 93.02, "target_accuracy"),
    ("lookahead_every_steps", 0, "lookahead_every_steps"), ("lr_drop_factor", 0.0, "lr_drop_factor"),
])
def test_a_bad_setting_is_one_line_naming_it(key, value, fragment):
    cfg = dataclasses.replace(cifar_resnet.cifar10_resnet18(), **{key: value})
    with pytest.raises(ValueError, match=fragment) as e:
        cfg.validate()
    assert "\n" not in str(e.value)


def test_nesterov_without_momentum_is_refused():
    with pytest.raises(ValueError, match="nesterov"):
        dataclasses.replace(cifar_resnet.cifar10_resnet18(), momentum=0.0).validate()
    dataclasses.replace(cifar_resnet.cifar10_resnet18(), momentum=0.0, nesterov=False).validate()


def test_the_step_schedule_drops_where_the_published_one_does():
    cfg = dataclasses.replace(cifar_resnet.cifar10_resnet18(), lr_schedule="step")
    # 350 epochs at 391 steps: the drops at epochs 150 and 250
    total = 350 * 391
    mults = [lr_mult(cfg, s, total) for s in (0, 150 * 391 - 1, 150 * 391, 250 * 391, total - 1)]
    assert mults == pytest.approx([1.0, 1.0, 0.1, 0.01, 0.01])


@pytest.mark.slow
def test_train_save_load_predict_and_resume_equal_to_the_whole_run(tmp_path, capsys):
    """One run with a checkpoint every 2 of its 8 steps; a copy of the step-2 checkpoint, resumed in another folder,
    ends with the same weights and accuracy: the loader, the optimizer, Lookahead and the RNG all come back."""
    whole = ["train", "cifar10-resnet18", *TINY, "--epochs", "2", "--quiet"]
    assert main([*whole, "--checkpoint-dir", "a", "--checkpoint-every", "2", "--keep-checkpoints", "10",
                 "--json", "a.json", "--save", "model_a"]) == 0
    a = json.loads(Path("a.json").read_text())
    assert a["recipe"] == "cifar10-resnet18" and a["config"]["widths"] == [8, 8, 16, 16] and a["complete"]
    (run,) = a["runs"]
    assert 0 <= run["accuracy"] <= 1 and run["steps"] == 8 and len(run["history"]) == 2
    assert "whitening init" in a["timed_region"]

    # The saved model takes images and names classes, with the run's TTA: the same test accuracy.
    model = speedrun.load("model_a")
    assert model.tta_level == 2 and model.image_shape == (3, 32, 32) and len(model.classes) == 10
    capsys.readouterr()
    assert main(["eval", "model_a", "--dataset", DATA, "--device", "cpu"]) == 0
    assert f"{100 * run['accuracy']:.2f}%" in capsys.readouterr().out
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save("x.png")
    (top,) = model.predict(torch.from_numpy(pixels).permute(2, 0, 1)[None], top=3)
    assert len(top) == 3 and all(name in model.classes for name, _ in top)
    assert main(["predict", "model_a", "x.png", "--top", "1", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(f"x.png: {top[0][0]}")

    step2 = [p for p in list_checkpoints(Path("a")) if p.name.endswith("-000000002.safetensors")]
    Path("b").mkdir()
    shutil.copy(step2[0], Path("b") / step2[0].name)
    assert main([*whole, "--checkpoint-dir", "b", "--resume", "auto", "--json", "b.json", "--save", "model_b"]) == 0
    b = json.loads(Path("b.json").read_text())
    assert b["resumed_from"] == [str(Path("b") / step2[0].name)]
    assert b["runs"][0]["accuracy"] == run["accuracy"]
    assert [r["train_loss"] for r in b["runs"][0]["history"]] == [r["train_loss"] for r in run["history"]]
    weights_a, weights_b = load_file("model_a.safetensors"), load_file("model_b.safetensors")
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.slow
def test_ablate_switches_each_trick_off_alone(tmp_path):
    out = tmp_path / "ablate.json"
    tiny = [a.replace("train=256", "train=128") for a in TINY]
    assert main(["ablate", "cifar10-resnet18", *tiny, "--epochs", "1", "--runs", "1", "--db", str(tmp_path / "r.db"),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(r["trick"] for r in report["tricks"]) == sorted(key for key, _, _ in cifar_resnet.TRICKS)
    # compile is off in the recipe; bf16 autocast is off on a CPU (precision=auto is fp32 there)
    assert {r["trick"] for r in report["tricks"] if not r["measured"]} == {"compile", "precision"}
    baseline = report["results"][0]["config"]
    offs = {key: off for key, off, _ in cifar_resnet.TRICKS}
    for setting, result in zip(report["settings"][1:], report["results"][1:]):
        key = setting["name"].split("=")[0]
        assert {k for k in baseline if baseline[k] != result["config"][k]} == {key}
        assert result["config"][key] == offs[key]


@pytest.mark.slow
def test_two_processes_under_torchrun_run_one_job(tmp_path):
    """torchrun, 2 CPU processes (gloo), each training on half of every batch of 64: one result, of 2 processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_DATA=str(tmp_path / "cache"),
               SPEEDRUN_RESULTS=str(tmp_path / "results"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "speedrun",
            "train", "cifar10-resnet18", *TINY, "--epochs", "2", "--quiet", "--json", "two.json"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "two.json").read_text())
    assert result["world"] == {"processes": 2, "nodes": 1, "backend": "gloo", "restarts": 0}
    (run,) = result["runs"]
    assert run["steps"] == 8 and len(run["history"]) == 2 and 0 <= run["accuracy"] <= 1
