"""Multi-run training: resolve recipe, data and device; train N seeds; summarize; write the result JSON.

This is what `speedrun train` and `speedrun.train()` call. The training loop itself lives in the recipe.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speedrun.config import apply_overrides
from speedrun.engine import resolve_device
from speedrun.recipes import cifar
from speedrun.results import default_result_path, environment, write_json
from speedrun.stats import summarize


@dataclass(frozen=True)
class Recipe:
    name: str
    make_config: Callable[[], Any]
    run: Callable[..., cifar.RunResult]
    warmup: Callable[..., float]
    default_dataset: str
    description: str


RECIPES = {r.name: r for r in [
    Recipe("cifar10-94", cifar.cifar10_94, cifar.train_run, cifar.warmup, "cifar10",
           "airbench94-class net, SGD + Lookahead, 9.9 epochs: 94%"),
    Recipe("cifar10-94-muon", cifar.cifar10_94_muon, cifar.train_run, cifar.warmup, "cifar10",
           "the same net with Muon on the conv filters, batch 2000, 8 epochs: 94%"),
    Recipe("cifar10-95", cifar.cifar10_95, cifar.train_run, cifar.warmup, "cifar10",
           "widths 128/384/384, 15 epochs: 95%"),
    Recipe("cifar10-96", cifar.cifar10_96, cifar.train_run, cifar.warmup, "cifar10",
           "residual groups 128/384/512, translate 4 + cutout 12, 37 epochs: 96%"),
]}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


def make_config(recipe: Recipe, epochs: float | None, overrides: dict[str, Any]):
    """The recipe's config with overrides applied; --epochs compresses the whole schedule to fit.

    The lr schedule and Lookahead are defined in fractions of the run already; the whitening bias's
    training window (in epochs) is scaled by the same factor.
    """
    cfg = apply_overrides(recipe.make_config(), overrides)
    if epochs is not None:
        if not epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {epochs}")
        scale = epochs / cfg.epochs
        cfg = dataclasses.replace(cfg, epochs=float(epochs), whiten_bias_epochs=cfg.whiten_bias_epochs * scale)
    cfg.validate()
    return cfg


@dataclass
class Result:
    """What a multi-run training returns; `to_dict()` is the JSON written by --json."""

    recipe: str
    dataset: str
    device: str
    config: dict
    runs: list[cifar.RunResult]
    environment: dict
    data_seconds: float = 0.0  # loading/decoding the dataset (untimed)
    warmup_seconds: float = 0.0  # the untimed warm-up run (compile, cuDNN autotune)
    interrupted: bool = False
    command: str | None = None  # the exact command line, when run from the CLI
    model: torch.nn.Module | None = field(default=None, repr=False)  # the last run's trained model

    @property
    def accuracies(self) -> list[float]:
        return [r.accuracy for r in self.runs]

    @property
    def mean_accuracy(self) -> float:
        return summarize(self.accuracies).mean

    @property
    def std_accuracy(self) -> float:
        return summarize(self.accuracies).std

    @property
    def target_accuracy(self) -> float:
        return self.config["target_accuracy"]

    @property
    def hit_rate(self) -> float:
        """Share of runs reaching the recipe's target accuracy."""
        return sum(a >= self.target_accuracy for a in self.accuracies) / len(self.runs)

    def to_dict(self) -> dict:
        acc = summarize(self.accuracies)
        secs = summarize([r.train_seconds for r in self.runs])
        return {
            "recipe": self.recipe, "dataset": self.dataset, "device": self.device, "command": self.command,
            "mean_accuracy": acc.mean, "std_accuracy": acc.std, "n": acc.n,
            "accuracy": acc.to_dict(), "train_seconds": secs.to_dict(),
            "target_accuracy": self.target_accuracy, "hit_rate": self.hit_rate,
            "timed_region": "whitening init + training + final TTA evaluation, device-synchronized; "
                            "excludes data loading, upload, per-epoch table evaluations and warm-up",
            "data_seconds": self.data_seconds, "warmup_seconds": self.warmup_seconds,
            "interrupted": self.interrupted, "seeds": [r.seed for r in self.runs],
            "runs": [r.to_dict() for r in self.runs], "config": self.config,
            "environment": self.environment,
        }


def train(recipe: str = "cifar10-94", dataset: str | None = None, *, device: str = "auto",
          epochs: float | None = None, runs: int = 1, seed: int = 0, data_dir: str | None = None,
          json_path: str | Path | None = None, verbose: bool = False, command: str | None = None,
          **overrides: Any) -> Result:
    """Train `runs` seeds of `recipe` on `dataset` and return a Result (with the last run's model).

    `overrides` are config fields, e.g. train("cifar10-94", lookahead=False, batch_size=512).
    json_path: where to write the result JSON; "auto" picks a new results/<time>-<recipe>-<dataset>.json when
    the result is written (so a run that fails early leaves no file behind); None writes nothing.
    """
    from speedrun import display  # rich is imported only when something is shown
    from speedrun.data.sources import load_dataset

    rec = get_recipe(recipe)
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    cfg = make_config(rec, epochs, overrides)
    dev = resolve_device(device)
    show = display.Display(verbose)
    dataset = dataset or rec.default_dataset
    start = time.perf_counter()
    data = load_dataset(dataset, data_dir=data_dir, log=show.line)
    data_seconds = time.perf_counter() - start
    env = environment(dev)
    show.line(f"device: {dev.type} ({env['device_name']})"
              + (" -- chosen by --device auto" if device == "auto" else ""))
    c, h, w = data.image_shape
    show.line(f"data: {data.name}: {len(data.train_labels)} train / {len(data.test_labels)} test, "
              f"{c}x{h}x{w}, {data.num_classes} classes ({data_seconds:.1f} s to load)")
    result = Result(recipe=rec.name, dataset=dataset, device=dev.type, config=dataclasses.asdict(cfg), runs=[],
                    environment=env, data_seconds=data_seconds, command=command)
    try:
        result.warmup_seconds = rec.warmup(cfg, data, dev)
        if result.warmup_seconds:
            show.line(f"warm-up run (untimed, shuffled labels): {result.warmup_seconds:.1f} s")
        for i in range(runs):
            with show.run(i, runs, seed + i) as (on_step, on_epoch):
                run = rec.run(cfg, data, dev, seed + i, on_step=on_step, on_epoch=on_epoch)
            result.model, run.model = run.model, None  # keep one model alive, not N
            result.runs.append(run)
    except KeyboardInterrupt:
        result.interrupted = True
        if not result.runs:
            raise
        show.line(f"interrupted: keeping the {len(result.runs)} finished run(s)")
    show.summary(result)
    if json_path is not None:
        if json_path == "auto":
            json_path = default_result_path(rec.name, dataset)
        path = write_json(json_path, result.to_dict())
        show.line(f"result: {path}")
    if result.interrupted:
        raise KeyboardInterrupt
    return result


def print_recipes(file=sys.stdout) -> None:
    for r in RECIPES.values():
        print(f"{r.name:18s} {r.description}", file=file)
