"""data/shard_loader.py: the order (exactly once per epoch, a pure function of (seed, step)), shares across
processes, resume from a step, the device-side crop and flip, and hostile shards."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from speedrun.data.loader import Normalization
from speedrun.data.shard_loader import (Decoding, ShardImages, ShardLoader, center_boxes, crop_resize, epoch_order,
                                        eval_batches, random_resized_boxes, stream_indices)
from speedrun.data.shards import write_split

MEAN, STD = torch.full((3,), 0.5), torch.full((3,), 0.25)


def _jpeg(rng: np.random.Generator, w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """37 JPEGs of mixed sizes (a prime count: batches straddle epochs), labels i % 5, over several shards."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    samples = [(_jpeg(rng, int(rng.integers(20, 90)), int(rng.integers(20, 90))), i % 5) for i in range(37)]
    write_split(samples, root, "train", shard_bytes=30_000)
    assert len(list(root.glob("train-*.tar"))) > 1
    return root


def _loader(root, *, workers: int = 0, device_decode=None, channels_last: bool = False, **kw) -> ShardLoader:
    args = dict(batch_size=8, epochs=3, device=torch.device("cpu"), res_at=lambda s: 24, seed=3)
    return ShardLoader(str(root), "train", normalization=Normalization(MEAN, STD, channels_last=channels_last),
                       decoding=Decoding(decode_px=32, workers=workers, device_decode=device_decode), **{**args, **kw})


def test_every_sample_is_seen_once_per_epoch_and_the_order_is_a_function_of_seed_and_epoch():
    n, b = 37, 8
    stream = torch.cat([stream_indices(5, n, b, s) for s in range(14)])  # 112 positions: 3 epochs and a bit
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n].tolist()) == list(range(n))
        assert torch.equal(stream[e * n:(e + 1) * n], epoch_order(5, e, n))
    assert not torch.equal(epoch_order(5, 0, n), epoch_order(5, 1, n))
    assert not torch.equal(epoch_order(5, 0, n), epoch_order(6, 0, n))
    assert torch.equal(stream_indices(5, n, b, 9), stream_indices(5, n, b, 9))


def test_shares_of_two_processes_make_the_global_batch_and_see_what_one_process_sees(shards):
    one = _loader(shards)
    parts = [_loader(shards, share=slice(0, 4)), _loader(shards, share=slice(4, 8))]
    for step, (x, y) in enumerate(one.batches(0)):
        assert torch.equal(torch.cat([p.indices(step) for p in parts]), one.indices(step))
        if step == 5:
            break
    full = list(one.batches(0))
    halves = [list(p.batches(0)) for p in parts]
    assert len(full) == one.steps == 14  # ceil(3 * 37 / 8)
    for step in range(one.steps):
        x = torch.cat([halves[0][step][0], halves[1][step][0]])
        y = torch.cat([halves[0][step][1], halves[1][step][1]])
        assert torch.equal(y, full[step][1])
        assert torch.allclose(x, full[step][0], atol=1e-6)  # same boxes, same flips: K processes = one


