"""`speedrun bench-loader DIR`: the images/s of the input path alone, prepared shards against a plain Pillow +
DataLoader pipeline over the original JPEGs.

- Ours: data/shard_loader.py's ShardLoader over DIR (what `speedrun data prepare` wrote): workers read a sample
  with one pread and decode it to a `decode_px` square; random-resized crop, flip and standardization on the
  device.
- Baseline (--baseline SRC): what a user writes without us. A torch Dataset that opens each original JPEG with
  Pillow, converts it to RGB, cuts a random-resized crop (the same box distribution as ours) resized to `res` px
  with Pillow's bilinear filter, flips it half the time, and returns a uint8 tensor; the default collate, a
  DataLoader with the same batch, workers and pinned memory on CUDA; then the copy to the device and a float
  standardization there. No `draft` (DCT-scaled decoding): a plain user does not know it.

Both run through many epochs without a new iterator (ours by design; the baseline's RandomSampler draws
consecutive permutations), so no worker restarts inside a measurement. Round r measures every setting in turn,
A B C D A B C D ..., as `speedrun bench` does, so drift on a shared machine falls on all alike; the order is
recorded, and so is the load average before and after.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from speedrun.data import folder, limits
from speedrun.data.prepare import list_source
from speedrun.data.shard_loader import ShardLoader, device_decoder, random_resized_boxes
from speedrun.data.shards import Shards
from speedrun.engine.loop import Timer
from speedrun.engine.system import resolve_device, synchronize
from speedrun.errors import print_line
from speedrun.records.environment import device_label, environment
from speedrun.records.stats import mean_diff_test, summarize

TIMED_REGION = ("from asking the iterator for a batch to holding it on the device cropped, resized, flipped and "
                "standardized (worker decode + augment + copy), over consecutive batches after untimed warm-up "
                "batches, device synchronized at both ends; worker start-up (new iterator to first batch) is "
                "timed apart")
# ImageNet's channel statistics (as torchvision's references and FFCV), on the 0-1 scale.
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
SPLITS = ("train", "val", "test")
PIPELINES = ("ours", "baseline")


def int_list(text: str, flag: str, low: int, high: int) -> list[int]:
    """"1,2" -> [1, 2], each in [low, high], repeats dropped; a ValueError naming `flag` otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas (e.g. {flag} {low},{low + 1}), "
                         f"got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{flag} values must be {low} to {high}, got {text!r}")
    return list(dict.fromkeys(values))


def _check(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ValueError(f"{name} must be {low} to {high}, got {value}")
    return value


def find_split(root: Path, split: str | None) -> str:
    """The split of DIR to read: `split`, or train, or the only one there; ValueError naming what is there."""
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder; give the folder `speedrun data prepare` wrote")
    present = [s for s in SPLITS if (root / f"{s}-index.npy").is_file()]
    if not present:
        raise ValueError(f"{root} holds no prepared shards (no train-, val- or test-index.npy); "
                         f"run speedrun data prepare SRC {root} first")
    if split is None:
        if "train" in present or len(present) == 1:
            return "train" if "train" in present else present[0]
        raise ValueError(f"{root} has the splits {', '.join(present)}; choose one with --split")
    if split not in present:
        raise ValueError(f"--split {split}: {root} has {', '.join(present)}")
    return split


def baseline_files(src: Path, split: str) -> tuple[list[str], list[int]]:
    """The original images of `split` under SRC (a train/val/test tree or class folders: data/prepare.py's
    layouts), or of its only split; (paths, labels)."""
    if not src.is_dir():
        raise ValueError(f"--baseline {src} is not a folder; give the original images' folder")
    _, splits, _ = list_source(src)
    if split not in splits and len(splits) != 1:
        raise ValueError(f"--baseline {src} has no {split}/ folder (it has "
                         f"{', '.join(splits)}); give the tree the shards were prepared from")
    files = splits[split] if split in splits else next(iter(splits.values()))
    return [f.path for f in files], [f.label for f in files]


class PlainImages(torch.utils.data.Dataset):
    """The baseline's Dataset: (uint8 (3, res, res), label) per original file, augmented in Pillow."""

    def __init__(self, paths: list[str], labels: list[int], res: int):
        self.paths, self.labels, self.res = paths, labels, res

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        # The original files are from elsewhere: opened as data/prepare.py opens them (JPEG or PNG, a regular
        # file, the header's size checked before a pixel is decoded), each failure one ValueError naming the file.
        # A stat and a header check: nothing next to a decode.
        try:
            with folder.open_image(self.paths[i]) as im:
                folder.check_header(self.paths[i], im, self.res)
                rgb = im.convert("RGB")
        except folder.Refused as e:
            raise ValueError(f"--baseline: {e}") from None
        w, h = rgb.size
        # The box as torchvision's RandomResizedCrop draws it, from the global generator that DataLoader seeds
        # in each worker; fractions back to pixels (they are whole pixels divided by the size).
        x0, y0, bw, bh = random_resized_boxes(torch.tensor([[w, h]]), None)[0].tolist()
        box = (round(x0 * w), round(y0 * h), round((x0 + bw) * w), round((y0 + bh) * h))
        out = rgb.resize((self.res, self.res), Image.Resampling.BILINEAR, box=box)
        if torch.rand(()) < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(out, dtype=np.uint8)).permute(2, 0, 1), self.labels[i]  # (3, res, res)


