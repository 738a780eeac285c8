"""The in-memory families' shared base (recipes/in_memory/): a family is its network and its differences, given to
the shared loop as Hooks; the shared config keeps each family's own defaults; the loader's and evaluation's grouped
settings (Normalization, Augmentation) validate as the loader always did."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
from conftest import make_tiny, run_cli
from torch import nn

import speedrun
from speedrun.data.loader import Augmentation, Normalization, normalize
from speedrun.engine.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from speedrun.recipes import cifar, cifar_resnet
from speedrun.recipes.in_memory.config import InMemoryConfig
from speedrun.recipes.in_memory.loop import Hooks, TrainState, train_run, train_step, with_initial_lr

CPU = torch.device("cpu")


class TinyHooks(Hooks[InMemoryConfig, TrainState]):
    """A family of one conv: its network, an SGD and its lr, and a record of the whitening sample it is given."""

    state_type = TrainState

    def build(self, data):
        c = data.image_shape[0]
        return nn.Sequential(nn.Conv2d(c, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, data.num_classes))

    def optimizers(self, model):
        return with_initial_lr(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def lr_setting(self):
        return "lr", 0.05

    def whiten(self, model, sample):
        self.sample = sample()


def tiny_cfg(**kw) -> InMemoryConfig:
    return dataclasses.replace(InMemoryConfig(), **({"batch_size": 32, "epochs": 2.0, "whiten_images": 16,
                                                     "eval_batch_size": 32, "eval_each_epoch": False} | kw))


def test_a_family_of_its_network_alone_trains_on_the_shared_loop_deterministically():
    data = make_tiny(n_train=128, n_test=32, shape=(3, 8, 8))
    hooks = TinyHooks(tiny_cfg())
    run = train_run(hooks, data, CPU, seed=1)
    assert run.steps == 8 and 0 <= run.accuracy <= 1 and len(run.history) == 2
    assert hooks.sample.shape == (16, 3, 8, 8) and hooks.sample.dtype == torch.float32  # standardized, float32
    again = train_run(TinyHooks(tiny_cfg()), data, CPU, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(run.model.state_dict().values(), again.model.state_dict().values()))
    unwhitened = TinyHooks(tiny_cfg(whiten_init=False))
    train_run(unwhitened, data, CPU, seed=1)
    assert not hasattr(unwhitened, "sample")  # whiten_init off: the hook is never asked


def test_the_mean_loss_step_takes_the_summed_loss_over_the_global_batch():
    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    grads = []
    for batch_size in (None, 12):  # 12: this process holds half of a global batch of 12
        torch.manual_seed(1)
        net = nn.Linear(4, 3)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        train_step(net, [opt], x, y, 0.0, contextlib.nullcontext, batch_size)
        grads.append(net.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] / 12)


def test_each_family_config_inherits_the_shared_settings_with_its_own_defaults():
    own, resnet = cifar.cifar10_94(), cifar_resnet.cifar10_resnet18()
    assert isinstance(own, InMemoryConfig) and isinstance(resnet, InMemoryConfig)
    keys = ("target_accuracy", "batch_size", "epochs", "translate_px", "widths", "momentum", "eval_batch_size")
    assert [getattr(own, k) for k in keys] == [0.94, 1024, 9.9, 2, (64, 256, 256), 0.85, 2000]
    assert [getattr(resnet, k) for k in keys] == [0.9302, 512, 15.0, 4, (64, 128, 256, 512), 0.9, 1000]
    assert (type(own).MEAN_LOSS, type(resnet).MEAN_LOSS) == (False, True)
    for cfg, example in ((own, "e.g. 0.94"), (resnet, "e.g. 0.9302")):  # the shared check names the family's default
        with pytest.raises(ValueError, match=rf"^bad config: target_accuracy is a fraction in \[0, 1\], {example}$"):
            dataclasses.replace(cfg, target_accuracy=94.0).validate()


@pytest.mark.parametrize("augmentation, message", [
    (Augmentation(flip="diagonal"), "flip must be one of ('none', 'random', 'alternating'), got 'diagonal'"),
    (Augmentation(translate_px=4), "translate_px must be in [0, 3] for 4x6 images, got 4"),
    (Augmentation(cutout_px=5), "cutout_px must be in [0, 4] for 4x6 images, got 5"),
    (Augmentation(cutmix_px=-1), "cutmix_px must be in [0, 4] for 4x6 images, got -1"),
])
def test_an_augmentation_that_cannot_fit_is_one_line(augmentation, message):
    with pytest.raises(ValueError) as e:
        augmentation.check(4, 6)
    assert str(e.value) == message
    Augmentation("alternating", 3, 4, 4).check(4, 6)


def test_normalization_is_normalize_with_its_settings_kept_together():
    images = torch.randint(0, 256, (5, 3, 4, 4), dtype=torch.uint8)
    mean, std = torch.tensor([0.4, 0.5, 0.6]), torch.tensor([0.2, 0.25, 0.3])
    made = Normalization(mean, std, torch.bfloat16, True)
    assert torch.equal(made(images), normalize(images, mean, std, torch.bfloat16, True))
    assert made(images).is_contiguous(memory_format=torch.channels_last)
    moved = made.to(torch.device("meta"))
    assert moved.mean.device.type == moved.std.device.type == "meta" and made.mean.device == CPU


def test_the_network_field_is_shared_and_a_resnet_file_without_it_trained_resnet18(tmp_path, monkeypatch, capsys):
    """`model` (the user's network, --model) is a shared setting, checked alike; a cifar10-resnet18 checkpoint or
    saved model whose config has no `model` (written before the family took --model) is ResNet-18's: it resumes to
    the accuracy of the run it was cut from, and it loads."""
    for cfg in (cifar.cifar10_94(), cifar_resnet.cifar10_resnet18()):
        assert cfg.model == ""
        with pytest.raises(ValueError, match="^model='not a name' is not a builder's name"):
            dataclasses.replace(cfg, model="not a name").validate()
    monkeypatch.chdir(tmp_path)
    args = ["train", "cifar10-resnet18", "--dataset", "synthetic:train=64,test=16,shape=3x16x16", "--device", "cpu",
            "--epochs", "1", "--set", "batch_size=16", "--set", "widths=8,8,8,8", "--quiet"]
    code, _, err = run_cli([*args, "--checkpoint-dir", "ck", "--checkpoint-every", "2", "--save", "m", "--json",
                            "full.json"], capsys)
    assert code == 0, err
    cut = next(p for p in list_checkpoints(tmp_path / "ck") if p.name == "ckpt-00000-000000002.safetensors")
    state, meta = load_checkpoint(cut)
    for path in list_checkpoints(tmp_path / "ck"):
        path.unlink()
    del meta["config"]["model"]
    save_checkpoint(tmp_path / "ck", 0, 2, state, meta, keep=2)
    code, _, err = run_cli([*args, "--checkpoint-dir", "ck", "--resume", "auto", "--json", "resumed.json"], capsys)
    assert code == 0, err
    full, resumed = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("full", "resumed"))
    assert resumed["resumed_from"] and resumed["config"]["model"] == ""
    assert [r["accuracy"] for r in resumed["runs"]] == [r["accuracy"] for r in full["runs"]]
    card = json.loads((tmp_path / "m.json").read_text())
    del card["config"]["model"]
    (tmp_path / "m.json").write_text(json.dumps(card))
    assert isinstance(speedrun.load(tmp_path / "m").net, cifar_resnet.CifarResNet)


def test_the_final_evaluation_reports_its_progress_and_without_the_hook_changes_nothing():
    """RunHooks.on_evaluation: (0, total) when the final evaluation begins, then after each batch, up to (total,
    total) in forward passes of one image (TTA level 2: 6 a test image); the run's numbers are those of a run
    without it."""
    from speedrun.engine.loop import RunHooks

    data = make_tiny(n_train=64, n_test=48, shape=(3, 16, 16))
    cfg = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8), batch_size=32, whiten_images=32, epochs=1.0,
                              tta_level=2, eval_batch_size=20, eval_each_epoch=False)
    seen: list[tuple[int, int]] = []
    hooked = cifar.train_run(cfg, data, CPU, 0, hooks=RunHooks(on_evaluation=lambda d, t: seen.append((d, t))))
    plain = cifar.train_run(cfg, data, CPU, 0)
    assert seen == [(0, 288), (120, 288), (240, 288), (288, 288)]
    assert hooked.accuracy == plain.accuracy


def test_train_shows_the_final_evaluation_as_it_goes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["train", "cifar10-94", "--dataset", "synthetic:train=64,test=48,shape=3x16x16",
                            "--device", "cpu", "--epochs", "1", "--set", "widths=8,8,8", "--set", "batch_size=32",
                            "--set", "whiten_images=32", "--set", "eval_batch_size=20", "--json", "r.json"], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "final evaluation with TTA level 2" in line and "%" in line]
    assert [line.split(" 2 ")[1].split("%")[0] for line in lines] == ["0", "41", "83", "100"], err
