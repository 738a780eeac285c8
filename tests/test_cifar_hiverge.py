"""Hiverge's 2025 record as switches of the cifar family (selective TTA, batched Newton-Schulz, renormalization at
an interval, brightness/contrast jitter, SiLU, SVD whitening) and the recipe cifar10-94-hiverge: each switch off is
exactly today's code path, each switch on does what it says."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedrun.data.augment import translate
from speedrun.data.loader import Normalization, normalize
from speedrun.engine import loop as engine_loop
from speedrun.engine.loop import evaluate
from speedrun.models import CifarNet
from speedrun.recipes import cifar, get_recipe
from speedrun.recipes.cifar import loop as cifar_loop
from speedrun.run.runner import make_config
from speedrun.tricks import color_jitter, whitening
from speedrun.tricks.muon import Muon, newton_schulz, newton_schulz_batched
from speedrun.tricks.tta import least_confident, passes, selected_count, selective_tta_logits, tta_logits

from conftest import make_tiny

CPU = torch.device("cpu")
# The keys TRICKS gained for the record, and what cifar10-94-hiverge sets them to.
HIVERGE_SWITCHES = {"tta_select": 0.25, "activation": "silu", "whiten_method": "svd", "jitter_brightness": 0.05,
                    "jitter_contrast": 0.05, "muon_ns_batched": True, "muon_renorm_every_steps": 2}


def small_cfg(base=None, **kw):
    small = dict(batch_size=32, epochs=0.25, widths=(8, 16, 16), whiten_images=64, eval_each_epoch=False)
    return dataclasses.replace(base or cifar.cifar10_94_muon(), **(small | kw))


def make_data(n_train=128, n_test=32):
    return make_tiny(n_train=n_train, n_test=n_test)


def same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- Muon: batched Newton-Schulz and renormalization at an interval ----------------------------------------------

def filter_banks(seed=0):
    """Conv-shaped weights (c_out, c_in, 3, 3) of several sizes, one of them tall as a matrix (c_out > 9 c_in)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (16, 16, 3, 3), (40, 4, 3, 3), (2, 1, 3, 3)]
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def reference_muon_steps(params, grads, lr, mu, ns_steps):
    """The per-bank Muon rule written out: momentum, Nesterov direction, renormalize every step, orthogonalize."""
    params = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, buf, grad in zip(params, bufs, step_grads):
            buf.mul_(mu).add_(grad)
            g = grad.add(buf, alpha=mu)
            p.mul_(len(p) ** 0.5 / p.norm())
            p.add_(newton_schulz(g.reshape(len(g), -1), ns_steps, torch.float32).view_as(g), alpha=-lr)
    return params


def run_muon(params, grads, **kw):
    opt = Muon(params, lr=0.1, momentum=0.6, ns_steps=3, **kw)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()
    return opt


def step_grads(params, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def test_muon_with_both_switches_off_is_the_per_bank_per_step_rule_bitwise():
    params = filter_banks()
    grads = step_grads(params)
    expected = reference_muon_steps(params, grads, lr=0.1, mu=0.6, ns_steps=3)
    opt = run_muon(params, grads)
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    # and the optimizer's state is as it was: only momentum buffers (a checkpoint of it reads as before)
    assert all(set(s) == {"momentum_buffer"} for s in opt.state.values())


@pytest.mark.parametrize("shapes", [[(8, 27), (16, 72)], [(40, 36), (8, 27), (16, 144)], [(5, 5)], [(30, 4), (3, 9)]])
def test_batched_newton_schulz_equals_per_matrix_newton_schulz(shapes):
    g = torch.Generator().manual_seed(len(shapes))
    gs = [torch.randn(s, generator=g) for s in shapes]
    batched = newton_schulz_batched(gs, 5, torch.float32)
    for x, out in zip(gs, batched):
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.allclose(out, newton_schulz(x, 5, torch.float32), atol=2e-5)


def test_muon_batched_step_equals_the_looped_step():
    looped, batched = filter_banks(), filter_banks()
    grads = step_grads(looped)
    run_muon(looped, grads)
    run_muon(batched, grads, batched=True)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(looped, batched))
    assert not all(torch.equal(a, b) for a, b in zip(filter_banks(), batched))  # it did move the weights


