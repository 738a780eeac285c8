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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from speedrun.data import folder, limits
from speedrun.data.loader import Normalization
from speedrun.data.prepare import list_source
from speedrun.data.shard_loader import Decoding, ShardLoader, device_decoder, random_resized_boxes
from speedrun.data.shards import (CLASSES, PREPARED_FORMAT, Shards, listed_splits, read_classes, read_manifest,
                                  unlisted_split)
from speedrun.data.workers import dataloader_worker_init, started
from speedrun.engine.loop import Timer
from speedrun.engine.system import resolve_device, synchronize
from speedrun.errors import counted, print_line
from speedrun.paths import user_path
from speedrun.records.environment import device_label, environment
from speedrun.records.stats import NON_NEGATIVE, mean_diff_test, summarize

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


@dataclass(frozen=True)
class Rounds:
    """How much each measurement reads and how often it is repeated: timed_batches batches of batch_size images
    (after an untimed warm-up), every setting once per round, `runs` interleaved rounds; round r's batches are
    drawn with seed + r. The limits name the command's flags (--batch, --batches, --runs)."""

    batch_size: int
    timed_batches: int
    runs: int
    seed: int = 0

    def check(self) -> None:
        """Refuse (ValueError naming the flag) a count out of range; bench_loader asks once DIR and its split are
        known to be there, so a wrong DIR is named first."""
        for name, value, low, high in (("--batch", self.batch_size, 1, 4096),
                                       ("--batches", self.timed_batches, 1, 100_000), ("--runs", self.runs, 1, 1000)):
            _check(name, value, low, high)


def find_split(root: Path, split: str | None) -> str:
    """The split of DIR to read: `split`, or train, or the only one there; ValueError naming what is there. The
    splits are those DIR's manifest lists (a split file it does not list is none), or, without a manifest of
    ours, its index files."""
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder; give the folder `speedrun data prepare` wrote")
    listed = listed_splits(root)
    present = listed if listed is not None else [s for s in SPLITS if (root / f"{s}-index.npy").is_file()]
    choose = " or ".join(f"--split {s}" for s in present)
    if not present:
        if listed is not None:
            raise ValueError(unlisted_split(root, split or "train", listed))
        raise ValueError(f"{root} holds no prepared shards (no train-, val- or test-index.npy); "
                         f"run speedrun data prepare SRC {root} first")
    if split is None:
        if "train" in present or len(present) == 1:
            return "train" if "train" in present else present[0]
        raise ValueError(f"{root} has the splits {', '.join(present)}; choose one with --split ({choose})")
    if split not in present:
        if listed is not None and os.path.lexists(root / f"{split}-index.npy"):
            raise ValueError(f"--split {split}: {unlisted_split(root, split, listed, f'choose {choose}')}")
        raise ValueError(f"--split {split}: {root} has {', '.join(present)}; choose {choose}")
    return split


def baseline_files(src: Path, split: str, root: Path | None = None) -> tuple[list[str], list[int]]:
    """The original images of `split` under SRC (a train/val/test tree or class folders: data/prepare.py's
    layouts), or of its only split; (paths, labels). root: the shards' folder, whose classes SRC's must be (a
    folder of other images would measure another data set)."""
    if not src.is_dir():
        raise ValueError(f"--baseline {src} is not a folder; give the original images' folder")
    classes, splits, _ = list_source(src)
    if split not in splits and len(splits) != 1:
        raise ValueError(f"--baseline {src} has no {split}/ folder (it has "
                         f"{', '.join(splits)}); give the tree the shards were prepared from")
    if root is not None:
        _check_baseline_classes(root, split, src, classes)
    files = splits[split] if split in splits else next(iter(splits.values()))
    return [f.path for f in files], [f.label for f in files]


def _check_baseline_classes(root: Path, split: str, src: Path, classes: list[str]) -> None:
    """SRC's class folders (printable, as classes.json stores them) are the shards' classes.json, name for name;
    shards without one (written by hand) have labels that SRC's classes cover."""
    manifest = read_manifest(root) or {}
    recorded = manifest.get("source") if manifest.get("format") == PREPARED_FORMAT else None
    fix = ("give the image folder the shards were prepared from" +
           (f" (their manifest records {recorded})" if isinstance(recorded, str) and recorded else ""))
    if (root / CLASSES).exists() or recorded is not None:
        names = list(read_classes(root))  # a damaged or edited one is refused with its repair
        if names != classes:
            k = next((k for k, (a, b) in enumerate(zip(classes, names)) if a != b), None)
            detail = (f"{len(classes):,} class folders where {root}'s {CLASSES} names {len(names):,}" if k is None
                      else f"its class {k} is {classes[k]} where {root}'s {CLASSES} has {names[k]}")
            raise ValueError(f"--baseline {src} is not the image folder these shards were prepared from ({detail}); "
                             f"{fix}")
        return
    with Shards(root, split) as shards:
        top = int(shards.index[:, 3].max()) if len(shards) else -1
    if top >= len(classes):
        raise ValueError(f"--baseline {src} has {len(classes):,} class folders, but the {split} split of {root} has "
                         f"label {top}: it is not the image folder these shards were prepared from; {fix}")


