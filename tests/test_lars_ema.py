"""tricks/lars.py (LARS, LAMB) and tricks/ema.py (weight EMA): hand-computed steps, exact equivalences, resume."""

import contextlib
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedrun.tricks.ema import WeightEma, decay_for_half_life, make_ema
from speedrun.tricks.lars import Lamb, Lars


def quadratic_grad(w: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> None:
    """w.grad of scale * 0.5 * ||w - target||^2, i.e. scale * (w - target), through autograd."""
    w.grad = None
    (scale * 0.5 * (w - target).pow(2).sum()).backward()


# --- LARS ------------------------------------------------------------------------------------------------

def test_lars_first_steps_match_a_hand_computation():
    # w = (3, 4): ||w|| = 5; target (3, 3): g = (0, 1), ||g|| = 1.
    w = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    target = torch.tensor([3.0, 3.0], dtype=torch.float64)
    opt = Lars([w], lr=2.0, momentum=0.5, weight_decay=0.1, trust_coefficient=0.01, eps=0.0)
    quadratic_grad(w, target)
    opt.step()
    # local = 0.01 * 5 / (1 + 0.1 * 5) = 1/30; d = (g + 0.1 w) / 30 = (0.3, 1.4) / 30; buf = d; w -= 2 * d
    assert torch.allclose(w.detach(), torch.tensor([2.98, 4 - 2.8 / 30], dtype=torch.float64), rtol=0, atol=1e-12)
    d1 = torch.tensor([0.3, 1.4], dtype=torch.float64) / 30
    w1 = w.detach().clone()
    quadratic_grad(w, target)
    opt.step()
    g = w1 - target
    local = 0.01 * w1.norm() / (g.norm() + 0.1 * w1.norm())
    buf = 0.5 * d1 + local * (g + 0.1 * w1)
    assert torch.allclose(w.detach(), w1 - 2.0 * buf, rtol=0, atol=1e-12)


def test_lars_nesterov_step_by_hand():
    w = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lars([w], lr=1.0, momentum=0.9, trust_coefficient=0.02, eps=0.0, nesterov=True)
    w.grad = torch.tensor([0.0, 2.0], dtype=torch.float64)
    opt.step()
    # local = 0.02 * 5 / 2 = 0.05; d = (0, 0.1); first buf = d; Nesterov step = d + 0.9 d = (0, 0.19)
    assert torch.allclose(w.detach(), torch.tensor([3.0, 3.81], dtype=torch.float64), rtol=0, atol=1e-12)


def _twin_params() -> tuple[nn.Parameter, nn.Parameter]:
    """Two equal (4, 3) parameters: ours, and a reference for torch's own optimizer."""
    torch.manual_seed(0)
    ours, ref = [nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    with torch.no_grad():
        ref.copy_(ours)
    return ours, ref


def _assert_same_steps(ours, ref, our_opt, ref_opt, steps: int = 5) -> None:
    """The same gradients into both optimizers, step by step: the parameters stay bitwise equal."""
    for step in range(steps):
        grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        ours.grad, ref.grad = grad.clone(), grad.clone()
        our_opt.step()
        ref_opt.step()
        assert torch.equal(ours, ref), step


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_lars_unadapted_group_is_torch_sgd_exactly(nesterov, weight_decay):
    ours, ref = _twin_params()
    lars = Lars([{"params": [ours], "adapt": False}], lr=0.1, momentum=0.9, weight_decay=weight_decay,
                nesterov=nesterov)
    sgd = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=weight_decay, nesterov=nesterov)
    _assert_same_steps(ours, ref, lars, sgd)


def test_lars_step_is_invariant_to_the_loss_scale():
    """With wd 0 the adapted step does not depend on ||g||: a loss x1000 gives the same trajectory."""
    torch.manual_seed(0)
    start, target = torch.randn(6, 5), torch.randn(6, 5)
    runs = []
    for scale in (1.0, 1000.0):
        w = nn.Parameter(start.clone())
        opt = Lars([w], lr=5.0, momentum=0.9)
        for _ in range(3):
            quadratic_grad(w, target, scale)
            opt.step()
        runs.append(w.detach())
    assert not torch.equal(runs[0], start)
    assert torch.allclose(runs[0], runs[1], rtol=1e-5, atol=1e-7)


def test_lars_step_scales_with_the_weights():
    """Same gradient, weights x10: the trust ratio, and so the step, grows x10 (wd 0, eps 0)."""
    torch.manual_seed(0)
    w0, grad = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    moves = []
    for c in (1.0, 10.0):
        w = nn.Parameter(c * w0)
        w.grad = grad.clone()
        Lars([w], lr=3.0, momentum=0.9, eps=0.0).step()
        moves.append(c * w0 - w.detach())
    assert torch.allclose(moves[1], 10 * moves[0], rtol=1e-9)
    # the first step's size is lr * trust_coefficient * ||w||, whatever g is
    assert moves[0].norm().item() == pytest.approx(3.0 * 0.001 * w0.norm().item(), rel=1e-9)


def test_lars_zero_norms_fall_back_to_ratio_one():
    zero = nn.Parameter(torch.zeros(3))
    still = nn.Parameter(torch.tensor([1.0, 2.0, 2.0]))  # zero gradient: d = wd * w, ratio 1
    zero.grad = torch.tensor([1.0, -2.0, 0.5])
    still.grad = torch.zeros(3)
    Lars([zero, still], lr=0.1, momentum=0.9, weight_decay=0.01).step()
    assert torch.isfinite(zero).all() and torch.isfinite(still).all()
    assert torch.allclose(zero.detach(), torch.tensor([-0.1, 0.2, -0.05]))
    assert torch.allclose(still.detach(), torch.tensor([1.0, 2.0, 2.0]) * (1 - 0.1 * 0.01))


# --- LAMB ------------------------------------------------------------------------------------------------

def test_lamb_first_step_matches_a_hand_computation():
    w = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lamb([w], lr=0.1, weight_decay=0.1)
    w.grad = torch.tensor([0.0, 1.0], dtype=torch.float64)
    opt.step()
    # step 1: m_hat = g, v_hat = g^2, so r = g / (|g| + eps) + wd w = (0.3, 1/(1 + 1e-6) + 0.4)
    r = torch.tensor([0.3, 1 / (1 + 1e-6) + 0.4], dtype=torch.float64)
    expected = torch.tensor([3.0, 4.0], dtype=torch.float64) - 0.1 * (5 / r.norm()) * r
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-12)
    assert w.detach()[1].item() == pytest.approx(4 - 0.1 * 5 * 1.4 / math.sqrt(2.05), rel=1e-6)


