"""Multi-run training: resolve recipe, world, data and device; train N seeds; summarize; write the result JSON.

This is what `speedrun train` and `speedrun.train()` call. It knows no recipe family by name: it calls a family
only through the contract in recipes/family.py, and the family owns the config, data, model and loop. The run
itself is prepared as every instrument prepares one (prepared.py: recipe, config, device, world, data, its
identity, checks). This module owns the order of what train adds: the settings file, the outputs claimed,
checkpoints and resume (resume.py), the runs, the saved model (export.py); session.py keeps the result file, the
database row and what is shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from speedrun import dist
from speedrun.config import apply_overrides, check_int, field_defaults
from speedrun.engine.checkpoint import list_checkpoints
from speedrun.engine.loop import Diverged
from speedrun.engine.system import System, resolve_device
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
from speedrun.run.prepared import MAX_EPOCHS, MAX_RUNS, PreparedRun, RunRequest, count_flops, make_config, prepare
from speedrun.run.session import Result, Session

__all__ = ["MAX_EPOCHS", "MAX_RUNS", "RECIPES", "Result", "TrainOptions", "count_flops", "make_config",
           "print_recipes", "train"]

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
        values = settings_file.named_values(e, tuned)
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
        values = settings_file.named_values(e, applied) if used is not None else ""
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


_PATH_LIKE = (str, os.PathLike, type(None))


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


@dataclass(frozen=True)
class TrainOptions:
    """What train() does besides training: the files it writes, checkpoints and resuming, what it shows. Each
    field is a keyword of train() too: train(..., json_path="auto", save="m") or train(..., options=TrainOptions(...)).

    json_path: where to write the result JSON, claimed before any data is read (an existing file is never replaced:
    that is an error); "auto" picks a new results/<time>-<recipe>-<dataset>.json; None writes nothing. The file is
    rewritten after every run, so a crash keeps the runs that ended ("complete": false).
    verbose: progress, tables and notes on stderr; summary: the summary table on stdout (default: as verbose), or
    "lines": the result's statistics and its verdict on the target, a line each (the CLI's --quiet).
    checkpoint_dir: save the training state there every `checkpoint_every` steps (default: ten times a run), at the
    end of each run and on SIGINT/SIGTERM, keeping the newest `keep_checkpoints`. resume: a checkpoint file, or
    "auto" for the newest usable one in checkpoint_dir (none yet: start afresh); under torchrun a restarted worker
    group resumes by itself. save: write the last run's trained network there (export.py; `speedrun.load`).
    price_per_hour: US dollars per device-hour for the result's cost (default: records/cost.py's table by device name).
    db: also store the result in this results database (records/db.py; the CLI passes its default_db_path()), opened
    and migrated before any work; a failure to store it later is a warning (the JSON file has it).
    strict: refuse to train (ValueError) while a debugging switch that slows training is on (records/debug_apis.py);
    without it each is a warning, and every result lists them (environment.debug_apis).
    settings: a settings file written by `speedrun tune --apply` (None: $SPEEDRUN_SETTINGS, if set; False: none):
    its values (tune's performance settings only: settings_file.KEYS) apply under the overrides, a line says so, and
    the result records them; a file for another recipe or device type is refused (one from the environment is
    skipped with a warning), and so is any refusal its values cause, naming the file.
    tensorboard: write TensorBoard event files under this folder (run/tensorboard.py): a new folder
    <time>-<recipe> per call, made and proved writable before any data is read, with a run seed-<n> per seed.
    """

    json_path: str | os.PathLike | None = None
    verbose: bool = False
    summary: bool | str | None = None
    command: str | None = None  # the command line the result records (the CLI's)
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None  # steps
    keep_checkpoints: int = 2
    resume: str | os.PathLike | None = None
    save: str | os.PathLike | None = None
    price_per_hour: float | None = None  # US dollars per device-hour
    db: str | os.PathLike | None = None
    strict: bool = False
    settings: str | os.PathLike | bool | None = None
    tensorboard: str | os.PathLike | None = None

    @classmethod
    def split(cls, options: TrainOptions | None, keywords: dict[str, Any]) -> tuple[TrainOptions, dict[str, Any]]:
        """(the options, checked, from `options` and the keywords that name one; the other keywords). A keyword
        sets a field that `options` leaves at its default; one that `options` sets to another value is refused."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        given = {k: v for k, v in keywords.items() if k in fields}
        if options is not None and not isinstance(options, cls):
            raise ValueError(f"options={options!r:.80} is not a TrainOptions")
        twice = sorted(k for k, v in given.items() if options is not None and getattr(options, k) != fields[k]
                       and getattr(options, k) != v)
        if twice:
            raise ValueError(f"{', '.join(twice)} given as a keyword and in options, with other values; give each "
                             "once")
        chosen = dataclasses.replace(options or cls(), **given)
        return chosen.checked(), {k: v for k, v in keywords.items() if k not in fields}

    def checked(self) -> TrainOptions:
        _check_types(json_path=(self.json_path, _PATH_LIKE, "a file path, 'auto' or None (--json)"),
                     checkpoint_dir=(self.checkpoint_dir, _PATH_LIKE, "a folder path (--checkpoint-dir)"),
                     resume=(self.resume, _PATH_LIKE, "a checkpoint path, 'auto' or None (--resume)"),
                     save=(self.save, _PATH_LIKE, "a file path (--save)"),
                     db=(self.db, _PATH_LIKE, "a file path (--db)"),
                     tensorboard=(self.tensorboard, _PATH_LIKE, "a folder path (--tensorboard)"),
                     settings=(None if self.settings is False else self.settings, _PATH_LIKE,
                               "a settings file path, None or False (--settings)"),
                     strict=(self.strict, (bool,), "True or False (--strict)"),
                     verbose=(self.verbose, (bool,), "True or False"),
                     summary=(self.summary, (bool, str, type(None)), "True, False, \"lines\" or None"),
                     command=(self.command, (str, type(None)), "a string or None"))
        if isinstance(self.summary, str) and self.summary != "lines":
            raise ValueError(f"summary={self.summary!r:.80} is not True, False, \"lines\" or None")
        every = self.checkpoint_every
        return dataclasses.replace(
            self, keep_checkpoints=check_int("keep_checkpoints", "--keep-checkpoints", self.keep_checkpoints, 1, 10**6),
            checkpoint_every=None if every is None else check_int("checkpoint_every", "--checkpoint-every", every, 1,
                                                                  2**62))


@escaped_refusals
def train(recipe: str = "cifar10-94", dataset: str | None = None, *, device: str = "auto",
          epochs: float | None = None, runs: int = 1, seed: int = 0, data_dir: str | os.PathLike | None = None,
          image_size: int | None = None, smoke: bool = False, options: TrainOptions | None = None,
          overrides: dict[str, Any] | None = None, **keywords: Any) -> Result:
    """Train `runs` seeds of `recipe` on `dataset` and return a Result (with the last run's model).

    keywords: config fields, e.g. train("cifar10-94", lookahead=False, batch_size=512), or the dict `overrides`
    (which may hold any key, `epochs` included); and TrainOptions' fields (json_path, save, checkpoint_dir, ...),
    or `options`. smoke: a pipeline check in seconds: a few steps on a little of the test set, no TTA; marked as
    such. model (a config field of the in-memory recipes): the user's network, a function or "MODULE:FUNCTION".
    Under torchrun (dist.py) every process calls this; rank 0 alone prints and writes.
    Every setting is checked before data is read, and the data against the config before any step is taken.
    """
    began = time.perf_counter()
    _check_types(dataset=(dataset, _PATH_LIKE, "a dataset name or path (--dataset)"),
                 device=(device, (str,), "a device name such as 'cpu' (--device)"),
                 data_dir=(data_dir, _PATH_LIKE, "a folder or archive path (--data-dir)"),
                 overrides=(overrides, (dict, type(None)), "a dict of config keys to values (--set)"),
                 smoke=(smoke, (bool,), "True or False (--smoke)"))
    opts, keywords = TrainOptions.split(options, keywords)
    rec = get_recipe(recipe)
    runs = check_int("runs", "--runs", runs, 1, MAX_RUNS)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    tuned, settings_used = _tuned(opts.settings, rec, device)
    given = {**(overrides or {}), **keywords}
    if callable(given.get("model")) or given.get("model"):  # train(model=build or "MODULE:FUNCTION"): the user's
        given["model"] = custom.use_builder(given["model"])  # network (models/custom.py), recorded by its name
    applied = {k: v for k, v in tuned.items() if k not in given}  # --set wins over the file
    request = RunRequest(rec.name, dataset, device, epochs, {**tuned, **given}, data_dir, image_size, smoke)
    with _naming_settings(settings_used, applied):
        cfg = make_config(rec, epochs, request.overrides)
    cost.price_for("", opts.price_per_hour)  # the price, or SPEEDRUN_PRICES's table, checked with the settings
    job = _Job(prepare(request, cfg=cfg), opts, runs, seed, settings_used, applied)
    with contextlib.ExitStack() as stack:  # released in reverse: what the job opened, the claim, the world
        stack.callback(lambda: dist.shutdown(job.run.world, job.in_step))
        stack.callback(job.release)
        stack.callback(job.show.close)
        with warnings.catch_warnings():
            if not job.run.world.is_main:  # every process checks the same things: one copy of each warning will do
                warnings.simplefilter("ignore", SpeedrunWarning)
            found = job.open_outputs(stack)
            done = job.finished(found)
            if done is not None:  # --resume auto in a job that finished: its result, nothing run or stored again
                return done
            job.claim_result(found)
            job.load_and_check()
            first_run, state = job.begin(found)
        session = job.session = Session(job.result, json_path=job.json_path, database=job.database, db=opts.db,
                                        world=job.run.world, show=job.show, began=began)
        try:
            job.train_runs(first_run, state)
        except KeyboardInterrupt as interrupt:  # Ctrl-C, and SIGTERM through errors.Terminated
            plan = job.plan
            session.keep_interrupted(interrupt, plan.directory if plan.directory and list_checkpoints(plan.directory)
                                     else None)
            job.in_step = getattr(interrupt, "in_step", False)
            raise
        except Exception as failure:  # an error after some runs ended: kept too
            session.keep_failed(failure)
            raise
        session.store()
        session.report()
        job.in_step = True
    return job.result


class _Job:
    """One train() call after its settings are checked: the prepared run and what the call claims, opens and
    shows, in the order train() takes them. The release of each is pushed on train()'s ExitStack as it is made."""

    def __init__(self, run: PreparedRun, opts: TrainOptions, runs: int, seed: int, settings_used: dict | None,
                 applied: dict[str, str]) -> None:
        self.run, self.opts, self.runs, self.seed = run, opts, runs, seed
        self.settings_used, self.applied = settings_used, applied
        world = run.world
        self.show = display.Display(opts.verbose and world.is_main, opts.summary if world.is_main else False)
        self.json_path = cast("str | Path | None", opts.json_path)  # a path-like as given, or the claimed Path
        self.claimed: Path | None = None
        self.database: Any = None
        self.session: Session | None = None
        self.in_step = False  # every process got to the end alike (dist.shutdown waits for the others then)
        self.check_warnings: list[str] = []  # the family's warnings about this run, shown once begin's checks pass
        self.result: Result

    def naming(self) -> contextlib.AbstractContextManager:
        return _naming_settings(self.settings_used, self.applied)

    def release(self) -> None:
        """A result path claimed and never written is given back (removed only if still empty)."""
        if self.claimed is not None and (self.session is None or not self.session.written):
            release_result_path(self.claimed)

    def open_outputs(self, stack: contextlib.ExitStack) -> resuming.Found | None:
        """The result path given anew, claimed before anything else is made (the checkpoint and TensorBoard
        folders, the database): one that cannot be claimed leaves none of them behind. A resumed command may
        continue the result file of its checkpoint instead (claim_result, once the checkpoint is found), and
        "auto" makes its folder: both are checked here (what can be told without making anything). Returns the
        checkpoint to resume, if any."""
        opts, world, rec = self.opts, self.run.world, self.run.recipe
        path = self.json_path
        self.early = path is not None and path != "auto" and opts.resume is None and world.restarts == 0
        if self.early:
            chosen = dist.main_first(world, lambda: claim_result_path(cast("str | Path", path)), everyone=False)
            if world.is_main:
                self.json_path = self.claimed = chosen
        elif path is not None:
            dist.main_first(world, lambda: _check_result_output(path), everyone=False)
        self.plan = resuming.Plan.make(opts.checkpoint_dir, opts.checkpoint_every, opts.keep_checkpoints,
                                       opts.resume, world)
        self.save_path = export.check_save(opts.save, world, self.json_path)
        self.board = None
        if opts.tensorboard is not None:  # rank 0 writes the event files; its refusal ends every process
            self.board = dist.main_first(world, lambda: boards.open_board(opts.tensorboard, rec.name), everyone=False)
            if self.board is not None:
                stack.callback(self.board.close)
        debug_apis.guard(opts.strict, self.run.device)
        if opts.db is not None:  # created or migrated now, by rank 0: a bad --db ends every process before any work
            self.database = dist.main_first(world, lambda: results_db.connect(opts.db), everyone=False)
            if self.database is not None:
                stack.callback(self.database.close)
        return self.plan.find(world, self.show.line)  # the checkpoint to resume (before the result is claimed)

    def finished(self, found: resuming.Found | None) -> Result | None:
        """The finished job's result as its file holds it, when --resume auto finds the job done; else None. Asked
        before the data is read: a checkpoint of a copy from --data-dir records the copy's path (PreparedRun.load),
        which stands for the dataset's name here."""
        run, data_dir = self.run, self.run.request.data_dir
        dataset = run.dataset
        if found is not None and data_dir is not None and found[1].get("dataset") == os.fspath(data_dir):
            dataset = os.fspath(data_dir)
        done = self.plan.finished_job(found, self.runs, {"recipe": run.recipe.name, "dataset": dataset,
                                                         "config": dataclasses.asdict(run.cfg), "seed": self.seed},
                                      run.family.MAY_DIFFER_ON_RESUME, self.database, run.world,
                                      field_defaults(run.cfg))
        if done is None:
            return None
        result = Result.from_dict(done)
        self.show.summary(result)
        self.in_step = True
        return result

    def claim_result(self, found: resuming.Found | None) -> None:
        """A result path not claimed early: by rank 0, now that the checkpoint is known."""
        path, run = self.json_path, self.run
        if path is None or self.early:
            return

        def claim():
            continued = self.plan.continued_result(found, path)
            return continued or (default_result_path(run.recipe.name, run.dataset) if path == "auto"
                                 else claim_result_path(path))

        chosen = dist.main_first(run.world, claim, everyone=False)
        if run.world.is_main:
            self.json_path = self.claimed = chosen

    def load_and_check(self) -> None:
        """The data, then the smoke cut and the family's checks against it (naming a settings file's values), and
        what a save would refuse, refused before training."""
        run = self.run
        run.load(self.show.line)
        with self.naming():  # a batch_size from the settings file too large here, say
            # its warnings (the user's network's note, ...) wait for begin's checks: a refusal there is the one line
            self.check_warnings = run.checked(quiet=True)
        if self.save_path is not None and run.world.is_main:
            export.check_card(run.family.model_card(run.cfg, run.data), run.recipe, run.cfg, run.dataset,
                              run.request.smoke)

    def begin(self, found: resuming.Found | None) -> tuple[int, dict | None]:
        """The checkpoint's agreement with this job checked, the lines shown before training, the Result to fill
        and the checkpoints to write. Returns (the first run to train, the training state it resumes from)."""
        run, show = self.run, self.show
        system = cast("System", run.system)
        # What a checkpoint records and a resume must match (the data's hash only when checkpoints are used).
        meta = None if self.plan.directory is None and found is None else {
            "recipe": run.recipe.name, "dataset": run.dataset, "config": dataclasses.asdict(run.cfg),
            "data": run.family.data_signature(run.data), "seed": self.seed,
            # what precision=auto resolved to here: a resumed run must continue at the precision it began with
            "device_type": run.device.type, "precision_used": system.precision,
            "half_weights_used": system.half_weights}
        with self.naming():
            first_run, state, finished = self.plan.check_found(found, meta, run.family.MAY_DIFFER_ON_RESUME,
                                                               self.runs, field_defaults(run.cfg))
        show.release()  # every check has passed: what was held back (downloads, decoding) may be shown now
        for message in self.check_warnings:
            warn(message)
        env = environment(run.device)
        world = run.world
        show.line(f"device: {run.device.type} ({env['device_name']})"
                  + (" -- chosen by --device auto" if run.request.device == "auto" else "")
                  + (f"; {world.size} processes on {counted(world.nodes, 'node')}, {world.backend}"
                     if world.size > 1 else ""))
        show.line(f"data: {run.family.describe(run.data)} ({run.data_seconds:.1f} s to load)")
        if self.settings_used is not None:  # it changes the run unseen otherwise ($SPEEDRUN_SETTINGS is set once)
            show.line(_settings_line(self.settings_used, self.applied))
        for note in run.family.notes(run.cfg, run.data, run.request.smoke):
            show.line(note)
        self.result = run.result(finished, env=env, runs_requested=self.runs, command=self.opts.command,
                                 resumed_from=[str(found[2])] if found else [],
                                 price=cost.price_for(env["device_name"], self.opts.price_per_hour),
                                 settings=self.settings_used)
        self.checkpoints = self.plan.checkpoints(meta, self.json_path, world)
        return first_run, state

    def train_runs(self, first_run: int, state: dict | None) -> None:
        """The warm-up, then each run in turn, the result saved after every one (a crash later keeps it); the last
        run's model saved when asked."""
        run, result, show, session = self.run, self.result, self.show, cast("Session", self.session)
        family, cfg, data, runs, seed = run.family, run.cfg, run.data, self.runs, self.seed
        try:
            result.warmup_seconds = family.warmup(cfg, data, run.device, run.world)
        except Diverged as e:  # shuffled labels; compile and autotuning happened before the bad step
            warn(f"the warm-up run {e}")
        if result.warmup_seconds:
            show.line(f"warm-up run (untimed, shuffled labels): {result.warmup_seconds:.1f} s")
        for i in range(first_run, runs):
            if self.checkpoints is not None:
                self.checkpoints.begin(i, result.runs)
            with boards.run_log(self.board, cfg, seed=seed + i, dataset=run.dataset,
                                steps=family.run_steps(cfg, data.num_train)) as log:
                try:
                    with show.run(i, runs, seed + i, family.final_evaluation(cfg)) as (on_step, on_epoch, scoring):
                        hooks = dataclasses.replace(boards.run_hooks(log, on_step=on_step, on_epoch=on_epoch,
                                                                     checkpoints=self.checkpoints),
                                                    on_evaluation=scoring)
                        one = family.train_run(cfg, data, run.device, seed + i, world=run.world, hooks=hooks,
                                               resume=state if i == first_run else None)
                except Diverged as e:
                    warn(f"run {i + 1}/{runs} (seed {seed + i}) {e}")
                    one = e.as_run(seed + i, cfg.epochs)
            result.model, one.model = one.model, None  # keep one model alive, not N
            result.runs.append(one)
            result.complete = len(result.runs) == runs
            session.save()  # after every run: a crash or kill later keeps this one
        if self.save_path is not None and run.world.is_main and result.model is not None:
            result.saved_model = export.save_trained(self.save_path, result.model,
                                                     family.model_card(cfg, data), run.recipe, cfg, run.dataset,
                                                     result.runs[-1], run.request.smoke)
            show.line(f"saved model: {result.saved_model}")
            session.save()


def print_recipes(file=sys.stdout) -> None:
    for line in recipe_lines():
        print(line, file=file)
