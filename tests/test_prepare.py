"""data/prepare.py: one source image as a shard's bytes: upright, RGB, bounded, JPEG; a bad file named.
data/prepare_tree.py: a folder tree as shards, labels by class folder, only what changed again, DST safe."""

import concurrent.futures as cf
import io
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from speedrun.data.prepare import SourceFile, prepare_all, prepare_image
from speedrun.data.prepare_tree import prepare_tree
from speedrun.data.shards import Shards
from speedrun.errors import SpeedrunWarning, printable


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


# ---- prepare_tree: an image folder tree as shards (`speedrun data prepare`) ----

IMAGENET_SAMPLE = Path(os.environ.get("SPEEDRUN_IMAGENET_SAMPLE", Path(__file__).resolve().parents[2] / "shared"
                                      / "datasets" / "imagenet-sample"))


def _gradient(width=48, height=32) -> Image.Image:
    """Smooth (JPEG keeps it within a few levels), different in every corner, a red block at the top left."""
    y, x = np.mgrid[0:height, 0:width]
    a = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 96)], axis=-1).astype(np.uint8)
    a[:8, :8] = (255, 0, 0)
    return Image.fromarray(a)


def _tree(root: Path) -> Path:
    """SRC with train/{cat,dog} in every mode and format, an EXIF-rotated photo, a large image, a corrupt file and a
    note; val/{cat,dog} with one image each. Returns SRC."""
    rgb = _gradient()
    cat, dog, vcat, vdog = (root / "src" / s / c for s, c in (("train", "cat"), ("train", "dog"), ("val", "cat"),
                                                               ("val", "dog")))
    for d in (cat, dog, vcat, vdog):
        d.mkdir(parents=True)
    _save(cat / "big.jpg", _gradient(200, 100), "JPEG", quality=95)  # resized to 64x32
    _save(cat / "cmyk.JPEG", rgb.convert("CMYK"), "JPEG", quality=95)
    _save(cat / "gray.JPEG", rgb.convert("L"), "JPEG", quality=95)
    _save(cat / "rgb.JPEG", rgb, "JPEG", quality=95)
    _save(dog / "alpha.png", rgb.convert("RGBA"), "PNG")
    good = _save(dog / "broken.JPEG", rgb, "JPEG")
    (dog / "broken.JPEG").write_bytes(Path(good).read_bytes()[:300])  # truncated inside its scan
    _save(dog / "palette.png", rgb.convert("P", palette=Image.Palette.ADAPTIVE), "PNG")  # undithered
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 48x32; shown rotated 90 degrees clockwise, 32x48
    _save(dog / "phone.jpg", rgb, "JPEG", quality=95, exif=exif)
    _save(dog / "png.JPEG", rgb, "PNG")  # PNG bytes named .JPEG, as in ImageNet
    (dog / "notes.txt").write_text("not an image")
    _save(vcat / "v.jpg", rgb, "JPEG", quality=95)
    _save(vdog / "v.png", rgb, "PNG")
    return root / "src"


TRAIN_GOOD = ["cat/big.jpg", "cat/cmyk.JPEG", "cat/gray.JPEG", "cat/rgb.JPEG", "dog/alpha.png", "dog/palette.png",
              "dog/phone.jpg", "dog/png.JPEG"]


def _prepare(src, dst, **kwargs):
    """prepare_tree at 64 px in this process (tests), its warnings returned as one-line strings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prepare_tree(src, dst, **{"max_side_px": 64, "workers": 0, **kwargs})
    return report, [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]


def _files(dst: Path) -> dict[str, tuple[bytes, int]]:
    """Every file in DST: its bytes and mtime_ns (a rewritten file changes its mtime even with the same bytes)."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(dst.iterdir())}


def _split(report, name):
    return next(s for s in report.splits if s.split == name)