def plain_batches(dataset: PlainImages, *, batch: int, steps: int, workers: int, device: torch.device,
                  seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The baseline's batches on the device, float and standardized: `steps` of them from one iterator."""
    pin = device.type == "cuda"
    sampler = torch.utils.data.RandomSampler(dataset, num_samples=steps * batch,
                                             generator=torch.Generator().manual_seed(seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                                         pin_memory=pin)
    mean, std = MEAN.to(device).view(1, 3, 1, 1), STD.to(device).view(1, 3, 1, 1)
    for images, labels in loader:
        x = images.to(device, non_blocking=pin).float().div_(255)
        yield (x - mean) / std, labels.to(device, non_blocking=pin)


def our_batches(root: Path, split: str, *, images: int, batch: int, steps: int, workers: int, res: int,
                decode_px: int, device: torch.device, seed: int,
                device_decode=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """ShardLoader's batches, `steps` of them over the split's `images` (counted once by the caller)."""
    loader = ShardLoader(str(root), split, batch_size=batch, epochs=steps * batch / images,
                         device=device, mean=MEAN, std=STD, res_at=lambda step: res, decode_px=decode_px,
                         workers=workers, seed=seed, device_decode=device_decode)
    assert loader.steps == steps, (loader.steps, steps)
    return loader.batches(0)


def _count(root: Path, split: str) -> int:
    with Shards(root, split) as shards:
        if len(shards) == 0:
            raise ValueError(f"the {split} split in {root} has no images")
        return len(shards)


def measure(batches: Iterator, *, warmup: int, count: int, res: int, device: torch.device) -> dict:
    """Start-up seconds (iterator to first batch), then `warmup` untimed batches, then `count` timed ones."""
    start = time.perf_counter()
    try:
        next(batches)
        synchronize(device)
        startup = time.perf_counter() - start
        for _ in range(warmup):
            next(batches)
        timer, images = Timer(device), 0
        timer.start()
        for _ in range(count):
            x, _ = next(batches)
            images += len(x)
        seconds = timer.stop()
    finally:
        batches.close()  # the workers stop here, outside the timed region
    assert x.shape[-2:] == (res, res) and x.device.type == device.type, (x.shape, x.device)
    return {"images_per_s": images / seconds, "seconds": seconds, "images": images, "startup_s": startup}


def batch_bytes(batch: int, workers: int, res: int, decode_px: int) -> int:
    """Bytes the batches in flight take, at least: each worker holds its prefetched uint8 decode_px squares
    (shard_loader's prefetch of 2 batches; the loading process one when there are no workers), and the batch on
    the device is cropped and resized to float32 twice over (the crop, then the standardized copy)."""
    in_flight = 2 * workers if workers else 1
    return batch * 3 * (decode_px * decode_px * (in_flight + 1) + 2 * 4 * res * res)


def bench_loader(root: str, *, split: str | None = None, workers: list[int], res: list[int], batch: int,
                 batches: int, runs: int, decode_px: int = 256, device: str = "auto", baseline: str | None = None,
                 seed: int = 0, decoder: str = "auto", log: Callable[[str], None] = print_line) -> dict:
    """Every (pipeline, workers, res) setting measured `runs` times, interleaved; returns the report."""
    root_path = Path(root)
    split = find_split(root_path, split)
    n = _count(root_path, split)
    for name, value, low, high in (("--batch", batch, 1, 4096), ("--batches", batches, 1, 100_000),
                                   ("--runs", runs, 1, 1000), ("--decode-px", decode_px, 8, 1024)):
        _check(name, value, low, high)
    limits.check_memory(batch_bytes(batch, max(workers), max(res), decode_px),
                        f"--batch {batch} at --res {max(res)} px with --decode-px {decode_px} and {max(workers)} "
                        "worker(s)", "lower --batch, --res or --decode-px, or give fewer --workers")
    dev = resolve_device(device)
    on_device, note = device_decoder(decoder, dev)  # nvJPEG through TorchCodec on CUDA, else the Pillow workers
    if note:
        log(f"note: {note}")
    plain = baseline_files(Path(baseline), split) if baseline is not None else None
    settings = [(p, w, r) for w in workers for r in res for p in PIPELINES if p == "ours" or plain is not None]
    rows = {s: [] for s in settings}
    order, load_before = [], os.getloadavg()
    for rnd in range(runs):
        for pipeline, w, r in settings:
            warmup = 2 * w + 2  # a DataLoader keeps 2 batches per worker in flight: drain what start-up filled
            steps = 1 + warmup + batches + 2 * w + 3  # and leave some unread: the end of the data is not timed
            if pipeline == "ours":
                it = our_batches(root_path, split, images=n, batch=batch, steps=steps, workers=w, res=r,
                                 decode_px=decode_px, device=dev, seed=seed + rnd, device_decode=on_device)
            else:
                it = plain_batches(PlainImages(*plain, r), batch=batch, steps=steps, workers=w, device=dev,
                                   seed=seed + rnd)
            m = measure(it, warmup=warmup, count=batches, res=r, device=dev)
            rows[(pipeline, w, r)].append(m)
            order.append({"round": rnd, "pipeline": pipeline, "workers": w, "res": r})
            log(f"round {rnd + 1}/{runs}: {pipeline}, {w} worker(s), {r} px: {m['images_per_s']:.0f} images/s "
                f"(start-up {m['startup_s']:.2f} s)")
    report = {"benchmark": "bench_loader", "dir": str(root), "split": split, "images": n, "baseline": baseline,
              "baseline_images": None if plain is None else len(plain[0]), "batch": batch, "batches": batches,
              "runs": runs, "decode_px": decode_px, "device": dev.type, "timed_region": TIMED_REGION,
              "decoder": "pillow" if on_device is None else "nvjpeg",
              "environment": environment(dev), "cpu_count": os.cpu_count(),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}, "order": order,
              "settings": []}
    for (pipeline, w, r), ms in rows.items():
        rates = [m["images_per_s"] for m in ms]
        row = {"pipeline": pipeline, "workers": w, "res": r, "n": len(ms), "images_per_s": rates,
               "summary": summarize(rates).to_dict(), "startup_s": [m["startup_s"] for m in ms],
               "images_timed": [m["images"] for m in ms], "versus_baseline": None}
        if pipeline == "ours" and plain is not None:
            base = [m["images_per_s"] for m in rows[("baseline", w, r)]]
            row["versus_baseline"] = (mean_diff_test(rates, base) if runs > 1 else
                                      {"ratio": rates[0] / base[0], "ratio_ci95": None, "p": None})
        report["settings"].append(row)
    return report


def rate_text(summary: dict) -> str:
    """"1234 ± 56" images/s from a Summary dict (no ± for one run)."""
    return f"{summary['mean']:.0f}" + (f" ± {summary['std']:.0f}" if summary["std"] is not None else "")


def versus_text(v: dict | None) -> str:
    """Ours against the baseline: "1.85 (1.70 .. 2.00), p = 0.0012", "1.85" for one run, "-" without one."""
    if v is None:
        return "-"
    if v["ratio_ci95"] is None:
        return f"{v['ratio']:.2f}"
    low, high = v["ratio_ci95"]
    return f"{v['ratio']:.2f} ({low:.2f} .. {high:.2f}), p = {v['p']:.2g}"


def _by_setting(report: dict) -> list[tuple[dict, dict | None]]:
    """(ours, baseline or None) per (workers, res), in the report's order."""
    base = {(s["workers"], s["res"]): s for s in report["settings"] if s["pipeline"] == "baseline"}
    return [(s, base.get((s["workers"], s["res"]))) for s in report["settings"] if s["pipeline"] == "ours"]


def markdown(report: dict) -> str:
    """BENCHMARKS.md's table (benchmarks/table.py): per (workers, px) ours and the baseline, and the ratio."""
    env, load = report["environment"], report["load_average"]
    lines = ["| date | device | workers | px | n | ours img/s (mean ± std) | baseline img/s (mean ± std) | "
             "ours / baseline (95% CI), Welch p | start-up s, ours / baseline |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ours, base in _by_setting(report):
        startup = f"{np.mean(ours['startup_s']):.2f}" + (f" / {np.mean(base['startup_s']):.2f}" if base else "")
        lines.append(f"| {env['timestamp_utc'][:10]} | {device_label(env)} | {ours['workers']} | {ours['res']} | "
                     f"{ours['n']} | {rate_text(ours['summary'])} | {rate_text(base['summary']) if base else '-'} | "
                     f"{versus_text(ours['versus_baseline'])} | {startup} |")
    lines += ["", f"`{report['command']}`: {report['images']:,} images ({report['split']}), batch {report['batch']}, "
              f"{report['batches']} timed batches per measurement, decode_px "
              f"{report['decode_px']}, {report['runs']} interleaved rounds; load average (1 min) "
              f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after. Timed: {report['timed_region']}."]
    return "\n".join(lines)
