"""Multi-run training: resolve recipe, world, data and device; train N seeds; summarize; write the result JSON.

This is what `speedrun train` and `speedrun.train()` call. It knows nothing of any recipe family: the family
module (recipes/__init__.py lists what it provides) owns the config, data, model and loop. This module owns seeds,
statistics, the result file, checkpoints and resume, the saved model, and what is shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sqlite3
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speedrun import dist
from speedrun.records import cost as cost
from speedrun.engine.checkpoint import list_checkpoints
from speedrun.config import apply_overrides
from speedrun.data import limits
from speedrun.engine.loop import Diverged, RunResult, signals_handled_by
from speedrun.engine.system import resolve_device
from speedrun.errors import SpeedrunWarning, note_kept, warn
from speedrun.recipes import RECIPES, Recipe, get_recipe, recipe_lines  # noqa: F401 (the public API's names)
from speedrun.records.result_file import (claim_result_path, default_result_path, environment, portable,
    release_result_path, write_json)
from speedrun.records.stats import summarize
from speedrun.config import check_int
from speedrun.engine.loop import signals_held

MAX_RUNS = 10_000
MAX_EPOCHS = 10_000.0


def _check_epochs(epochs: Any) -> float:
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) \
            or not 0 < epochs <= MAX_EPOCHS:
        raise ValueError(f"epochs (--epochs) must be a number in (0, {MAX_EPOCHS:g}], got {epochs!r}")
    return float(epochs)


def make_config(recipe: Recipe, epochs: float | None, overrides: dict[str, Any]):
    """The recipe's config with overrides applied; --epochs compresses the whole schedule to fit.

    `--set epochs=E` sets the field alone; giving it and --epochs is ambiguous and refused.
    """
    if epochs is not None and "epochs" in overrides:
        raise ValueError("epochs is given twice (epochs= / --epochs and --set epochs=); keep one")
    cfg = apply_overrides(recipe.make_config(), overrides)
    if epochs is not None:
        cfg = recipe.module().with_epochs(cfg, _check_epochs(epochs))
    cfg.validate()
    return cfg


def _check_types(**values: tuple[Any, tuple[type, ...], str]) -> None:
    """Each keyword is (value, allowed types, what to pass instead): the API's arguments, before anything uses them
    (a device of None or a json_path of 123 would otherwise fail deep inside, as a TypeError naming nothing)."""
    for name, (value, types, expected) in values.items():
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f"{name}={value!r:.80} is not {expected}")


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
    runs: list[RunResult]
    environment: dict
    data_seconds: float = 0.0  # loading/decoding the dataset (untimed)
    warmup_seconds: float = 0.0  # the untimed warm-up run (compile, cuDNN autotune)
    interrupted: bool = False
    complete: bool = False  # every requested run ended (a file with complete=false was cut off)
    runs_requested: int = 0
    smoke_test: bool = False
    image_size: int | None = None
    command: str | None = None  # the exact command line, when run from the CLI
    timed_region: str = ""  # what train_seconds covers (the family's timed_region(cfg))
    world: dict = field(default_factory=lambda: dist.World().to_dict())  # processes, nodes, backend, restarts
    resumed_from: list[str] = field(default_factory=list)  # checkpoints this result continued from
    saved_model: str | None = None  # --save: the trained network's files
    wall_seconds: float = 0.0  # the whole command: settings, data, warm-up, every run, writing
    price: cost.Price | None = None  # of one device-hour (cost.py); None: no cost is shown
    model: torch.nn.Module | None = field(default=None, repr=False)  # the last run's trained model

    @property
    def finished(self) -> list[RunResult]:
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

    def costs(self) -> dict | None:
        """US dollars: the mean timed region of a run, and the whole command, on every process's device."""
        if self.price is None:
            return None
        devices = self.world.get("processes", 1)
        timed = summarize([r.train_seconds for r in self.finished]).mean if self.finished else None
        return {**self.price.to_dict(), "devices": devices,
                "timed_usd_per_run": cost.dollars(timed, self.price, devices),
                "wall_usd": cost.dollars(self.wall_seconds, self.price, devices)}

    def to_dict(self) -> dict:
        acc = summarize(self.accuracies).to_dict() if self.finished else None
        secs = summarize([r.train_seconds for r in self.finished]).to_dict() if self.finished else None
        return {
            "recipe": self.recipe, "dataset": self.dataset, "device": self.device, "command": self.command,
            "smoke_test": self.smoke_test,
            "mean_accuracy": self.mean_accuracy, "std_accuracy": self.std_accuracy, "n": len(self.finished),
            "accuracy": acc, "train_seconds": secs,
            "target_accuracy": self.target_accuracy, "hit_rate": self.hit_rate,
            "timed_region": self.timed_region,
            "data_seconds": self.data_seconds, "warmup_seconds": self.warmup_seconds,
            "complete": self.complete, "interrupted": self.interrupted, "runs_requested": self.runs_requested,
            "diverged_runs": self.diverged_runs, "image_size": self.image_size,
            "world": self.world, "resumed_from": self.resumed_from, "saved_model": self.saved_model,
            "wall_seconds": self.wall_seconds, "cost": self.costs(),
            "seeds": [r.seed for r in self.runs],
            "runs": [r.to_dict() for r in self.runs], "config": self.config,
            "environment": self.environment,
        }