def test_every_image_once_upright_rgb_with_its_label_and_the_corrupt_one_named(tmp_path):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    report, warned = _prepare(src, dst)
    assert json.loads((dst / "classes.json").read_text()) == ["cat", "dog"]
    train = _split(report, "train")
    assert (train.written, train.skipped, train.ignored) == (8, ["dog/broken.JPEG"], 1)
    assert dict(train.converted) == {"CMYK": 1, "L": 1, "P": 1, "RGBA": 1}
    assert (train.rotated, train.resized, train.png_named_jpeg) == (1, 1, 1)
    assert len(warned) == 1 and "broken.JPEG" in warned[0] and "train: skipped" in warned[0]
    assert "dog/broken.JPEG" in train.line() and "8 written" in train.line()
    with Shards(dst, "train") as shards:
        assert len(shards) == 8
        for i, rel in enumerate(TRAIN_GOOD):
            assert shards.label(i) == ["cat", "dog"].index(rel.split("/")[0]), rel
            got = np.asarray(Image.open(io.BytesIO(shards.read(i))).convert("RGB")).astype(int)
            with Image.open(src / "train" / rel) as im:  # the file's own pixels, upright and shrunk like prepare's
                ref = ImageOps.exif_transpose(im).convert("RGB")
            ref.thumbnail((64, 64), Image.Resampling.LANCZOS)
            assert got.shape == np.asarray(ref).shape, rel
            assert np.abs(got - np.asarray(ref).astype(int)).mean() < 4, rel
        # orientation 6: the stored 48x32 pixels turned 90 degrees clockwise (the red block goes to the top right)
        phone = np.asarray(Image.open(io.BytesIO(shards.read(TRAIN_GOOD.index("dog/phone.jpg"))))).astype(int)
        stored = np.asarray(Image.open(src / "train" / "dog" / "phone.jpg").convert("RGB")).astype(int)
        assert phone.shape == (48, 32, 3) and np.abs(phone - np.rot90(stored, k=-1)).mean() < 4
        assert phone[2, 29, 0] > 200 and phone[2, 2, 0] < 120
    with Shards(dst, "val") as shards:
        assert [shards.label(i) for i in range(len(shards))] == [0, 1]
    # deterministic: a second DST, and 2 worker processes instead of none, gives the same bytes
    _prepare(src, tmp_path / "again", workers=2)
    assert {k: v[0] for k, v in _files(dst).items()} == {k: v[0] for k, v in _files(tmp_path / "again").items()}


def test_on_error_stop_names_the_file_and_leaves_dst_as_it_was(tmp_path):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    with pytest.raises(ValueError, match=r"broken\.JPEG.*--on-error skip"):
        _prepare(src, dst, on_error="stop")
    assert not dst.exists()  # it did not exist before
    _prepare(src, dst)
    before = _files(dst)
    os.utime(src / "train" / "cat" / "rgb.JPEG", ns=(1, 1))  # train must be prepared again, and stops
    with pytest.raises(ValueError, match="broken.JPEG"):  # in 2 worker processes this time
        _prepare(src, dst, on_error="stop", workers=2)
    assert _files(dst) == before


def test_a_second_run_does_nothing_and_a_change_redoes_only_its_split(tmp_path):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    _prepare(src, dst)
    before = _files(dst)
    report, warned = _prepare(src, dst)
    assert report.up_to_date and report.lines()[0].endswith("up to date: nothing to do")
    assert "dog/broken.JPEG" not in " ".join(report.lines()) and "1 skipped when prepared" in report.lines()[1]
    assert _files(dst) == before and warned == []  # nothing rewritten, not even the manifest
    os.utime(src / "val" / "cat" / "v.jpg", ns=(10**18, 10**18))  # touched
    report, _ = _prepare(src, dst)
    assert [s.up_to_date for s in report.splits] == [True, False]  # train as it was, val redone
    after = _files(dst)
    assert after["train-00000.tar"] == before["train-00000.tar"] and after["val-00000.tar"][1] != before[
        "val-00000.tar"][1]
    _save(src / "val" / "dog" / "w.jpg", _gradient(), "JPEG")  # added
    report, _ = _prepare(src, dst)
    assert not _split(report, "val").up_to_date and _split(report, "val").written == 3
    report, _ = _prepare(src, dst, quality=80)  # other settings: everything again
    assert not any(s.up_to_date for s in report.splits)
    (dst / "val-00000.tar").unlink()  # shards gone: that split again, whatever the manifest says
    report, _ = _prepare(src, dst, quality=80)
    assert [s.up_to_date for s in report.splits] == [True, False]
    with Shards(dst, "val") as shards:
        assert len(shards) == 3