def test_lamb_step_scales_with_the_weights():
    """wd 0: r is the Adam direction, independent of w, and the step has norm lr * ||w|| exactly on step 1."""
    torch.manual_seed(0)
    w0, grad = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    moves = []
    for c in (1.0, 10.0):
        w = nn.Parameter(c * w0)
        w.grad = grad.clone()
        Lamb([w], lr=0.01).step()
        moves.append(c * w0 - w.detach())
    assert torch.allclose(moves[1], 10 * moves[0], rtol=1e-9)
    assert moves[0].norm().item() == pytest.approx(0.01 * w0.norm().item(), rel=1e-9)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_lamb_unadapted_group_is_torch_adamw_exactly(weight_decay):
    """Ratio 1 and r = m_hat/(sqrt(v_hat)+eps) + wd*w is AdamW's step; with wd 0 it is plain Adam."""
    ours, ref = _twin_params()
    lamb = Lamb([{"params": [ours], "adapt": False}], lr=0.01, weight_decay=weight_decay)
    cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    adam = cls([ref], lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay)
    _assert_same_steps(ours, ref, lamb, adam)


def test_lamb_zero_norms_give_a_finite_step():
    zero = nn.Parameter(torch.zeros(3))
    quiet = nn.Parameter(torch.ones(3))
    zero.grad, quiet.grad = torch.tensor([1.0, -2.0, 0.5]), torch.zeros(3)
    Lamb([zero, quiet], lr=0.1).step()
    assert torch.allclose(zero.detach(), torch.tensor([-0.1, 0.1, -0.1]), atol=1e-5)  # ratio 1: -lr * sign(g)
    assert torch.equal(quiet.detach(), torch.ones(3))  # r = 0 (no gradient, no decay): no move


