"""Trained models a user keeps: `speedrun train --save PATH` writes PATH.safetensors + PATH.json (model_files.py
describes both and how they are checked); `speedrun.load(PATH)` gives a TrainedModel that takes images and names
classes; `speedrun eval` scores it on a dataset and `speedrun predict` on image files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn

from speedrun import dist
from speedrun._version import __version__
from speedrun.data import folder, limits
from speedrun.data.loader import Normalization, normalize
from speedrun.dist import unwrap
from speedrun.engine.flops import on_meta
from speedrun.engine.loop import evaluate
from speedrun.engine.system import resolve_device
from speedrun.errors import clip, escaped_refusals, note_stopped, printable, warn
from speedrun.models import custom
from speedrun.paths import in_the_way, user_path
from speedrun.recipes import RECIPES, STREAMED_TEST_SPLIT
from speedrun.run import model_files as files
from speedrun.run.display import EvalProgress
from speedrun.run.model_files import MODEL_FORMAT, MODEL_VERSION
from speedrun.tricks.tta import passes as tta_passes
from speedrun.tricks.tta import selective_tta_logits, tta_logits

_PREDICT_BATCH = 64  # image files decoded and scored at a time, at most
# What one batch of `predict` may take: a card may legally ask for 1024x1024 images, where 64 images through the
# network's first layers take gigabytes; the batch shrinks to fit this (and half the memory available).
_PREDICT_BUDGET_BYTES = 1 << 30
_FIX = "use the .safetensors and .json exactly as `speedrun train --save` wrote them, or save the model again"


def model_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(weights, card): "m", "m.safetensors" and "m.json" all mean m.safetensors + m.json ("m.v2" keeps ".v2")."""
    text = os.fsdecode(path)
    p = user_path(text, "model path")
    if p.suffix in (".safetensors", ".json"):
        p = p.with_suffix("")
    if not text.strip() or text.endswith(("/", os.sep)) or "\0" in text or p.name in ("", ".", ".."):
        raise ValueError(f"model path {text!r} names no file; give a file name such as models/cifar "
                         "(written as models/cifar.safetensors + models/cifar.json)")
    return p.with_name(p.name + ".safetensors"), p.with_name(p.name + ".json")


def check_save_path(path: str | os.PathLike) -> Path:
    """Before training: refuse (ValueError) a path whose files exist or whose folder cannot be made or written.
    Returns the path without suffix; leaves nothing behind (its probe file is removed)."""
    weights, card = model_paths(path)
    if os.path.isdir(os.fsdecode(path)):  # "models" meant as the folder to save into, most likely
        raise ValueError(f"--save {os.fsdecode(path)} is a folder; give a file name in it, such as "
                         f"{os.path.join(os.fsdecode(path), 'model')} (written as .safetensors + .json)")
    for p in (weights, card):
        if len(os.fsencode(p.name)) > 255:
            raise ValueError(f"model file name {p.name[:60]}... is over 255 bytes; choose a shorter --save "
                             "path")
        if os.path.lexists(p):
            raise ValueError(f"{p} already exists and is never replaced; choose a new --save path or "
                             "move the old file away")
    existing = weights.parent  # the nearest folder that exists: save_model creates the rest
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    where = str(weights.parent)
    if not os.path.isdir(existing):
        why = in_the_way(existing) or f"{existing} is not a folder"  # a file, a symlink loop, a link to nothing
        raise ValueError(f"cannot save the model in {where}: {why}; choose another --save path")
    # Proved by making a file there, as the write will: access(2) passes root in /proc, where no file can be made,
    # and says nothing of a full disk or a file system that refuses new names.
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-model-", dir=existing)
    except OSError as e:
        raise ValueError(f"cannot save the model in {where}: cannot make a file in {existing} ({e.strerror}); "
                         f"{files.write_fix(e)}") from None
    os.close(fd)
    files.unlink(probe)
    return weights.with_name(weights.name[:-len(".safetensors")])


