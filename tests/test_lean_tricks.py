"""The lean step's settings, each an exact no-op when off: half weights (tricks/precision.py), max pooling without
indices in evaluation (tricks/pooling.py), Muon's compiled Newton-Schulz (tricks/muon.py), the finite-loss guard's
reads every K steps (engine/loop.py); and the compiled network's graphs (no graph breaks)."""

import contextlib
import dataclasses
import math

import pytest
import torch
from torch import nn

import speedrun
from speedrun.engine.loop import Diverged, FiniteLossGuard
from speedrun.engine.system import resolve_system
from speedrun.models import CifarNet
from speedrun.recipes import cifar, cifar_resnet
from speedrun.tricks.muon import Muon, newton_schulz, newton_schulz_batched
from speedrun.tricks.pooling import IndexFreeEvalPool, max_pool_index_free
from speedrun.tricks.precision import resolve_half_weights, to_half_weights

from conftest import make_tiny

CPU, META, CUDA = torch.device("cpu"), torch.device("meta"), torch.device("cuda")


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (2, 5, 7, 9), (1, 4, 3, 3), (3, 2, 2, 5)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_index_free_pooling_equals_max_pool_bit_for_bit(shape, channels_last):
    x = torch.randn(shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(max_pool_index_free(x, 2), nn.functional.max_pool2d(x, 2))
    with torch.no_grad():
        assert torch.equal(IndexFreeEvalPool(2, True).eval()(x), nn.MaxPool2d(2)(x))


def test_index_free_pooling_only_where_no_gradient_is_kept(monkeypatch):
    calls = []
    monkeypatch.setattr("speedrun.tricks.pooling.max_pool_index_free",
                        lambda x, k: calls.append(k) or nn.functional.max_pool2d(x, k))
    pool, x = IndexFreeEvalPool(2, True), torch.randn(1, 1, 4, 4)
    pool.train()(x)
    pool.eval()(x)  # eval, but gradients on: the indices may be needed
    assert calls == []
    with torch.no_grad():
        IndexFreeEvalPool(2, False).eval()(x)  # off
        assert calls == []
        pool.eval()(x)
    assert calls == [2]


def test_a_net_with_index_free_eval_pooling_scores_and_trains_exactly_as_without():
    torch.manual_seed(0)
    plain = CifarNet(widths=(8, 16, 16))
    free = CifarNet(widths=(8, 16, 16), index_free_eval_pool=True)
    free.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(plain.eval()(x), free.eval()(x))
    plain.train(), free.train()
    a, b = plain(x), free(x)
    a.sum().backward(), b.sum().backward()
    assert torch.equal(a, b) and all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(),
                                                                               free.parameters()) if p.grad is not None)


def test_half_weights_keep_batchnorm_in_fp32_and_everything_else_in_16_bits():
    net = to_half_weights(CifarNet(widths=(8, 16, 16)), torch.float16)
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        if "norms" in name:
            assert t.dtype in (torch.float32, torch.int64), name
        else:
            assert t.dtype == torch.float16, name


def test_half_weights_resolve_as_documented():
    assert resolve_half_weights("auto", CUDA, "fp16", True) and resolve_half_weights("auto", META, "fp16", True)
    assert not resolve_half_weights("auto", CUDA, "bf16", True)  # bf16's 7 mantissa bits: never chosen
    assert not resolve_half_weights("auto", CUDA, "fp16", False)  # a family that has not measured it
    assert not resolve_half_weights("auto", CPU, "fp16", True)
    assert resolve_half_weights("on", CPU, "bf16") and not resolve_half_weights("off", CUDA, "fp16", True)
    with pytest.raises(ValueError, match="precision=fp16"):
        resolve_half_weights("on", CPU, "fp32")
    # the cifar family on CUDA: fp16 with half weights, no autocast; cifar10-resnet18: bf16 autocast as before
    system = resolve_system(cifar.cifar10_94(), META)
    assert (system.precision, system.half_weights, system.channels_last) == ("fp16", True, True)
    assert isinstance(system.amp(), contextlib.nullcontext)
    other = resolve_system(cifar_resnet.cifar10_resnet18(), META)
    assert (other.precision, other.half_weights) == ("bf16", False)


