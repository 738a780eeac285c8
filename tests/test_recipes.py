"""Every recipe runs on tiny synthetic data; runs are deterministic; learning happens; any shape works."""

import dataclasses

import pytest
import torch

from speedrun.engine.loop import RunHooks
from speedrun.recipes import cifar
from speedrun.recipes.cifar import loop as cifar_loop
from speedrun.run.runner import RECIPES, get_recipe, make_config

from conftest import make_tiny

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", sorted(n for n, r in RECIPES.items() if r.family == "cifar"))  # imagenet: test_imagenet.py
def test_every_recipe_runs_two_steps_on_tiny_synthetic_data(name):
    data = make_tiny(n_train=64, n_test=16)
    recipe = get_recipe(name)
    # The recipe's own network and tricks; only batch and length shrink to two steps.
    cfg = make_config(recipe, None, {"batch_size": 32, "whiten_images": 32, "eval_each_epoch": False})
    cfg = dataclasses.replace(cfg, epochs=1.0)
    result = recipe.module().train_run(cfg, data, CPU, seed=0)
    assert result.steps == 2
    assert 0.0 <= result.accuracy <= 1.0 and result.train_seconds > 0
    assert len(result.history) == 1 and result.history[0]["step"] == 2
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_runs_are_deterministic_under_a_seed():
    data = make_tiny(n_train=128, n_test=32)
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=32, epochs=0.5, widths=(8, 16, 16), whiten_images=64)
    a = cifar.train_run(cfg, data, CPU, seed=5)
    b = cifar.train_run(cfg, data, CPU, seed=5)
    c = cifar.train_run(cfg, data, CPU, seed=6)
    sa, sb, sc = (r.model.state_dict() for r in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_learning_happens_on_a_learnable_tiny_task():
    data = make_tiny(n_train=512, n_test=256)
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=64, epochs=4.0, widths=(16, 32, 32),
                              whiten_images=256, eval_each_epoch=False)
    result = cifar.train_run(cfg, data, CPU, seed=0)
    assert result.accuracy > 0.5  # chance is 0.1; seeds 0-2 gave 0.68, 0.57, 0.64


def test_one_channel_28px_data_works():
    data = make_tiny(n_train=64, n_test=16, shape=(1, 28, 28))
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=32, epochs=1.0, widths=(8, 8, 8), whiten_images=32)
    result = cifar.train_run(cfg, data, CPU, seed=0)
    assert result.model.whiten.weight.shape == (8, 1, 2, 2)  # 2 * C * k * k filters from the data's C
    assert result.steps == 2


def test_muon_variant_trains_with_muon_and_sgd():
    cfg = cifar.cifar10_94_muon()
    net = cifar_loop.CifarNet(widths=(8, 8, 8))
    sgd, muon = cifar.build_optimizers(cfg, net)
    assert isinstance(muon, cifar_loop.Muon)
    assert id(net.whiten.bias) in {id(p) for p in sgd.param_groups[0]["params"]}  # with the BN biases
    assert {id(p) for g in muon.param_groups for p in g["params"]} == \
        {id(p) for n, p in net.named_parameters() if "convs" in n}


def test_sgd_parameter_groups_follow_airbench94():
    net = cifar_loop.CifarNet(widths=(8, 8, 8))
    (sgd,) = cifar.build_optimizers(cifar.cifar10_94(), net)
    fast, base = sgd.param_groups
    bn_biases = {id(m.bias) for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert {id(p) for p in fast["params"]} == bn_biases  # only BN biases get the 64x lr (frozen scales excluded)
    assert id(net.whiten.bias) in {id(p) for p in base["params"]}
    assert fast["lr"] == pytest.approx(64 * base["lr"])


def test_epochs_override_compresses_the_schedule():
    recipe = get_recipe("cifar10-94")
    cfg = make_config(recipe, 1.0, {})
    assert cfg.epochs == 1.0
    assert cfg.whiten_bias_epochs == pytest.approx(3.0 / 9.9)  # the bias window shrinks with the run


def test_whitening_bias_freezes_after_its_window(monkeypatch):
    data = make_tiny(n_train=64, n_test=16)
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=32, epochs=2.0, widths=(8, 8, 8), whiten_images=32,
                              whiten_bias_epochs=1.0, eval_each_epoch=False)
    built = []
    original = cifar_loop.CifarNet
    monkeypatch.setattr(cifar_loop, "CifarNet", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    seen = []  # the whitening bias's requires_grad after each step
    cifar.train_run(cfg, data, CPU, seed=0,
                    hooks=RunHooks(on_step=lambda step, total: seen.append(built[0].whiten.bias.requires_grad)))
    # 4 steps of 32 over 64 examples: epochs 0.5, 1.0, 1.5, 2.0; the bias trains in steps 1-2 only
    assert seen == [True, True, False, False]