@pytest.mark.parametrize("every", [1, 2, 3])
def test_renormalization_happens_before_every_kth_step_only(every):
    """lr = 0 leaves only the renormalization: the norm is reset to sqrt(c_out) on steps 0, K, 2K ..., and a
    scaled-up weight keeps its norm on the steps in between."""
    w = nn.Parameter(torch.randn(8, 4, 3, 3) * 3)
    opt = Muon([w], lr=0.0, momentum=0.6, renorm_every_steps=every)
    for step in range(7):
        with torch.no_grad():
            w.mul_(2.0)
        before = w.norm().item()
        w.grad = torch.randn_like(w)
        opt.step()
        expected = 8**0.5 if step % every == 0 else before
        assert w.norm().item() == pytest.approx(expected, rel=1e-5), step


def test_renormalization_interval_resumes_from_the_optimizer_state():
    """A run interrupted after step 1 and resumed from the optimizer's state renormalizes on the same steps."""
    params, grads = filter_banks(), step_grads(filter_banks(), steps=5)
    whole = run_muon([nn.Parameter(p.detach().clone()) for p in params], grads, renorm_every_steps=3)
    first = [nn.Parameter(p.detach().clone()) for p in params]
    saved = run_muon(first, grads[:2], renorm_every_steps=3).state_dict()
    second = Muon(first, lr=0.1, momentum=0.6, ns_steps=3, renorm_every_steps=3)
    second.load_state_dict(saved)
    for step_grads_ in grads[2:]:
        for p, grad in zip(first, step_grads_):
            p.grad = grad.clone()
        second.step()
    whole_params = [p for group in whole.param_groups for p in group["params"]]
    assert all(torch.equal(a, b) for a, b in zip(first, whole_params))


def test_cifar10_94_muon_trains_bitwise_the_same_with_the_muon_switches_at_their_off_values(monkeypatch):
    """Off is the code path without them: Muon built with batched=False, K=1 trains as the reference rule does."""
    base = small_cfg(epochs=0.5)
    a = cifar.train_run(base, make_data(), CPU, seed=0)

    def boom(*args, **kwargs):
        raise AssertionError("batched Newton-Schulz ran although muon_ns_batched=false")
    monkeypatch.setattr("speedrun.tricks.muon.newton_schulz_batched", boom)
    b = cifar.train_run(base, make_data(), CPU, seed=0)
    assert same_weights(a, b)


def test_muon_switches_on_change_the_run_and_train_finitely():
    base = small_cfg(epochs=0.5)
    off = cifar.train_run(base, make_data(), CPU, seed=0)
    for change in ({"muon_ns_batched": True}, {"muon_renorm_every_steps": 2}):
        on = cifar.train_run(dataclasses.replace(base, **change), make_data(), CPU, seed=0)
        assert all(torch.isfinite(p).all() for p in on.model.parameters())
        assert not same_weights(off, on), change


# --- whitening by SVD ------------------------------------------------------------------------------------------

def smooth_images(channels, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, channels, 10, 10, generator=g)
    return F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), 3, stride=1) + 0.3 * x.mean(1, keepdim=True)


@pytest.mark.parametrize("channels,k", [(3, 2), (1, 2), (3, 3), (2, 1)])
def test_svd_whitening_equals_eigh_whitening_up_to_each_filters_sign(channels, k):
    x = smooth_images(channels)
    d = channels * k * k
    eps = 1e-6
    convs = {m: nn.Conv2d(channels, 2 * d, k, bias=False) for m in ("eigh", "svd")}
    for method, conv in convs.items():
        whitening.patch_whitening_init_(conv, x, eps=eps, method=method)
    w_eigh, w_svd = (convs[m].weight[:d].reshape(d, d).double() for m in ("eigh", "svd"))
    # what no choice of signs or basis changes: W^T W = (Sigma + eps I)^-1 for both
    sigma = whitening.patch_covariance(x, k)
    inverse = torch.linalg.inv(sigma + eps * torch.eye(d, dtype=sigma.dtype))
    for w in (w_eigh, w_svd):
        assert torch.allclose(w.T @ w, inverse, rtol=1e-4, atol=1e-4 * inverse.abs().max().item())
    # each filter is the other's up to sign (the smooth images' eigenvalues are distinct), largest first in both
    cosine = (w_eigh * w_svd).sum(1) / (w_eigh.norm(dim=1) * w_svd.norm(dim=1))
    assert torch.allclose(cosine.abs(), torch.ones(d, dtype=cosine.dtype), atol=1e-4)
    assert torch.allclose(w_eigh.norm(dim=1), w_svd.norm(dim=1), rtol=1e-4)
    assert torch.equal(convs["svd"].weight[d:], -convs["svd"].weight[:d])