def test_fewer_images_remove_only_that_splits_stale_shards(tmp_path):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    _prepare(src, dst, shard_bytes=1)  # one image per shard
    assert sorted(p.name for p in dst.glob("train-*.tar")) == [f"train-{i:05d}.tar" for i in range(8)]
    others = ["notes.txt", "train-00007.tar.bak", "train-7.tar", "train-000007.tar", "val-00009.tar", "x-00007.tar"]
    for name in others:
        (dst / name).write_text("someone else's")
    (dst / "train-00009.tar").mkdir()  # a folder with our name is not ours either
    for rel in ("cat/gray.JPEG", "dog/alpha.png", "dog/png.JPEG"):
        (src / "train" / rel).unlink()
    source_before = sorted(p for p in src.rglob("*"))
    report, _ = _prepare(src, dst, shard_bytes=1)
    assert _split(report, "train").written == 5 and _split(report, "val").up_to_date
    shards = sorted(p.name for p in dst.glob("train-0000?.tar") if p.is_file())
    assert shards == [f"train-{i:05d}.tar" for i in range(5)]
    assert all((dst / name).read_text() == "someone else's" for name in others) and (dst / "train-00009.tar").is_dir()
    assert sorted(p for p in src.rglob("*")) == source_before
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]  # no staging folder or temporary left
    with Shards(dst, "train") as shards:
        assert [shards.label(i) for i in range(len(shards))] == [0, 0, 0, 1, 1]


HOSTILE_MANIFESTS = {
    "not JSON": b"not json", "not UTF-8": b"\xff\xfe", "a list": b"[]",
    "version true": b'{"format": "speedrun data prepare", "version": true}',
    "nested 100,000 deep": b"[" * 100_000, "an int of 5,000 digits": b"9" * 5000, "over 1 MiB": b" " * (2**20 + 1),
    "a setting of another type": b'{"format": "speedrun data prepare", "version": 1, "settings": {"quality": "90"}, '
                                 b'"classes_sha256": "", "splits": {}}',
}


@pytest.mark.parametrize("manifest", HOSTILE_MANIFESTS.values(), ids=HOSTILE_MANIFESTS.keys())
def test_a_hostile_manifest_is_no_manifest(tmp_path, manifest):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    _prepare(src, dst)
    good = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_bytes(manifest)
    report, _ = _prepare(src, dst)
    assert not any(s.up_to_date for s in report.splits)  # prepared again, no crash
    assert json.loads((dst / "manifest.json").read_text()) == good


