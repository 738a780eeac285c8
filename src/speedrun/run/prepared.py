"""A prepared run: where `speedrun train` and every instrument that trains (bench, ablate and --to-target, tune,
profile, sweep) start.

prepare(RunRequest) turns what a command asks for (recipe, dataset, device, epochs, config overrides) into the
recipe's family and config, the device and the process world, every setting checked before any file is read.
PreparedRun.load() adds the data and the dataset's identity; .checked(cfg) the family's checks and the system
settings a run uses; .result(runs, cfg) makes the Result of finished runs. The rules each of these applies (a copy
of a named dataset that is not its published files is recorded under the path it came from, never under the
name; the config is validated before data is read; the data is checked against every config before any step)
are written here once, so no command can skip one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from speedrun import dist
from speedrun.config import SystemConfig, apply_overrides
from speedrun.data import limits
from speedrun.engine import peak
from speedrun.engine.flops import RunFlops
from speedrun.engine.loop import RunResult
from speedrun.engine.system import System, resolve_device, resolve_system, setup_system
from speedrun.errors import warn
from speedrun.recipes import Recipe, get_recipe
from speedrun.records.environment import environment
from speedrun.run.session import Result
from speedrun.tricks.precision import default_cpu_threads

MAX_RUNS = 10_000  # seeds one command trains
MAX_EPOCHS = 10_000.0


def check_epochs(epochs: Any) -> float:
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) \
            or not 0 < epochs <= MAX_EPOCHS:
        raise ValueError(f"epochs (--epochs) must be a number in (0, {MAX_EPOCHS:g}], got {epochs!r}")
    return float(epochs)


def make_config(recipe: Recipe, epochs: float | None, overrides: Mapping[str, Any]) -> Any:
    """The recipe's config with overrides applied; --epochs compresses the whole schedule to fit.

    `--set epochs=E` sets the field alone; giving it and --epochs is ambiguous and refused.
    """
    if epochs is not None and "epochs" in overrides:
        # the setting may come from --set, --vary, --space or a settings file: name them all, not one never given
        raise ValueError("epochs is given twice: --epochs (the whole schedule compressed) and a setting epochs= "
                         "(--set, --vary, --space or a settings file: the field alone); keep one")
    cfg = apply_overrides(recipe.make_config(), dict(overrides))
    if epochs is not None:
        cfg = recipe.module().with_epochs(cfg, check_epochs(epochs))
    cfg.validate()
    return cfg


def count_flops(family: Any, cfg: Any, data: Any) -> RunFlops | None:
    """The family's count of what one run computes, or None (warned) where the counter cannot follow the model:
    the count is an instrument, and a run never fails for it."""
    try:
        return family.flops(cfg, data)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        warn(f"FLOPs not counted ({type(e).__name__}: {' '.join(str(e).split())[:120]}); the result has no MFU")
        return None


@dataclass(frozen=True)
class RunRequest:
    """What a command asks to train: the recipe, the data, the device and the config's changes."""

    recipe: str = "cifar10-94"
    dataset: str | None = None  # a name or path; None: the recipe's default dataset
    device: str = "auto"
    epochs: float | None = None  # the whole schedule compressed to this many epochs; None: the recipe's
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config fields (--set), the settings file's too
    data_dir: str | os.PathLike | None = None
    image_size: int | None = None
    smoke: bool = False  # a few steps on a little data: does the pipeline run?


