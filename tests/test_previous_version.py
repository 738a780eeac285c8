"""Files written by the previous version (tests/fixtures/previous_version/, made at commit 36626e0) still load: its
result files, checkpoints, saved models and results database, each through the public API or the command."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import speedrun
from speedrun.cli.program import main
from speedrun.config import field_defaults
from speedrun.recipes.cifar import CifarConfig

OLD = Path(__file__).parent / "fixtures" / "previous_version"
# The cifar command that wrote the checkpoint, less its output flags (--resume replaces --checkpoint-every's start).
CIFAR = ["train", "cifar10-94", "--dataset", "synthetic:train=256,test=64", "--device", "cpu", "--epochs", "1",
         "--runs", "2", "--set", "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet"]


@pytest.mark.parametrize("name", ["cifar-model", "imagenet-model"])
def test_a_saved_model_of_the_previous_version_loads_and_gives_its_logits(name):
    model = speedrun.load(OLD / name)
    c, h, w = model.image_shape
    images = (torch.arange(2 * c * h * w) % 251).to(torch.uint8).reshape(2, c, h, w)
    with torch.no_grad():
        logits = model(images)
    expected = torch.tensor(json.loads((OLD / "expected_logits.json").read_text())[name])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_the_previous_version_resumes_to_that_versions_accuracy(tmp_path, monkeypatch, capsys):
    """Run 2 resumed at its step 3 of 4 by this version ends at the accuracy the old version reached without
    stopping (a deterministic CPU run), and the finished run 1 the checkpoint carries is kept as it was."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ck"
    folder.mkdir()
    shutil.copy(OLD / "cifar-ckpt-00001-000000003.safetensors", folder / "ckpt-00001-000000003.safetensors")
    # The old run was fp32 (precision=auto on a CPU then); where auto now means bf16 (a CPU with native bf16
    # instructions), the resume asks for fp32 by name, as the refusal says (the next test).
    # It trained every epoch's last partial batch (drop_last_batch did not exist): the resume says so by name.
    assert main([*CIFAR, "--set", "precision=fp32", "--checkpoint-dir", "ck", "--resume", "auto",
                 "--json", "refused.json"]) == 2
    assert "was made with drop_last_batch=False; this run has drop_last_batch=True" in capsys.readouterr().err
    assert main([*CIFAR, "--set", "precision=fp32", "--set", "drop_last_batch=false", "--checkpoint-dir", "ck",
                 "--resume", "auto", "--json", "new.json"]) == 0
    old, new = (json.loads(p.read_text()) for p in (OLD / "cifar-result.json", tmp_path / "new.json"))
    assert [r["accuracy"] for r in new["runs"]] == [r["accuracy"] for r in old["runs"]]
    assert [r["steps"] for r in new["runs"]] == [r["steps"] for r in old["runs"]] == [4, 4]
    # the config is the old one, with the precision named and the settings added since at their defaults
    added = {k: v for k, v in field_defaults(CifarConfig).items() if k not in old["config"]}
    assert {"cpu_threads", "optimizer_kernel", "tta_select", "whiten_method"} <= set(added)
    assert added["drop_last_batch"] is False  # what the old version did, not the new default
    assert new["config"] == json.loads(json.dumps({**old["config"], **added, "precision": "fp32"}))


def test_a_checkpoint_continues_at_the_precision_it_began_with(tmp_path, monkeypatch, capsys):
    """The previous version's CPU checkpoint ran at fp32 (what precision=auto meant for it): where auto now means
    bf16, resuming it is refused with the --set that continues it as it began, and that --set resumes it to the
    old version's accuracy."""
    from speedrun.recipes.cifar import CifarConfig

    monkeypatch.setattr(CifarConfig, "BF16_AUTO_ON_CPU", True)
    monkeypatch.setattr("speedrun.tricks.precision.native_bf16_cpu", lambda: True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    shutil.copy(OLD / "cifar-ckpt-00001-000000003.safetensors", tmp_path / "ck" / "ckpt-00001-000000003.safetensors")
    assert main([*CIFAR, "--checkpoint-dir", "ck", "--resume", "auto", "--json", "a.json"]) == 2
    line = capsys.readouterr().err.strip()
    assert "ran in fp32 (precision=auto); this run would run in bf16: add --set precision=fp32" in line
    assert main([*CIFAR, "--set", "precision=fp32", "--set", "drop_last_batch=false", "--checkpoint-dir", "ck",
                 "--resume", "auto", "--json", "b.json"]) == 0
    old, new = (json.loads(p.read_text()) for p in (OLD / "cifar-result.json", tmp_path / "b.json"))
    assert [r["accuracy"] for r in new["runs"]] == [r["accuracy"] for r in old["runs"]]


def test_an_imagenet_checkpoint_of_the_previous_version_restores_into_a_train_state():
    from speedrun.engine.checkpoint import load_checkpoint
    from speedrun.recipes import get_recipe
    from speedrun.recipes.imagenet import build_model, build_optimizer, TrainState
    from speedrun.run.runner import make_config
    from speedrun.tricks.ema import make_ema

    state, meta = load_checkpoint(OLD / "imagenet-ckpt-00000-000000008.safetensors")
    assert (meta["recipe"], meta["run"], meta["step"]) == ("imagenet-debug", 0, 8)
    cfg = make_config(get_recipe("imagenet-debug"), None, meta["config"])
    model = build_model(cfg, 3, meta["data"]["num_classes"])
    train_state = TrainState(model, build_optimizer(cfg, model), make_ema(model, cfg.ema_decay, 1))
    train_state.load_state_dict(state, total_steps=10)
    assert (train_state.step, train_state.epochs_done) == (8, 0)
    torch.testing.assert_close(model.state_dict()["head.weight"], state["model"]["head.weight"])


@pytest.mark.parametrize("name", ["cifar-result.json", "imagenet-result.json"])
def test_a_result_file_of_the_previous_version_imports_and_compares(name, tmp_path, capsys):
    assert main(["results", "import", str(OLD / name), "--db", str(tmp_path / "r.db")]) == 0
    assert main(["compare", str(OLD / name), str(OLD / name), "--db", str(tmp_path / "r.db")]) == 0
    assert "same result" in capsys.readouterr().out


def test_the_previous_versions_results_database_opens_lists_and_reports(tmp_path, capsys):
    db = tmp_path / "old.db"
    shutil.copy(OLD / "results-v2.db", db)
    assert main(["results", "--db", str(db)]) == 0
    listed = capsys.readouterr().out
    assert "cifar10-94" in listed and "imagenet-debug" in listed
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "r.html")]) == 0
    assert "imagenet-debug" in (tmp_path / "r.html").read_text()


def test_a_setting_added_since_a_checkpoint_resumes_only_at_its_default(tmp_path, monkeypatch, capsys):
    """The previous version's checkpoint has no whiten_method or tta_select: it ran as their defaults do, so a
    resume at another value is refused naming the default it ran with."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    shutil.copy(OLD / "cifar-ckpt-00001-000000003.safetensors", tmp_path / "ck" / "ckpt-00001-000000003.safetensors")
    for setting, text in (("whiten_method=svd", "whiten_method='eigh'"), ("tta_select=0.5", "tta_select=0.0")):
        assert main([*CIFAR, "--set", "precision=fp32", "--set", "drop_last_batch=false", "--set", setting,
                     "--checkpoint-dir", "ck", "--resume", "auto", "--json", "x.json"]) == 2
        line = capsys.readouterr().err.strip()
        assert f"was made with {text}" in line and "\n" not in line
