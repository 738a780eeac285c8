import math

import pytest
import torch

from speedrun.data.loader import Augmentation, DeviceLoader, Normalization, channel_stats, normalize, steps_for

AUGMENTATION = ("flip", "translate_px", "cutout_px", "cutmix_px")


def make(n=50, batch=8, epochs=3.0, **kw):
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 4, 4).contiguous()
    labels = torch.arange(n) % 5
    identity = Normalization(torch.zeros(1), torch.ones(1))  # identity normalization (x / 255) keeps ids recoverable
    augmentation = Augmentation(**{k: kw.pop(k) for k in AUGMENTATION if k in kw})
    loader = DeviceLoader(images, labels, batch_size=batch, epochs=epochs, num_classes=5,
                          device=torch.device("cpu"), normalization=identity, augmentation=augmentation, **kw)
    return loader


def ids(x):  # each image is constant = its index / 255
    return (x[:, 0, 0, 0] * 255).round().long()


@pytest.mark.parametrize("n,batch", [(50, 8), (48, 8), (10, 32)])
def test_each_epoch_visits_every_example_exactly_once(n, batch):
    loader = make(n=n, batch=batch, epochs=4.0, translate_px=0)
    stream = torch.cat([ids(x) for x, _ in loader])
    assert len(stream) == loader.steps * batch
    for e in range(len(stream) // n):  # every whole epoch in the stream is a permutation
        assert sorted(stream[e * n:(e + 1) * n].tolist()) == list(range(n))


def test_labels_follow_their_images():
    loader = make(epochs=2.0)
    for x, y in loader:
        assert torch.equal(y, ids(x) % 5)


@pytest.mark.parametrize("epochs,expected", [(1.0, 7), (2.5, 16), (9.9, 62), (0.01, 1)])
def test_fractional_epochs_give_the_exact_step_count(epochs, expected):
    # 50 examples, batch 8: ceil(epochs * 50 / 8)
    assert expected == math.ceil(round(epochs * 50, 6) / 8)
    loader = make(epochs=epochs)
    assert len(loader) == loader.steps == expected
    assert sum(1 for _ in loader) == expected


def test_step_count_is_not_fooled_by_float_error():
    assert 1.1 * 100 != 110  # the float product is 110.00000000000001: a naive ceil gives 111 steps
    assert steps_for(1.1, 100, 1) == 110
    assert steps_for(9.9, 50000, 1024) == 484
    with pytest.raises(ValueError):
        steps_for(0, 10, 2)


def test_deterministic_under_seed_and_different_across_seeds():
    def stream(seed):
        return torch.cat([x for x, _ in make(seed=seed, flip="alternating", translate_px=1)])
    assert torch.equal(stream(3), stream(3))
    assert not torch.equal(stream(3), stream(4))


def test_alternating_flip_in_the_loader():
    n = 16
    images = torch.arange(n * 4, dtype=torch.uint8).view(n, 1, 1, 4).expand(n, 1, 2, 4).contiguous()
    loader = DeviceLoader(images, torch.zeros(n, dtype=torch.int64), batch_size=n, epochs=3, num_classes=1,
                          device=torch.device("cpu"), normalization=Normalization(torch.zeros(1), torch.ones(1)),
                          augmentation=Augmentation(flip="alternating"))
    epochs = [(x[:, 0, 0] * 255).round().long() for x, _ in loader]  # (n, 4) per epoch
    flipped = [(e[:, 0] > e[:, -1]) for e in epochs]
    # sort by image to compare the same image across epochs (the first pixel identifies it)
    per_image = [f[torch.argsort(e.min(1).values)] for f, e in zip(flipped, epochs)]
    assert torch.equal(per_image[1], ~per_image[0]) and torch.equal(per_image[2], per_image[0])
    assert 0 < int(per_image[0].sum()) < n


def test_cutmix_yields_probability_targets():
    loader = make(cutmix_px=2, epochs=1.0)
    x, t = next(iter(loader))
    assert t.shape == (8, 5) and t.dtype == torch.float32
    assert torch.allclose(t.sum(1), torch.ones(8))


def test_bad_settings_raise_value_errors():
    with pytest.raises(ValueError, match="translate_px"):
        make(translate_px=4)
    with pytest.raises(ValueError, match="flip"):
        make(flip="diagonal")
    with pytest.raises(ValueError, match="batch_size"):
        make(batch=0)


def test_normalize_standardizes_with_channel_stats():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 8, 8), generator=g, dtype=torch.uint8)
    mean, std = channel_stats(x)
    z = normalize(x, mean, std, torch.float32)
    assert torch.allclose(z.mean((0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(z.std((0, 2, 3)), torch.ones(3), atol=1e-3)
    cl = normalize(x, mean, std, torch.float32, channels_last=True)
    assert cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(cl, z)


def test_channel_stats_in_chunks_match_the_direct_computation():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (1000, 3, 6, 6), generator=g, dtype=torch.uint8)
    mean, std = channel_stats(x, chunk=97)  # chunks that do not divide N
    flat = x.double().div(255).transpose(0, 1).reshape(3, -1)
    assert torch.allclose(mean.double(), flat.mean(1), atol=1e-6)
    assert torch.allclose(std.double(), flat.std(1), atol=1e-6)


def _reference_batches(images, labels, batch, steps, *, seed, flip, translate_px, mean, std, dtype, channels_last):
    """Each batch as the loader made it before it standardized once: the epoch's uint8 images augmented with the
    same draws, then each batch standardized on its own."""
    from speedrun.data import augment
    from speedrun.data.loader import _generator
    n = len(images)
    base = torch.rand(n, generator=_generator(seed, -1)) < 0.5
    out, epoch, pos, x = [], 0, 0, None
    while len(out) < steps:
        if x is None or pos + batch > n:
            g = _generator(seed, epoch)
            perm = torch.randperm(n, generator=g)
            coins = base if flip == "alternating" else torch.rand(n, generator=g) < 0.5
            mask = augment.flip_mask(coins, epoch, flip)
            dy, dx = torch.randint(-translate_px, translate_px + 1, (2, n), generator=g)
            x = augment.hflip(images[perm], None if mask is None else mask[perm])
            x = augment.translate(x, dy, dx, translate_px)
            y = labels[perm]
            epoch, pos = epoch + 1, 0
        out.append((normalize(x[pos:pos + batch], mean, std, dtype, channels_last), y[pos:pos + batch]))
        pos += batch
    return out


@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.bfloat16, True),
                                                 (torch.float16, True)])
