"""Each trick's functional form, and that switching it off in the config is an exact no-op."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedrun.models import CifarNet
from speedrun.recipes import cifar
from speedrun.recipes.cifar import loop as cifar_loop
from speedrun.recipes.in_memory import loop as in_memory_loop
from speedrun.tricks import lookahead as lookahead_mod
from speedrun.tricks import precision, whitening
from speedrun.tricks.decoupled_sgd import decoupled_sgd
from speedrun.tricks.identity_init import dirac_init_
from speedrun.tricks.label_smoothing import cross_entropy
from speedrun.tricks.lookahead import Lookahead, lookahead_decay
from speedrun.tricks.muon import Muon, newton_schulz
from speedrun.tricks.schedule import triangle
from speedrun.tricks.tta import tta_logits

CPU = torch.device("cpu")


def small_cfg(**kw):
    base = dict(batch_size=32, epochs=0.25, widths=(8, 16, 16), whiten_images=64, eval_each_epoch=False)
    return dataclasses.replace(cifar.cifar10_94(), **(base | kw))


# --- patch whitening -------------------------------------------------------------------------------------

@pytest.mark.parametrize("channels,k", [(3, 2), (1, 2), (3, 3)])
def test_whitened_first_layer_makes_patch_covariance_identity(channels, k):
    g = torch.Generator().manual_seed(0)
    # Correlated inputs: smooth images (neighbouring pixels and channels strongly correlated).
    x = torch.randn(400, channels, 12, 12, generator=g)
    x = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), 3, stride=1) + 0.3 * x.mean(1, keepdim=True)
    d = channels * k * k
    conv = nn.Conv2d(channels, 2 * d, k, padding=0, bias=False)
    before = whitening.patch_covariance(x, k)
    assert (before - torch.eye(d, dtype=before.dtype)).abs().max() > 0.1  # far from white to start with
    whitening.patch_whitening_init_(conv, x, eps=1e-8)
    with torch.no_grad():
        out = conv(x.float())[:, :d].double()  # (N, d, H', W'): the eigenvector half
    feats = out.permute(0, 2, 3, 1).reshape(-1, d)
    cov = feats.T @ feats / len(feats)
    assert torch.allclose(cov, torch.eye(d, dtype=cov.dtype), atol=2e-3)
    # the second half is the negation of the first
    assert torch.equal(conv.weight[d:], -conv.weight[:d])


def test_whitening_off_leaves_default_init(monkeypatch, tiny):
    def boom(*a, **k):
        raise AssertionError("patch whitening ran although whiten_init=false")
    monkeypatch.setattr(cifar_loop, "patch_whitening_init_", boom)
    cifar.train_run(small_cfg(whiten_init=False), tiny, CPU, seed=0)


# --- identity init ---------------------------------------------------------------------------------------

def test_dirac_init_makes_identity_filters_and_off_is_default_init():
    torch.manual_seed(0)
    on = CifarNet(widths=(8, 16, 16), dirac=True)
    torch.manual_seed(0)
    off = CifarNet(widths=(8, 16, 16), dirac=False)
    for conv_on, conv_off in zip([m for m in on.modules() if isinstance(m, nn.Conv2d)][1:],
                                 [m for m in off.modules() if isinstance(m, nn.Conv2d)][1:]):
        k = min(conv_on.in_channels, conv_on.out_channels)
        x = torch.randn(2, conv_on.in_channels, 5, 5)
        assert torch.allclose(conv_on(x)[:, :k], x[:, :k])  # the first k filters pass their channel through
        assert torch.equal(conv_on.weight[k:], conv_off.weight[k:])  # the rest: same default init
    conv = nn.Conv2d(4, 2, 3)
    dirac_init_(conv)
    assert torch.equal(conv.weight[:, 0, 1, 1], torch.tensor([1.0, 0.0]))


def test_bn_scale_frozen_switch():
    frozen = CifarNet(widths=(8, 8, 8), bn_scale_frozen=True)
    free = CifarNet(widths=(8, 8, 8), bn_scale_frozen=False)
    assert all(not bn.weight.requires_grad for bn in frozen.modules() if isinstance(bn, nn.BatchNorm2d))
    assert all(bn.weight.requires_grad for bn in free.modules() if isinstance(bn, nn.BatchNorm2d))


# --- label smoothing -------------------------------------------------------------------------------------

def test_label_smoothing_zero_is_plain_summed_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(16, 10, generator=g), torch.randint(0, 10, (16,), generator=g)
    assert torch.equal(cross_entropy(logits, y, 0.0), F.cross_entropy(logits, y, reduction="sum"))
    s = 0.2
    soft = torch.full((16, 10), s / 10).scatter_add_(1, y[:, None], torch.full((16, 1), 1 - s))
    expected = -(soft * logits.log_softmax(1)).sum()
    assert torch.allclose(cross_entropy(logits, y, s), expected, atol=1e-5)
    # probability targets (cutmix) give the same loss as their class indices when one-hot
    assert torch.allclose(cross_entropy(logits, F.one_hot(y, 10).float(), s), expected, atol=1e-5)


# --- lookahead -------------------------------------------------------------------------------------------

def test_lookahead_update_moves_live_weights_to_the_average():
    net = nn.Linear(3, 2)
    la = Lookahead(net)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.weight.add_(1.0)
    la.update(decay=0.75)
    assert torch.allclose(net.weight, start["weight"] + 0.25)
    assert torch.equal(la.slow[la.names.index("weight")], net.weight)
    before = net.weight.clone()
    la.update(decay=1.0)  # the final sync: live takes the slow copy, unchanged
    assert torch.equal(net.weight, before)
    assert lookahead_decay(0, 100) == 0.0
    assert lookahead_decay(100, 100) == pytest.approx(0.95**5)


def test_lookahead_fused_update_equals_the_per_tensor_rule():
    """ema <- lerp(ema, w, 1 - decay); w <- ema, for every float tensor (BN running stats too), bit for bit."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    la = Lookahead(net)
    assert "1.num_batches_tracked" not in la.names and "1.running_mean" in la.names
    expected = {k: v.clone() for k, v in net.state_dict().items() if v.is_floating_point()}
    for decay in (0.1, 0.6):
        net(torch.randn(8, 3, 6, 6)).sum().backward()  # BN running stats move
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(0.1 * p.grad)
        for name, live in net.state_dict().items():
            if live.is_floating_point():
                expected[name].lerp_(live, 1 - decay)
        la.update(decay)
        for name, live in net.state_dict().items():
            if live.is_floating_point():
                assert torch.equal(live, expected[name]), name


