"""The imagenet family's answers to the runner (recipes/__init__.py lists the questions): the prepared shards it
reads, checks, the smoke test, notes, what a checkpoint and a saved model must agree on. The loop is in
recipes/imagenet.py."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from speedrun import dist
from speedrun.data.loader import epochs_for_steps as loader_epochs
from speedrun.data.loader import steps_for
from speedrun.data.shard_loader import device_decoder
from speedrun.data.shards import (MANIFEST, SPLITS, SYNTHETIC_FORMAT, Shards, file_sha256, listed_splits, open_regular,
                                  prepare_command, read_classes, read_manifest, repair_advice, write_split)
from speedrun.errors import counted, print_line, warn
from speedrun.paths import data_root, make_folder, user_path
from speedrun.recipes.imagenet.config import ImagenetConfig
from speedrun.records.result_file import write_text

# ImageNet's channel statistics (the values every torchvision-era recipe uses), in [0, 1] units.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SMOKE_STEPS = 4
# --smoke checks the whole path (shards, workers, decode, resizing, evaluation, result file) in seconds on a 2-core
# CPU: small batches at 64 px. ResNet-50's evaluation of 512 images at 256 px alone is ~2.8 TFLOP, half a minute.
SMOKE_BATCH = 32  # divides any power-of-two number of processes up to 32
SMOKE_EVAL_IMAGES = 64
SMOKE_RES_PX = 64
SMOKE_WORKERS = 2
SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class ShardData:
    """A prepared data set (`speedrun data prepare`): where its shards are and what they hold."""
    name: str
    root: str
    train_split: str
    eval_split: str
    classes: tuple[str, ...]
    num_train: int
    num_eval: int
    mean_t: torch.Tensor
    std_t: torch.Tensor
    content: str = ""  # fingerprint()'s answer, made when the folder is opened (_open_prepared)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def fingerprint(self) -> str:
        """What this prepared data set is, wherever its folder lies: "sha256:<hex>" over the class names, each read
        split's index (shard, offset, size, label per sample) and the manifest's SHA-256 of every shard of those
        splits (prepare records them as it writes). Hashing the shards themselves would read the whole data set
        (ImageNet's are 140 GB): a change that keeps every image's byte size is seen only through the manifest's
        checksums, so a folder without them (not prepared by speedrun) is told apart by its index alone."""
        return self.content


def load_data(dataset: str, *, data_dir=None, image_size=None, log=print_line, smoke: bool = False) -> ShardData:
    """`dataset`: a folder written by `speedrun data prepare` (classes.json, train-*.tar, and val-* or test-*),
    or "synthetic" (small learnable shards made once in the data cache: imagenet-debug's default). smoke changes
    nothing here: shards are opened, not read, and a run reads only the images it steps through."""
    if image_size is not None:
        raise ValueError("--image-size is for image folders; the imagenet recipes choose resolutions by config "
                         "(--set min_res_px=... max_res_px=... eval_res_px=...)")
    if not dataset:
        raise ValueError("the imagenet recipes need --dataset DIR: a folder written by `speedrun data prepare SRC "
                         "DIR` (README: preparing ImageNet)")
    if dataset == SYNTHETIC:
        cache = data_root(data_dir)
        root = _synthetic_shards(cache, log)
        try:
            return _open_prepared(root, SYNTHETIC)
        except (ValueError, OSError) as e:
            # Our own cache, written whole (_synthetic_shards) and damaged since (files removed or cut short): the
            # advice for a prepared folder ("prepare it again") would name a command the user never ran.
            warn(f"the synthetic shards in {root} are damaged ({e}); writing them again")
            _remove_synthetic(root)
            return _open_prepared(_synthetic_shards(cache, log), SYNTHETIC)
    root = user_path(dataset, "--dataset")
    if not root.is_dir():
        raise ValueError(f"--dataset {dataset} is not a folder; the imagenet recipes read what "
                         "`speedrun data prepare SRC DST` wrote (pass DST), or 'synthetic'")
    if not (root / "classes.json").exists() and not (root / MANIFEST).exists() \
            and any((root / split).is_dir() for split in ("train", "val", "test")):
        shards_dir = root.parent / f"{root.name}-shards"
        raise ValueError(f"--dataset {dataset} is an image folder, not prepared shards; prepare it once with "
                         f"`speedrun data prepare {shlex.quote(str(root))} {shlex.quote(str(shards_dir))}`, then "
                         f"train with --dataset {shlex.quote(str(shards_dir))}")
    return _open_prepared(root, root.name)


def _open_prepared(root: Path, name: str) -> ShardData:
    """A prepared folder's classes and split sizes, every index checked against its shards; nothing decoded. Its
    splits are those its manifest lists (a split file it does not list is none: shards.listed_splits), or, without
    a manifest of ours, its index files."""
    classes = read_classes(root)  # checked against the manifest's record: a reordered list is refused
    listed = listed_splits(root)
    have = listed if listed is not None else [s for s in SPLITS if (root / f"{s}-index.npy").exists()]
    evals = [s for s in ("val", "test") if s in have]
    if "train" not in have or not evals:
        said = f"its {MANIFEST} lists {', '.join(listed) or 'no split'}" if listed is not None else "no manifest"
        raise ValueError(f"{root} needs a train split and a val or test split (train-index.npy, "
                         f"val-index.npy; {said}); prepare a folder with train/ and val/ (or test/)")
    counts = []
    content = hashlib.sha256(json.dumps({"classes": list(classes)}).encode())
    recorded = (read_manifest(root) or {}).get("splits")
    for split in ("train", evals[0]):
        with Shards(root, split) as shards:  # the index only (checked against the shards); nothing decoded
            labels = shards.index[:, 3]
            content.update(split.encode() + np.ascontiguousarray(shards.index, dtype="<i8").tobytes())
        entry = recorded.get(split) if isinstance(recorded, dict) else None
        table = entry.get("shard_files") if isinstance(entry, dict) else None
        content.update(json.dumps([t.get("sha256") for t in table if isinstance(t, dict)]
                                  if isinstance(table, list) else None).encode())
        if len(labels) == 0:  # before training: no steps to take, or an accuracy of 0 / 0
            raise ValueError(f"{root}: the {split} split has no images; prepare a folder whose "
                             f"{split}/ holds images")
        if int(labels.max()) >= len(classes):
            raise ValueError(f"{root}: the {split} split has label {int(labels.max())} but "
                             f"classes.json names {len(classes)} classes; {repair_advice(root)}")
        if split == "train":
            _check_every_class_trains(root, labels, classes)
        counts.append(len(labels))
    return ShardData(name=name, root=str(root), train_split="train",
                     eval_split=evals[0], classes=classes, num_train=counts[0], num_eval=counts[1],
                     mean_t=torch.tensor(IMAGENET_MEAN), std_t=torch.tensor(IMAGENET_STD),
                     content="sha256:" + content.hexdigest())


def _check_every_class_trains(root: Path, labels: np.ndarray, classes: tuple[str, ...]) -> None:
    """Every class of classes.json has training images (prepare keeps an empty class folder in the index, with a
    warning): a class never trained on is a wrong answer for each of its evaluation images, and a saved model
    would name it. As the in-memory image-folder loader refuses the same layout."""
    absent = np.flatnonzero(np.bincount(labels, minlength=len(classes)) == 0).tolist()  # labels: 0 <= label < C
    if absent:
        names = ", ".join(classes[k] for k in absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
        command, recorded = prepare_command(root)
        where = (f"{recorded}/train/" if recorded and Path(recorded, "train").is_dir() else recorded or
                 "SRC/train/ (SRC: the image folder they were prepared from)")  # SRC/<class>/ is a train split too
        noun, have, folders, them, those = (
            ("class", "has", "its train/ folder is", "it", "that class folder") if len(absent) == 1 else
            ("classes", "have", "their train/ folders are", "them", "those class folders"))
        raise ValueError(f"{root}: {noun} {names} of classes.json {have} no training images ({folders} empty), and "
                         f"a class never trained on is never predicted; add images to {them}, or remove {those} from "
                         f"{where}, then run `{command}` again")


def _synthetic_shards(cache: Path, log) -> Path:
    """imagenet-debug's data: write_synthetic_shards(640, 160) made once in the data cache.

    Written in a folder of this process's own and renamed into place whole: two commands (or two ranks) that
    find the cache empty at once each write their own copy, the first rename wins and the other copy is dropped
    (with fixed temporary names in one folder they renamed each other's files away)."""

    root = cache / "imagenet-synthetic-v1"
    if _whole(root):
        return root
    if (root.exists() or root.is_symlink()) and not (root.is_dir() and not root.is_symlink()):
        raise ValueError(f"{root} is in the way of imagenet-debug's synthetic shards (not a folder "
                         "of ours); remove it, or set SPEEDRUN_DATA (--data-dir) to another folder")
    make_folder(cache, "the data cache", "remove or rename what is in the way, or set SPEEDRUN_DATA (--data-dir) "
                "to a folder")
    log(f"writing synthetic shards to {root}")
    own = Path(tempfile.mkdtemp(prefix=".imagenet-synthetic-v1.", dir=cache))
    try:
        write_synthetic_shards(own, 640, 160)
        # Checksums of every file, written last: _whole trusts the cache only when each file matches, and the
        # advice for a damaged sample (shards.repair_advice) names the command that checks and writes it again.
        names = sorted(p.name for p in own.iterdir() if p.is_file())
        write_text(own / MANIFEST, json.dumps({"format": SYNTHETIC_FORMAT,
                                               "files": {n: file_sha256(own / n) for n in names}}), 0o644)
        own.chmod(0o755)  # mkdtemp's folder is private; a cache is as readable as its data
        if root.is_dir() and not _whole(root):
            shutil.rmtree(root)  # written in place by another writer, or damaged (whole copies are equal)
        try:
            own.rename(root)
        except OSError:
            if not _whole(root):  # not another writer's whole copy: a real failure
                raise
    finally:
        shutil.rmtree(own, ignore_errors=True)
    return root


def _whole(root: Path) -> bool:
    """The synthetic shards in `root` are there and every file matches the checksum written beside it."""
    try:
        with open(open_regular(root / MANIFEST), "rb") as f:
            manifest = json.loads(f.read(2**20).decode("utf-8"))
        files = manifest["files"]
        return (manifest["format"] == SYNTHETIC_FORMAT and isinstance(files, dict)
                and {"classes.json", "train-index.npy", "val-index.npy"} <= set(files)
                and all(isinstance(name, str) and "/" not in name and file_sha256(root / name) == digest
                        for name, digest in files.items()))
    except (OSError, ValueError, RecursionError, TypeError, KeyError, AttributeError):
        return False


def _remove_synthetic(root: Path) -> None:
    """The damaged synthetic cache removed, so that _synthetic_shards writes it again (a symlink there is the
    user's, not ours: refused)."""
    if root.is_symlink() or not root.is_dir():
        raise ValueError(f"{root} holds damaged synthetic shards and is not a folder of ours; "
                         "remove it, or set SPEEDRUN_DATA (--data-dir) to another folder")
    shutil.rmtree(root)


def write_synthetic_shards(root: Path, n_train: int, n_val: int, classes: int = 10) -> Path:
    """`classes` classes of 32-px images, each class its own colour with noise (learnable in a few steps), as
    train and val shards and classes.json in `root` (the writes are atomic: a killed run leaves no half split)."""

    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (classes, 3))
    for split, n in (("train", n_train), ("val", n_val)):
        def samples(n=n):
            for i in range(n):
                label = i % classes
                noise = rng.normal(0, 40, (32, 32, 3))
                pixels = np.clip(colours[label] + noise, 0, 255).astype(np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, "JPEG", quality=90)
                yield buf.getvalue(), label
        write_split(samples(), root, split)
    write_text(root / "classes.json", json.dumps([f"class{k}" for k in range(classes)]), 0o644)
    return root


def describe(data: ShardData) -> str:
    return (f"{data.name}: {data.num_train} train / {data.num_eval} {data.eval_split} images in shards, "
            f"{data.num_classes} classes")


def with_epochs(cfg: ImagenetConfig, epochs: float) -> ImagenetConfig:
    """cfg for `epochs`: the warm-up scaled alike (the resizing ramp is in fractions of the run already)."""
    return dataclasses.replace(cfg, epochs=epochs, warmup_epochs=cfg.warmup_epochs * epochs / cfg.epochs)


def run_steps(cfg: ImagenetConfig, num_train: int) -> int:
    return steps_for(cfg.epochs, num_train, cfg.batch_size)


def epochs_for_steps(cfg: ImagenetConfig, num_train: int, steps: int) -> float:
    return loader_epochs(steps, num_train, cfg.batch_size)


def smoke(cfg: ImagenetConfig, data: ShardData) -> tuple[ImagenetConfig, ShardData]:
    """SMOKE_STEPS steps of at most SMOKE_BATCH images at no more than SMOKE_RES_PX, and the first
    SMOKE_EVAL_IMAGES of the evaluation split: does the pipeline run?"""
    px = SMOKE_RES_PX
    cfg = dataclasses.replace(cfg, eval_each_epoch=False, batch_size=min(cfg.batch_size, SMOKE_BATCH),
                              eval_batch_size=min(cfg.eval_batch_size, SMOKE_EVAL_IMAGES),
                              decode_px=min(cfg.decode_px, px), min_res_px=min(cfg.min_res_px, px),
                              max_res_px=min(cfg.max_res_px, px), eval_res_px=min(cfg.eval_res_px, px),
                              workers=min(cfg.workers, SMOKE_WORKERS))
    data = dataclasses.replace(data, num_eval=min(data.num_eval, SMOKE_EVAL_IMAGES))
    return with_epochs(cfg, min(cfg.epochs, SMOKE_STEPS * cfg.batch_size / data.num_train)), data


def notes(cfg: ImagenetConfig, data: ShardData, smoke: bool = False) -> list[str]:
    steps = steps_for(cfg.epochs, data.num_train, cfg.batch_size)
    if smoke:
        return [f"smoke test: {counted(steps, 'step')} of {cfg.batch_size} at {cfg.max_res_px} px, {data.num_eval} "
                "evaluation images: this checks that the pipeline runs; its accuracy is not a result"]
    return [f"{steps} steps of {cfg.batch_size}; resolution {cfg.min_res_px}->{cfg.max_res_px} px, evaluation at "
            f"{cfg.eval_res_px} px"]


def check(cfg: ImagenetConfig, data: ShardData, device: torch.device, world: dist.World) -> list[str]:
    dist.check(cfg.batch_size, world, device, cfg.sync_bn)
    if device.type == "cpu" and cfg.channels_last == "on" and cfg.width < 16:
        raise ValueError(f"channels_last=on with width={cfg.width} crashes torch's CPU kernels (a segfault in the "
                         "backward pass at 224 px and up, measured with torch 2.13); use width >= 16 or "
                         "channels_last=auto (contiguous on a CPU for this family)")
    # decoder=nvjpeg without CUDA or TorchCodec is a ValueError; "auto" on CUDA without TorchCodec a note.
    on_device, fallback = device_decoder(cfg.decoder, device)
    warnings = [fallback] if fallback else []
    if on_device is None and cfg.decode_px < cfg.max_res_px:  # Pillow workers decode to decode_px squares
        warnings.append(f"decode_px {cfg.decode_px} is below max_res_px {cfg.max_res_px}: training crops are "
                        "upsampled; raise decode_px (--set decode_px=...)")
    if cfg.batch_size > data.num_train:
        warnings.append(f"batch_size {cfg.batch_size} is larger than the {data.num_train} training images: every "
                        "step repeats images; lower batch_size (--set batch_size=...)")
    return warnings


# ImageNet-1k (ILSVRC-2012) as published: its 1,000 synsets (SHA-256 of their wnids sorted, one per line) and its
# split sizes, 1,281,167 training and 50,000 validation images (Russakovsky et al., IJCV 2015).
IMAGENET_1K_SYNSETS_SHA256 = "385e0240499426c022b773be1ae4da780f057b89c9694c7f47199f62746b6edd"
IMAGENET_1K_SIZES = (1_281_167, 50_000)


def own_data(named: str, dataset: str, data: ShardData) -> bool:
    """ImageNet-1k, the data set FFCV's targets were measured on (the imagenet recipes name no default): shards
    whose classes are its 1,000 synsets and whose train and evaluation splits have its sizes. Other shards (a
    subset, CIFAR prepared as shards) train the same recipes, but a target measured on ImageNet says nothing of
    them."""
    synsets = hashlib.sha256("\n".join(sorted(data.classes)).encode()).hexdigest()
    return synsets == IMAGENET_1K_SYNSETS_SHA256 and (data.num_train, data.num_eval) == IMAGENET_1K_SIZES


def data_signature(data: ShardData) -> dict:
    """What a checkpoint must have been trained on: the classes and a SHA-256 of both splits' indexes (which hold
    every sample's shard, offset, size and label; re-preparing changes them)."""
    h = hashlib.sha256()
    for split in (data.train_split, data.eval_split):
        h.update((Path(data.root) / f"{split}-index.npy").read_bytes())
    h.update(json.dumps(list(data.classes)).encode())
    return {"name": data.name, "num_train": data.num_train, "num_eval": data.num_eval,
            "num_classes": data.num_classes, "sha256": h.hexdigest()}


def model_card(cfg: ImagenetConfig, data: ShardData) -> dict:
    return {"classes": list(data.classes), "image_shape": [3, cfg.eval_res_px, cfg.eval_res_px],
            "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "tta_level": 1 if cfg.tta_flip else 0}


def warmup(cfg: ImagenetConfig, data: ShardData, device: torch.device, world: dist.World | None = None) -> float:
    """No warm-up run: an ImageNet run is long enough that compile and autotuning are a small part of it, and they
    happen inside it (reported in the timed region)."""
    return 0.0


def idle_tricks(cfg) -> list[str]:
    """None: this family trains its own network only (--model trains through the in-memory families)."""
    return []


# Every trick of the family as (config key, its "off" value, what it is): what `speedrun ablate` switches.
TRICKS: list[tuple[str, object, str]] = [
    ("progressive_resizing", False, "progressive resizing (train at max_res_px throughout when off)"),
    ("label_smoothing", 0.0, "label smoothing (tricks/label_smoothing.py)"),
    ("no_decay_norm_bias", False, "no weight decay on BatchNorm and biases"),
    ("zero_init_residual", False, "zero-initialized last BN scale per block (models/resnet.py)"),
    ("blurpool", False, "BlurPool anti-aliased downsampling (models/resnet.py)"),
    ("ema_decay", 0.0, "EMA of the weights (tricks/ema.py)"),
    ("tta_flip", False, "test-time flip averaging"),
    ("flip", False, "random horizontal flip"),
    ("channels_last", "off", "channels_last memory layout (speed)"),
    ("compile", False, "torch.compile (speed)"),
    ("precision", "fp32", "bf16 autocast (speed)"),
]
