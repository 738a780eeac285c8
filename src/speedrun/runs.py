"""Multi-run training: resolve recipe, data and device; train N seeds; summarize; write the result JSON.

This is what `speedrun train` and `speedrun.train()` call. The training loop itself lives in the recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speedrun.config import apply_overrides
from speedrun.data import limits
from speedrun.data.loader import steps_for
from speedrun.engine import Diverged, resolve_device
from speedrun.errors import warn
from speedrun.recipes import cifar
from speedrun.results import (claim_result_path, default_result_path, environment, release_result_path,
                              write_json)
from speedrun.stats import summarize


@dataclass(frozen=True)
class Recipe:
    name: str
    make_config: Callable[[], Any]
    run: Callable[..., cifar.RunResult]
    warmup: Callable[..., float]
    check: Callable[..., list[str]]  # (cfg, image_shape, num_train, num_test, num_classes, device) -> warnings
    default_dataset: str
    description: str


RECIPES = {r.name: r for r in [
    Recipe("cifar10-94", cifar.cifar10_94, cifar.train_run, cifar.warmup, cifar.check_data, "cifar10",
           "airbench94-class net, SGD + Lookahead, 9.9 epochs: 94%"),
    Recipe("cifar10-94-muon", cifar.cifar10_94_muon, cifar.train_run, cifar.warmup, cifar.check_data, "cifar10",
           "the same net with Muon on the conv filters, batch 2000, 8 epochs: 94%"),
    Recipe("cifar10-95", cifar.cifar10_95, cifar.train_run, cifar.warmup, cifar.check_data, "cifar10",
           "widths 128/384/384, 15 epochs: 95%"),
    Recipe("cifar10-96", cifar.cifar10_96, cifar.train_run, cifar.warmup, cifar.check_data, "cifar10",
           "residual groups 128/384/512, translate 4 + cutout 12, 37 epochs: 96%"),
]}

MAX_RUNS = 10_000
# --smoke: a check that the whole pipeline runs, in seconds even on a CPU; its accuracy means nothing.
SMOKE_STEPS = 4
SMOKE_TEST_IMAGES = 1000


def get_recipe(name: str) -> Recipe:
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


def _check_epochs(epochs: Any) -> float:
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) \
            or not 0 < epochs <= cifar.MAX_EPOCHS:
        raise ValueError(f"epochs (--epochs) must be a number in (0, {cifar.MAX_EPOCHS:g}], got {epochs!r}")
    return float(epochs)


def _compress(cfg, epochs: float):
    """cfg with `epochs`, the whitening bias's window scaled by the same factor (the lr schedule and Lookahead are
    defined in fractions of the run already)."""
    scale = epochs / cfg.epochs
    return dataclasses.replace(cfg, epochs=epochs, whiten_bias_epochs=cfg.whiten_bias_epochs * scale)


def make_config(recipe: Recipe, epochs: float | None, overrides: dict[str, Any]):
    """The recipe's config with overrides applied; --epochs compresses the whole schedule to fit.

    `--set epochs=E` sets the field alone; giving it and --epochs is ambiguous and refused.
    """
    if epochs is not None and "epochs" in overrides:
        raise ValueError("epochs is given twice (epochs= / --epochs and --set epochs=); keep one")
    cfg = apply_overrides(recipe.make_config(), overrides)
    if epochs is not None:
        cfg = _compress(cfg, _check_epochs(epochs))
    cfg.validate()
    return cfg


def _check_types(**values: tuple[Any, tuple[type, ...], str]) -> None:
    """Each keyword is (value, allowed types, what to pass instead): the API's arguments, before anything uses them
    (a device of None or a json_path of 123 would otherwise fail deep inside, as a TypeError naming nothing)."""
    for name, (value, types, expected) in values.items():
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f"{name}={value!r:.80} is not {expected}")


def _check_int(name: str, flag: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} ({flag}) must be an integer in [{low}, {high}], got {value!r}")
    return value


def _smoke_data(data):
    """The first SMOKE_TEST_IMAGES of a fixed random order of the test set (test folders are class-ordered)."""
    if len(data.test_labels) <= SMOKE_TEST_IMAGES:
        return data
    pick = torch.randperm(len(data.test_labels), generator=torch.Generator().manual_seed(0))[:SMOKE_TEST_IMAGES]
    return dataclasses.replace(data, test_images=data.test_images[pick], test_labels=data.test_labels[pick])


@dataclass
class Result:
    """What a multi-run training returns; `to_dict()` is the JSON written by --json.

    `runs` holds every run that ended, diverged ones included (their accuracy is None); the statistics cover the
    runs that finished.
    """

    recipe: str
    dataset: str
    device: str
    config: dict
    runs: list[cifar.RunResult]
    environment: dict
    data_seconds: float = 0.0  # loading/decoding the dataset (untimed)
    warmup_seconds: float = 0.0  # the untimed warm-up run (compile, cuDNN autotune)
    interrupted: bool = False
    complete: bool = False  # every requested run ended (a file with complete=false was cut off)
    runs_requested: int = 0
    smoke_test: bool = False
    image_size: int | None = None
    command: str | None = None  # the exact command line, when run from the CLI
    model: torch.nn.Module | None = field(default=None, repr=False)  # the last run's trained model

    @property
    def finished(self) -> list[cifar.RunResult]:
        return [r for r in self.runs if r.diverged is None]

    @property
    def diverged_runs(self) -> int:
        return len(self.runs) - len(self.finished)

    @property
    def accuracies(self) -> list[float]:
        return [r.accuracy for r in self.finished]

    @property
    def mean_accuracy(self) -> float | None:
        return summarize(self.accuracies).mean if self.finished else None

    @property
    def std_accuracy(self) -> float | None:
        """None with fewer than two finished runs: one run has no spread."""
        return summarize(self.accuracies).std if self.finished else None

    @property
    def target_accuracy(self) -> float:
        return self.config["target_accuracy"]

    @property
    def hit_rate(self) -> float | None:
        """Share of finished runs reaching the recipe's target accuracy."""
        return sum(a >= self.target_accuracy for a in self.accuracies) / len(self.finished) if self.finished else None

    def to_dict(self) -> dict:
        acc = summarize(self.accuracies).to_dict() if self.finished else None
        secs = summarize([r.train_seconds for r in self.finished]).to_dict() if self.finished else None
        return {
            "recipe": self.recipe, "dataset": self.dataset, "device": self.device, "command": self.command,
            "smoke_test": self.smoke_test,
            "mean_accuracy": self.mean_accuracy, "std_accuracy": self.std_accuracy, "n": len(self.finished),
            "accuracy": acc, "train_seconds": secs,
            "target_accuracy": self.target_accuracy, "hit_rate": self.hit_rate,
            "timed_region": "whitening init + training + final TTA evaluation, device-synchronized; "
                            "excludes data loading, upload, per-epoch table evaluations and warm-up",
            "data_seconds": self.data_seconds, "warmup_seconds": self.warmup_seconds,
            "complete": self.complete, "interrupted": self.interrupted, "runs_requested": self.runs_requested,
            "diverged_runs": self.diverged_runs, "image_size": self.image_size,
            "seeds": [r.seed for r in self.runs],
            "runs": [r.to_dict() for r in self.runs], "config": self.config,
            "environment": self.environment,
        }