class TrainedModel(nn.Module):
    """A saved network ready for images, normalized and test-time augmented as it was scored.

    forward(images): (N, C, H, W) as `image_shape`, uint8 in 0..255 or floating in [0, 1] -> logits (N, K).
    The network stays in eval mode (BatchNorm's running statistics) even after .train(): this module is for
    inference. Gradients flow unless the caller uses torch.no_grad(); predict() does.
    """

    mean: torch.Tensor  # buffers (register_buffer), which nn.Module's attribute lookup types as Tensor | Module
    std: torch.Tensor

    def __init__(self, net: nn.Module, card: dict):
        super().__init__()
        self.net = net.eval()
        self.card = card
        self.classes: list[str] = list(card["classes"])
        self.image_shape: tuple[int, int, int] = tuple(card["image_shape"])
        self.tta_level: int = card["tta_level"]
        # selective TTA (tricks/tta.py) when scoring a test set: the views only for this fraction of it, least
        # confident first; 0 is every image. A config field, checked with the card's config (model_files.parse_card).
        self.tta_select: float = float((card.get("config") or {}).get("tta_select") or 0.0)
        self.smoke_test: bool = card.get("smoke_test") is True  # saved from `speedrun train --smoke`
        self.register_buffer("mean", torch.tensor(card["mean"], dtype=torch.float32))  # (C,), [0, 1] units
        self.register_buffer("std", torch.tensor(card["std"], dtype=torch.float32))
        self.source = "this model"  # what a refusal names: load() sets the weights file

    def finite(self, logits: torch.Tensor, what: str) -> torch.Tensor:
        """`logits`, refused (one line naming the model) where any is NaN or inf: its softmax would print NaN
        probabilities, its argmax a meaningless class. A card's ranges (model_files.py) keep a sound network's
        finite; weights that are not (a forged file with a matching checksum) end here."""
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(f"{self.source} gives non-finite scores (NaN or inf) for {what}: its weights do not "
                             f"make a working network; {_FIX}")
        return logits

    def train(self, mode: bool = True) -> TrainedModel:
        super().train(mode)
        self.net.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not isinstance(images, torch.Tensor) or images.ndim != 4 or tuple(images.shape[1:]) != self.image_shape:
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"this model takes images of shape (N, {', '.join(map(str, self.image_shape))}), got "
                             f"{got}; resize them (predict_files does, for image files)")
        if images.dtype == torch.uint8:
            x = images.to(self.mean.device).float() / 255  # as loader.normalize, so logits equal training's own
        elif images.is_floating_point():
            x = images.to(self.mean.device, torch.float32)
        else:
            raise ValueError(f"images must be uint8 (0..255) or floating point (0..1), got {images.dtype}")
        x = (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        # Every image gets the card's full TTA, selective or not: a prediction must not depend on the other images
        # of the call (set_logits scores a test set as its training run did).
        return tta_logits(self.net, x, self.tta_level)  # (N, K)

    def set_logits(self, images: torch.Tensor, batch_size: int,
                   on_batch: Callable[[int], object] | None = None) -> torch.Tensor:
        """Logits (N, K) of a test set of uint8 images (N, C, H, W) on the model's device, in batches, scored as its
        training run scored its test set: the card's TTA level, on the least confident tta_select of the set
        where the card selects (engine.loop.evaluate's operations); refused where any is not finite.
        on_batch(p) after each batch, with the forward passes of one image it made (their sum is passes(N))."""
        def inputs(idx: torch.Tensor) -> torch.Tensor:
            return normalize(images[idx.to(images.device)], self.mean, self.std, torch.float32, False)

        logits = selective_tta_logits(self.net, inputs, len(images), self.tta_level, self._fraction(), batch_size,
                                      on_batch)
        return self.finite(logits, "its evaluation images")

    def _fraction(self) -> float:
        return self.tta_select if 0 < self.tta_select < 1 else 1.0

    def passes(self, n: int) -> int:
        """Forward passes of one image that scoring a test set of n images takes (set_logits; tricks/tta.py)."""
        return tta_passes(n, self.tta_level, self._fraction())

    @torch.no_grad()
    def predict(self, images: torch.Tensor, top: int = 5) -> list[list[tuple[str, float]]]:
        """Per image, the `top` classes as (name, probability), most probable first."""
        check_top(top)
        return top_classes(self.probabilities(images), self.classes, top)

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """The softmax of forward(images): (N, K) float32, refused where a logit is not finite."""
        return torch.softmax(self.finite(self(images).float(), "these images"), dim=1)


def check_top(top) -> None:
    """Refuse, in one line and before any image is scored, a `top` for predict() that is not a whole number >= 1."""
    if type(top) is not int or top < 1:
        raise ValueError(f"top must be a whole number >= 1, got {top!r}")


def top_classes(probs: torch.Tensor, classes: list[str], top: int) -> list[list[tuple[str, float]]]:
    """Per row of `probs` (N, K), the `top` classes as (name, probability), most probable first."""
    values, indices = probs.topk(min(top, len(classes)), dim=1)
    return [[(classes[i], p) for i, p in zip(ids, ps)] for ids, ps in zip(indices.tolist(), values.tolist())]


def save_model(path: str | os.PathLike, model: nn.Module, card: dict) -> str:
    """Write PATH.safetensors and PATH.json (card: see model_files.py), neither replacing a file; returns
    "PATH.safetensors + PATH.json", each as the user would type it (a card in another folder than the one named is
    no card). The runner calls it on rank 0 with the bare or wrapped network."""
    weights, card_path = model_paths(check_save_path(path))
    # A fresh contiguous CPU copy of each tensor: channels_last or shared storage would not save as they are. In
    # fp32: a network trained with half weights (fp16) is saved as the card's network is built and evaluated.
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True,
                                memory_format=torch.contiguous_format)
               for k, v in unwrap(model).state_dict().items()}
    # these three first: they head the card file
    full: dict[str, Any] = {"format": MODEL_FORMAT, "version": MODEL_VERSION, "speedrun_version": __version__}
    full.update((k, v) for k, v in card.items() if k not in full)
    if isinstance(full.get("accuracy"), float) and not math.isfinite(full["accuracy"]):
        full["accuracy"] = None  # JSON has no NaN
    if isinstance(full.get("dataset"), bytes):
        full["dataset"] = os.fsdecode(full["dataset"])  # a bytes path (the runner passes os.fspath(dataset))
    try:  # what load() would refuse is never written
        files.match_state(files.expected_state(files.parse_card({**full, "weights_sha256": "0" * 64})), tensors)
    except files.Unusable as e:
        raise ValueError(f"cannot save the model as {weights}: its card or network is not valid "
                         f"({e})") from None
    files.write_files(weights, card_path, tensors, full)
    # Escaped as a stored name: the result file and the database keep it (saved_model), the log shows it.
    return printable(f"{weights} + {card_path}")


