"""Multi-run training: resolve recipe, world, data and device; train N seeds; summarize; write the result JSON.

This is what `speedrun train` and `speedrun.train()` call. It knows no recipe family by name: it calls a family
only through the contract in recipes/family.py, and the family owns the config, data, model and loop. This module
owns the order of things: settings checked, world and data, checkpoints and resume (resume.py), the runs, the saved
model (export.py); session.py keeps the result file, the database row and what is shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from speedrun import dist
from speedrun.config import apply_overrides, check_int, field_defaults
from speedrun.data import limits
from speedrun.engine import peak
from speedrun.engine.checkpoint import list_checkpoints
from speedrun.engine.flops import RunFlops
from speedrun.engine.loop import Diverged, RunResult
from speedrun.engine.system import resolve_device, setup_system
from speedrun.errors import SpeedrunWarning, counted, escaped_refusals, warn
from speedrun.models import custom
from speedrun.paths import check_file_name, check_writable, user_path
from speedrun.recipes import RECIPES, Recipe, get_recipe, recipe_lines
from speedrun.records import cost
from speedrun.records import db as results_db
from speedrun.records import debug_apis, settings_file
from speedrun.records.environment import environment
from speedrun.records.result_file import check_result_path, claim_result_path, default_result_path, release_result_path
from speedrun.run import display, export
from speedrun.run import resume as resuming
from speedrun.run import tensorboard as boards
from speedrun.run.session import Result, Session

__all__ = ["RECIPES", "Result", "train", "make_config", "print_recipes"]

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
        # the setting may come from --set, --vary, --space or a settings file: name them all, not one never given
        raise ValueError("epochs is given twice: --epochs (the whole schedule compressed) and a setting epochs= "
                         "(--set, --vary, --space or a settings file: the field alone); keep one")
    cfg = apply_overrides(recipe.make_config(), overrides)
    if epochs is not None:
        cfg = recipe.module().with_epochs(cfg, _check_epochs(epochs))
    cfg.validate()
    return cfg


def _tuned(settings, recipe: Recipe, device: str) -> tuple[dict[str, str], dict | None]:
    """The overrides of the settings file (`settings`, else $SPEEDRUN_SETTINGS; False: none, whatever the
    environment says) for a run of `recipe` on `device`, each key checked to be a performance setting and the
    recipe's config with them applied validated now, while the file is known. What the result records of it.
    Every refusal names the file, where it came from, the values at fault and the fix."""
    source = "--settings"
    if settings is None and os.environ.get("SPEEDRUN_SETTINGS"):
        settings, source = os.environ["SPEEDRUN_SETTINGS"], settings_file.ENVIRONMENT
    if settings is None or settings is False:
        return {}, None
    asked = resolve_device(device)
    where = f"settings file {os.fspath(settings)} ({source})"
    fix = settings_file.leave_out(source)
    try:
        tuned, used = settings_file.overrides_from(settings, recipe.name, asked.type,
                                                   environment(asked)["device_name"], source)
    except ValueError as e:  # the file itself refused (named, with its fix): say where it came from
        named, text = f"settings file {os.fspath(settings)}", str(e)
        if where not in text:
            text = text.replace(named, where, 1) if text.startswith(named) else f"{where}: {text}"
        raise ValueError(text if fix in text else f"{text}, or {fix}") from None
    base = recipe.make_config()
    try:
        settings_file.check_keys(tuned, {f.name for f in dataclasses.fields(base)})
    except ValueError as e:  # its text says which key and to remove it
        raise ValueError(f"{where}: {e}; or {fix}") from None
    try:
        apply_overrides(base, tuned).validate()
    except ValueError as e:  # a value of the file refused: which, and what to do
        values = settings_file.named_values(str(e), tuned)
        raise ValueError(f"{where}: {e}" + (f" (the file sets {values})" if values else "")
                         + f"; edit the file, or {fix}") from None
    return tuned, used


@contextlib.contextmanager
def _naming_settings(used: dict | None, applied: dict[str, str]) -> Iterator[None]:
    """A refusal (ValueError) inside whose text names a key the settings file set (and --set did not override)
    says so: the value, the file, where it came from and the fix; alone it would read as if the user had set it."""
    try:
        yield
    except ValueError as e:
        values = settings_file.named_values(str(e), applied) if used is not None else ""
        if not values:
            raise
        assert used is not None  # values come only from a settings file
        raise ValueError(f"{e} ({values} from settings file {used['file']} ({used['source']}); edit the file, or "
                         f"{settings_file.leave_out(used['source'])})") from None


def _settings_line(used: dict, applied: dict[str, str]) -> str:
    """The line that says which settings file a run applied and what it set (the result records the same)."""
    set_text = ", ".join(f"{k}={v}" for k, v in applied.items()) or "nothing"
    overridden = sorted(set(used["settings"]) - set(applied))
    return (f"settings: {used['file']} ({used['source']}) applied: {set_text}"
            + (f" (--set gave {', '.join(overridden)})" if overridden else ""))


def count_flops(family, cfg, data) -> RunFlops | None:
    """The family's count of what one run computes, or None (warned) where the counter cannot follow the model:
    the count is an instrument, and a run never fails for it."""
    try:
        return family.flops(cfg, data)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        warn(f"FLOPs not counted ({type(e).__name__}: {' '.join(str(e).split())[:120]}); the result has no MFU")
        return None


def _check_types(**values: tuple[Any, tuple[type, ...], str]) -> None:
    """Each keyword is (value, allowed types, what to pass instead): the API's arguments, before anything uses them
    (a device of None or a json_path of 123 would otherwise fail deep inside, as a TypeError naming nothing)."""
    for name, (value, types, expected) in values.items():
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f"{name}={value!r:.80} is not {expected}")


def _check_result_output(json_path: str | os.PathLike) -> None:
    """What can be told of a result path (--json) that is claimed only once the checkpoint to resume is known,
    without making anything: "auto", its folder; a path, its name and its folder. The file may exist: the command
    may continue it (the claim then decides)."""
    if json_path == "auto":
        check_result_path(None)
        return
    check_file_name(json_path, "--json")
    check_writable(user_path(json_path, "--json").parent, "--json", "choose a writable path (--json)", folder=True)


@escaped_refusals
def train(recipe: str = "cifar10-94", dataset: str | None = None, *, device: str = "auto",
          epochs: float | None = None, runs: int = 1, seed: int = 0, data_dir: str | None = None,
          image_size: int | None = None, json_path: str | Path | None = None, verbose: bool = False,
          summary: bool | str | None = None, command: str | None = None, smoke: bool = False,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, keep_checkpoints: int = 2,
          resume: str | Path | None = None, save: str | Path | None = None, price_per_hour: float | None = None,
          db: str | Path | None = None, strict: bool = False, settings: str | Path | bool | None = None,
          tensorboard: str | Path | None = None, overrides: dict[str, Any] | None = None,
          **config_overrides: Any) -> Result:
    """Train `runs` seeds of `recipe` on `dataset` and return a Result (with the last run's model).

    `config_overrides` (or the dict `overrides`, which may hold any key, `epochs` included) are config fields,
    e.g. train("cifar10-94", lookahead=False, batch_size=512).
    json_path: where to write the result JSON, claimed before any data is read (an existing file is never replaced:
    that is an error); "auto" picks a new results/<time>-<recipe>-<dataset>.json; None writes nothing. The file is
    rewritten after every run, so a crash keeps the runs that ended ("complete": false).
    verbose: progress, tables and notes on stderr; summary: the summary table on stdout (default: as verbose), or
    "lines": the result's statistics and its verdict on the target, a line each (the CLI's --quiet).
    smoke: a pipeline check in seconds: a few steps on a little of the test set, no TTA; marked as such.
    checkpoint_dir: save the training state there every `checkpoint_every` steps (default: ten times a run), at the
    end of each run and on SIGINT/SIGTERM, keeping the newest `keep_checkpoints`. resume: a checkpoint file, or
    "auto" for the newest usable one in checkpoint_dir (none yet: start afresh); under torchrun a restarted worker
    group resumes by itself. save: write the last run's trained network there (export.py; `speedrun.load`).
    price_per_hour: US dollars per device-hour for the result's cost (default: records/cost.py's table by device name).
    strict: refuse to train (ValueError) while a debugging switch that slows training is on (records/debug_apis.py);
    without it each is a warning, and every result lists them (environment.debug_apis).
    settings: a settings file written by `speedrun tune --apply` (None: $SPEEDRUN_SETTINGS, if set; False: none):
    its values (tune's performance settings only: settings_file.KEYS) apply under the overrides, a line says so, and
    the result records them; a file for another recipe or device type is refused (one from the environment is
    skipped with a warning), and so is any refusal its values cause, naming the file.
    db: also store the result in this results database (records/db.py; the CLI passes its default_db_path()), opened and
    migrated before any work; a failure to store it later is a warning (the JSON file has it).
    tensorboard: write TensorBoard event files under this folder (run/tensorboard.py): a new folder
    <time>-<recipe> per call, made and proved writable before any data is read, with a run seed-<n> per seed.
    Under torchrun (dist.py) every process calls this; rank 0 alone prints and writes.
    Every setting is checked before data is read, and the data against the config before any step is taken.
    """
    began = time.perf_counter()
    path_like = (str, os.PathLike, type(None))
    _check_types(dataset=(dataset, path_like, "a dataset name or path (--dataset)"),
                 device=(device, (str,), "a device name such as 'cpu' (--device)"),
                 data_dir=(data_dir, path_like, "a folder or archive path (--data-dir)"),
                 json_path=(json_path, path_like, "a file path, 'auto' or None (--json)"),
                 checkpoint_dir=(checkpoint_dir, path_like, "a folder path (--checkpoint-dir)"),
                 resume=(resume, path_like, "a checkpoint path, 'auto' or None (--resume)"),
                 save=(save, path_like, "a file path (--save)"), db=(db, path_like, "a file path (--db)"),
                 tensorboard=(tensorboard, path_like, "a folder path (--tensorboard)"),
                 settings=(None if settings is False else settings, path_like,
                           "a settings file path, None or False (--settings)"),
                 overrides=(overrides, (dict, type(None)), "a dict of config keys to values (--set)"),
                 smoke=(smoke, (bool,), "True or False (--smoke)"),
                 strict=(strict, (bool,), "True or False (--strict)"), verbose=(verbose, (bool,), "True or False"),
                 summary=(summary, (bool, str, type(None)), "True, False, \"lines\" or None"),
                 command=(command, (str, type(None)), "a string or None"))
    if isinstance(summary, str) and summary != "lines":
        raise ValueError(f"summary={summary!r:.80} is not True, False, \"lines\" or None")
    rec = get_recipe(recipe)
    family = rec.module()
    runs = check_int("runs", "--runs", runs, 1, MAX_RUNS)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    keep_checkpoints = check_int("keep_checkpoints", "--keep-checkpoints", keep_checkpoints, 1, 10**6)
    if checkpoint_every is not None:
        checkpoint_every = check_int("checkpoint_every", "--checkpoint-every", checkpoint_every, 1, 2**62)
    tuned, settings_used = _tuned(settings, rec, device)
    given = {**(overrides or {}), **config_overrides}
    if callable(given.get("model")) or given.get("model"):  # train(model=build or "MODULE:FUNCTION"): the user's
        given["model"] = custom.use_builder(given["model"])  # network (models/custom.py), recorded by its name
    applied = {k: v for k, v in tuned.items() if k not in given}  # --set wins over the file
    with _naming_settings(settings_used, applied):
        cfg = make_config(rec, epochs, {**tuned, **given})
    cost.price_for("", price_per_hour)  # the price, or SPEEDRUN_PRICES's table, checked with the settings
    world = dist.from_env()
    dev = dist.device_for(world, resolve_device(device))
    limits.max_dataset_bytes()  # the environment's limit, checked with the settings, before any file is touched
    dataset = rec.default_dataset if dataset is None else os.fspath(dataset)  # "" is a mistake, not the default
    world = dist.init(world, dev)
    show = display.Display(verbose and world.is_main, summary if world.is_main else False)
    claimed, in_step, database, session, board = None, False, None, None, None
    # A result path given anew is claimed before anything else is made (the checkpoint and TensorBoard folders, the
    # database): one that cannot be claimed then leaves none of them behind. A resumed command may continue the
    # result file of its checkpoint instead (plan.continued_result, once the checkpoint is found), and "auto" makes
    # its folder: both are checked here (what can be told without making anything) and claimed below.
    early = json_path is not None and json_path != "auto" and resume is None and world.restarts == 0
    try:
        if early:  # json_path is given (early says so), which the lambda cannot tell
            chosen = dist.main_first(world, lambda: claim_result_path(cast("str | Path", json_path)), everyone=False)
            if world.is_main:
                json_path = claimed = chosen
        elif json_path is not None:
            dist.main_first(world, lambda: _check_result_output(json_path), everyone=False)
        plan = resuming.Plan.make(checkpoint_dir, checkpoint_every, keep_checkpoints, resume, world)
        save_path = export.check_save(save, world, json_path)
        if tensorboard is not None:  # rank 0 writes the event files; its refusal ends every process
            board = dist.main_first(world, lambda: boards.open_board(tensorboard, rec.name), everyone=False)
        with warnings.catch_warnings():
            if not world.is_main:  # every process checks the same things: one copy of each warning is enough
                warnings.simplefilter("ignore", SpeedrunWarning)
            debug_apis.guard(strict, dev)
            if db is not None:  # created or migrated now, by rank 0: a bad --db ends every process before any work
                database = dist.main_first(world, lambda: results_db.connect(db), everyone=False)
            found = plan.find(world, show.line)  # the checkpoint to resume, if any (before the result is claimed)
            done: dict | Result | None  # the finished job's result as its file holds it, then as a Result
            done = plan.finished_job(found, runs, {"recipe": rec.name, "dataset": dataset,
                                                   "config": dataclasses.asdict(cfg), "seed": seed},
                                     family.MAY_DIFFER_ON_RESUME, database, world, field_defaults(cfg))
            if done is not None:  # --resume auto in a job that finished: its result, nothing run or stored again
                done = Result.from_dict(done)
                show.summary(done)
                in_step = True
                return done
            if json_path is not None and not early:  # claimed now by rank 0, once the checkpoint is known

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
                                                                   log=show.line, smoke=smoke))
            data_seconds = time.perf_counter() - start
            if getattr(data, "unofficial", "") and data_dir is not None:
                # A copy of a named dataset that is not its published files (data/sources.py warned): recorded
                # under the path it came from, so it never enters the named dataset's leaderboard.
                dataset = os.fspath(data_dir)
            with _naming_settings(settings_used, applied):  # a batch_size from the file too large here, say
                if smoke:
                    cfg, data = family.smoke(cfg, data)
                for message in family.check(cfg, data, dev, world):
                    warn(message)
                system = setup_system(cfg, dev)  # the precision auto resolves to here; the CPU threads the runs use
            if save_path is not None and world.is_main:  # what the save would refuse, refused before training
                export.check_card(family.model_card(cfg, data), rec, cfg, dataset, smoke)
            # What a checkpoint records and a resume must match (the data's hash only when checkpoints are used).
            meta = None if plan.directory is None and found is None else {
                "recipe": rec.name, "dataset": dataset, "config": dataclasses.asdict(cfg),
                "data": family.data_signature(data), "seed": seed,
                # what precision=auto resolved to here: a resumed run must continue at the precision it began with
                "device_type": dev.type, "precision_used": system.precision,
                "half_weights_used": system.half_weights}
            with _naming_settings(settings_used, applied):
                first_run, state, finished = plan.check_found(found, meta, family.MAY_DIFFER_ON_RESUME, runs,
                                                              field_defaults(cfg))
            show.release()  # every check has passed: what was held back (downloads, decoding) may be shown now
            env = environment(dev)
            show.line(f"device: {dev.type} ({env['device_name']})"
                      + (" -- chosen by --device auto" if device == "auto" else "")
                      + (f"; {world.size} processes on {counted(world.nodes, 'node')}, {world.backend}"
                         if world.size > 1 else ""))
            show.line(f"data: {family.describe(data)} ({data_seconds:.1f} s to load)")
            if settings_used is not None:  # it changes the run unseen otherwise ($SPEEDRUN_SETTINGS is set once)
                show.line(_settings_line(settings_used, applied))
            for note in family.notes(cfg, data, smoke):
                show.line(note)
            result = Result(recipe=rec.name, dataset=dataset, device=dev.type, config=dataclasses.asdict(cfg),
                            runs=finished, environment=env, data_seconds=data_seconds, runs_requested=runs,
                            smoke_test=smoke, image_size=image_size, command=command,
                            timed_region=family.timed_region(cfg), world=world.to_dict(),
                            resumed_from=[str(found[2])] if found else [],
                            price=cost.price_for(env["device_name"], price_per_hour),
                            flops=count_flops(family, cfg, data), precision=system.precision,
                            peaks=peak.cached(dev, env["device_name"]), settings=settings_used)
            checkpoints = plan.checkpoints(meta, json_path, world)

        session = Session(result, json_path=json_path, database=database, db=db, world=world, show=show,
                          began=began)

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
                with boards.run_log(board, cfg, seed=seed + i, dataset=dataset,
                                    steps=family.run_steps(cfg, data.num_train)) as log:
                    try:
                        with show.run(i, runs, seed + i, family.final_evaluation(cfg)) as (on_step, on_epoch):
                            run = family.train_run(cfg, data, dev, seed + i, world=world, on_step=on_step,
                                                   on_epoch=boards.on_epoch_too(log, on_epoch),
                                                   checkpoints=checkpoints, resume=state if i == first_run else None,
                                                   on_scalars=None if log is None else log.scalars)
                    except Diverged as e:
                        warn(f"run {i + 1}/{runs} (seed {seed + i}) {e}")
                        run = RunResult(seed=seed + i, accuracy=None, train_seconds=None, epochs=cfg.epochs,
                                        steps=e.step, diverged=e.to_dict())
                result.model, run.model = run.model, None  # keep one model alive, not N
                result.runs.append(run)
                result.complete = len(result.runs) == runs
                session.save()  # after every run: a crash or kill later keeps this one
            if save_path is not None and world.is_main and result.model is not None:
                result.saved_model = export.save_trained(save_path, result.model, family.model_card(cfg, data), rec,
                                                         cfg, dataset, result.runs[-1], smoke)
                show.line(f"saved model: {result.saved_model}")
                session.save()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, and SIGTERM through errors.Terminated
            kept = plan.directory if plan.directory and list_checkpoints(plan.directory) else None
            session.keep_interrupted(interrupt, kept)
            in_step = getattr(interrupt, "in_step", False)
            raise
        except Exception as failure:  # an error after some runs ended: kept too
            session.keep_failed(failure)
            raise
        session.store()
        session.report()
        in_step = True
        return result
    finally:
        show.close()
        if board is not None:
            board.close()
        if database is not None:
            database.close()
        if claimed is not None and (session is None or not session.written):
            release_result_path(claimed)  # removes it only if still empty
        dist.shutdown(world, in_step)


def print_recipes(file=sys.stdout) -> None:
    for line in recipe_lines():
        print(line, file=file)