def test_lookahead_off_never_touches_the_weights(monkeypatch, tiny):
    def boom(*a, **k):
        raise AssertionError("Lookahead used although lookahead=false")
    monkeypatch.setattr(in_memory_loop, "Lookahead", boom)  # the shared loop makes the cifar family's
    cifar.train_run(small_cfg(lookahead=False), tiny, CPU, seed=0)


def test_lookahead_on_is_its_only_effect(monkeypatch, tiny):
    """With Lookahead's update replaced by a no-op, lookahead=true trains exactly like lookahead=false."""
    off = cifar.train_run(small_cfg(lookahead=False, epochs=0.5), tiny, CPU, seed=1)
    monkeypatch.setattr(lookahead_mod.Lookahead, "update", lambda self, decay: None)
    on = cifar.train_run(small_cfg(lookahead=True, epochs=0.5), tiny, CPU, seed=1)
    for a, b in zip(off.model.state_dict().values(), on.model.state_dict().values()):
        assert torch.equal(a, b)


# --- test-time augmentation ------------------------------------------------------------------------------

def test_tta_levels():
    torch.manual_seed(0)
    model = CifarNet(widths=(8, 8, 8)).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(tta_logits(model, x, 0), model(x))
        assert torch.allclose(tta_logits(model, x, 1), 0.5 * model(x) + 0.5 * model(x.flip(-1)), atol=1e-6)
        pad = F.pad(x, (1, 1, 1, 1), mode="reflect")
        views = [x, pad[..., :32, :32], pad[..., 2:, 2:]]
        mirrored = [0.5 * model(v) + 0.5 * model(v.flip(-1)) for v in views]
        expected = 0.5 * mirrored[0] + 0.25 * mirrored[1] + 0.25 * mirrored[2]
        assert torch.allclose(tta_logits(model, x, 2), expected, atol=1e-5)
    with pytest.raises(ValueError):
        tta_logits(model, x, 3)


# --- optimizers and schedule -----------------------------------------------------------------------------

def test_triangle_schedule_points():
    assert triangle(0, 100, 0.2, 0.23, 0.07) == pytest.approx(0.2)
    assert triangle(23, 100, 0.2, 0.23, 0.07) == pytest.approx(1.0)
    assert triangle(100, 100, 0.2, 0.23, 0.07) == pytest.approx(0.07)
    assert triangle(50, 100, 1.0, 0.0, 0.0) == pytest.approx(0.5)  # Muon: linear decay to 0


def test_decoupled_sgd_converts_lr_and_weight_decay():
    p = nn.Parameter(torch.ones(3))
    opt = decoupled_sgd([{"params": [p], "lr_mult": 2.0}], lr_per_1024=11.5, weight_decay_per_1024=0.0153,
                        momentum=0.85, batch_size=1024)
    scale = 1024 * (1 + 1 / 0.15)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(2 * 11.5 / scale)
    assert group["lr"] * group["weight_decay"] == pytest.approx(0.0153 * 1024 / scale)  # per-step shrink
    assert group["nesterov"] and group["momentum"] == 0.85


def test_newton_schulz_orthogonalizes():
    g = torch.randn(16, 72, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g, steps=5, dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.3  # the quintic iteration's band, not exactly 1
    assert newton_schulz(g.T, steps=5, dtype=torch.float32).shape == (72, 16)


def test_muon_step_renormalizes_and_moves_weights():
    w = nn.Parameter(torch.randn(8, 4, 3, 3))
    opt = Muon([w], lr=0.1, momentum=0.6)
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(before, w)
    # after the renormalization to sqrt(8) the update of spectral norm ~1 moves it by at most lr * ~1.3 * sqrt(8)
    assert abs(w.norm().item() - 8**0.5) < 0.1 * 1.3 * 8**0.5


# --- precision / layout / compile ------------------------------------------------------------------------

def test_system_tricks_off_are_identity():
    net = nn.Linear(2, 2)
    assert precision.maybe_compile(net, False) is net
    assert precision.to_channels_last(net, False) is net
    assert precision.resolve_precision("auto", CPU) == "fp32"
    with precision.autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError):
        precision.resolve_precision("fp8", CPU)


@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cpu", True), ("auto", "cuda", True), ("auto", "mps", False),  # measured faster on CPU: step_time.py
    ("on", "mps", True), ("off", "cpu", False), ("off", "cuda", False), ("on", "cpu", True)])
def test_resolve_channels_last(setting, device, expected):
    assert precision.resolve_channels_last(setting, torch.device(device)) is expected


def test_resolve_channels_last_rejects_unknown_setting():
    with pytest.raises(ValueError, match="channels_last must be one of"):
        precision.resolve_channels_last("nhwc", CPU)