def check_save(save, world: dist.World, json_path=None) -> Path | None:
    """--save checked before any work: rank 0 checks the path it will write (under torchrun its refusal ends the
    other processes too: call this after dist.init), and the model's files must not take the result file's name."""
    if save is None:
        return None
    save_path = dist.main_first(world, lambda: check_save_path(save), everyone=False)
    save_path = save_path if world.is_main else Path(os.fspath(save))
    if json_path not in (None, "auto") and user_path(json_path, "--json").resolve() in [
            p.resolve() for p in model_paths(save)]:
        raise ValueError(f"--save {os.fspath(save)} would write the result file's name "
                         f"({os.fspath(json_path)}); choose another --save or --json")
    return save_path


def _card(card: dict, recipe, cfg, dataset: str, accuracy, seed, smoke: bool) -> dict:
    return {**card, "recipe": recipe.name, "family": recipe.family, "config": dataclasses.asdict(cfg),
            "dataset": dataset, "accuracy": accuracy, "seed": seed, "smoke_test": smoke}


def check_card(card: dict, recipe, cfg, dataset: str, smoke: bool) -> None:
    """Before training with --save: refuse (ValueError) a card that save_trained would refuse after it (class
    names a folder made that a card may not hold, say), so that no training is lost to it."""
    full = {"format": MODEL_FORMAT, "version": MODEL_VERSION, **_card(card, recipe, cfg, os.fsdecode(dataset), None,
                                                                      0, smoke), "weights_sha256": "0" * 64}
    try:
        files.expected_state(files.parse_card(full))
    except files.Unusable as e:
        raise ValueError(f"--save: this run's model could not be saved: its card is not valid ({e}); fix the "
                         "data (its class names), or leave out --save") from None


def save_trained(path: Path, model: nn.Module, card: dict, recipe, cfg, dataset: str, run, smoke: bool) -> str:
    """The last run's network saved with its card: the family's card plus the recipe, config, data, the run's
    accuracy and seed, and whether it was a smoke test (a few steps: `eval` and `predict` say so)."""
    return save_model(path, unwrap(model), _card(card, recipe, cfg, dataset, run.accuracy, run.seed, smoke))