def _eval_note(cfg, data, steps: int) -> str | None:
    """A line when scoring the test set is more work than training (short CPU runs), with the quicker path."""
    views = {0: 1, 1: 2, 2: 6}[cfg.tta_level]  # forward passes per test image (tricks/tta.py)
    n_test = len(data.test_labels)
    eval_passes = n_test * views + (n_test * math.floor(cfg.epochs) if cfg.eval_each_epoch else 0)
    train_passes = 3 * steps * cfg.batch_size  # a training step costs about three forward passes
    if eval_passes <= train_passes:
        return None
    return (f"note: scoring {n_test} test images x {views} TTA view(s) is more work than the training itself "
            f"({steps} step(s) of {cfg.batch_size}); for a quick check of the pipeline use smoke=True (--smoke)")


def train(recipe: str = "cifar10-94", dataset: str | None = None, *, device: str = "auto",
          epochs: float | None = None, runs: int = 1, seed: int = 0, data_dir: str | None = None,
          image_size: int | None = None, json_path: str | Path | None = None, verbose: bool = False,
          summary: bool | None = None, command: str | None = None, smoke: bool = False,
          overrides: dict[str, Any] | None = None, **config_overrides: Any) -> Result:
    """Train `runs` seeds of `recipe` on `dataset` and return a Result (with the last run's model).

    `config_overrides` (or the dict `overrides`, which may hold any key, `epochs` included) are config fields,
    e.g. train("cifar10-94", lookahead=False, batch_size=512).
    json_path: where to write the result JSON, claimed before any data is read (an existing file is never replaced:
    that is an error); "auto" picks a new results/<time>-<recipe>-<dataset>.json; None writes nothing. The file is
    rewritten after every run, so a crash keeps the runs that ended ("complete": false).
    verbose: progress, tables and notes on stderr; summary: the summary table on stdout (default: as verbose).
    smoke: a pipeline check in seconds: SMOKE_STEPS steps, SMOKE_TEST_IMAGES test images, no TTA; marked as such.
    Every setting is checked before data is read, and the data against the config before any step is taken.
    """
    from speedrun import display  # rich is imported only when something is shown
    from speedrun.data.sources import load_dataset

    path_like = (str, os.PathLike, type(None))
    _check_types(dataset=(dataset, path_like, "a dataset name or path (--dataset)"),
                 device=(device, (str,), "a device name such as 'cpu' (--device)"),
                 data_dir=(data_dir, path_like, "a folder or archive path (--data-dir)"),
                 json_path=(json_path, path_like, "a file path, 'auto' or None (--json)"),
                 overrides=(overrides, (dict, type(None)), "a dict of config keys to values (--set)"),
                 smoke=(smoke, (bool,), "True or False (--smoke)"), verbose=(verbose, (bool,), "True or False"),
                 summary=(summary, (bool, type(None)), "True, False or None"),
                 command=(command, (str, type(None)), "a string or None"))
    rec = get_recipe(recipe)
    runs = _check_int("runs", "--runs", runs, 1, MAX_RUNS)
    seed = _check_int("seed", "--seed", seed, 0, 2**62)
    cfg = make_config(rec, epochs, {**(overrides or {}), **config_overrides})
    if smoke:
        cfg = dataclasses.replace(cfg, tta_level=0, eval_each_epoch=False)
    dev = resolve_device(device)
    limits.max_dataset_bytes()  # the environment's limit, checked with the settings, before any file is touched
    dataset = rec.default_dataset if dataset is None else os.fspath(dataset)  # "" is a mistake, not the default
    if json_path is not None:  # claimed now: an existing or unwritable path fails before any work
        json_path = default_result_path(rec.name, dataset) if json_path == "auto" else claim_result_path(json_path)
    written = False
    show = display.Display(verbose, summary)
    try:
        start = time.perf_counter()
        data = load_dataset(dataset, data_dir=data_dir, image_size=image_size, log=show.line)
        data_seconds = time.perf_counter() - start
        if smoke:
            data = _smoke_data(data)
            cfg = _compress(cfg, min(cfg.epochs, SMOKE_STEPS * cfg.batch_size / len(data.train_labels)))
        steps = steps_for(cfg.epochs, len(data.train_labels), cfg.batch_size)
        for message in rec.check(cfg, data.image_shape, len(data.train_labels), len(data.test_labels),
                                 data.num_classes, dev):
            warn(message)
        show.release()  # every check has passed: what was held back (downloads, decoding) may be shown now
        env = environment(dev)
        show.line(f"device: {dev.type} ({env['device_name']})"
                  + (" -- chosen by --device auto" if device == "auto" else ""))
        c, h, w = data.image_shape
        show.line(f"data: {data.name}: {len(data.train_labels)} train / {len(data.test_labels)} test, "
                  f"{c}x{h}x{w}, {data.num_classes} classes ({data_seconds:.1f} s to load)")
        if smoke:
            show.line(f"smoke test: {steps} step(s), {len(data.test_labels)} test images, no TTA: this checks that "
                      "the pipeline runs; its accuracy is not a result")
        elif (note := _eval_note(cfg, data, steps)) is not None:
            show.line(note)
        result = Result(recipe=rec.name, dataset=dataset, device=dev.type, config=dataclasses.asdict(cfg), runs=[],
                        environment=env, data_seconds=data_seconds, runs_requested=runs, smoke_test=smoke,
                        image_size=image_size, command=command)

        def save() -> None:
            nonlocal written
            if json_path is not None:
                write_json(json_path, result.to_dict())
                written = True

        def report() -> None:
            show.summary(result)
            if json_path is not None:
                show.line(f"result: {json_path}")

        try:
            try:
                result.warmup_seconds = rec.warmup(cfg, data, dev)
            except Diverged as e:  # shuffled labels; compile and autotuning happened before the bad step
                warn(f"the warm-up run {e}")
            if result.warmup_seconds:
                show.line(f"warm-up run (untimed, shuffled labels): {result.warmup_seconds:.1f} s")
            for i in range(runs):
                try:
                    with show.run(i, runs, seed + i, cfg.tta_level) as (on_step, on_epoch):
                        run = rec.run(cfg, data, dev, seed + i, on_step=on_step, on_epoch=on_epoch)
                except Diverged as e:
                    warn(f"run {i + 1}/{runs} (seed {seed + i}) {e}")
                    run = cifar.RunResult(seed=seed + i, accuracy=None, train_seconds=None, epochs=cfg.epochs,
                                          steps=e.step, diverged=e.to_dict())
                result.model, run.model = run.model, None  # keep one model alive, not N
                result.runs.append(run)
                result.complete = len(result.runs) == runs
                save()  # after every run: a crash or kill later keeps this one
        except KeyboardInterrupt as interrupt:  # Ctrl-C, and SIGTERM through errors.Terminated
            result.interrupted = True
            # What the CLI's last line says: how many runs were kept, and where.
            interrupt.runs_kept = len(result.runs)
            interrupt.result_path = json_path if result.runs else None
            if not result.runs:
                raise
            show.line(f"interrupted: keeping the {len(result.runs)} finished run(s)")
            with _signals_held():  # a second Ctrl-C must not cut this write short: it would keep the last file
                save()
            report()
            raise
        report()
        return result
    finally:
        show.close()
        if json_path is not None and not written:
            release_result_path(Path(json_path))


@contextlib.contextmanager
def _signals_held():
    """A Ctrl-C or SIGTERM during the block does not interrupt it; the command is stopping already, so it changes
    nothing after it either. Python-level handlers, not a signal mask: torch's threads would take a process-directed
    signal that the main thread blocks. Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, frame: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python


def print_recipes(file=sys.stdout) -> None:
    for r in RECIPES.values():
        print(f"{r.name:18s} {r.description}", file=file)