def test_half_weights_off_is_the_autocast_run_bit_for_bit_and_on_trains():
    data = make_tiny(n_train=64, n_test=16)
    cfg = dataclasses.replace(cifar.cifar10_94(), widths=(8, 16, 16), batch_size=16, epochs=1.0,
                              eval_batch_size=16, whiten_images=32, tta_level=0, eval_each_epoch=False,
                              precision="bf16")
    auto = cifar.train_run(cfg, data, CPU, seed=0)  # auto is off on a CPU
    off = cifar.train_run(dataclasses.replace(cfg, half_weights="off"), data, CPU, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(auto.model.state_dict().values(), off.model.state_dict().values()))
    on = cifar.train_run(dataclasses.replace(cfg, half_weights="on"), data, CPU, seed=0)
    assert on.model.head.weight.dtype == torch.bfloat16 and on.model.groups[0].norms[0].bias.dtype == torch.float32
    assert 0 <= on.accuracy <= 1 and all(torch.isfinite(t).all() for t in on.model.state_dict().values()
                                         if t.is_floating_point())


def test_muon_uncompiled_calls_the_functions_as_written():
    p = nn.Parameter(torch.randn(4, 3, 3, 3))
    opt = Muon([p], lr=0.1, momentum=0.6)
    assert opt.orthogonalize is newton_schulz and opt.orthogonalize_batched is newton_schulz_batched


@pytest.mark.slow
def test_muon_compiled_steps_as_the_eager_one():
    torch.manual_seed(0)
    eager = [nn.Parameter(torch.randn(8, 4, 3, 3)), nn.Parameter(torch.randn(6, 8, 3, 3))]
    compiled = [nn.Parameter(p.detach().clone()) for p in eager]
    grads = [torch.randn_like(p) for p in eager]
    for params, flag in ((eager, False), (compiled, True)):
        opt = Muon(params, lr=0.1, momentum=0.6, compiled=flag)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager, compiled))


class _Host:
    """A device that is not a CPU for the guard's choice of path, holding CPU tensors (their reads work)."""
    type = "mps"


@pytest.mark.parametrize("every", [1, 3, 8])
def test_the_guard_reads_every_k_steps_and_names_the_exact_step(every):
    guard = FiniteLossGuard(CPU, total_steps=40, lr_name="lr", every_steps=every)
    guard.device = _Host()
    reads = []
    real = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: reads.append(len(self)) or real(self)
    try:
        with pytest.raises(Diverged) as e:
            for step in range(1, 41):
                guard.check(step, torch.tensor(math.nan if step == 11 else 1.0), 0.1)
        assert e.value.step == 11
        raised_at = step
    finally:
        torch.Tensor.tolist = real
    assert raised_at == math.ceil(11 / every) * every  # at the first read that holds step 11
    assert reads == [every] * (raised_at // every)


def test_the_guard_checks_the_last_partial_group_at_finish():
    guard = FiniteLossGuard(CPU, total_steps=10, lr_name="lr", every_steps=8)
    guard.device = _Host()
    for step in range(1, 11):
        guard.check(step, torch.tensor(math.inf if step == 10 else 1.0), 0.1)
    with pytest.raises(Diverged, match="step 10 of 10"):
        guard.finish()


@pytest.mark.slow
@pytest.mark.parametrize("build", [lambda: CifarNet(widths=(8, 16, 16)),
                                   lambda: CifarNet(widths=(8, 16, 16), index_free_eval_pool=True),
                                   lambda: cifar_resnet.build_model(cifar_resnet.cifar10_resnet18(), 3, 10)])
def test_the_compiled_networks_have_no_graph_breaks_in_training_or_evaluation(build):
    import torch._dynamo
    net = build()
    x = torch.randn(2, 3, 32, 32)
    for training in (True, False):
        net.train(training)
        torch._dynamo.reset()
        with torch.set_grad_enabled(training):
            explained = torch._dynamo.explain(net)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.slow
def test_a_compiled_run_compiles_one_graph_per_phase():
    """Whitening bias learning, then frozen, then evaluation: three graphs for a whole run (static shapes: drop_last
    keeps every batch one shape), none recompiled for a dynamic shape."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    data = make_tiny(n_train=64, n_test=16)
    cfg = dataclasses.replace(cifar.cifar10_94(), widths=(8, 16, 16), batch_size=16, epochs=2.0, eval_batch_size=16,
                              whiten_images=32, tta_level=0, eval_each_epoch=False, whiten_bias_epochs=1.0,
                              compile=True, compile_mode="default", precision="fp32")
    run = cifar.train_run(cfg, data, CPU, seed=0)
    assert run.steps == 8 and math.isfinite(run.accuracy)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
def test_a_process_compiling_many_configurations_never_falls_back_to_eager(monkeypatch):
    """bench, tune and sweep compile one network's forward at several shapes and modes in one process: past
    dynamo's default limit of 8 graphs a function, the later runs silently ran eager code (tune's compile rows). Ten
    static shapes of one compiled module: ten graphs, none refused."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from speedrun.tricks.precision import maybe_compile

    import torch._dynamo.config as dynamo_config
    for limit in ("recompile_limit", "accumulated_recompile_limit"):  # the process's own, back after the test
        monkeypatch.setattr(dynamo_config, limit, getattr(dynamo_config, limit))
    torch._dynamo.reset()
    counters.clear()
    net = maybe_compile(torch.nn.Linear(4, 2), True, "default")
    for batch in range(1, 11):
        net(torch.randn(batch, 4))
    assert counters["stats"]["unique_graphs"] == 10, dict(counters["stats"])