def _not_a_folder(given: Path, card_path: Path) -> None:
    """A folder given as the model (`eval --ensemble m1 models/`) is named as one, with the saved models in it,
    not as its missing PATH.json."""
    if card_path.exists() or not given.is_dir():
        return
    try:
        with os.scandir(given) as entries:  # bounded: the first few saved models only
            found = [e.name[:-len(".safetensors")] for _, e in zip(range(10_000), entries)
                     if e.name.endswith(".safetensors")][:3]
    except OSError:
        found = []
    example = f" such as {given / found[0]}" if found else ""
    raise FileNotFoundError(f"{given} is a folder, not a saved model; give the PATH of a model saved with --save "
                            f"PATH{example} (PATH, PATH.safetensors and PATH.json name the same model)")


def _builder_given(cfg, model: str | None, card_path: Path) -> None:
    """Refuse a card whose network's builder was not given (never imported because the card names it), and one
    naming another builder than the one given, before any network is built."""
    recorded = getattr(cfg, "model", "")
    if model is not None and model != recorded:
        built = f"by {recorded}" if recorded else "as its recipe's own network"
        raise ValueError(f"saved model {card_path} was built {built}, not by {model}; "
                         + (f"give --model with the file or module of {recorded}" if recorded else
                            "leave out --model"))
    if recorded:
        custom.builder(recorded)  # the builder must have been given: its refusal names the flag


@escaped_refusals
def load(path: str | os.PathLike, device: str | torch.device = "cpu", model=None) -> TrainedModel:
    """`speedrun.load(PATH)`: the model saved at PATH (PATH, PATH.safetensors or PATH.json), checked as
    model_files.py describes; every refusal is one ValueError (FileNotFoundError) naming the file and the fix.
    model: the builder of a network trained with --model (MODULE:FUNCTION or the function; models/custom.py): a
    card that names one is loaded only once it is given, and a card naming another is refused."""
    weights, card_path = model_paths(path)
    model = custom.use_builder(model) if model is not None else custom.given()  # eval / predict's --model
    _not_a_folder(card_path.with_suffix(""), card_path)
    device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    try:
        try:  # UnicodeDecodeError and JSONDecodeError are ValueErrors; deep nesting is a RecursionError
            # utf-8-sig: a byte order mark (an editor's) is skipped
            card = json.loads(files.read_bytes(card_path, files.MAX_CARD_BYTES).decode("utf-8-sig"))
        except RecursionError:
            raise files.Unusable("not valid JSON (nested too deep to read)") from None
        except ValueError as e:
            raise files.Unusable(f"not valid JSON ({type(e).__name__}: {clip(str(e), 160)})") from None
        spec = files.parse_card(card)
        _builder_given(spec.cfg, model, card_path)
        expected = files.expected_state(spec)
    except files.Unusable as e:
        raise ValueError(f"saved model card {card_path} is unusable: {e}; {_FIX}") from None
    try:
        blob = files.read_bytes(weights, None, files.weights_size_range(expected))
        if hashlib.sha256(blob).hexdigest() != spec.sha256:  # before safetensors parses a byte of it
            raise files.Unusable("its SHA-256 is not the card's weights_sha256: the file is damaged, or the two "
                                 "files are not from one save")
        try:
            tensors = safetensors.torch.load(blob)
        except Exception as e:  # noqa: BLE001 -- safetensors' errors for a bad header, offsets or dtype vary
            raise files.Unusable(f"not a valid safetensors file ({type(e).__name__}: "
                                 f"{clip(str(e), 160)})") from None
        del blob
        files.match_state(expected, tensors)
    except files.Unusable as e:
        raise ValueError(f"saved model weights {weights} are unusable: {e}; {_FIX}") from None
    net = spec.family.build_model(spec.cfg, spec.shape[0], len(spec.classes), spec.shape[1])
    net.load_state_dict(tensors)  # names, shapes and dtypes were matched above
    model = TrainedModel(net, card)
    model.source = f"saved model {weights}"
    return model.to(device).eval()


