"""Ensembles of saved models: `speedrun eval --ensemble` and `speedrun predict --ensemble` average the softmax of
several models (export.py loads and checks each exactly as a single model) of one family, trained on one dataset.

The models must agree on what makes their outputs comparable: the family, the class names in order, the image
shape, the normalization and the dataset named in their cards; each keeps its own TTA level (its logits over its
views, then its softmax). eval scores one model at a time over the test set and keeps the running sum of the
softmax and, while a model is scored, its logits: two (N, K) float32 besides the test images (a model whose card
selects TTA chooses over the whole set, TrainedModel.set_logits); predict streams the image files a batch at a
time through every model, as for one model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch

from speedrun.engine.system import resolve_device, synchronize
from speedrun.errors import note_stopped
from speedrun.records.environment import device_label, environment
from speedrun.run import export
from speedrun.run.display import EvalProgress
from speedrun.run.export import TrainedModel

_T = TypeVar("_T")
MIN_MODELS = 2
# What each evaluation time in a report holds, said in the table and the JSON.
TIMED = ("per model: its pass over the test images already on the device (normalization, its TTA forward passes, "
         "softmax, adding to the running sum), after an untimed warm-up batch, with device synchronization; the "
         "ensemble: the models' passes plus the average and its argmax; loading the models and the data is not "
         "timed")


def _name(path: str | os.PathLike) -> str:
    return os.fsdecode(path)


def _same_data(a: str, b: str) -> bool:
    """Whether two cards' datasets name one dataset: the same name or path as written, or two spellings of one
    path (a relative and an absolute one, say): one folder here, or the same last part. Called once the models'
    normalization agrees: the channel statistics of their training images, equal to the last bit."""
    if a == b or os.path.basename(os.path.normpath(a)) == os.path.basename(os.path.normpath(b)):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either is a name (cifar10), or not here
        return False


def _disagreement(a: TrainedModel, b: TrainedModel) -> str | None:
    """The first field in which two models' cards differ so that their softmax cannot be averaged, as words."""
    ca, cb = a.card, b.card
    if ca["family"] != cb["family"]:
        return f"family: {ca['family']!r} against {cb['family']!r}"
    if a.classes != b.classes:
        if len(a.classes) != len(b.classes):
            return f"classes: {len(a.classes)} against {len(b.classes)}"
        i = next(i for i, (x, y) in enumerate(zip(a.classes, b.classes)) if x != y)
        order = " (the same names in another order)" if sorted(a.classes) == sorted(b.classes) else ""
        return f"classes: class {i} is {a.classes[i][:60]!r} against {b.classes[i][:60]!r}{order}"
    if a.image_shape != b.image_shape:
        return f"image_shape: {list(a.image_shape)} against {list(b.image_shape)}"
    for key in ("mean", "std"):
        if ca[key] != cb[key]:
            return f"normalization ({key}): {ca[key]} against {cb[key]}"
    if not _same_data(ca["dataset"], cb["dataset"]):
        return f"dataset: {ca['dataset'][:100]!r} against {cb['dataset'][:100]!r}"
    return None