def test_eigh_whitening_is_the_default_and_an_unknown_method_is_refused():
    x = smooth_images(3)
    a, b = nn.Conv2d(3, 24, 2, bias=False), nn.Conv2d(3, 24, 2, bias=False)
    whitening.patch_whitening_init_(a, x)
    whitening.patch_whitening_init_(b, x, method="eigh")
    assert torch.equal(a.weight, b.weight)
    with pytest.raises(ValueError, match="whiten_method must be one of eigh, svd"):
        whitening.patch_whitening_init_(b, x, method="qr")


def test_whiten_method_off_never_calls_the_svd(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("SVD whitening ran although whiten_method=eigh")
    monkeypatch.setattr(whitening, "svd_whitening_filters", boom)
    cifar.train_run(small_cfg(), make_data(), CPU, seed=0)


# --- loop-free crops ---------------------------------------------------------------------------------------------

def looped_crops(images, dy, dx, pad_px):
    """Per-shift crops (airbench's batch_crop idea): reflect-pad once, then one slice per distinct (dy, dx)."""
    padded = F.pad(images.float(), (pad_px,) * 4, mode="reflect").to(images.dtype)
    out = torch.empty_like(images)
    h, w = images.shape[-2:]
    for sy in range(-pad_px, pad_px + 1):
        for sx in range(-pad_px, pad_px + 1):
            mask = (dy == sy) & (dx == sx)
            out[mask] = padded[mask, :, pad_px + sy:pad_px + sy + h, pad_px + sx:pad_px + sx + w]
    return out


@pytest.mark.parametrize("pad_px,shape", [(1, (3, 8, 8)), (2, (3, 32, 32)), (4, (1, 9, 7))])
def test_the_loaders_one_gather_crops_equal_per_shift_looped_crops(pad_px, shape):
    """Hiverge's loop-free batch crops are what the loader's translate already does: one gather per batch."""
    g = torch.Generator().manual_seed(pad_px)
    images = torch.randint(0, 256, (64, *shape), generator=g, dtype=torch.uint8)
    dy, dx = torch.randint(-pad_px, pad_px + 1, (2, 64), generator=g)
    assert torch.equal(translate(images, dy, dx, pad_px), looped_crops(images, dy, dx, pad_px))


# --- brightness / contrast jitter --------------------------------------------------------------------------------

def test_jitter_brightness_shifts_and_contrast_scales_each_image():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 5, 5, generator=g)
    std = torch.tensor([0.25, 0.5, 0.2])
    offsets, factors = color_jitter.jitter_draws(seed=3, step=7, batch_size=6, brightness=0.1, contrast=0.2)
    assert offsets.abs().max() <= 0.1 and (factors - 1).abs().max() <= 0.2 and offsets.abs().min() > 0
    out = color_jitter.brightness_contrast(x, offsets, factors, std)
    mean_in, mean_out = x.mean((2, 3)), out.mean((2, 3))  # (B, C)
    assert torch.allclose(mean_out - mean_in, offsets.view(6, 1) / std.view(1, 3), atol=1e-5)
    assert torch.allclose(out - mean_out[..., None, None], (x - mean_in[..., None, None]) * factors.view(6, 1, 1, 1),
                          atol=1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_jitter_draws_are_a_function_of_seed_and_step_and_a_share_is_a_slice_of_the_global_batch():
    a = color_jitter.jitter_draws(1, 5, 8, 0.1, 0.1)
    assert all(torch.equal(u, v) for u, v in zip(a, color_jitter.jitter_draws(1, 5, 8, 0.1, 0.1)))
    assert not torch.equal(a[0], color_jitter.jitter_draws(1, 6, 8, 0.1, 0.1)[0])
    assert not torch.equal(a[0], color_jitter.jitter_draws(2, 5, 8, 0.1, 0.1)[0])
    x = torch.randn(8, 3, 4, 4)
    std = torch.ones(3)
    whole = color_jitter.jitter_batch(x, seed=1, step=5, batch_size=8, brightness=0.1, contrast=0.1, std=std)
    part = color_jitter.jitter_batch(x[2:6], seed=1, step=5, batch_size=8, brightness=0.1, contrast=0.1, std=std,
                                     share=slice(2, 6))
    assert torch.equal(whole[2:6], part)


def test_jitter_table_equals_the_per_step_jitter_bit_for_bit_with_shares():
    x = torch.randn(8, 3, 4, 4)
    std = torch.tensor([0.25, 0.5, 0.2])
    table = color_jitter.JitterTable(seed=2, steps=5, batch_size=8, brightness=0.1, contrast=0.2, std=std,
                                     device=torch.device("cpu"), dtype=torch.float32)
    part = color_jitter.JitterTable(seed=2, steps=5, batch_size=8, brightness=0.1, contrast=0.2, std=std,
                                    device=torch.device("cpu"), dtype=torch.float32, share=slice(2, 6))
    for step in range(5):
        expected = color_jitter.jitter_batch(x, seed=2, step=step, batch_size=8, brightness=0.1, contrast=0.2,
                                             std=std)
        assert torch.equal(table(x, step), expected)
        assert torch.equal(part(x[2:6], step), expected[2:6])


def test_jitter_off_never_touches_the_batches(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("jitter ran although jitter_brightness = jitter_contrast = 0")
    monkeypatch.setattr(cifar_loop, "JitterTable", boom)
    cifar.train_run(small_cfg(), make_data(), CPU, seed=0)


def test_jitter_on_is_its_only_effect(monkeypatch):
    """With the jitter replaced by the identity, jitter on trains bitwise like jitter off: it draws from its own
    generator and changes nothing else."""
    off = cifar.train_run(small_cfg(epochs=0.5), make_data(), CPU, seed=1)
    calls = []

    class Identity:
        def __init__(self, **kwargs):
            pass

        def __call__(self, inputs, step):
            calls.append(step)
            return inputs

    monkeypatch.setattr(cifar_loop, "JitterTable", Identity)
    on = cifar.train_run(small_cfg(epochs=0.5, jitter_brightness=0.1, jitter_contrast=0.1), make_data(), CPU, seed=1)
    assert same_weights(off, on)
    assert calls == list(range(on.steps))  # once per step, with the step's number


# --- SiLU ----------------------------------------------------------------------------------------------------------

def test_activation_switch_builds_silu_and_its_off_value_is_gelu():
    def kinds(cfg):
        return {type(m) for m in cifar.build_model(cfg, 3, 10).modules()} & {nn.GELU, nn.SiLU}
    assert kinds(small_cfg()) == {nn.GELU}
    assert kinds(small_cfg(activation="silu")) == {nn.SiLU}
    assert dict((k, off) for k, off, _ in cifar.TRICKS)["activation"] == "gelu"


# --- selective TTA -------------------------------------------------------------------------------------------------

def eval_net(seed=0):
    torch.manual_seed(seed)
    net = CifarNet(widths=(8, 8, 8), logit_scale=1.0)
    net.train()
    with torch.no_grad():  # a batch through in train mode gives BatchNorm statistics other than the init's
        net(torch.randn(64, 3, 32, 32))
    return net.eval()


def _whole_set(net, x, level, fraction, batch_size):
    return selective_tta_logits(net, lambda idx: x[idx], len(x), level, fraction, batch_size)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_tta_select_one_is_full_tta_exactly(level):
    net, x = eval_net(), torch.randn(12, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(_whole_set(net, x, level, 1.0, 12), tta_logits(net, x, level))


@pytest.mark.parametrize("level,fraction", [(1, 0.25), (2, 0.25), (2, 0.5), (2, 0.01), (1, 0.9)])
def test_tta_select_augments_the_least_confident_images_of_the_whole_set_only(level, fraction):
    net, x = eval_net(level), torch.randn(20, 3, 32, 32)
    with torch.no_grad():
        plain, full = net(x), tta_logits(net, x, level)
        out = _whole_set(net, x, level, fraction, 7)  # batches of 7, 7, 6: the selection spans them
    k = max(1, math.ceil(fraction * len(x)))
    assert selected_count(len(x), fraction) == k
    confidence = plain.softmax(1).amax(1)
    chosen = set(confidence.argsort()[:k].tolist())
    assert chosen == set(least_confident(plain, fraction).tolist())
    for i in range(len(x)):
        if i in chosen:  # the same views and weights as full TTA
            assert torch.allclose(out[i], full[i], atol=1e-5), i
            assert not torch.allclose(out[i], plain[i], atol=1e-6), i
        else:  # the plain prediction
            assert torch.allclose(out[i], plain[i], atol=1e-6), i
    # the least confident of the unchosen is at least as confident as the most confident chosen one
    assert min(confidence[i] for i in range(len(x)) if i not in chosen) >= max(confidence[i] for i in chosen)


def test_selective_tta_does_not_depend_on_the_batch_size():
    """The selection is over the whole set: batches of 1, 3, 7 and 40 choose the same images and give the same
    predictions (a per-batch selection would give a lone image all the views)."""
    net, x = eval_net(3), torch.randn(40, 3, 32, 32)
    with torch.no_grad():
        outs = [_whole_set(net, x, 2, 0.25, b) for b in (1, 3, 7, 40)]
    for out in outs[1:]:
        assert torch.equal(out.argmax(1), outs[0].argmax(1))
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


def test_evaluate_with_tta_select_scores_the_whole_set_at_any_batch_size():
    net, data = eval_net(4), make_data(n_test=50)
    kwargs = dict(normalization=Normalization(torch.zeros(3), torch.ones(3)), tta_level=2)
    scores = {b: evaluate(net, data.test_images, data.test_labels, batch_size=b, tta_select=0.25, **kwargs)
              for b in (1, 8, 2000)}
    assert len(set(scores.values())) == 1
    x = normalize(data.test_images, torch.zeros(3), torch.ones(3), torch.float32, False)
    with torch.no_grad():
        by_hand = _whole_set(net, x, 2, 0.25, 50).argmax(1)
    assert scores[8] == int((by_hand == data.test_labels).sum()) / 50


@pytest.mark.parametrize("level,fraction", [(0, 1.0), (1, 1.0), (2, 1.0), (2, 0.25), (1, 0.5), (0, 0.25)])
def test_the_passes_each_batch_reports_sum_to_passes_as_evaluate_and_the_whole_set_count_them(level, fraction):
    """What progress and its estimate count (tricks/tta.py's passes): every forward pass of one image, each batch's
    share reported as it ends, by selective_tta_logits and by evaluate alike."""
    net, data = eval_net(5), make_data(n_test=20)
    x = normalize(data.test_images, torch.zeros(3), torch.ones(3), torch.float32, False)
    counted, seen = [], []
    with torch.no_grad():
        selective_tta_logits(net, lambda idx: x[idx], 20, level, fraction, 7, counted.append)
    evaluate(net, data.test_images, data.test_labels, normalization=Normalization(torch.zeros(3), torch.ones(3)),
             tta_level=level, batch_size=7, tta_select=fraction, on_batch=seen.append)
    views = {0: 1, 1: 2, 2: 6}[level]
    expected = 20 * views if fraction >= 1 or level == 0 else 20 + selected_count(20, fraction) * (views - 1)
    assert sum(counted) == sum(seen) == passes(20, level, fraction) == expected
    assert len(counted) == (3 if fraction >= 1 or level == 0 else 3 + math.ceil(selected_count(20, fraction) / 7))


def test_tta_select_off_scores_as_full_tta(monkeypatch):
    data = make_data()
    cfg = small_cfg(tta_level=2)
    whole = cifar.train_run(dataclasses.replace(cfg, tta_select=1.0), data, CPU, seed=0)

    def boom(*args, **kwargs):
        raise AssertionError("selective TTA used although tta_select=0")
    monkeypatch.setattr(engine_loop, "selective_tta_logits", boom)
    full = cifar.train_run(cfg, data, CPU, seed=0)
    assert whole.accuracy == full.accuracy and same_weights(full, whole)
    assert cifar.train_run(dataclasses.replace(cfg, tta_select=None), data, CPU, seed=0).accuracy == full.accuracy


def test_selective_tta_is_described_in_the_timed_region_and_its_views_counted():
    cfg = small_cfg(tta_level=2, tta_select=0.25)
    assert "on the 25% least confident test images" in cifar.timed_region(cfg)
    assert "least confident" not in cifar.timed_region(small_cfg(tta_level=2))
    assert "least confident" not in cifar.timed_region(small_cfg(tta_level=2, tta_select=1.0))
    data = make_data(n_test=10_000)  # scoring then outweighs training: the note names the views
    assert "x 2.25 TTA views" in " ".join(cifar.notes(cfg, data))
    assert "x 6 TTA views" in " ".join(cifar.notes(small_cfg(tta_level=2), data))


def test_selective_tta_flops_count_the_plain_pass_and_the_selected_shares_other_views():
    data = make_data(n_test=100)
    plain, full = (cifar.flops(small_cfg(tta_level=level), data).evaluation for level in (0, 2))
    quarter = cifar.flops(small_cfg(tta_level=2, tta_select=0.25), data)
    assert full == 6 * plain and quarter.evaluation == plain + round(0.25 * 5 * plain)
    assert "25 of the 100 test images" in quarter.counted
    # ceil(0.25 * 10) = 3 of 10 images get the views: the count is the code's, not 2.5 images' worth
    ten = make_data(n_test=10)
    one = cifar.flops(small_cfg(tta_level=2, tta_select=0.0), ten).evaluation // 60  # one forward of one image
    assert cifar.flops(small_cfg(tta_level=2, tta_select=0.25), ten).evaluation == 10 * one + 3 * 5 * one
    assert cifar.flops(small_cfg(tta_level=2, tta_select=1.0), data).evaluation == full


# --- settings: validation, TRICKS, the recipe ---------------------------------------------------------------------

@pytest.mark.parametrize("key,bad", [("tta_select", -0.1), ("tta_select", 1.5), ("muon_renorm_every_steps", 0),
                                     ("muon_renorm_every_steps", 2.0), ("jitter_brightness", -0.01),
                                     ("jitter_brightness", 1.5), ("jitter_contrast", -1.0), ("jitter_contrast", 2.0),
                                     ("whiten_method", "qr")])
def test_each_new_setting_out_of_range_is_refused_in_one_line(key, bad):
    with pytest.raises(ValueError, match=f"^bad config: .*{key}") as err:
        dataclasses.replace(cifar.cifar10_94(), **{key: bad}).validate()
    assert "\n" not in str(err.value)


def test_the_new_settings_are_refused_from_set_too():
    recipe = get_recipe("cifar10-94-hiverge")
    for key, text in (("tta_select", "2"), ("muon_renorm_every_steps", "0"), ("whiten_method", "qr")):
        with pytest.raises(ValueError, match=key):
            make_config(recipe, None, {key: text}).validate()


def test_tricks_lists_every_switch_off_by_default_and_on_in_the_hiverge_recipe():
    offs = {key: off for key, off, _ in cifar.TRICKS}
    assert set(HIVERGE_SWITCHES) <= set(offs)
    default, muon, hiverge = cifar.cifar10_94(), cifar.cifar10_94_muon(), cifar.cifar10_94_hiverge()
    for key, on in HIVERGE_SWITCHES.items():
        assert getattr(default, key) == offs[key] and getattr(muon, key) == offs[key], key  # today's behaviour
        assert getattr(hiverge, key) == on != offs[key], key


def test_cifar10_94_hiverge_is_the_muon_recipe_with_the_readmes_values_and_the_switches():
    hiverge, muon = cifar.cifar10_94_hiverge(), cifar.cifar10_94_muon()
    hiverge.validate()
    retuned = {"batch_size": 1536, "epochs": 7.59, "label_smoothing": 0.09, "muon_lr": 0.205, "muon_momentum": 0.655}
    for key, value in retuned.items():
        assert getattr(hiverge, key) == value, key
    differs = {f.name for f in dataclasses.fields(hiverge) if getattr(hiverge, f.name) != getattr(muon, f.name)}
    assert differs == set(retuned) | set(HIVERGE_SWITCHES)
    recipe = get_recipe("cifar10-94-hiverge")
    assert recipe.family == "cifar" and recipe.make_config() == hiverge
    assert "hiverge/cifar10-speedrun" in cifar.cifar10_94_hiverge.__doc__


def test_cifar10_94_hiverge_trains_on_cpu_with_every_switch_on():
    """The recipe's own settings (tta level 2 on a quarter of the test images, jitter, SVD whitening, batched NS,
    renormalization every 2 steps) at a small width, 4 steps."""
    data = make_data(n_train=128, n_test=64)
    cfg = dataclasses.replace(cifar.cifar10_94_hiverge(), batch_size=32, widths=(8, 16, 16), whiten_images=64,
                              eval_each_epoch=False)
    result = cifar.train_run(cifar.with_epochs(cfg, 1.0), data, CPU, seed=0)
    assert result.steps == 4 and 0.0 <= result.accuracy <= 1.0
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    assert isinstance(result.model.act, nn.SiLU)


def test_speedrun_train_cifar10_94_hiverge_smoke(tmp_path, capsys):
    from speedrun.cli.program import main
    out = tmp_path / "r.json"
    assert main(["train", "cifar10-94-hiverge", "--dataset", "synthetic:train=256,test=64", "--device", "cpu",
                 "--smoke", "--quiet", "--set", "widths=8,8,8", "--set", "whiten_images=32", "--json",
                 str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["recipe"] == "cifar10-94-hiverge" and result["config"]["muon_ns_batched"] is True