def test_a_loader_resumed_at_a_step_gives_the_remaining_batches_bitwise_and_workers_change_nothing(shards):
    straight = list(_loader(shards).batches(0))
    resumed = list(_loader(shards, workers=2).batches(6))
    assert len(resumed) == len(straight) - 6
    for (x, y), (rx, ry) in zip(straight[6:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_the_resolution_may_change_at_any_step(shards):
    sizes = [x.shape[-1] for x, _ in _loader(shards, res_at=lambda s: 16 if s < 4 else 28).batches(2)]
    assert sizes == [16, 16] + [28] * 10


def test_labels_are_the_shards_labels(shards):
    loader = _loader(shards)
    for step, (_, y) in enumerate(loader.batches(0)):
        assert y.tolist() == [i % 5 for i in loader.indices(step).tolist()]


def test_random_resized_boxes_obey_scale_and_ratio_and_stay_inside():
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([[640, 480], [480, 640], [300, 300], [10, 1000], [1000, 10]] * 200)
    boxes = random_resized_boxes(sizes, g)
    x0, y0, w, h = boxes.double().unbind(1)
    assert bool((x0 >= 0).all() and (y0 >= 0).all() and (x0 + w <= 1 + 1e-6).all() and (y0 + h <= 1 + 1e-6).all())
    px_w, px_h = w * sizes[:, 0], h * sizes[:, 1]
    ratio = px_w / px_h
    normal = torch.arange(len(sizes)) % 5 < 3  # images of ordinary shape: a draw fits
    area = (w * h)[normal]
    assert area.min() > 0.07 and area.max() <= 1.0 + 1e-6
    assert area.std() > 0.15  # spread over (0.08, 1), not one size
    assert ratio[normal].min() > 0.74 and ratio[normal].max() < 1.34
    # A 10 x 1000 image fits no draw: the fallback is its centre cut to the nearest allowed ratio (3/4).
    thin = torch.arange(len(sizes)) % 5 == 3
    assert torch.allclose(ratio[thin], torch.full_like(ratio[thin], 10 / 13))


def test_crop_resize_of_the_whole_image_at_its_own_size_is_the_image_and_flip_mirrors_it():
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    whole = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 3)
    ident = Normalization(torch.zeros(3), torch.ones(3))
    out = crop_resize(images, whole, None, 16, ident) * 255
    assert torch.allclose(out, images.float(), atol=1e-3)
    flipped = crop_resize(images, whole, torch.tensor([True, False, True]), 16, ident) * 255
    assert torch.allclose(flipped[0], images[0].flip(-1).float(), atol=1e-3)
    assert torch.allclose(flipped[1], images[1].float(), atol=1e-3)
    # The bottom-right quarter at its own resolution: exactly those pixels.
    quarter = crop_resize(images, torch.tensor([[0.5, 0.5, 0.5, 0.5]] * 3), None, 8, ident)
    assert torch.allclose(quarter * 255, images[..., 8:, 8:].float(), atol=1e-3)
    cl = crop_resize(images, whole, None, 16, Normalization(torch.zeros(3), torch.ones(3), channels_last=True))
    assert cl.is_contiguous(memory_format=torch.channels_last)


def test_center_boxes_are_square_in_pixels_and_centred():
    sizes = torch.tensor([[400, 300], [300, 400]])
    boxes = center_boxes(sizes, 0.875)
    px = boxes[:, 2:] * sizes
    assert torch.allclose(px, torch.full_like(px, 262.5))
    assert torch.allclose(boxes[:, 0] * 2 + boxes[:, 2], torch.ones(2))


def test_evaluation_batches_cover_each_part_once(shards):
    data = ShardImages(str(shards), "train", 32)
    seen = []
    for part in (slice(0, 19), slice(19, 37)):
        for x, y in eval_batches(data, batch_size=8, res=24, crop_ratio=0.875, device=torch.device("cpu"),
                                 mean=MEAN, std=STD, dtype=torch.float32, channels_last=False, workers=0, part=part):
            assert x.shape[1:] == (3, 24, 24)
            seen += y.tolist()
    assert seen == [i % 5 for i in range(37)]


def test_a_sample_that_is_not_a_jpeg_is_named(tmp_path):
    rng = np.random.default_rng(1)
    write_split([(_jpeg(rng, 30, 30), 0), (b"\xff\xd8 not really a jpeg" * 10, 1)], tmp_path, "train")
    data = ShardImages(str(tmp_path), "train", 16)
    assert data[0][0].shape == (3, 16, 16)
    with pytest.raises(ValueError, match="sample 1 of train .* is not a usable JPEG"):
        data[1]


def _bomb_jpeg(side_px: int) -> bytes:
    """An 8 x 8 JPEG whose frame header (SOF0) claims side_px x side_px."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = side_px.to_bytes(2, "big") * 2
    return bytes(data)


@pytest.mark.parametrize("raw", [False, True])  # the Pillow workers, and the workers feeding a device decoder
def test_a_bomb_jpeg_header_is_refused_before_decoding(tmp_path, raw):
    # A JPEG whose header claims 65,000 x 65,000 px: refused by its size, no pixel decoded.
    write_split([(_bomb_jpeg(65000), 0)], tmp_path, "train")
    with pytest.raises(ValueError, match="sample 0 of train .* is not a usable JPEG"):
        ShardImages(str(tmp_path), "train", 16, raw=raw)[0]


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"^decode_px must be in \[8, 1024\], got 4$"):
        Decoding(decode_px=4)
    with pytest.raises(ValueError, match=r"^workers must be in \[0, 256\], got -1$"):
        Decoding(workers=-1)


def _pillow_on_device(blobs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A stand-in for TorchCodec's decode_jpeg(list, device=...): the same contract (host bytes in, (3, H, W)
    uint8 out at each image's own size), so the device-decode path runs on this CPU-only machine."""
    out = []
    for b in blobs:
        with Image.open(io.BytesIO(b.numpy().tobytes())) as im:
            out.append(torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous())
    return out


def test_the_device_decode_path_gets_checked_bytes_and_yields_what_the_pillow_path_yields(tmp_path):
    # Flat-colour images: any crop of them, resampled any way, is the colour; so both paths must agree exactly
    # in labels, shapes, and values (to rounding), step by step, with the same boxes and flips.
    colours = [(i * 40 % 256, 255 - i * 30 % 256, i * 70 % 256) for i in range(11)]
    samples = []
    for i, c in enumerate(colours):
        buf = io.BytesIO()
        Image.new("RGB", (30 + 3 * i, 50 - 2 * i), c).save(buf, "JPEG", quality=100)
        samples.append((buf.getvalue(), i))
    write_split(samples, tmp_path, "train")
    calls = []

    def counting(blobs):
        calls.append(len(blobs))
        return _pillow_on_device(blobs)

    cpu = _loader(tmp_path, batch_size=4, epochs=2)
    dev = _loader(tmp_path, batch_size=4, epochs=2, device_decode=counting, channels_last=True)
    assert dev.dataset.raw and not cpu.dataset.raw
    for (x, y), (dx, dy) in zip(cpu.batches(0), dev.batches(0)):
        assert torch.equal(y, dy) and x.shape == dx.shape
        assert torch.allclose(x, dx, atol=0.05)  # standardized units: 0.05 x 0.25 x 255 = 3 grey levels (JPEG)
        assert dx.is_contiguous(memory_format=torch.channels_last)
    assert calls == [4] * cpu.steps


def test_device_decoder_choices_and_the_fallback_note():
    from speedrun.data.shard_loader import device_decoder

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert device_decoder("auto", cpu) == (None, None)
    assert device_decoder("pillow", cuda) == (None, None)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        device_decoder("nvjpeg", cpu)
    with pytest.raises(ValueError, match="decoder must be"):
        device_decoder("dali", cpu)
    try:
        import torchcodec.decoders  # noqa: F401
        pytest.skip("TorchCodec loads here: the fallback cannot be shown")
    except Exception:  # noqa: BLE001 -- what device_decoder catches
        pass
    decode, note = device_decoder("auto", cuda)
    assert decode is None and "pip install 'speedrun[gpu]'" in note and "Pillow" in note
    with pytest.raises(ValueError, match="decoder=nvjpeg: TorchCodec is not usable"):
        device_decoder("nvjpeg", cuda)