def load_ensemble(paths: list, device: str | torch.device = "cpu") -> list[TrainedModel]:
    """The saved models at `paths`, each loaded and checked by export.load; refused (one line naming two models and
    the field) where two disagree, where fewer than MIN_MODELS are given, or where one is given twice."""
    if isinstance(paths, (str, bytes, os.PathLike)) or len(paths) < MIN_MODELS:
        got = "one" if isinstance(paths, (str, bytes, os.PathLike)) or len(paths) == 1 else "none"
        raise ValueError(f"an ensemble averages at least {MIN_MODELS} saved models; got {got}: give --ensemble "
                         "MODEL MODEL ... (one model alone is scored without --ensemble)")
    seen: dict[str, str] = {}
    for path in paths:  # the same files named twice (m, m.json, ./m): refused before any is read
        weights = os.path.realpath(export.model_paths(path)[0])
        if weights in seen:
            raise ValueError(f"{seen[weights]} and {_name(path)} are the same saved model; an ensemble averages "
                             "different models: give each once")
        seen[weights] = _name(path)
    models: list[TrainedModel] = []
    for path in paths:
        model = export.load(path, device)
        for earlier, other in zip(paths, models):
            if other.card["weights_sha256"] == model.card["weights_sha256"]:
                raise ValueError(f"{_name(earlier)} and {_name(path)} hold the same weights (one SHA-256): copies "
                                 "of one model; an ensemble averages different models: give each once")
        why = _disagreement(models[0], model) if models else None
        if why is not None:
            raise ValueError(f"{_name(paths[0])} and {_name(path)} cannot be averaged: they differ in {why}; an "
                             "ensemble takes models of one family trained on one dataset (the same classes, "
                             "image shape and normalization)")
        models.append(model)
    return models


class Ensemble:
    """Saved models whose softmax is averaged: probabilities(images) (N, K) and predict(images, top) as one
    TrainedModel's (export.py), for images of their common shape."""

    def __init__(self, models: list[TrainedModel]):
        self.models = models
        self.classes = models[0].classes
        self.image_shape = models[0].image_shape

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """The mean over the models of each one's softmax (its TTA logits first): (N, K) float32."""
        total = self.models[0].probabilities(images)
        for model in self.models[1:]:
            total += model.probabilities(images)
        return total / len(self.models)

    def predict(self, images: torch.Tensor, top: int = 5) -> list[list[tuple[str, float]]]:
        export.check_top(top)
        return export.top_classes(self.probabilities(images), self.classes, top)


def _timed(device: torch.device, work: Callable[[], _T]) -> tuple[_T, float]:
    synchronize(device)
    start = time.perf_counter()
    value = work()
    synchronize(device)
    return value, time.perf_counter() - start


def evaluate_ensemble(paths: list, dataset: str, *, data_dir=None, image_size: int | None = None,
                      device: str = "auto", batch_size: int = 2000, log=None,
                      progress: Callable[[int], EvalProgress] | None = None) -> dict:
    """Each model's test accuracy on `dataset` (with its card's TTA, as `speedrun eval` gives it alone) and the
    ensemble's (the argmax of the mean softmax), with the evaluation seconds of each (TIMED says what is in them).
    progress(total): the EvalProgress to show the scoring on, given its total work once the data is loaded (default
    one that shows nothing). An interrupt carries how far the scoring got (errors.note_stopped)."""
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    dev = resolve_device(device)
    models = load_ensemble(paths, dev)
    data = export.evaluation_data(models[0], paths[0], dataset, data_dir=data_dir, image_size=image_size, log=log)
    images, labels = data.test_images.to(dev), data.test_labels.to(dev)  # (N, C, H, W) uint8, (N,)
    n = len(labels)
    total = torch.zeros(n, len(models[0].classes), dtype=torch.float32, device=dev)  # the softmax summed, (N, K)
    warm = min(batch_size, n)
    work = sum(model.passes(warm) + model.passes(n) for model in models)
    shown = (progress or (lambda total: EvalProgress(False, total)))(work)

    def one_pass(model: TrainedModel) -> int:
        # as engine.evaluate scores one saved model (export.evaluate_saved): the same operations, the same logits
        scores = model.set_logits(images, batch_size, shown.advance)  # (N, K)
        total.add_(torch.softmax(scores, dim=1))
        return int((scores.argmax(1) == labels).sum())

    rows = []
    try:
        with torch.no_grad():
            for i, (path, model) in enumerate(zip(paths, models)):
                label = f"model {i + 1}/{len(models)} ({_name(path)})"
                shown.stage(f"{label} warm-up", warm, model.passes(warm))
                # the untimed warm-up (kernels chosen, caches filled)
                model.set_logits(images[:batch_size], batch_size, shown.advance)
                shown.stage(label, n, model.passes(n))
                correct, seconds = _timed(dev, lambda: one_pass(model))
                rows.append({"model": _name(path), "recipe": model.card["recipe"], "seed": model.card["seed"],
                             "tta_level": model.tta_level, "accuracy": correct / n, "seconds": seconds,
                             "smoke_test": model.smoke_test})
            ensemble_correct, combine = _timed(dev, lambda: int(((total / len(models)).argmax(1) == labels).sum()))
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (errors.Terminated)
        note_stopped(interrupt, f"evaluation of {len(models)} models stopped at {shown.where()}")
        raise
    finally:
        shown.close()
    single = [r["seconds"] for r in rows]
    seconds = sum(single) + combine
    mean_single = float(np.mean(single))
    return {"benchmark": "ensemble", "environment": environment(dev), "dataset": data.name, "n": n,
            "device": str(dev), "models": rows, "timed": TIMED,
            "ensemble": {"n_models": len(models), "accuracy": ensemble_correct / n, "seconds": seconds,
                         "extra_seconds": seconds - mean_single,
                         "time_ratio": seconds / mean_single if mean_single > 0 else None}}


