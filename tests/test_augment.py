import pytest
import torch
import torch.nn.functional as F

from speedrun.data import augment


def images(n=6, c=3, h=8, w=10, dtype=torch.uint8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_every_augmentation_keeps_shape_and_dtype(dtype):
    x = images(dtype=dtype)
    n = len(x)
    mask = torch.tensor([True, False] * 3)
    shift = torch.tensor([-2, -1, 0, 1, 2, 1])
    corner = torch.tensor([0, 1, 2, 3, 4, 5])
    outs = [augment.hflip(x, mask), augment.translate(x, shift, shift.flip(0), 2),
            augment.cutout(x, corner, corner, 3)]
    if dtype != torch.uint8:
        t = torch.eye(4)[torch.arange(n) % 4]
        mixed, targets = augment.cutmix(x, t, torch.roll(torch.arange(n), 1), corner, corner, 3)
        outs.append(mixed)
        assert targets.shape == t.shape and targets.dtype == t.dtype
    for out in outs:
        assert out.shape == x.shape and out.dtype == x.dtype


def test_each_augmentation_is_exact_identity_when_off():
    x = images(dtype=torch.float32)
    zeros = torch.zeros(len(x), dtype=torch.int64)
    t = torch.rand(len(x), 5)
    assert augment.hflip(x, None) is x
    assert augment.flip_mask(torch.ones(len(x), dtype=torch.bool), 3, "none") is None
    assert augment.translate(x, zeros, zeros, 0) is x
    assert augment.cutout(x, zeros, zeros, 0) is x
    mixed, targets = augment.cutmix(x, t, torch.arange(len(x)), zeros, zeros, 0)
    assert mixed is x and targets is t
    # A zero shift with padding on is also the identity, bit for bit.
    assert torch.equal(augment.translate(x, zeros, zeros, 2), x)


def test_hflip_mirrors_only_masked_images():
    x = images()
    mask = torch.tensor([True, False, True, False, False, True])
    out = augment.hflip(x, mask)
    assert torch.equal(out[mask], x[mask].flip(-1))
    assert torch.equal(out[~mask], x[~mask])


def test_alternating_flip_flips_each_image_on_alternate_epochs():
    base = torch.tensor([True, False, True, False])
    m0, m1, m2 = (augment.flip_mask(base, e, "alternating") for e in range(3))
    assert torch.equal(m0, base) and torch.equal(m1, ~base) and torch.equal(m2, base)
    assert torch.equal(augment.flip_mask(base, 1, "random"), base)
    with pytest.raises(ValueError, match="flip must be one of"):
        augment.flip_mask(base, 0, "sideways")


def test_translate_matches_reflect_pad_then_crop():
    x = images(n=25, h=7, w=9, dtype=torch.float32)
    pad = 2
    dy = torch.arange(25) // 5 - 2  # every (dy, dx) in [-2, 2]^2 once
    dx = torch.arange(25) % 5 - 2
    out = augment.translate(x, dy, dx, pad)
    padded = F.pad(x, (pad,) * 4, mode="reflect")
    for i in range(25):
        top, left = pad + int(dy[i]), pad + int(dx[i])
        assert torch.equal(out[i], padded[i, :, top:top + 7, left:left + 9])


def test_cutout_zeros_exactly_one_square():
    x = images(dtype=torch.float32) + 1  # no zeros to start with
    top = torch.tensor([0, 5, 2, 0, 1, 3])
    left = torch.tensor([0, 7, 3, 4, 0, 2])
    out = augment.cutout(x, top, left, 3)
    for i in range(len(x)):
        expected = x[i].clone()
        expected[:, top[i]:top[i] + 3, left[i]:left[i] + 3] = 0
        assert torch.equal(out[i], expected)
    assert int((out == 0).sum()) == len(x) * 3 * 9


def test_cutmix_pastes_partner_patch_and_mixes_labels_by_area():
    x = images(n=4, h=8, w=8, dtype=torch.float32)
    t = torch.eye(4)
    partner = torch.tensor([1, 2, 3, 0])
    top, left = torch.tensor([0, 2, 4, 5]), torch.tensor([1, 0, 3, 5])
    mixed, targets = augment.cutmix(x, t, partner, top, left, 4)
    for i in range(4):
        j = int(partner[i])
        region = (slice(None), slice(int(top[i]), int(top[i]) + 4), slice(int(left[i]), int(left[i]) + 4))
        assert torch.equal(mixed[i][region], x[j][region])
        outside = mixed[i].clone()
        outside[region] = x[i][region]
        assert torch.equal(outside, x[i])
    w = 16 / 64
    assert torch.allclose(targets, t * (1 - w) + t[partner] * w)
    assert torch.allclose(targets.sum(1), torch.ones(4))