def test_standardizing_once_gives_the_batches_of_standardizing_each_bit_for_bit(dtype, channels_last):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 3, 6, 6), dtype=torch.uint8, generator=g)
    labels = torch.arange(40) % 4
    mean, std = channel_stats(images)
    loader = DeviceLoader(images, labels, batch_size=8, epochs=3.0, num_classes=4, device=torch.device("cpu"),
                          normalization=Normalization(mean, std, dtype, channels_last),
                          augmentation=Augmentation(flip="alternating", translate_px=2), seed=5, drop_last=True)
    got = list(loader)
    expected = _reference_batches(images, labels, 8, loader.steps, seed=5, flip="alternating", translate_px=2,
                                  mean=mean, std=std, dtype=dtype, channels_last=channels_last)
    assert len(got) == len(expected) == 15
    for (x, y), (ex, ey) in zip(got, expected):
        assert x.dtype == dtype and torch.equal(x, ex) and torch.equal(y, ey)
        assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("n,batch,epochs,steps", [(50, 8, 1.0, 6), (50, 8, 9.9, 60), (48, 8, 2.0, 12),
                                                  (50_000, 1024, 9.9, 476), (50_000, 1024, 2.0, 96)])
def test_drop_last_counts_whole_batches_of_each_epoch_as_airbench(n, batch, epochs, steps):
    assert steps_for(epochs, n, batch, drop_last=True) == steps
    if n < 1000:
        loader = make(n=n, batch=batch, epochs=epochs, drop_last=True)
        stream = [ids(x) for x, _ in loader]
        assert len(stream) == loader.steps == steps and all(len(s) == batch for s in stream)
        per_epoch = n // batch
        for e in range(steps // per_epoch):  # each epoch's batches: distinct examples, never straddling epochs
            seen = torch.cat(stream[e * per_epoch:(e + 1) * per_epoch])
            assert len(set(seen.tolist())) == per_epoch * batch
        assert loader.epoch_at(per_epoch) == 1.0


def test_drop_last_resumes_at_any_step_with_the_same_batches():
    whole = [x for x, _ in make(n=50, batch=8, epochs=3.0, drop_last=True, flip="alternating", translate_px=1)]
    for start in (0, 5, 6, 7, 17):
        again = make(n=50, batch=8, epochs=3.0, drop_last=True, flip="alternating", translate_px=1)
        assert all(torch.equal(a[0], b) for a, b in zip(again.batches(start), whole[start:]))


def test_drop_last_with_a_batch_larger_than_the_data_drops_nothing():
    loader = make(n=10, batch=32, epochs=4.0, drop_last=True)
    assert loader.steps == steps_for(4.0, 10, 32) == steps_for(4.0, 10, 32, drop_last=True) == 2
    assert all(len(x) == 32 for x, _ in loader)


def test_one_copy_to_the_device_an_epoch():
    """The epoch's five draws (order, flips, two shifts, corners) travel in one copy."""
    from speedrun.engine.launches import Counter
    with Counter() as c:
        loader = DeviceLoader(torch.zeros(20, 3, 4, 4, dtype=torch.uint8), torch.zeros(20, dtype=torch.int64),
                              batch_size=5, epochs=2.0, num_classes=2, device=torch.device("meta"),
                              normalization=Normalization(torch.zeros(3), torch.ones(3)),
                              augmentation=Augmentation(flip="random", translate_px=1, cutout_px=2))
        c.mark()
        batches = loader.batches(0)
        for _ in range(4):
            next(batches)
            c.mark()
    setup, first, *rest = c.stretches
    assert len(first.host_to_device) == 1 and all(not w.host_to_device for w in rest)