def test_a_half_weights_model_saves_in_fp32_and_loads(tmp_path):
    result = speedrun.train("cifar10-94", "synthetic:train=64,test=16", device="cpu", save=tmp_path / "m",
                            batch_size=16, widths=(8, 16, 16), whiten_images=32, tta_level=0,
                            eval_each_epoch=False, precision="bf16", half_weights="on", epochs=1.0)
    assert result.model.head.weight.dtype == torch.bfloat16
    model = speedrun.load(tmp_path / "m")
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape == (2, 10)


def test_a_resume_continues_with_the_half_weights_it_began_with(tmp_path):
    from speedrun.run.resume import check_precision
    meta = {"precision_used": "fp16", "half_weights_used": False, "device_type": "cuda"}
    check_precision({"precision_used": "fp16", "config": {}}, meta, tmp_path / "c")  # made before: autocast
    with pytest.raises(ValueError, match="half_weights=on"):
        check_precision({"precision_used": "fp16", "half_weights_used": True, "config": {}}, meta, tmp_path / "c")
    with pytest.raises(ValueError, match="half_weights=off"):
        check_precision({"precision_used": "fp16", "half_weights_used": False, "config": {}},
                        {**meta, "half_weights_used": True}, tmp_path / "c")


def test_lookahead_over_mixed_dtypes_is_the_per_tensor_rule():
    from speedrun.tricks.lookahead import Lookahead
    net = to_half_weights(CifarNet(widths=(8, 16, 16)), torch.bfloat16)
    la = Lookahead(net)
    assert len(la._groups) == 2  # bf16 weights, fp32 BatchNorm
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    expected = [torch.lerp(s, v, 0.3) for s, v in zip(la.slow, la.live)]
    la.update(0.7)
    assert all(torch.equal(s, e) and torch.equal(v, e) for s, v, e in zip(la.slow, la.live, expected))


def test_a_checkpoint_is_written_only_after_every_loss_is_checked():
    from speedrun.engine.loop import LoopState, RunHooks, Steps, Timer
    calls = []

    class Due:
        def due(self, step, total):
            return True

        def save(self, step, state):
            calls.append("save")

    timer = Timer(CPU)
    timer.start()
    steps = Steps(timer, 10, RunHooks(checkpoints=Due()))

    class State(LoopState):
        def state_dict(self):
            return {}

    state = State(step=3)
    steps.after(state, 0.3, False, batch_row=lambda s: {}, settle=lambda: calls.append("settle"))
    assert calls == ["settle", "save"]

    def diverged():
        raise Diverged(3, 10, math.nan, 0.1, "lr")

    with pytest.raises(Diverged):
        steps.after(state, 0.3, False, batch_row=lambda s: {}, settle=diverged)
    assert calls == ["settle", "save"]  # nothing saved