# --- shared: groups, lr schedule, resume -------------------------------------------------------------------

def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def groups_of(net, lr):
    decay = [p for p in net.parameters() if p.ndim > 1]
    rest = [p for p in net.parameters() if p.ndim <= 1]  # BN scales/shifts and biases
    return [{"params": decay, "initial_lr": lr},
            {"params": rest, "adapt": False, "weight_decay": 0.0, "initial_lr": lr}]


OPTIMIZERS = {
    "lars": lambda groups: Lars(groups, lr=2.0, momentum=0.9, weight_decay=5e-4, nesterov=True),
    "lamb": lambda groups: Lamb(groups, lr=0.01, weight_decay=0.01),
}


def train_steps(net, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
        for group in opt.param_groups:  # what the recipes do with their schedule
            group["lr"] = group["initial_lr"] * (1 - step / 20)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_from_state_dict_is_bitwise_the_straight_run(name):
    straight = make_net()
    opt = OPTIMIZERS[name](groups_of(straight, 2.0))
    assert [g["initial_lr"] for g in opt.param_groups] == [2.0, 2.0]
    assert [g["adapt"] for g in opt.param_groups] == [True, False]
    train_steps(straight, opt, range(10))

    first = make_net()
    opt = OPTIMIZERS[name](groups_of(first, 2.0))
    train_steps(first, opt, range(5))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = make_net(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt = OPTIMIZERS[name](groups_of(resumed, 2.0))
    opt.load_state_dict(saved["optimizer"])
    assert [g["initial_lr"] for g in opt.param_groups] == [2.0, 2.0]
    train_steps(resumed, opt, range(5, 10))
    for (key, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), key


def test_optimizer_arguments_are_validated():
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="momentum"):
        Lars(p, lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="nesterov"):
        Lars(p, lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="trust_coefficient"):
        Lars(p, lr=0.1, trust_coefficient=0.0)
    with pytest.raises(ValueError, match="betas"):
        Lamb(p, lr=0.1, betas=(0.9, 1.5))


# --- weight EMA ------------------------------------------------------------------------------------------

def bn_net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(dtype)


def nudge(net, seed):
    """Move every parameter, and the BN running stats through a train-mode forward."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        net.train()
        net(torch.randn(8, 3, generator=g).to(next(net.parameters()).dtype))


def test_decay_for_half_life():
    d = decay_for_half_life(100)
    assert d**100 == pytest.approx(0.5)
    assert decay_for_half_life(1) == 0.5
    with pytest.raises(ValueError):
        decay_for_half_life(0)


def test_ema_averages_follow_the_hand_recursion_buffers_too():
    net = bn_net()
    ema = WeightEma(net, decay_per_step=0.8)
    expected = {k: v.double().clone() for k, v in net.state_dict().items() if v.is_floating_point()}
    for step in (1, 2, 3):
        nudge(net, step)
        assert ema.update(step)
        for k, v in net.state_dict().items():
            if v.is_floating_point():
                expected[k] = 0.8 * expected[k] + 0.2 * v.double()
    for k, v in expected.items():
        assert torch.allclose(ema.averages[k].double(), v, rtol=0, atol=1e-6), k
    assert not torch.allclose(ema.averages["1.running_mean"].double(), net.state_dict()["1.running_mean"].double())
    # integer buffers are copied, not averaged
    assert ema.averages["1.num_batches_tracked"].dtype == torch.int64
    assert ema.averages["1.num_batches_tracked"].item() == 3 == net[1].num_batches_tracked.item()


def test_ema_every_steps_uses_decay_to_the_power_every():
    net = bn_net()
    ema = WeightEma(net, decay_per_step=0.9, every_steps=3)
    w0 = net[0].weight.detach().clone()
    nudge(net, 1)
    assert not ema.update(1) and not ema.update(2)
    assert torch.equal(ema.averages["0.weight"], w0)  # steps 1, 2: nothing
    assert ema.update(3)
    d = 0.9**3
    assert torch.allclose(ema.averages["0.weight"], d * w0 + (1 - d) * net[0].weight.detach(), atol=1e-6)


def test_swapped_evaluates_the_averages_and_restores_the_live_weights_bitwise():
    net = bn_net()
    ema = WeightEma(net, decay_per_step=0.5)
    for step in (1, 2):
        nudge(net, step)
        ema.update(step)
    live = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(5, 3)
    with ema.swapped(net):
        for k, v in net.state_dict().items():
            assert torch.equal(v, ema.averages[k].to(v.dtype)), k
        net.train()
        net(x)  # a train-mode forward inside moves BN stats: they must still come back
    for k, v in net.state_dict().items():
        assert torch.equal(v, live[k]), k
    with pytest.raises(RuntimeError), ema.swapped(net):
        raise RuntimeError("evaluation failed")
    for k, v in net.state_dict().items():
        assert torch.equal(v, live[k]), k


def test_ema_of_a_bf16_model_keeps_fp32_averages():
    net = bn_net(torch.bfloat16)
    ema = WeightEma(net, decay_per_step=0.999)
    assert all(v.dtype == torch.float32 for k, v in ema.averages.items() if "num_batches" not in k)
    before = ema.averages["0.weight"].clone()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    ema.update(1)
    # a 0.001 move is below bf16 resolution near 1 but is kept in fp32
    moved = ema.averages["0.weight"] - before
    assert torch.allclose(moved, 0.001 * (net[0].weight.float() - before), atol=1e-6)
    ema.copy_to(net)
    assert net[0].weight.dtype == torch.bfloat16
    assert torch.equal(net[0].weight, ema.averages["0.weight"].to(torch.bfloat16))


def test_ema_state_dict_round_trip_and_shape_checks():
    net = bn_net()
    ema = WeightEma(net, decay_per_step=0.7)
    nudge(net, 1)
    ema.update(1)
    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)
    buffer.seek(0)
    other = WeightEma(bn_net(), decay_per_step=0.7)
    other.load_state_dict(torch.load(buffer))
    for k, v in ema.averages.items():
        assert torch.equal(other.averages[k], v) and other.averages[k].dtype == v.dtype, k
    state = ema.state_dict()
    state["averages"]["0.weight"] = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="'0.weight'"):
        other.load_state_dict(state)
    state = ema.state_dict()
    del state["averages"]["2.bias"]
    with pytest.raises(ValueError, match="2.bias"):
        other.load_state_dict(state)


def test_ema_arguments_are_validated_and_zero_decay_is_off():
    net = bn_net()
    assert make_ema(net, 0.0, 5) is None
    assert isinstance(make_ema(net, 0.99, 5), WeightEma)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="decay_per_step"):
            WeightEma(net, bad)
    with pytest.raises(ValueError, match="every_steps"):
        WeightEma(net, 0.9, every_steps=0)


def ema_loop(ema_decay, use_trick_code=True):
    """A small training loop with evaluations; use_trick_code=False is the loop with no EMA code at all."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ema = make_ema(net, ema_decay, every_steps=2) if use_trick_code else None
    x_eval = torch.randn(8, 4, generator=torch.Generator().manual_seed(99))
    evals = []
    for step in range(1, 9):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
        net.train()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if ema is not None:
            ema.update(step)
        if step % 4 == 0:
            net.eval()
            with ema.swapped(net) if ema is not None else contextlib.nullcontext(), torch.no_grad():
                evals.append(net(x_eval))
    return net, evals


def test_ema_off_is_an_exact_no_op_and_on_never_changes_training():
    plain, plain_evals = ema_loop(0.0, use_trick_code=False)
    off, off_evals = ema_loop(0.0)
    on, on_evals = ema_loop(0.9)
    for (k, a), b, c in zip(plain.state_dict().items(), off.state_dict().values(), on.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), k  # the live weights never see the average
    assert all(torch.equal(a, b) for a, b in zip(plain_evals, off_evals))
    assert not torch.allclose(on_evals[-1], plain_evals[-1])  # with the trick on, evaluation uses the average
