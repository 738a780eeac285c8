"""`speedrun bench-loader`: both pipelines measured, one row per setting, interleaved order, images counted,
one-line errors, and the JSON report read back and rendered. No assertion on time (benchmarks measure,
tests check)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import load_benchmark
from speedrun.instruments.bench_loader import PlainImages, find_split, int_list, markdown
from speedrun.cli.program import main
from speedrun.data.shards import write_split
from speedrun.records.result_file import load_result
from speedrun.report.portable import portable_paths

CLASSES = ("n001", "n002", "n003")


def _photo(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(shards, originals): 12 JPEGs of mixed sizes in originals/val/<class>/, and the same as a val split of
    shards (written directly: data prepare has its own tests)."""
    root = tmp_path_factory.mktemp("bench_loader")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(12):
        label = i % len(CLASSES)
        im = _photo(rng, int(rng.integers(24, 60)), int(rng.integers(24, 60)))
        folder = root / "originals" / "val" / CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        im.save(folder / f"{i:03d}.JPEG", quality=90)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        samples.append((buf.getvalue(), label))
    (root / "shards").mkdir()
    write_split(samples, root / "shards", "val", shard_bytes=20_000)
    return root / "shards", root / "originals"


TINY = ["--workers", "0,1", "--res", "16,24", "--batch", "4", "--batches", "2", "--runs", "2", "--decode-px", "32",
        "--device", "cpu"]


def test_both_pipelines_one_row_each_interleaved_counted_and_the_json_reads_back(data, tmp_path, capsys):
    shards, originals = data
    out = tmp_path / "report.json"
    assert main(["bench-loader", str(shards), *TINY, "--baseline", str(originals), "--json", str(out)]) == 0
    captured = capsys.readouterr()
    settings = [(p, w, r) for w in (0, 1) for r in (16, 24) for p in ("ours", "baseline")]
    rows = [line.split() for line in captured.out.splitlines() if line.startswith(("ours ", "baseline "))]
    assert [(p, int(w), int(r)) for p, w, r, *_ in rows] == settings
    # The log says the measurements ran round by round, every setting once per round.
    logged = [re.match(r"round (\d)/2: (\w+), (\d) workers?, (\d+) px: ", line).groups()
              for line in captured.err.splitlines() if line.startswith("round ")]
    assert [(int(k), p, int(w), int(r)) for k, p, w, r in logged] == [(k, *s) for k in (1, 2) for s in settings]
    report = load_result(out)
    assert report["benchmark"] == "bench_loader" and report["split"] == "val" and report["images"] == 12
    assert report["baseline_images"] == 12 and report["command"].startswith("speedrun bench-loader ")
    assert [(o["round"], o["pipeline"], o["workers"], o["res"]) for o in report["order"]] == \
        [(k, *s) for k in range(2) for s in settings]
    assert [(s["pipeline"], s["workers"], s["res"]) for s in report["settings"]] == settings
    for s in report["settings"]:
        assert s["n"] == 2 and s["images_timed"] == [2 * 4, 2 * 4]  # batches x batch, each run
        assert len(s["images_per_s"]) == 2 and all(v > 0 for v in s["images_per_s"])
        assert (s["versus_baseline"] is None) == (s["pipeline"] == "baseline")
    ours = report["settings"][0]
    base = report["settings"][1]
    ratio = ours["versus_baseline"]
    assert ratio["ratio"] == pytest.approx(np.mean(ours["images_per_s"]) / np.mean(base["images_per_s"]))
    assert ratio["ratio_ci95"][0] <= ratio["ratio"] <= ratio["ratio_ci95"][1]
    # What was printed is what was stored.
    assert [" ".join(row[4:7]) for row in rows] == \
        [f"{s['summary']['mean']:.0f} ± {s['summary']['std']:.0f}" for s in report["settings"]]
    la = report["load_average"]
    assert len(la["before"]) == len(la["after"]) == 3
    # BENCHMARKS.md's table: one row per (workers, px), from the file as stored.
    table_py = load_benchmark("table")
    table = table_py.tables([out])["bench_loader"]
    assert table == portable_paths(markdown(report), table_py.REPO)  # the machine's paths shown portably
    assert str(tmp_path) not in table
    body = [line for line in table.splitlines() if line.startswith("| 20")]
    assert [tuple(line.split(" | ")[2:4]) for line in body] == [("0", "16"), ("0", "24"), ("1", "16"), ("1", "24")]


def test_without_a_baseline_only_ours_is_measured(data, capsys):
    shards, _ = data
    argv = ["bench-loader", str(shards), *TINY[:4], "--batch", "3", "--batches", "1", "--runs", "1", "--decode-px",
            "32", "--device", "cpu"]
    assert main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("ours", "baseline"))]
    assert [row[:3] for row in rows] == [["ours", "0", "16"], ["ours", "0", "24"], ["ours", "1", "16"],
                                         ["ours", "1", "24"]]
    assert all(row[-1] == "-" for row in rows)