def evaluate_saved(path: str | os.PathLike, dataset: str, *, data_dir=None, image_size: int | None = None,
                   device: str = "auto", batch_size: int = 2000, log=None,
                   progress: Callable[[int], EvalProgress] | None = None) -> dict:
    """Test accuracy of the saved model on `dataset`'s test split, with the card's TTA (`speedrun eval`).
    progress(total): the EvalProgress to show the scoring on, given its total work once the data is loaded; an
    interrupt carries how far the scoring got (errors.note_stopped)."""
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    dev = resolve_device(device)
    model = load(path, dev)
    data = evaluation_data(model, path, dataset, data_dir=data_dir, image_size=image_size, log=log)
    n = len(data.test_labels)
    shown = (progress or (lambda total: EvalProgress(False, total)))(model.passes(n))
    shown.stage(os.fsdecode(path), n, model.passes(n))
    try:
        with torch.no_grad():
            accuracy = evaluate(_Finite(model), data.test_images.to(dev), data.test_labels.to(dev),
                                normalization=Normalization(model.mean, model.std), tta_level=model.tta_level,
                                batch_size=batch_size, tta_select=model.tta_select, on_batch=shown.advance)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (errors.Terminated)
        note_stopped(interrupt, f"evaluation of {os.fsdecode(path)} stopped at {shown.images_done():,}/{n:,} images")
        raise
    finally:
        shown.close()
    return {"accuracy": accuracy, "n": len(data.test_labels), "tta_level": model.tta_level, "dataset": data.name,
            "model": os.fsdecode(path), "smoke_test": model.smoke_test}


def evaluation_data(model: TrainedModel, path: str | os.PathLike, dataset: str, *, data_dir=None,
                    image_size: int | None = None, log=None):
    """`dataset` loaded by the model's family for `speedrun eval`: refused unless its test images are held in
    memory and have the model's shape and class count; a warning where a class name differs."""
    recipe = RECIPES[model.card["recipe"]]
    if recipe.family in STREAMED_TEST_SPLIT:
        raise ValueError(f"speedrun eval scores data held in memory (the cifar family's); a model of "
                         f"{recipe.name} is scored by its training run's final evaluation, and `speedrun "
                         "predict` takes its images")
    data = recipe.module().load_data(dataset, data_dir=data_dir, image_size=image_size, log=log or (lambda line: None))
    (c, h, w), k = model.image_shape, len(model.classes)
    if data.image_shape != model.image_shape or data.num_classes != k:
        dc, dh, dw = data.image_shape
        raise ValueError(f"model {os.fsdecode(path)} takes {c}x{h}x{w} images of {k} classes, but "
                         f"{data.name} has {dc}x{dh}x{dw} images of {data.num_classes} classes; evaluate "
                         f"it on data like its training set{_resize_advice(data, model)}")
    if list(data.classes) != model.classes:
        i = next(i for i, (a, b) in enumerate(zip(data.classes, model.classes)) if a != b)
        warn(f"{data.name}'s class {i} is {data.classes[i]!r} but the model's is "
             f"{model.classes[i]!r}; the accuracy takes label i to mean the model's class i")
    return data


def _resize_advice(data, model: TrainedModel) -> str:
    """The --image-size advice for data whose images are not the model's size, where it can work: the model's
    images are square (--image-size makes squares), the classes agree, and the data at that size fits the limit
    (data/limits.py) that loading it would be held to; else what stops it."""
    (_, h, w), (_, dh, dw) = model.image_shape, data.image_shape
    if h != w or (dh, dw) == (h, w) or data.num_classes != len(model.classes):
        return ""
    # folder.py decodes every image of both splits to RGB: 3 bytes a pixel
    images = len(data.train_labels) + len(data.test_labels)
    need, limit = images * 3 * h * w, limits.max_dataset_bytes()
    if need > limit:
        return (f" (resized to {h}x{w} by --image-size {h}, its {images:,} images would take {need:,} bytes, over "
                f"the limit of {limit:,} (SPEEDRUN_MAX_DATA_BYTES): evaluate it on a folder of fewer images)")
    return f" (an image folder's images are resized to {h}x{h} by --image-size {h})"


class _Finite(nn.Module):
    """A saved model's network that refuses non-finite logits (TrainedModel.finite), for engine evaluate."""

    def __init__(self, model: TrainedModel):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.finite(self.model.net(x), "its evaluation images")


def _user_image(file: str) -> None:
    """Refuse a file that is not there or not a regular file, as the user's input (not a dataset's)."""
    if not os.path.isfile(file):
        what = "is not a regular file" if os.path.lexists(file) else "does not exist"
        raise ValueError(f"{file} {what}; give image files (.jpg, .jpeg or .png)")


