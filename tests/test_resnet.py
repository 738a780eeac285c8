"""models/resnet.py: sizes against the published counts, shapes at the progressive-resizing sides, channels_last,
the zero-init and blurpool switches (off is an exact no-op), the blur's placement, and that a debug net learns."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from speedrun.models.resnet import BasicBlock, Blur, Bottleneck, norm_and_bias_params, resnet

BLOCKS = (BasicBlock, Bottleneck)


def build(seed: int, depth: int, width: int, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return resnet(depth, 10, width=width, **kw)


def last_bn_weight_keys(model: nn.Module) -> set[str]:
    names = {id(m): name for name, m in model.named_modules()}
    return {f"{names[id(m.last_bn)]}.weight" for m in model.modules() if isinstance(m, BLOCKS)}


@pytest.mark.parametrize("depth,params,gmacs", [(18, 11_689_512, 1.814), (50, 25_557_032, 4.089)])
def test_sizes_match_the_published_resnets(depth, params, gmacs):
    torch.manual_seed(0)
    model = resnet(depth, 1000).eval()
    assert sum(p.numel() for p in model.parameters()) == params
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    # MACs tell v1.5 from v1: with the stride on the first 1x1 a ResNet-50 is 3.86 GMACs.
    assert counter.get_total_flops() / 2e9 == pytest.approx(gmacs, abs=5e-4)


def test_v15_puts_the_bottleneck_stride_on_the_3x3():
    model = resnet(50, 10, width=8)
    first = model.stages[1][0]
    assert (first.conv1.stride, first.conv2.stride, first.conv3.stride) == ((1, 1), (2, 2), (1, 1))
    assert first.shortcut.conv.stride == (2, 2)


@pytest.mark.parametrize("bad", [0, 20, 200, "50"])
def test_unknown_depth_lists_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"\[18, 34, 50, 101, 152\]"):
        resnet(bad, 10)


def test_bad_width_is_a_value_error():
    with pytest.raises(ValueError, match="width"):
        resnet(18, 10, width=0)


@pytest.mark.parametrize("depth", [18, 50])
@pytest.mark.parametrize("blurpool", [False, True])
def test_output_shape_at_every_training_side(depth, blurpool):
    model = build(0, depth, 8, blurpool=blurpool, in_channels=1).eval()
    with torch.no_grad():
        for side in (32, 33, 128, 160, 192, 224):
            assert model(torch.randn(2, 1, side, side)).shape == (2, 10)


@pytest.mark.parametrize("depth", [18, 50])
def test_channels_last_forward_equals_contiguous(depth):
    model = build(0, depth, 16, zero_init_residual=False, blurpool=True)
    x = torch.randn(4, 3, 64, 64)
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            expected = model(x)
            model_cl = model.to(memory_format=torch.channels_last)
            got = model_cl(x.contiguous(memory_format=torch.channels_last))
            model.to(memory_format=torch.contiguous_format)
        # Summation order differs between layouts; in training mode BN over a 2x2 map at batch 4 (stage 4 at
        # 64 px) amplifies that rounding to ~4e-5 on logits of size ~1. A layout bug moves them by ~1.
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# --- zero_init_residual -----------------------------------------------------------------------------------

@pytest.mark.parametrize("depth,blocks", [(18, 8), (50, 16)])
def test_zero_init_off_changes_exactly_the_last_bn_scales(depth, blocks):
    on = build(3, depth, 16, zero_init_residual=True).state_dict()
    off = build(3, depth, 16, zero_init_residual=False).state_dict()
    last = last_bn_weight_keys(resnet(depth, 10, width=16))
    assert len(last) == blocks and last <= on.keys()
    assert on.keys() == off.keys()
    for key in on:
        if key in last:
            assert torch.equal(on[key], torch.zeros_like(on[key])) and torch.equal(off[key], torch.ones_like(off[key]))
        else:
            assert torch.equal(on[key], off[key]), key


@pytest.mark.parametrize("depth", [18, 50])
def test_zero_init_blocks_start_as_the_identity(depth):
    model = build(0, depth, 8).eval()
    block = model.stages[2][1]  # a block with an identity shortcut
    x = torch.relu(torch.randn(2, block.last_bn.num_features, 8, 8))  # blocks read a post-ReLU input
    with torch.no_grad():
        assert torch.equal(block(x.clone()), x)
        assert not torch.equal(build(0, depth, 8, zero_init_residual=False).eval().stages[2][1](x.clone()), x)


# --- blurpool ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [18, 50])
def test_blurpool_off_is_an_exact_no_op(depth):
    default, off, on = build(5, depth, 16), build(5, depth, 16, blurpool=False), build(5, depth, 16, blurpool=True)
    assert not any(isinstance(m, Blur) for m in off.modules())
    assert sum(isinstance(m, Blur) for m in on.modules()) == 6  # stages 2-4: the branch's strided conv and shortcut
    assert [n for n, _ in off.named_buffers()] == [n for n, _ in default.named_buffers()]
    # The filter is constant and non-persistent: the same seed gives the same state_dict with the blur on.
    for a, b in ((default, off), (default, on)):
        sd_a, sd_b = a.state_dict(), b.state_dict()
        assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        for m in (default, off, on):
            m.eval()
        assert torch.equal(off(x), default(x))
        assert not torch.allclose(on(x), default(x), atol=1e-3)


def test_blur_is_a_fixed_normalized_low_pass():
    model = build(0, 18, 16, blurpool=True)
    trainable = {id(p) for p in model.parameters()}
    for blur in (m for m in model.modules() if isinstance(m, Blur)):
        assert list(blur.parameters()) == [] and id(blur.kernel) not in trainable
        assert torch.allclose(blur.kernel.sum(dim=(1, 2, 3)), torch.ones(blur.kernel.shape[0]))
    assert not any("kernel" in k for k in model.state_dict())
    blur = Blur(3)
    x = torch.full((1, 3, 9, 9), 2.0)
    y = blur(x)  # (1, 3, 9, 9): a constant passes unchanged inside, zero padding dims the border
    assert torch.allclose(y[..., 1:-1, 1:-1], x[..., 1:-1, 1:-1])
    assert y[0, 0, 0, 4].item() == pytest.approx(1.5) and y[0, 0, 0, 0].item() == pytest.approx(2 * 9 / 16)


@pytest.mark.parametrize("kernel_px", [1, 3])
@pytest.mark.parametrize("side", [16, 15])
def test_blur_then_strided_conv_equals_zhangs_conv_then_blurpool(kernel_px, side):
    # Ours: blur at stride 1, then the stride-2 conv. Zhang's: conv at stride 1, then blur at stride 2. Linear
    # shift-invariant maps commute, so they agree away from the borders; for a 1x1 conv, at the borders too.
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 5, kernel_px, stride=2, padding=kernel_px // 2, bias=False)
    blur = Blur(6)
    x = torch.randn(2, 6, side, side)
    ours = conv(blur(x))
    stride1 = F.conv2d(x, conv.weight, padding=kernel_px // 2)
    zhang = F.conv2d(stride1, Blur(5).kernel, stride=2, padding=1, groups=5)
    assert ours.shape == zhang.shape == (2, 5, (side + 1) // 2, (side + 1) // 2)
    if kernel_px == 1:
        torch.testing.assert_close(ours, zhang)
    else:
        torch.testing.assert_close(ours[..., 1:-1, 1:-1], zhang[..., 1:-1, 1:-1])
        assert not torch.allclose(ours, zhang)  # the borders do differ: the test can tell the two apart


# --- parameters without weight decay ----------------------------------------------------------------------

@pytest.mark.parametrize("depth", [18, 50])
def test_norm_and_bias_params_are_exactly_the_bn_params_and_the_head_bias(depth):
    model = resnet(depth, 10, width=8, blurpool=True)
    got = norm_and_bias_params(model)
    expected = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in (m.weight, m.bias)]
    expected.append(model.head.bias)
    assert len(got) == len({id(p) for p in got}) == len(expected)
    assert {id(p) for p in got} == {id(p) for p in expected}
    assert all(p.dim() == 1 for p in got)  # and so no conv or linear weight slipped in
    rest = [p for p in model.parameters() if id(p) not in {id(q) for q in got}]
    assert all(p.dim() in (2, 4) for p in rest) and len(rest) + len(got) == len(list(model.parameters()))
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # what dist.py does under DDP
    assert {id(p) for p in norm_and_bias_params(synced)} == {id(p) for p in norm_and_bias_params(model)}
    assert len(norm_and_bias_params(synced)) == len(expected)


# --- learning ---------------------------------------------------------------------------------------------

def test_debug_resnet18_overfits_a_small_batch_through_zero_init_blocks():
    torch.manual_seed(0)
    model = resnet(18, 4, width=8)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 4, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses  # memorized: from ~1.4 to ~0.05 in 20 steps (seeds 0-3)
    # The zero-initialized scales were trained off zero: gradient reached every residual branch.
    assert all(m.last_bn.weight.abs().min() > 0 for m in model.modules() if isinstance(m, BLOCKS))
