"""data/prepare.py: one source image as a shard's bytes: upright, RGB, bounded, JPEG; a bad file named."""

import io

import numpy as np
import pytest
from PIL import Image

from speedrun.data.prepare import prepare_image


def _save(path, im, fmt, **kwargs):
    im.save(path, format=fmt, **kwargs)
    return str(path)


def _decoded(prepared) -> Image.Image:
    im = Image.open(io.BytesIO(prepared.jpeg))
    assert im.format == "JPEG" and im.mode == "RGB" and im.size == (prepared.width_px, prepared.height_px)
    return im


def _marked(width=120, height=80) -> Image.Image:
    """A grey image with a red block in its top-left corner: where the corner ends up shows the rotation."""
    a = np.full((height, width, 3), 128, np.uint8)
    a[:20, :20] = (255, 0, 0)
    return Image.fromarray(a)


def test_modes_and_formats_all_become_rgb_jpeg(tmp_path):
    rgb = _marked()
    cases = {"gray.JPEG": (rgb.convert("L"), "JPEG", "L"), "cmyk.JPEG": (rgb.convert("CMYK"), "JPEG", "CMYK"),
             "png-named-jpeg.JPEG": (rgb, "PNG", "RGB"), "palette.png": (rgb.convert("P"), "PNG", "P"),
             "alpha.png": (rgb.convert("RGBA"), "PNG", "RGBA")}
    for name, (im, fmt, mode) in cases.items():
        out = prepare_image(_save(tmp_path / name, im, fmt), 256, 90)
        back = np.asarray(_decoded(out))
        assert (out.source_format, out.source_mode, out.rotated, out.resized) == (fmt, mode, False, False), name
        assert (out.width_px, out.height_px) == (120, 80)
        # the content survives: each pixel near the source's own RGB rendering (within JPEG q90's error)
        source = np.asarray(im.convert("RGB")).astype(int)
        for y, x in ((5, 5), (60, 100)):
            assert np.abs(back[y, x].astype(int) - source[y, x]).max() < 16, (name, back[y, x], source[y, x])


def test_exif_orientation_is_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": stored 120x80, shown 80x120 with the corner at the top right
    path = _save(tmp_path / "phone.jpg", _marked(), "JPEG", exif=exif)
    out = prepare_image(path, 256, 95)
    assert out.rotated and (out.width_px, out.height_px) == (80, 120)
    back = np.asarray(_decoded(out))
    assert back[5, 75, 0] > 200 and back[5, 5, 0] < 160  # red now at the top right, not the top left


def test_large_images_shrink_to_the_longer_side_and_small_ones_stay(tmp_path):
    out = prepare_image(_save(tmp_path / "big.jpg", _marked(1000, 600), "JPEG"), 256, 90)
    assert out.resized and (out.width_px, out.height_px) == (256, 154)
    out = prepare_image(_save(tmp_path / "small.png", _marked(100, 60), "PNG"), 256, 90)
    assert not out.resized and (out.width_px, out.height_px) == (100, 60)


def test_a_bad_file_is_one_error_naming_it(tmp_path):
    good = tmp_path / "good.jpg"
    _marked().save(good, format="JPEG")
    data = good.read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.JPEG").write_text("not an image")
    (tmp_path / "gif.jpg").write_bytes(b"GIF89a" + b"\0" * 64)
    for name in ("cut.jpg", "text.JPEG", "gif.jpg"):
        with pytest.raises(ValueError, match=name):
            prepare_image(str(tmp_path / name), 256, 90)
    for bad in ((8, 90), (256, 0), (256, 101)):
        with pytest.raises(ValueError, match="px|quality"):
            prepare_image(str(good), *bad)