def plain_order(n: int, count: int, seed: int) -> list[int]:
    """The `count` positions of the n original files the baseline reads, in order: consecutive random
    permutations from one generator seeded with `seed` (torch's RandomSampler's draw), known before any is read,
    so that every file is checked before a measurement starts."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < count:
        order += torch.randperm(n, generator=gen).tolist()[:count - len(order)]
    return order


def check_baseline_headers(paths: list[str], positions: set[int], res: int) -> None:
    """Each original file the baseline will read opened and its header checked as PlainImages checks it (format,
    size, scans; no pixel decoded): a bad file is one line before any measurement, not after ours was timed."""
    for i in sorted(positions):
        try:
            with folder.open_image(paths[i]) as im:
                folder.check_header(paths[i], im, res)
        except folder.Refused as e:
            raise ValueError(f"--baseline: {e}") from None


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
    sampler = plain_order(len(dataset), steps * batch, seed)  # the files check_baseline_headers checked
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                                         pin_memory=pin, worker_init_fn=dataloader_worker_init())
    mean, std = MEAN.to(device).view(1, 3, 1, 1), STD.to(device).view(1, 3, 1, 1)
    for images, labels in started(loader):
        x = images.to(device, non_blocking=pin).float().div_(255)
        yield (x - mean) / std, labels.to(device, non_blocking=pin)


def our_batches(root: Path, split: str, *, images: int, batch: int, steps: int, res: int, device: torch.device,
                seed: int, decoding: Decoding) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """ShardLoader's batches, `steps` of them over the split's `images` (counted once by the caller), float32
    standardized by ImageNet's statistics, augmented as training is by default."""
    loader = ShardLoader(str(root), split, batch_size=batch, epochs=steps * batch / images, device=device,
                         res_at=lambda step: res, normalization=Normalization(MEAN, STD), decoding=decoding,
                         seed=seed)
    assert loader.steps == steps, (loader.steps, steps)
    return loader.batches(0)


def _count(root: Path, split: str) -> int:
    with Shards(root, split) as shards:
        if len(shards) == 0:
            raise ValueError(f"the {split} split in {root} has no images; choose another --split, or prepare a "
                             f"SRC whose {split}/ holds images")
        return len(shards)


def _steps(workers: int, batches: int) -> tuple[int, int]:
    """(untimed warm-up batches, batches drawn) of one measurement with `workers` worker processes."""
    warmup = 2 * workers + 2  # a DataLoader keeps 2 batches per worker in flight: drain what start-up filled
    return warmup, 1 + warmup + batches + 2 * workers + 3  # and leave some unread: the end of the data is not timed


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


def bench_loader(root: str, rounds: Rounds, *, split: str | None = None, workers: list[int], res: list[int],
                 decode_px: int = 256, device: str = "auto", baseline: str | None = None, decoder: str = "auto",
                 log: Callable[[str], None] = print_line) -> dict:
    """Every (pipeline, workers, res) setting measured rounds.runs times, interleaved; returns the report."""
    batch, batches, runs, seed = rounds.batch_size, rounds.timed_batches, rounds.runs, rounds.seed
    # An empty path (an unset shell variable) would mean the current folder.
    if not os.fsdecode(root).strip():
        raise ValueError("DIR is empty (an unset shell variable?); give the folder `speedrun data prepare SRC DIR` "
                         "wrote")
    if baseline is not None and not os.fsdecode(baseline).strip():
        raise ValueError("--baseline is empty (an unset shell variable?); give the original images' folder, or "
                         "leave --baseline out")
    root_path = user_path(root, "DIR")
    split = find_split(root_path, split)
    n = _count(root_path, split)
    rounds.check()
    _check("--decode-px", decode_px, 8, 1024)
    limits.check_memory(batch_bytes(batch, max(workers), max(res), decode_px),
                        f"--batch {batch} at --res {max(res)} px with --decode-px {decode_px} and "
                        f"{counted(max(workers), 'worker')}",
                        "lower --batch, --res or --decode-px, or give fewer --workers")
    dev = resolve_device(device)
    on_device, note = device_decoder(decoder, dev)  # nvJPEG through TorchCodec on CUDA, else the Pillow workers
    if note:
        log(f"note: {note}")
    plain = baseline_files(user_path(baseline, "--baseline"), split, root_path) if baseline is not None else None
    if plain is not None and plain[0]:
        longest = max(_steps(w, batches)[1] for w in workers) * batch
        check_baseline_headers(plain[0], {i for rnd in range(runs) for i in plain_order(len(plain[0]), longest,
                                                                                         seed + rnd)}, max(res))
    settings = [(p, w, r) for w in workers for r in res for p in PIPELINES if p == "ours" or plain is not None]
    rows = {s: [] for s in settings}
    order, load_before = [], os.getloadavg()
    for rnd in range(runs):
        for pipeline, w, r in settings:
            warmup, steps = _steps(w, batches)
            if pipeline == "ours":
                decoding = Decoding(decode_px=decode_px, workers=w, device_decode=on_device)
                it = our_batches(root_path, split, images=n, batch=batch, steps=steps, res=r, device=dev,
                                 seed=seed + rnd, decoding=decoding)
            else:
                it = plain_batches(PlainImages(*plain, r), batch=batch, steps=steps, workers=w, device=dev,
                                   seed=seed + rnd)
            m = measure(it, warmup=warmup, count=batches, res=r, device=dev)
            rows[(pipeline, w, r)].append(m)
            order.append({"round": rnd, "pipeline": pipeline, "workers": w, "res": r})
            log(f"round {rnd + 1}/{runs}: {pipeline}, {counted(w, 'worker')}, {r} px: {m['images_per_s']:.0f} images/s "
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
               "summary": summarize(rates, NON_NEGATIVE).to_dict(), "startup_s": [m["startup_s"] for m in ms],
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