def read_image(file: str, c: int, h: int, w: int) -> np.ndarray:
    """One image file as the model takes it: uint8 (c, h, w), decoded under folder.py's limits."""
    _user_image(file)
    # Square models: the shorter side scaled to the model's and centre-cropped, as `--image-size` does.
    pixels = folder.decode_one(file, h if h == w else None)  # (1 or 3, H, W)
    if pixels.shape[1:] != (h, w):
        raise ValueError(f"{file} is {pixels.shape[2]}x{pixels.shape[1]} px but this model takes {w}x{h} images "
                         f"(it was trained on images that are not square); resize it to {w}x{h}")
    if c == 3 and pixels.shape[0] == 1:
        pixels = np.repeat(pixels, 3, axis=0)  # grey -> RGB by replication, as folder.decode
    elif c == 1 and pixels.shape[0] == 3:
        r, g, b = pixels.astype(np.uint32)  # RGB -> grey: Pillow's "L" (ITU-R 601-2 luma) in its fixed point
        pixels = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[None]
    return np.ascontiguousarray(pixels)


def check_images(paths: list[str], h: int, w: int) -> None:
    """Every file's header read and checked (formats, claimed size, the model's shape) before any is decoded:
    a bad file among thousands is refused before minutes of work, not after. No pixel is decoded here."""
    for file in paths:
        _user_image(file)
        try:
            width, height = folder.header_size(file, h if h == w else None)
        except folder.Refused as e:
            raise folder.as_user_input(e) from None
        if h != w and (width, height) != (w, h):
            raise ValueError(f"{file} is {width}x{height} px but this model takes {w}x{h} images (it was trained "
                             f"on images that are not square); resize it to {w}x{h}")


def inference_bytes_per_image(model: TrainedModel) -> int:
    """Bytes one image needs through the network in evaluation: the input and output of its largest layer (both
    alive while it runs), from the shapes of a pass on the meta device; no weights are copied."""
    largest = [0]

    def hook(module, inputs, output):
        n = sum(t.numel() for t in inputs if isinstance(t, torch.Tensor))
        if isinstance(output, torch.Tensor):
            n += output.numel()
        largest[0] = max(largest[0], n)

    spec = files.parse_card(model.card)
    net = on_meta(lambda: spec.family.build_model(spec.cfg, spec.shape[0], len(spec.classes), spec.shape[1])).eval()
    handles = [m.register_forward_hook(hook) for m in net.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            net(torch.zeros((1, *model.image_shape), device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return 4 * largest[0]  # float32


def predict_batch_size(model: TrainedModel) -> int:
    """Images scored at a time: _PREDICT_BATCH, fewer where the model's images are large; refused when one image
    alone cannot fit in the memory available."""
    per_image = inference_bytes_per_image(model)
    c, h, w = model.image_shape
    limits.check_memory(per_image, f"one {w}x{h} image through this model",
                        "free memory, or use a model trained on smaller images")
    available = limits.available_memory_bytes()
    budget = _PREDICT_BUDGET_BYTES if available is None else min(_PREDICT_BUDGET_BYTES, available // 2)
    return max(1, min(_PREDICT_BATCH, budget // max(1, per_image)))


def iter_predictions(path: str | os.PathLike, images: list[str], *, top: int = 5, device: str = "auto",
                     on_load: Callable[[TrainedModel], object] | None = None,
                     ) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """Per image file, its `top` classes under the saved model as (name, probability), yielded a batch at a time
    (the CLI prints each as it comes). Every file's header is checked before the first is decoded. on_load: called
    with the model once it is loaded (the CLI notes a smoke test's model)."""
    if isinstance(images, (str, bytes, os.PathLike)) or not images:
        raise ValueError("give a list of one or more image files")
    if type(top) is not int or top < 1:
        raise ValueError(f"top (--top) must be a whole number >= 1, got {top!r}")
    model = load(path, resolve_device(device))
    c, h, w = model.image_shape
    if c not in (1, 3):
        raise ValueError(f"model {os.fsdecode(path)} takes {c}-channel images; image files give 1 "
                         "(grey) or 3 (RGB)")
    paths = [os.fsdecode(f) for f in images]
    check_images(paths, h, w)
    if on_load is not None:
        on_load(model)
    batch = predict_batch_size(model)
    for start in range(0, len(paths), batch):  # a bounded batch in memory, however many files
        chunk = paths[start:start + batch]
        pixels = torch.from_numpy(np.stack([read_image(f, c, h, w) for f in chunk]))  # (B, C, H, W) uint8
        yield from zip(chunk, model.predict(pixels, top=top))


def predict_files(path: str | os.PathLike, images: list[str], *, top: int = 5,
                  device: str = "auto") -> list[tuple[str, list[tuple[str, float]]]]:
    """Per image file, its `top` classes under the saved model as (name, probability) (`speedrun predict`)."""
    return list(iter_predictions(path, images, top=top, device=device))