@dataclass
class PreparedRun:
    """A request resolved: the family, its config, the device and world; then (load) the data and what it is."""

    request: RunRequest
    recipe: Recipe
    family: Any  # the recipe family's module (recipes/family.py's Family)
    cfg: Any  # its config (a SystemConfig): the baseline, for a command that trains several
    device: torch.device
    world: dist.World
    dataset: str  # what the result records: the name asked, or the path of an unofficial copy (load)
    data: Any = None
    data_seconds: float = 0.0
    system: System | None = None  # what checked() set for the runs: precision resolved, CPU threads

    def config(self, changes: Mapping[str, Any]) -> Any:
        """The request's config with `changes` on top (a bench setting, a sweep trial), validated."""
        return make_config(self.recipe, self.request.epochs, {**self.request.overrides, **changes})

    def join(self) -> dist.World:
        """Join the process group (under torchrun every process calls this); a prepare(join=False) whose settings
        are all checked joins here."""
        self.world = dist.init(self.world, self.device)
        return self.world

    def load(self, log: Callable[[str], None]) -> Any:
        """The data, rank 0 first (what it writes once, a download or a decoded cache, the others then read); read
        once: a command that hands its prepared run on (tune to bench) reads it no more."""
        if self.data is not None:
            return self.data
        req, start = self.request, time.perf_counter()
        self.data = dist.main_first(self.world, lambda: self.family.load_data(
            self.dataset, data_dir=req.data_dir, image_size=req.image_size, log=log, smoke=req.smoke))
        self.data_seconds = time.perf_counter() - start
        if getattr(self.data, "unofficial", "") and req.data_dir is not None:
            # A copy of a named dataset that is not its published files (data/sources.py warned): recorded under
            # the path it came from, so it never enters the named dataset's leaderboard.
            self.dataset = os.fspath(req.data_dir)
        return self.data

    def checked(self, cfg: Any = None, *, quiet: bool = False) -> list[str]:
        """The family's refusal (ValueError) of what cannot train on this data and device, for cfg (default the
        request's, cut to a smoke test when asked); its warnings, shown unless quiet. Sets the system the runs use
        (precision resolved, CPU threads) for the request's config."""
        if cfg is None:
            if self.request.smoke:
                self.cfg, self.data = self.family.smoke(self.cfg, self.data)
            cfg = self.cfg
        messages = self.family.check(cfg, self.data, self.device, self.world)
        if not quiet:
            for message in messages:
                warn(message)
        if cfg is self.cfg:
            self.system = setup_system(cfg, self.device)
        return messages

    def result(self, runs: list[RunResult], cfg: Any = None, env: dict | None = None, **fields: Any) -> Result:
        """The Result of `runs` of cfg (default the request's): what every command records alike (recipe, dataset
        identity, device, config, environment, timed region, world, FLOPs, precision, peaks), and `fields`."""
        cfg = self.cfg if cfg is None else cfg
        env = environment(self.device) if env is None else env
        source = self.request.dataset if self.request.dataset is not None else self.recipe.default_dataset
        own = self.family.own_data(self.recipe.default_dataset, os.fsdecode(source), self.data)
        given = "target_accuracy" in self.request.overrides  # the user's own target, on whatever data
        data = {"name": self.data.name, "fingerprint": self.data.fingerprint(), "source": self.dataset, "own": own}
        threads = cfg.cpu_threads or default_cpu_threads() if isinstance(cfg, SystemConfig) else None
        return Result(recipe=self.recipe.name, dataset=self.dataset, device=self.device.type,
                      config=dataclasses.asdict(cfg), runs=runs, environment=env,
                      data_seconds=self.data_seconds, image_size=self.request.image_size,
                      smoke_test=self.request.smoke, timed_region=self.family.timed_region(cfg),
                      world=self.world.to_dict(), flops=count_flops(self.family, cfg, self.data),
                      precision=resolve_system(cfg, self.device).precision,
                      peaks=peak.cached(self.device, env["device_name"], threads), data=data,
                      target_applies=own or given, **fields)


def prepare(request: RunRequest, *, cfg: Any = None, join: bool = True) -> PreparedRun:
    """The request resolved, every setting checked before any file is read: the recipe's config with the overrides
    validated (cfg: made so already), the device, the process world (joined when `join`: under torchrun every
    process calls this), the environment's data-size limit, the dataset's name."""
    rec = get_recipe(request.recipe)
    cfg = make_config(rec, request.epochs, request.overrides) if cfg is None else cfg
    world = dist.from_env()
    dev = dist.device_for(world, resolve_device(request.device))
    limits.max_dataset_bytes()  # the environment's limit, checked with the settings, before any file is touched
    dataset = rec.default_dataset if request.dataset is None else os.fspath(request.dataset)  # "": a mistake
    run = PreparedRun(request, rec, rec.module(), cfg, dev, world, dataset)
    if join:
        run.join()
    return run