def train(recipe: str = "cifar10-94", dataset: str | None = None, *, device: str = "auto",
          epochs: float | None = None, runs: int = 1, seed: int = 0, data_dir: str | None = None,
          image_size: int | None = None, json_path: str | Path | None = None, verbose: bool = False,
          summary: bool | None = None, command: str | None = None, smoke: bool = False,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, keep_checkpoints: int = 2,
          resume: str | Path | None = None, save: str | Path | None = None, price_per_hour: float | None = None,
          db: str | Path | None = None, overrides: dict[str, Any] | None = None, **config_overrides: Any) -> Result:
    """Train `runs` seeds of `recipe` on `dataset` and return a Result (with the last run's model).

    `config_overrides` (or the dict `overrides`, which may hold any key, `epochs` included) are config fields,
    e.g. train("cifar10-94", lookahead=False, batch_size=512).
    json_path: where to write the result JSON, claimed before any data is read (an existing file is never replaced:
    that is an error); "auto" picks a new results/<time>-<recipe>-<dataset>.json; None writes nothing. The file is
    rewritten after every run, so a crash keeps the runs that ended ("complete": false).
    verbose: progress, tables and notes on stderr; summary: the summary table on stdout (default: as verbose).
    smoke: a pipeline check in seconds: a few steps on a little of the test set, no TTA; marked as such.
    checkpoint_dir: save the training state there every `checkpoint_every` steps (default: ten times a run), at the
    end of each run and on SIGINT/SIGTERM, keeping the newest `keep_checkpoints`. resume: a checkpoint file, or
    "auto" for the newest usable one in checkpoint_dir (none yet: start afresh); under torchrun a restarted worker
    group resumes by itself. save: write the last run's trained network there (saved.py; `speedrun.load`).
    price_per_hour: US dollars per device-hour for the result's cost (default: cost.py's table by device name).
    db: also store the result in this results database (db.py; the CLI passes db.default_path()), opened and
    migrated before any work; a failure to store it later is a warning (the JSON file has it).
    Under torchrun (dist.py) every process calls this; rank 0 alone prints and writes.
    Every setting is checked before data is read, and the data against the config before any step is taken.
    """
    from speedrun.run import display as display
    from speedrun.run import resume as resuming  # rich is imported only when something is shown

    began = time.perf_counter()
    path_like = (str, os.PathLike, type(None))
    _check_types(dataset=(dataset, path_like, "a dataset name or path (--dataset)"),
                 device=(device, (str,), "a device name such as 'cpu' (--device)"),
                 data_dir=(data_dir, path_like, "a folder or archive path (--data-dir)"),
                 json_path=(json_path, path_like, "a file path, 'auto' or None (--json)"),
                 checkpoint_dir=(checkpoint_dir, path_like, "a folder path (--checkpoint-dir)"),
                 resume=(resume, path_like, "a checkpoint path, 'auto' or None (--resume)"),
                 save=(save, path_like, "a file path (--save)"), db=(db, path_like, "a file path (--db)"),
                 overrides=(overrides, (dict, type(None)), "a dict of config keys to values (--set)"),
                 smoke=(smoke, (bool,), "True or False (--smoke)"), verbose=(verbose, (bool,), "True or False"),
                 summary=(summary, (bool, type(None)), "True, False or None"),
                 command=(command, (str, type(None)), "a string or None"))
    rec = get_recipe(recipe)
    family = rec.module()
    runs = check_int("runs", "--runs", runs, 1, MAX_RUNS)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    keep_checkpoints = check_int("keep_checkpoints", "--keep-checkpoints", keep_checkpoints, 1, 10**6)
    if checkpoint_every is not None:
        checkpoint_every = check_int("checkpoint_every", "--checkpoint-every", checkpoint_every, 1, 2**62)
    cfg = make_config(rec, epochs, {**(overrides or {}), **config_overrides})
    cost.price_for("", price_per_hour)  # the price, or SPEEDRUN_PRICES's table, checked with the settings
    world = dist.from_env()
    dev = dist.device_for(world, resolve_device(device))
    limits.max_dataset_bytes()  # the environment's limit, checked with the settings, before any file is touched
    dataset = rec.default_dataset if dataset is None else os.fspath(dataset)  # "" is a mistake, not the default
    world = dist.init(world, dev)
    show = display.Display(verbose and world.is_main, summary if world.is_main else False)
    written, claimed, in_step, database = False, None, False, None
    try:
        plan = resuming.Plan.make(checkpoint_dir, checkpoint_every, keep_checkpoints, resume, save, world, json_path)
        with warnings.catch_warnings():
            if not world.is_main:  # every process checks the same things: one copy of each warning is enough
                warnings.simplefilter("ignore", SpeedrunWarning)
            if db is not None:  # created or migrated now, by rank 0: a bad --db ends every process before any work
                from speedrun.records import db as results_db

                database = dist.main_first(world, lambda: results_db.connect(db), everyone=False)
            found = plan.find(world, show.line)  # the checkpoint to resume, if any (before the result is claimed)
            if json_path is not None:  # claimed now by rank 0: an existing or unwritable path fails early

                def claim():
                    continued = plan.continued_result(found, json_path)
                    return continued or (default_result_path(rec.name, dataset) if json_path == "auto"
                                         else claim_result_path(json_path))

                chosen = dist.main_first(world, claim, everyone=False)
                if world.is_main:
                    json_path = claimed = chosen
            start = time.perf_counter()
            # rank 0 first: what it writes once (a download, a decoded cache) the others then read
            data = dist.main_first(world, lambda: family.load_data(dataset, data_dir=data_dir, image_size=image_size,
                                                                   log=show.line))
            data_seconds = time.perf_counter() - start
            if smoke:
                cfg, data = family.smoke(cfg, data)
            for message in family.check(cfg, data, dev, world):
                warn(message)
            # What a checkpoint records and a resume must match (the data's hash only when checkpoints are used).
            meta = None if plan.directory is None and found is None else {
                "recipe": rec.name, "dataset": dataset, "config": dataclasses.asdict(cfg),
                "data": family.data_signature(data), "seed": seed}
            first_run, state, finished = plan.check_found(found, meta, family.MAY_DIFFER_ON_RESUME, runs)
            show.release()  # every check has passed: what was held back (downloads, decoding) may be shown now
            env = environment(dev)
            show.line(f"device: {dev.type} ({env['device_name']})"
                      + (" -- chosen by --device auto" if device == "auto" else "")
                      + (f"; {world.size} processes on {world.nodes} node(s), {world.backend}" if world.size > 1
                         else ""))
            show.line(f"data: {family.describe(data)} ({data_seconds:.1f} s to load)")
            for note in family.notes(cfg, data, smoke):
                show.line(note)
            result = Result(recipe=rec.name, dataset=dataset, device=dev.type, config=dataclasses.asdict(cfg),
                            runs=finished, environment=env, data_seconds=data_seconds, runs_requested=runs,
                            smoke_test=smoke, image_size=image_size, command=command,
                            timed_region=family.timed_region(cfg), world=world.to_dict(),
                            resumed_from=[str(found[2])] if found else [],
                            price=cost.price_for(env["device_name"], price_per_hour))
            checkpoints = plan.checkpoints(meta, json_path, world)

        def save() -> None:
            nonlocal written
            result.wall_seconds = time.perf_counter() - began
            if json_path is not None and world.is_main:
                write_json(json_path, result.to_dict())
                written = True

        def store() -> None:
            """The final result (complete or not) into the database too, as the JSON file has it."""
            if database is None:
                return
            from speedrun.records import db as results_db

            try:
                stored = results_db.insert_result(database, portable(result.to_dict()), source=str(json_path))
                show.line(f"stored in {db} as #{stored}")
            except (ValueError, OSError, sqlite3.Error) as e:
                warn(f"the result was not stored in the database {db} ({e}); it is in {json_path}; "
                     "`speedrun results import` adds it later")

        def report() -> None:
            show.summary(result)
            if json_path is not None:
                show.line(f"result: {json_path}")

        try:
            try:
                result.warmup_seconds = family.warmup(cfg, data, dev, world)
            except Diverged as e:  # shuffled labels; compile and autotuning happened before the bad step
                warn(f"the warm-up run {e}")
            if result.warmup_seconds:
                show.line(f"warm-up run (untimed, shuffled labels): {result.warmup_seconds:.1f} s")
            for i in range(first_run, runs):
                if checkpoints is not None:
                    checkpoints.begin(i, result.runs)
                try:
                    with show.run(i, runs, seed + i, family.final_evaluation(cfg)) as (on_step, on_epoch):
                        run = family.train_run(cfg, data, dev, seed + i, world=world, on_step=on_step,
                                               on_epoch=on_epoch, checkpoints=checkpoints,
                                               resume=state if i == first_run else None)
                except Diverged as e:
                    warn(f"run {i + 1}/{runs} (seed {seed + i}) {e}")
                    run = RunResult(seed=seed + i, accuracy=None, train_seconds=None, epochs=cfg.epochs,
                                    steps=e.step, diverged=e.to_dict())
                result.model, run.model = run.model, None  # keep one model alive, not N
                result.runs.append(run)
                result.complete = len(result.runs) == runs
                save()  # after every run: a crash or kill later keeps this one
            if plan.save_path is not None and world.is_main and result.model is not None:
                result.saved_model = plan.save_model(result.model, family.model_card(cfg, data), rec, cfg, dataset,
                                                     result.runs[-1])
                show.line(f"saved model: {result.saved_model}")
                save()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, and SIGTERM through errors.Terminated
            result.interrupted = True
            # What the CLI's last line says: how many runs were kept, and where.
            interrupt.runs_kept = len(result.runs)
            interrupt.result_path = json_path if result.runs else None
            interrupt.checkpoint_dir = plan.directory if plan.directory and list_checkpoints(plan.directory) else None
            if not result.runs:
                in_step = getattr(interrupt, "in_step", False)
                raise
            show.line(f"interrupted: keeping the {len(result.runs)} finished run(s)")
            with signals_held():  # a second Ctrl-C must not cut this write short: it would keep the last file
                save()
                store()
            report()
            in_step = getattr(interrupt, "in_step", False)
            raise
        except Exception as failure:  # an error after some runs ended (a later run, saving the model): kept too
            if result.runs:
                with signals_held():
                    with contextlib.suppress(Exception):  # the first failure is the one to report
                        save()
                    store()
                if world.is_main:  # the others keep nothing (and their line, if any, says so)
                    note_kept(failure, len(result.runs), json_path if written else db if database else None)
            raise
        store()
        report()
        in_step = True
        return result
    finally:
        show.close()
        if database is not None:
            database.close()
        if claimed is not None and not written:
            release_result_path(claimed)  # removes it only if still empty
        dist.shutdown(world, in_step)


def print_recipes(file=sys.stdout) -> None:
    for line in recipe_lines():
        print(line, file=file)