def iter_ensemble_predictions(paths: list, images: list[str], *, top: int = 5, device: str = "auto",
                              on_load: Callable[[list[TrainedModel]], object] | None = None,
                              ) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """Per image file, its `top` classes under the ensemble's mean softmax as (name, probability), a batch at a
    time, as export.iter_predictions gives one model's; on_load is called with the models once all are loaded."""
    if isinstance(images, (str, bytes, os.PathLike)) or not images:
        raise ValueError("give a list of one or more image files")
    if type(top) is not int or top < 1:
        raise ValueError(f"top (--top) must be a whole number >= 1, got {top!r}")
    ensemble = Ensemble(load_ensemble(paths, resolve_device(device)))
    c, h, w = ensemble.image_shape
    if c not in (1, 3):
        raise ValueError(f"models {', '.join(map(_name, paths))} take {c}-channel images; image files give 1 "
                         "(grey) or 3 (RGB)")
    files = [os.fsdecode(f) for f in images]
    export.check_images(files, h, w)
    if on_load is not None:
        on_load(ensemble.models)
    batch = min(export.predict_batch_size(model) for model in ensemble.models)  # each model's pass in turn
    for start in range(0, len(files), batch):  # a bounded batch in memory, however many files
        chunk = files[start:start + batch]
        pixels = torch.from_numpy(np.stack([export.read_image(f, c, h, w) for f in chunk]))  # (B, C, H, W) uint8
        yield from zip(chunk, ensemble.predict(pixels, top=top))


def markdown(report: dict) -> str:
    """BENCHMARKS.md's table of one `eval --ensemble --json` report (benchmarks/table.py renders it between the
    ensemble markers): each model's accuracy and evaluation seconds, then the ensemble's."""
    env = report.get("environment")
    where = f"{env['timestamp_utc'][:10]}, {device_label(env)}" if env else report["device"]
    command = f": `{report['command']}`" if report.get("command") else ""
    e = report["ensemble"]
    lines = [f"{where}, {report['dataset']} test ({report['n']:,} images){command}", "",
             "| model | TTA level | test acc % | eval s |", "|---|---|---|---|"]
    lines += [f"| {os.path.basename(r['model'])} | {r['tta_level']} | {100 * r['accuracy']:.2f} | {r['seconds']:.1f} |"
              for r in report["models"]]
    ratio = "" if e["time_ratio"] is None else f", {e['time_ratio']:.2f}x one model's mean"
    lines.append(f"| ensemble of {e['n_models']} (mean softmax) | | {100 * e['accuracy']:.2f} | {e['seconds']:.1f} "
                 f"(+{e['extra_seconds']:.1f}{ratio}) |")
    return "\n".join(lines)