@pytest.mark.parametrize("extra,fragment", [
    (["--split", "train"], "--split train: "),
    (["--res", "0"], "--res values must be 8 to 1024, got '0'"),
    (["--workers", "-1"], "--workers values must be 0 to 64, got '-1'"),
    (["--workers", "one"], "--workers takes whole numbers"),
    (["--batch", "0"], "--batch must be 1 to 4096"),
    (["--baseline", "/nonexistent/originals"], "--baseline /nonexistent/originals is not a folder"),
    (["--device", "tpu"], "device (--device) must be one of"),
    # what the batches in flight would take, checked before any is allocated (103 GB; the test says 16 GiB is free)
    (["--batch", "4096", "--res", "1024"], "--batch 4096 at --res 1024 px with --decode-px"),
])
def test_bad_flags_are_one_line_and_exit_2(data, extra, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("speedrun.data.limits.available_memory_bytes", lambda: 16 * 2**30)
    shards, _ = data
    out = tmp_path / "r.json"
    assert main(["bench-loader", str(shards), *TINY, *extra, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("speedrun: error: ")
    assert not out.exists()  # the claimed report file is given back


@pytest.mark.parametrize("make,fragment", [
    (lambda p: p.mkdir(), "holds no prepared shards"),
    (lambda p: None, "is not a folder"),
    (lambda p: (p.mkdir(), (p / "val-index.npy").write_bytes(b"not numpy")), "cannot read the shard index"),
])
def test_a_dir_that_is_not_shards_is_one_line_and_exit_2(make, fragment, tmp_path, capsys):
    target = tmp_path / "not-shards"
    make(target)
    assert main(["bench-loader", str(target), *TINY]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("speedrun: error: ")


def test_the_memory_estimate_grows_with_every_setting_and_counts_the_float_batch():
    from speedrun.instruments.bench_loader import batch_bytes
    base = batch_bytes(256, 8, 192, 256)
    assert base >= 256 * 3 * 192 * 192 * 4  # the float32 batch on the device, at least
    for more in (batch_bytes(512, 8, 192, 256), batch_bytes(256, 16, 192, 256), batch_bytes(256, 8, 224, 256),
                 batch_bytes(256, 8, 192, 320)):
        assert more > base
    assert batch_bytes(256, 0, 192, 256) < base


def test_the_split_is_train_or_the_only_one(tmp_path):
    for split in ("val", "test"):
        np.save(tmp_path / f"{split}-index.npy", np.zeros((0, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="choose one with --split"):
        find_split(tmp_path, None)
    assert find_split(tmp_path, "test") == "test"
    np.save(tmp_path / "train-index.npy", np.zeros((0, 4), dtype=np.int64))
    assert find_split(tmp_path, None) == "train"
    assert int_list("2, 1,2", "--workers", 0, 4) == [2, 1]


def test_the_baseline_crops_resizes_and_flips_in_pillow(tmp_path):
    """A one-colour image stays that colour whatever the box; one dark on the left and bright on the right comes
    out mirrored about half the time."""
    flat = tmp_path / "flat.png"  # PNG: no JPEG rounding, so the colour is exact
    Image.new("RGB", (50, 40), (10, 200, 30)).save(flat)
    halves = np.zeros((40, 80, 3), dtype=np.uint8)
    halves[:, 40:] = 255
    split = tmp_path / "split.png"
    Image.fromarray(halves).save(split)
    torch.manual_seed(0)
    x, label = PlainImages([str(flat)], [7], 24)[0]
    assert x.shape == (3, 24, 24) and x.dtype == torch.uint8 and label == 7
    assert torch.equal(x, torch.tensor([10, 200, 30], dtype=torch.uint8).view(3, 1, 1).expand(3, 24, 24))
    spanning = bright_left = 0
    for _ in range(300):
        x, _ = PlainImages([str(split)], [0], 16)[0]
        left, right = x[:, :, 0].float().mean(), x[:, :, -1].float().mean()
        assert left in (0, 255) or right in (0, 255)  # a crop is >= 14 px wide: one edge is away from the seam
        spanning += int(left != right)
        bright_left += int(left > right)
    assert spanning > 50  # crops across the seam show which way the image faces
    assert 0.3 < bright_left / spanning < 0.7  # mirrored about half the time (never, without the flip)


def test_decoder_nvjpeg_without_cuda_is_one_line(tmp_path, capsys):
    root = tmp_path / "s"
    root.mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (20, 20)).save(buf, "JPEG")
    write_split([(buf.getvalue(), 0)] * 4, root, "train")
    code = main(["bench-loader", str(root), "--device", "cpu", "--decoder", "nvjpeg", "--runs", "1",
                 "--batches", "1", "--batch", "2", "--workers", "0", "--res", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a CUDA device" in err[0]