def test_a_manifest_that_is_a_fifo_or_claims_other_splits(tmp_path):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    _prepare(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["splits"]["train"]["fingerprint"] = "0" * 64  # a changed source
    manifest["splits"]["test"] = manifest["splits"]["val"]  # a split SRC does not have
    (dst / "manifest.json").write_text(json.dumps(manifest))
    report, warned = _prepare(src, dst)
    assert [s.up_to_date for s in report.splits] == [False, True]
    assert any("split test" in w for w in warned)
    (dst / "manifest.json").unlink()
    os.mkfifo(dst / "manifest.json")  # reading it would block forever
    report, _ = _prepare(src, dst)
    assert not report.up_to_date and json.loads((dst / "manifest.json").read_text())["version"] == 1


@pytest.mark.parametrize("splits, missing", [(("val",), "has no train/ folder"), (("test",), "has no train/ folder"),
                                             (("train",), "has no val/ or test/ folder"),
                                             ((), "holds class folders, not train/ and val/ (or test/) folders"),
                                             (("train", "val"), None), (("train", "test"), None)])
def test_shards_that_train_would_refuse_are_warned_about_before_any_image_is_prepared(tmp_path, monkeypatch, splits,
                                                                                       missing):
    """A tree without train/, or without val/ and test/, prepares as before, with one warning first saying that
    `speedrun train` refuses such shards and what to add; a tree train can use, none."""
    src = tmp_path / "src"
    for split in splits or ("",):
        (src / split / "c").mkdir(parents=True)
        _save(src / split / "c" / "x.png", _gradient(), "PNG")
    order = []
    from speedrun.data import prepare_tree as tree

    write = tree._write
    monkeypatch.setattr(tree, "_write", lambda *a, **k: (order.append("prepared"), write(*a, **k))[1])
    monkeypatch.setattr(tree, "warn", lambda message: (order.append(message), warnings.warn(message, SpeedrunWarning)))
    report, warned = _prepare(src, tmp_path / "dst")
    assert [s.split for s in report.splits] == list(splits or ("train",))
    if missing is None:
        assert warned == [] and order == ["prepared"]
        return
    assert len(warned) == 1 and warned[0].startswith(f"{src} {missing}, so its shards will hold "), warned
    assert "which speedrun train refuses" in warned[0] and "to train on them, " in warned[0]
    assert order == [warned[0], "prepared"]  # said before the work, not after it


def test_layouts_and_paths(tmp_path):
    flat = tmp_path / "flat"  # SRC/<class>/<image>: one split, train
    for c in ("b", "a"):
        (flat / c).mkdir(parents=True)
        _save(flat / c / "x.png", _gradient(), "PNG")
    (flat / "empty").mkdir()  # kept in the index (its label is its position), with a warning
    report, warned = _prepare(flat, tmp_path / "out")
    assert [s.split for s in report.splits] == ["train"] and _split(report, "train").written == 2
    assert json.loads((tmp_path / "out" / "classes.json").read_text()) == ["a", "b", "empty"]
    assert any("empty" in w and "holds no images" in w for w in warned)
    cifar = tmp_path / "cifar"  # train/ and test/
    for s in ("train", "test"):
        (cifar / s / "c").mkdir(parents=True)
        _save(cifar / s / "c" / "x.jpg", _gradient(), "JPEG")
    report, _ = _prepare(cifar, tmp_path / "cifar-out")
    assert [s.split for s in report.splits] == ["train", "test"]
    (cifar / "test" / "d").mkdir()  # a class train/ has not
    for src, dst, message in [
        (cifar, tmp_path / "cifar-out2", "class folder.*d; labels come from train"),
        (tmp_path / "missing", tmp_path / "o", "missing does not exist"),
        (flat, flat, "inside SRC"), (flat, flat / "a" / "shards", "inside SRC"),
        (flat, flat / "a" / "x.png", "inside SRC"),
        (tmp_path / "flat" / "a" / "x.png", tmp_path / "o", "is not a folder"),
        (tmp_path / "out", tmp_path / "o", "no class folders"),
    ]:
        with pytest.raises(ValueError, match=message):
            _prepare(src, dst)
    (tmp_path / "link").symlink_to(flat, target_is_directory=True)  # DST reached through a link into SRC
    with pytest.raises(ValueError, match="inside SRC"):
        _prepare(flat, tmp_path / "link" / "out")
    (tmp_path / "noimages" / "c").mkdir(parents=True)
    (tmp_path / "noimages" / "c" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match="no .jpg/.jpeg/.png images"):
        _prepare(tmp_path / "noimages", tmp_path / "o")
    for bad in ({"workers": -1}, {"on_error": "ignore"}, {"quality": 0}, {"max_side_px": 8}):
        with pytest.raises(ValueError, match="workers|on-error|quality|max side"):
            _prepare(flat, tmp_path / "o", **bad)


def test_odd_names_links_and_loops_are_named_printably(tmp_path):
    src = tmp_path / "src"
    odd_class = os.fsdecode(b"c\nl\xff")  # a newline and a byte that is not UTF-8
    (src / odd_class).mkdir(parents=True)
    _save(src / odd_class / "ok.jpg", _gradient(), "JPEG")
    (src / odd_class / "bad\nname.jpg").write_bytes(os.urandom(2000))  # random bytes named .jpg
    (src / odd_class / "loop.jpg").symlink_to(src / odd_class / "loop.jpg")  # a symlink loop
    (src / odd_class / "gone.png").symlink_to(tmp_path / "nowhere.png")  # a broken link
    (src / odd_class / "folder.jpg").mkdir()  # a folder named like an image
    (src / odd_class / "sub").mkdir()  # and one that is not: ignored, never entered
    (src / odd_class / "sub" / "loop").symlink_to(src, target_is_directory=True)
    report, warned = _prepare(src, tmp_path / "dst")
    train = _split(report, "train")
    assert train.written == 1 and len(train.skipped) == 4 and train.ignored == 1
    assert "which speedrun train refuses" in warned.pop(0)  # class folders without split folders: no val/
    assert len(warned) == 4 and all("\n" not in w and "\\n" in w for w in warned)
    assert all(w.isprintable() for w in warned) and any("\\xff" in w for w in warned)
    assert json.loads((tmp_path / "dst" / "classes.json").read_text()) == [printable(odd_class)]
    assert "\n" not in " ".join(report.lines())


def test_results_stream_in_order_with_a_bounded_number_waiting(tmp_path):
    """What is submitted to the workers runs at most 2 chunks per worker (+1) ahead of what has been consumed: the
    prepared images never pile up in memory, however many files a split has."""
    path = _save(tmp_path / "x.jpg", _gradient(), "JPEG")
    files = [SourceFile(path, f"c/{i}.jpg", 0, 1, 1) for i in range(300)]
    files.append(SourceFile(str(tmp_path), "c/d.jpg", 0, 1, 1))  # a folder named .jpg: its reason comes last

    class CountingPool:  # runs each chunk at once, and counts what was handed out
        submitted = 0

        def submit(self, fn, paths, *args):
            self.submitted += len(paths)
            future = cf.Future()
            future.set_result(fn(paths, *args))
            return future

    pool, consumed = CountingPool(), 0
    for out in prepare_all(files, pool, 2, 64, 90):
        consumed += 1
        assert pool.submitted - consumed <= (2 * 2 + 1) * 16
        assert isinstance(out, str) == (consumed == len(files))  # in order: the folder named .jpg is last
    assert consumed == pool.submitted == len(files)


def test_imagenet_sample_once_each_with_its_wnid_label(tmp_path):
    val = IMAGENET_SAMPLE / "val"
    if not val.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"CI needs {val} (shared/datasets/imagenet-sample beside the clone)")
        pytest.skip(f"{val} not present")
    wnids = sorted(p.name for p in val.iterdir())
    report, warned = _prepare(IMAGENET_SAMPLE, tmp_path / "dst", workers=2)
    assert [s.split for s in report.splits] == ["val"]
    assert len(warned) == 1 and warned[0].startswith(f"{IMAGENET_SAMPLE} has no train/ folder")  # val/ alone
    rep = _split(report, "val")
    assert (rep.written, rep.skipped, rep.ignored) == (1000, [], 0)
    # 23 grayscale; 1 EXIF-rotated (orientation 6): 2 more carry orientation 0, which is no rotation
    assert rep.converted == {"L": 23} and rep.rotated == 1
    assert json.loads((tmp_path / "dst" / "classes.json").read_text()) == wnids
    with Shards(tmp_path / "dst", "val") as shards:
        assert [shards.label(i) for i in range(len(shards))] == list(range(1000))  # one image per wnid, in order
        for i in (0, 500, 999):
            im = Image.open(io.BytesIO(shards.read(i)))
            assert im.mode == "RGB" and max(im.size) <= 64
    before = _files(tmp_path / "dst")
    report, _ = _prepare(IMAGENET_SAMPLE, tmp_path / "dst", workers=2)
    assert report.up_to_date and _files(tmp_path / "dst") == before


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_not_clipped(tmp_path):
    """ImageNet-class trees hold 16-bit grayscale PNGs now and then; they become RGB with value v / 257."""
    import numpy as np
    from PIL import Image

    from speedrun.data.prepare import prepare_image

    ramp = (np.arange(64, dtype=np.uint16)[None, :].repeat(8, 0) * 1040)  # 0 .. 65520
    path = tmp_path / "deep.png"
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode in ("I;16", "I")
    out = prepare_image(str(path), 256, 100)
    with Image.open(__import__("io").BytesIO(out.jpeg)) as im:
        got = np.asarray(im.convert("RGB"), dtype=np.float64)[..., 0]
    assert out.source_mode in ("I;16", "I") and got.shape == (8, 64)
    assert np.abs(got - ramp / 257.0).max() < 4  # JPEG at quality 100; clipping would leave 255 from column 1 on
