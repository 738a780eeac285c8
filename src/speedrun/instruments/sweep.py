"""`speedrun sweep RECIPE --space KEY=LOW:HIGH[:log] --space KEY=A,B,C --trials N --runs K`: a hyperparameter
search on Optuna (https://optuna.org; the optional extra `pip install 'speedrun[sweep]'`), every trial measured
over K seeds, as a record would be.

The space: a range of an int field draws integers (suggest_int), of a float field floats (suggest_float), on a log
scale with `:log`; a list draws one of its values (suggest_categorical), each parsed as the field's type (a tuple
field's values, themselves comma-separated, take ';' between them, as bench's --vary). Every key, bound and value
is checked against the recipe's config before anything is opened or trained. The sampler is TPE (seeded) by
default; `random` and `grid` (lists and int ranges only) are the others.

A trial trains seeds S .. S + K - 1 (the same seeds in every trial, so that trials differ by their parameters and
not by their luck) with its parameters over the recipe (and --set), after an untimed warm-up of that trial's own
configuration (bench.warm_up: compile, autotune and other first-run costs fall there, not in its timed seconds). Its
objective:
- accuracy (maximized): the mean final test accuracy at the recipe's budget (or --epochs);
- time (minimized): the mean timed seconds, where the runs reach the recipe's target by the records rule
  (records/stats.reaches_target: a one-sided t-test of the accuracies against the target, p < 0.01, n >= 2). A
  trial that does not reach it gets PENALTY_S * (1 + shortfall) + its mean seconds, shortfall being the target
  minus its mean accuracy (0 where the mean is above the target but p is not small enough): worse than any trial
  that reaches the target (PENALTY_S is about 11.6 days of one run), and the closer to the target the better, so
  that the sampler still learns which way the target lies.
A diverged run (NaN/inf loss) counts as accuracy 0. The space may not hold what defines the measure
(MEASURE_KEYS): the target, what only decides what the pruner sees, and, for the accuracy objective, the budget.
Each trial records as Optuna user attributes its mean, the 95% t-interval of that mean, n, the one-sided p against
the target and whether it reached it.

Pruning (--prune; on by default when the recipe evaluates every epoch, eval_each_epoch): each run's per-epoch test
accuracy is reported to Optuna at step run * STEP_STRIDE + epoch, so that every trial's run r, epoch e is compared
with the other trials' run r, epoch e. Optuna's MedianPruner stops a trial whose best value so far lies below the
median of the finished trials' values at the same step; here "so far" is within the current run (_pruner), else
the first run's best would shield every later run of the trial. For the time objective, which minimizes, the
value reported is the error rate (1 - accuracy). A pruned trial is kept as pruned, with the runs it finished.

Storage: an Optuna RDB storage, --storage URL (sqlite:///study.db, postgresql://..., for many processes or
machines on one study), by default an SQLite file beside the results database (results.db -> results.sweeps.db:
its own file, so that Optuna's tables and migrations never meet records/db.py's schema check, and a study that is
locked or damaged never blocks the results). Several processes may add trials to one study (--resume in all but
the first): Optuna's storage numbers and keeps each trial; TPE's constant liar keeps them from proposing the same
point at once. A study's name is derived from the recipe, dataset, objective, budget and space unless --study gives
one. A study's question (what --resume must repeat) is those and --set, --runs, --seed and, for the time objective,
the records rule's p threshold: every trial of a study is measured the same way. A new study's sampler is seeded
with --seed; a resumed one's from the operating system, since resumes may run at once in several processes, which
must not propose the same points. The storage must outlive the process (an in-memory SQLite URL is refused).

Every trial's finished runs are stored in the results database as a training result of their own (its command line
ends `# setting trial N of STUDY: k=v ...`), and at the end the whole study (every trial of every process so far,
the best with its interval, Optuna's parameter importances where it gives them) as a "sweep" report, which the
report's study section (report/study.py) draws. A sweep that stops part way (Ctrl-C, an error after some runs) keeps
the interrupted trial's finished runs and statistics the same way as a finished trial's, and still writes and
hands on its report (on_report).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable
from datetime import timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from speedrun import dist
from speedrun.config import RUN_OPTIONS, check_int, field_types, parse_value
from speedrun.engine import peak
from speedrun.engine.loop import Diverged, RunResult, signals_held
from speedrun.engine.system import resolve_device, resolve_system
from speedrun.errors import note_kept, print_line, warn
from speedrun.instruments.bench import warm_up
from speedrun.instruments.variants import set_text
from speedrun.paths import user_path
from speedrun.records import db, stats
from speedrun.records.environment import environment
from speedrun.records.result_file import (claim_result_path, default_result_path, portable, release_result_path,
                                          write_json)
from speedrun.run import runner
from speedrun.run import tensorboard as boards
from speedrun.tricks.precision import default_cpu_threads

INSTALL = "pip install 'speedrun[sweep]'"
OBJECTIVES = {"accuracy": "maximize", "time": "minimize"}
SAMPLERS = ("tpe", "random", "grid")
MAX_TRIALS = 100_000
MAX_GRID = 10_000  # points a grid sampler may hold
PENALTY_S = 1e6  # seconds: a time trial that misses the target scores above every one that reaches it
STEP_STRIDE = 10_001  # > MAX_EPOCHS: run r's epoch e reports at step r * STEP_STRIDE + e, never another run's step
PRUNE_STARTUP_TRIALS = 5  # MedianPruner's default: no trial is pruned before five have finished
SQLITE_TIMEOUT_S = 60.0  # how long a process waits for another's write lock on an SQLite study
MAX_REPORT_TRIALS = 5_000  # trials a stored report lists (the newest), to keep it far below a report's size limit
# Config keys that define what a trial is judged by, not what it trains: searching them lets the sweep win by
# moving the yardstick. objective -> key -> why (None: every objective).
MEASURE_KEYS = {
    None: {"target_accuracy": "it is the target the trials are judged against; set it with --set target_accuracy=",
           "eval_each_epoch": "it changes no training, only whether the pruner sees a trial's epochs; set it with "
                              "--set eval_each_epoch="},
    "accuracy": {"epochs": "the accuracy objective is measured at a fixed budget, and a search of the budget finds "
                           "the longest run; give --epochs, or search it with --objective time"},
}


def optuna_module():
    """optuna, imported on first use (an optional extra: `import speedrun` works without it)."""
    try:
        import optuna
    except ImportError:
        raise ValueError(f"speedrun sweep needs Optuna, which is not installed here; {INSTALL}") from None
    return optuna


@dataclasses.dataclass(frozen=True)
class Param:
    """One --space entry: a config key and how a trial draws its value."""

    key: str
    kind: str  # "int", "float" (a range) or "categorical" (a list)
    text: str  # as given, for messages and the study's question
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    choices: tuple = ()  # Optuna-storable values: bool, int, float, str (a tuple field's value as "8,16,16")

    def suggest(self, trial) -> Any:
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log)
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log)
        return trial.suggest_categorical(self.key, list(self.choices))

    def grid(self) -> list:
        """The values a grid sampler tries: a list's values, an int range's every integer."""
        if self.kind == "categorical":
            return list(self.choices)
        if self.kind == "int" and not self.log:
            return list(range(self.low, self.high + 1))
        raise ValueError(f"--space {self.text}: --sampler grid needs a list of values (KEY=A,B,C) or an int range "
                         "without :log; give the values, or use --sampler tpe")


def parse_space(items: list[str], rec, epochs: float | None, overrides: dict[str, Any],
                objective: str = "accuracy") -> list[Param]:
    """The --space entries for recipe `rec`, each checked against its config: the key is a field (and not also
    given with --set) that does not define the measure (MEASURE_KEYS), a range is LOW < HIGH of the field's number
    type (LOW > 0 on a log scale), a list holds two or more distinct values of the field's type, and the config
    with each bound or value (over --set and --epochs) passes the recipe's own validation. Every refusal is one
    line naming the entry and the fix."""
    if not items:
        raise ValueError("give the space to search: --space KEY=LOW:HIGH[:log] or --space KEY=A,B,C (repeatable)")
    cfg = runner.make_config(rec, epochs, overrides)
    types = field_types(type(cfg))
    params: list[Param] = []
    for item in items:
        key, sep, spec = (part.strip() for part in item.partition("="))
        shown = item.strip()[:200]
        if not sep or not key or not spec:
            raise ValueError(f"--space {shown!r}: expected KEY=LOW:HIGH[:log] or KEY=A,B,C, e.g. --space "
                             "lr_per_1024=8:14 --space label_smoothing=0,0.1,0.2")
        if key not in types:
            hint = (f"{key} is not a config key: use {RUN_OPTIONS[key]}" if key in RUN_OPTIONS
                    else f"unknown config key {key[:60]!r}")
            raise ValueError(f"--space {shown}: {hint}; valid keys: {', '.join(sorted(types))}")
        why = {**MEASURE_KEYS[None], **MEASURE_KEYS.get(objective, {})}.get(key)
        if why is not None:
            raise ValueError(f"--space {key}: {key} defines what the sweep measures and cannot be searched: {why}")
        if any(p.key == key for p in params):
            raise ValueError(f"--space {key} is given twice; give each key once")
        if key in overrides:
            raise ValueError(f"--space {key} and --set {key} both set it; keep one")
        tp = types[key]
        if tp in (int, float) and ":" in spec:
            param = _range(shown, key, spec, tp)
            values = [param.low, param.high]
        else:
            param = _choices(shown, key, spec, tp)
            values = list(param.choices)
        for value in values:  # the config takes each bound and value: a range's inner values lie between
            try:
                runner.make_config(rec, epochs, {**overrides, key: value})
            except ValueError as e:
                raise ValueError(f"--space {shown}: {e}") from None
        params.append(param)
    return params


def _range(shown: str, key: str, spec: str, tp: type) -> Param:
    parts = [p.strip() for p in spec.split(":")]
    if len(parts) not in (2, 3) or len(parts) == 3 and parts[2] != "log":
        raise ValueError(f"--space {shown}: a range is LOW:HIGH or LOW:HIGH:log, e.g. {key}=8:14")
    kind = "int" if tp is int else "float"
    try:
        low, high = (parse_value(key, p, tp) for p in parts[:2])
    except ValueError:
        raise ValueError(f"--space {shown}: {key} is {'an int' if tp is int else 'a number'} field, so LOW and "
                         f"HIGH must be {'integers' if tp is int else 'finite numbers'}") from None
    log = len(parts) == 3
    if not low < high:
        raise ValueError(f"--space {shown}: LOW must be below HIGH (to try one value, --set {key}={parts[0]})")
    if log and low <= 0:
        raise ValueError(f"--space {shown}: a log range needs LOW > 0; give a positive LOW, or leave out :log")
    return Param(key, kind, shown, low=low, high=high, log=log)


def _choices(shown: str, key: str, spec: str, tp: Any) -> Param:
    is_tuple = getattr(tp, "__origin__", None) is tuple
    texts = [v.strip() for v in spec.split(";" if is_tuple else ",")]
    if any(not t for t in texts):
        raise ValueError(f"--space {shown}: an empty value; give KEY=A,B,C" + (" (a tuple key takes ';' between "
                                                                                 "values: 64,256,256;32,64,64)"
                                                                                 if is_tuple else ""))
    choices = []
    for text in texts:
        try:
            value = parse_value(key, text, tp)
        except ValueError as e:
            raise ValueError(f"--space {shown}: {e}") from None
        value = ",".join(map(str, value)) if is_tuple else value  # Optuna stores bool, int, float, str
        if value in choices and type(value) is type(choices[choices.index(value)]):
            raise ValueError(f"--space {shown}: {text} is given twice; give each value once")
        choices.append(value)
    if len(choices) < 2:
        hint = f"a range is LOW:HIGH, e.g. {key}=8:14" if tp in (int, float) else f"to use one, --set {key}={texts[0]}"
        raise ValueError(f"--space {shown}: give two or more values to choose from ({hint})")
    return Param(key, "categorical", shown, choices=tuple(choices))


def default_storage(db_path: str | Path | None) -> str:
    """The SQLite URL of the sweeps file beside the results database: results.db -> results.sweeps.db."""
    path = db.default_db_path() if db_path is None else user_path(db_path, "--db")
    return f"sqlite:///{path.with_name(path.stem + '.sweeps.db').absolute()}"


def shown_url(url: str) -> str:
    """A storage URL as it may be printed and stored: a password in it replaced by ***."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))
    except ValueError:  # not a URL Python can split: Optuna will refuse it, named without its parts
        return "the --storage URL"


def default_study_name(recipe: str, dataset: str, objective: str, question: dict) -> str:
    """recipe-dataset-objective-HASH, the hash of what the study asks (space, budget, --set), so that another
    question gets another study and the same one, the same study (--resume)."""
    digest = hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()[:10]
    name = Path(str(dataset).rstrip("/\\")).name or str(dataset)
    return f"{recipe}-{name[:60]}-{objective}-{digest}"


def check_storage_url(url: str) -> None:
    """Refuse (one line) what is not a database URL, and an SQLite database in memory (sqlite://, sqlite:///,
    sqlite:///:memory:, mode=memory), which ends with the process: a study must outlive it for --resume."""
    shown = shown_url(url)
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"--storage {shown}: not a database URL; give one such as sqlite:///study.db")
    from sqlalchemy.engine import make_url  # Optuna's own dependency: here only after optuna_module()

    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 -- SQLAlchemy's parse errors: _open_storage names them when it opens the URL
        return
    database = parsed.database or ""
    if parsed.get_backend_name() == "sqlite" and (database in ("", ":memory:") or database.startswith("file::memory:")
                                                  or parsed.query.get("mode") == "memory"):
        raise ValueError(f"--storage {shown}: an in-memory database ends with this process, and a study must outlive "
                         "it (--resume); give a file, e.g. sqlite:///study.db")


def _open_storage(optuna, url: str):
    """Optuna's RDB storage at `url`; an SQLite file waits SQLITE_TIMEOUT_S for another process's write lock."""
    shown = shown_url(url)
    check_storage_url(url)
    engine = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else None
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine)
    except Exception as e:  # noqa: BLE001 -- SQLAlchemy's and the driver's errors: one line naming the storage
        text = " ".join(str(e).split())[:300]
        raise ValueError(f"cannot open the study storage {shown} ({type(e).__name__}: {text}); give a URL such as "
                         "sqlite:///study.db (--storage)") from None


def _pruner(optuna):
    """Optuna's MedianPruner (PRUNE_STARTUP_TRIALS finished trials first) judging each run of a trial on its own:
    the trial's best value is taken over the current run's steps only (see the module)."""

    class RunwiseMedianPruner(optuna.pruners.MedianPruner):
        def prune(self, study, trial) -> bool:
            step = trial.last_step
            if step is None:
                return False
            this_run = copy.copy(trial)
            this_run.intermediate_values = {s: v for s, v in trial.intermediate_values.items()
                                            if s >= step - step % STEP_STRIDE}
            return super().prune(study, this_run)

    return RunwiseMedianPruner(n_startup_trials=PRUNE_STARTUP_TRIALS)


def _sampler(optuna, name: str, params: list[Param], seed: int | None):
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    grid = {p.key: p.grid() for p in params}
    if math.prod(len(v) for v in grid.values()) > MAX_GRID:
        raise ValueError(f"--sampler grid: the grid holds more than {MAX_GRID:,} points; give fewer values, or use "
                         "--sampler tpe")

    class Grid(optuna.samplers.GridSampler):
        # GridSampler ends study.optimize's loop (study.stop) after the grid's last point; this loop asks and tells
        # itself, where stop() is an error, and ends on is_exhausted before it asks.
        def after_trial(self, study, trial, state, values) -> None:
            pass

    return Grid(grid, seed=seed)


def _open_study(optuna, storage, name: str, *, shown: str, resume: bool, direction: str, question: dict, sampler,
                pruner):
    """The study `name`: created (refused when it exists, unless `resume`), or loaded with `resume` (refused when
    it does not exist, or asks another question)."""
    exists = name in optuna.study.get_all_study_names(storage)
    if exists and not resume:
        raise ValueError(f"study {name!r} already exists in {shown}: add --resume to add trials to it, or give "
                         "another --study NAME")
    if resume and not exists:
        raise ValueError(f"--resume: there is no study {name!r} in {shown}; leave out --resume to start it")
    try:
        study = optuna.create_study(storage=storage, sampler=sampler, pruner=pruner, study_name=name,
                                    direction=direction, load_if_exists=resume)
    except optuna.exceptions.DuplicatedStudyError:  # another process created it since the question above
        raise ValueError(f"study {name!r} was created meanwhile in {shown} (by another process): add --resume to "
                         "add trials to it") from None
    if not resume:
        study.set_user_attr("question", question)
    else:
        # None: a study made elsewhere (Optuna's own tools), which states no question; its direction must agree
        asked = study.user_attrs.get("question", question)
        if study.direction.name.lower() != direction or asked != question:
            differ = sorted(k for k in set(question) | set(_dict(asked)) if _dict(asked).get(k) != question.get(k))
            values = "; ".join(f"{k} {json.dumps(_dict(asked).get(k))[:80]}" for k in differ)
            raise ValueError(f"--resume: study {name!r} in {shown} asks another question (it differs in "
                             f"{', '.join(differ) or 'its direction'}; the study's: {values or 'another direction'})"
                             "; give the same recipe, dataset, objective, space, --epochs, --set, --runs, --seed "
                             f"and {stats.RECORD_P_ENV}, or another --study NAME")
    return study


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


class _Pruned(Exception):
    """Raised from a run's per-epoch callback when Optuna's pruner stops the trial."""


def _score(objective: str, runs: list[RunResult], target: float, alpha: float | None = None) -> dict:
    """What a trial's runs measure: the objective's value (None with no finished run), its mean and 95% interval,
    n, the one-sided p of the accuracies against `target` and whether they reach it (stats.reaches_target at
    threshold `alpha`; None: the records rule's setting)."""
    accuracies = [0.0 if r.diverged is not None else r.accuracy for r in runs]  # a diverged run learned nothing
    seconds = [r.train_seconds for r in runs if r.diverged is None]
    out: dict[str, Any] = {"n": len(runs), "diverged": len(runs) - len(seconds), "target": target, "value": None,
                           "mean": None, "ci95": None, "p": None, "reached": False, "penalized": False,
                           "accuracy": None, "seconds": None}
    if not runs:
        return out
    acc = stats.summarize(accuracies, stats.FRACTION)
    out["accuracy"] = {"mean": acc.mean, "std": acc.std, "ci95": _ci(acc)}
    if seconds:
        secs = stats.summarize(seconds, stats.NON_NEGATIVE)
        out["seconds"] = {"mean": secs.mean, "std": secs.std, "ci95": _ci(secs)}
    reached, p = stats.reaches_target(acc.mean, acc.std, acc.n, target, alpha=alpha)
    out.update(p=p, reached=bool(reached) and not out["diverged"])
    if objective == "accuracy":
        out.update(value=acc.mean, mean=acc.mean, ci95=out["accuracy"]["ci95"])
    elif out["seconds"] is not None:
        mean = out["seconds"]["mean"]
        out.update(mean=mean, ci95=out["seconds"]["ci95"], value=mean)
        if not out["reached"]:
            out.update(value=PENALTY_S * (1.0 + max(0.0, target - acc.mean)) + mean, penalized=True)
    return out


def _ci(summary: stats.Summary) -> list[float] | None:
    return None if summary.ci95_low is None else [summary.ci95_low, summary.ci95_high]


def _trial_row(t) -> dict:
    """A FrozenTrial as the report keeps it."""
    attrs = t.user_attrs
    return {"number": t.number, "state": t.state.name.lower(), "value": t.value,
            "params": {k: v for k, v in t.params.items()},
            **{k: attrs.get(k) for k in ("mean", "ci95", "n", "p", "reached", "penalized", "diverged", "accuracy",
                                         "seconds", "result_id", "error", "pruned_at_epoch", "run_seeds",
                                         "warmup_seconds")},
            "started_utc": t.datetime_start.astimezone(timezone.utc).isoformat(timespec="seconds")
            if t.datetime_start else None,
            "finished_utc": t.datetime_complete.astimezone(timezone.utc).isoformat(timespec="seconds")
            if t.datetime_complete else None}


# fANOVA fits a random forest to the completed trials: on a handful it returns confident-looking shares of noise
# (2 and 4 trials of chance-level runs both gave one parameter 0.98), so none are shown below this many.
MIN_IMPORTANCE_TRIALS = 8


def _importances(optuna, study, completed: int) -> tuple[dict | None, str | None]:
    """Optuna's parameter importances (fANOVA) of the study, or None and why not."""
    if completed < MIN_IMPORTANCE_TRIALS:
        return None, f"{completed} completed trial(s): importances need {MIN_IMPORTANCE_TRIALS} or more"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study)
    except Exception as e:  # noqa: BLE001 -- a library's estimate, never a reason to lose the sweep's report
        return None, f"Optuna could not estimate them ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return {k: float(v) for k, v in found.items()}, None


def sweep(recipe: str, *, space: list[str], trials: int = 10, runs: int = 3, objective: str = "accuracy",
          dataset: str | None = None, device: str = "auto", epochs: float | None = None, seed: int = 0,
          data_dir=None, overrides: dict[str, Any] | None = None, storage: str | None = None,
          study: str | None = None, resume: bool = False, prune: bool | None = None, sampler: str = "tpe",
          db_path: str | Path | None = None, json_path: str | Path | None = None, command: str | None = None,
          tensorboard: str | Path | None = None, on_report: Callable[[dict, Path, int | None], None] | None = None,
          log: Callable[[str], None] = print_line) -> tuple[dict, Path | None, int | None]:
    """Run `trials` trials of the study (see the module); (the report, its file, its id in the results database).

    Every setting is checked, the results database opened and the report file claimed (json_path; None: a new
    results/<time>-sweep-<recipe>-<dataset>.json) before the study is opened or any data is read.
    tensorboard: a folder for TensorBoard event files (run/tensorboard.py): a new <time>-<recipe> folder in it,
    each run as trial-<n>/seed-<s>. on_report(report, its file, its id): called once the report is written and
    stored, whether the sweep finished or stopped part way (before that stop is raised again), so that what a
    caller does with the report (a settings file) happens on both paths."""
    optuna = optuna_module()
    rec = runner.get_recipe(recipe)
    family = rec.module()
    overrides = dict(overrides or {})
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective {objective!r:.40}: choose accuracy or time")
    if sampler not in SAMPLERS:
        raise ValueError(f"--sampler {sampler!r:.40}: choose {', '.join(SAMPLERS)}")
    trials = check_int("trials", "--trials", trials, 1, MAX_TRIALS)
    runs = check_int("runs", "--runs", runs, 1, runner.MAX_RUNS)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    if objective == "time" and runs < 2:
        raise ValueError("--objective time judges each trial by the records rule, a t-test that needs n >= 2: "
                         "give --runs 2 or more")
    alpha = stats.record_alpha()  # a bad $SPEEDRUN_RECORD_P: refused before any storage or data is touched
    params = parse_space(space, rec, epochs, overrides, objective)
    base = runner.make_config(rec, epochs, overrides)
    if prune is None:
        prune = bool(getattr(base, "eval_each_epoch", False))
    elif prune and not getattr(base, "eval_each_epoch", False):
        raise ValueError("--prune needs each epoch's test accuracy: add --set eval_each_epoch=true (untimed), or "
                         "leave out --prune")
    if sampler == "grid":
        for p in params:
            p.grid()  # refuses a float range now
    dataset = rec.default_dataset if dataset is None else dataset
    question = {"recipe": rec.name, "dataset": str(dataset), "objective": objective, "epochs": epochs,
                "set": {k: str(v) for k, v in sorted(overrides.items())}, "space": sorted(p.text for p in params)}
    if study is not None and (not isinstance(study, str) or not study.strip() or len(study) > 200):
        raise ValueError("--study: give a name of 1 to 200 characters, not blank (or leave out --study for the "
                         "default name)")
    # the name follows what is searched; runs, seeds and the threshold judge every trial alike, so a resume
    # that changes them finds the study and is refused naming its values (_open_study)
    name = study if study is not None else default_study_name(rec.name, dataset, objective, question)
    question.update(runs=runs, seed=seed, **({"record_p": alpha} if objective == "time" else {}))
    url = storage if storage is not None else default_storage(db_path)
    check_storage_url(url)
    shown = shown_url(url)
    dev = resolve_device(device)

    conn = db.connect(db_path)  # a bad --db fails before the study is touched
    path, written, board = None, False, None
    try:
        path = (claim_result_path(json_path) if json_path is not None
                else default_result_path(f"sweep-{rec.name}", dataset))
        store = _open_storage(optuna, url)
        if tensorboard is not None:
            board = boards.open_board(tensorboard, rec.name)
        direction = OBJECTIVES[objective]
        level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # our lines say what each trial did
        try:
            pruner = _pruner(optuna) if prune else optuna.pruners.NopPruner()
            the_study = _open_study(optuna, store, name, shown=shown, resume=resume, direction=direction,
                                    question=question, sampler=_sampler(optuna, sampler, params,
                                                                        None if resume else seed),
                                    pruner=pruner)
            log(f"study {name} in {shown}: {len(the_study.trials)} trial(s) so far; {trials} more, {runs} run(s) "
                f"each, {objective} ({direction}), sampler {sampler}, pruning {'on' if prune else 'off'}")
            report = _trials(optuna, the_study, family, rec, params, conn, path, log, base=base, trials=trials,
                             runs=runs, objective=objective, dataset=dataset, data_dir=data_dir, dev=dev,
                             epochs=epochs, seed=seed, overrides=overrides, command=command, shown=shown,
                             sampler=sampler, prune=prune, board=board, alpha=alpha)
        finally:
            optuna.logging.set_verbosity(level)
        interrupt = report.pop("_interrupt", None)
        report["command"] = command
        with signals_held():  # what finished is kept whole, whatever signal comes now
            report = portable(report)
            write_json(path, report)
            written = True
            try:
                stored = db.insert_result(conn, report)
            except ValueError as e:  # db.UnusableDatabase: damaged, full, locked, read-only
                stored = None
                warn(f"the sweep report was not stored in the results database ({e}); it is in {path}")
            if on_report is not None:
                on_report(report, path, stored)
        if interrupt is not None:
            note_kept(interrupt, report["runs_finished"], path)
            raise interrupt
        return report, path, stored
    finally:
        conn.close()
        if board is not None:
            board.close()
        if path is not None and not written:
            release_result_path(Path(path))


def _trials(optuna, study, family, rec, params, conn, path, log, *, base, trials, runs, objective, dataset, data_dir,
            dev, epochs, seed, overrides, command, shown, sampler, prune, board, alpha) -> dict:
    """Load the data, run the trials, each after a warm-up of its own configuration; the report (with
    "_interrupt": what stopped it, if anything)."""
    data = family.load_data(dataset, data_dir=data_dir, image_size=None, log=log)
    # a copy of a named dataset that is not its published files is recorded under its path, as train records it
    stored_as = os.fspath(data_dir) if getattr(data, "unofficial", "") and data_dir is not None else dataset
    family.check(base, data, dev, dist.World())
    mine: list[int] = []
    finished_runs = 0
    warmup_seconds = 0.0
    interrupt: BaseException | None = None
    for _ in range(trials):
        if sampler == "grid" and study.sampler.is_exhausted(study):
            log("the grid is exhausted: every point has a trial")
            break
        trial = study.ask()
        mine.append(trial.number)
        done: list[RunResult] = []
        cfg, shown_params, kept = None, "", False

        def keep() -> dict:
            """The trial's finished runs stored and its statistics set, once, on the normal and the stopped path
            alike; its score."""
            nonlocal finished_runs, kept
            score = _score(objective, done, cfg.target_accuracy, alpha)
            if not kept:
                kept = True
                finished_runs += len(done)
                result_id = _store_runs(conn, family, rec, cfg, data, dev, done, stored_as, runs, command,
                                        study.study_name, trial.number, shown_params, log) if done else None
                trial.set_user_attr("result_id", result_id)
                for key in ("mean", "ci95", "n", "p", "reached", "penalized", "diverged", "accuracy", "seconds"):
                    trial.set_user_attr(key, score[key])
                trial.set_user_attr("run_seeds", [r.seed for r in done])
            return score

        try:
            values = {p.key: p.suggest(trial) for p in params}
            shown_params = " ".join(f"{k}={set_text(v)}" for k, v in values.items())
            try:
                cfg = runner.make_config(rec, epochs, {**overrides, **values})
                family.check(cfg, data, dev, dist.World())
            except ValueError as e:  # a combination the recipe refuses: that trial failed, the search goes on
                trial.set_user_attr("error", " ".join(str(e).split())[:300])
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                log(f"trial {trial.number}: {shown_params}: refused by the recipe ({e}); marked failed")
                continue
            log(f"trial {trial.number}: {shown_params}; warm-up (untimed)")
            # this configuration's own compile, autotune and first-run costs, outside its timed seconds
            warmed = warm_up(family, cfg, data, dev, None, f"trial {trial.number}", log)
            warmup_seconds += warmed
            trial.set_user_attr("warmup_seconds", warmed)
            pruned_at = None
            for r in range(runs):
                hook = _reporter(trial, r, objective) if prune else None
                try:
                    with boards.run_log(board, cfg, seed=seed + r, dataset=stored_as,
                                        steps=family.run_steps(cfg, data.num_train),
                                        setting=f"trial-{trial.number}") as scalars:
                        hooks = {} if scalars is None else {"on_scalars": scalars.scalars}
                        run = family.train_run(cfg, data, dev, seed + r, on_epoch=boards.on_epoch_too(scalars, hook),
                                               **hooks)
                except Diverged as e:
                    warn(f"trial {trial.number}, seed {seed + r}: {e}")
                    run = RunResult(seed=seed + r, accuracy=None, train_seconds=None, epochs=cfg.epochs,
                                    steps=e.step, diverged=e.to_dict())
                except _Pruned as e:
                    pruned_at = e.args[0]
                    break
                run.model = None
                done.append(run)
            with signals_held():  # the runs stored and the statistics set whole
                score = keep()
            if pruned_at is not None:
                trial.set_user_attr("pruned_at_epoch", pruned_at)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                log(f"trial {trial.number}: pruned at run {len(done) + 1}, epoch {pruned_at} ({len(done)} run(s) "
                    "finished)")
            elif score["value"] is None:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                log(f"trial {trial.number}: no run finished; marked failed")
            else:
                study.tell(trial, score["value"])
                log(f"trial {trial.number}: {_value_text(objective, score)}")
        except (KeyboardInterrupt, Exception) as e:  # Ctrl-C, SIGTERM, an error: the finished trials are kept
            with signals_held(), contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                trial.set_user_attr("error", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            with signals_held():
                if cfg is not None and not kept:
                    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                        keep()
                study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            if done:
                log(f"trial {trial.number}: stopped ({type(e).__name__}) after {len(done)} of {runs} run(s); "
                    "those are kept, the trial marked failed")
            if not isinstance(e, KeyboardInterrupt) and not finished_runs:
                raise
            interrupt = e
            break
    return _report(optuna, study, rec, family, base, dev, dataset, runs, objective, epochs, seed, overrides,
                   params, shown, sampler, prune, mine, finished_runs, warmup_seconds, interrupt)


def _reporter(trial, run_index: int, objective: str) -> Callable[[dict], None]:
    """The on_epoch callback of run `run_index`: each row with a test accuracy reported to the trial, and the run
    stopped (_Pruned) when the pruner says so."""
    def on_epoch(row: dict) -> None:
        accuracy = row.get("val_acc")
        if accuracy is None:
            return
        epoch = math.ceil(row.get("epoch") or 0)
        trial.report(accuracy if objective == "accuracy" else 1.0 - accuracy, run_index * STEP_STRIDE + epoch)
        if trial.should_prune():
            raise _Pruned(epoch)

    return on_epoch


def _value_text(objective: str, score: dict) -> str:
    mean, ci = score["mean"], score["ci95"]
    interval = "" if ci is None else f" (95% CI {ci[0] * (100 if objective == 'accuracy' else 1):.2f} .. " \
                                     f"{ci[1] * (100 if objective == 'accuracy' else 1):.2f})"
    p = "n/a" if score["p"] is None else f"{score['p']:.3g}"
    if objective == "accuracy":
        return f"accuracy {100 * mean:.2f}%{interval}, n {score['n']}, p {p} against the target"
    return (f"{mean:.2f} s{interval}, n {score['n']}, p {p}: "
            + ("reaches the target" if score["reached"] else "does not reach the target (penalized)"))


def _store_runs(conn, family, rec, cfg, data, dev, done, dataset, runs, command, study_name, number, shown_params,
                log) -> int | None:
    """A trial's finished runs as a training result in the results database; its id (None: not stored, warned)."""
    env = environment(dev)
    result = runner.Result(recipe=rec.name, dataset=str(dataset), device=dev.type, config=dataclasses.asdict(cfg),
                           runs=done, environment=env, runs_requested=runs, complete=len(done) == runs,
                           timed_region=family.timed_region(cfg), world=dist.World().to_dict(),
                           command=f"{command or 'speedrun sweep'}  # setting trial {number} of {study_name}: "
                                   f"{shown_params}",
                           flops=runner.count_flops(family, cfg, data), precision=resolve_system(cfg, dev).precision,
                           peaks=peak.cached(dev, env["device_name"], cfg.cpu_threads or default_cpu_threads()))
    row = portable(result.to_dict())
    try:
        return db.insert_result(conn, row)
    except ValueError as e:  # db.UnusableDatabase: the runs are still in the study's user attributes
        warn(f"trial {number}'s runs were not stored in the results database ({e})")
        return None


def _report(optuna, study, rec, family, base, dev, dataset, runs, objective, epochs, seed, overrides, params,
            shown, sampler, prune, mine, finished_runs, warmup_seconds, interrupt) -> dict:
    """The study as the results database keeps it: every trial of every process so far, the best, importances."""
    everything = study.get_trials(deepcopy=False)
    completed = [t for t in everything if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if completed:
        best = _trial_row(study.best_trial)
    importances, why_not = _importances(optuna, study, len(completed))
    stop = None if interrupt is None or isinstance(interrupt, KeyboardInterrupt) else \
        f"{type(interrupt).__name__}: {' '.join(str(interrupt).split())[:500]}"
    env = environment(dev)
    report = {"benchmark": "sweep", "recipe": rec.name, "dataset": str(dataset), "device": dev.type,
              "study": study.study_name, "storage": shown, "objective": objective,
              "direction": OBJECTIVES[objective], "target": base.target_accuracy, "runs": runs, "epochs": epochs,
              "seed": seed, "set": {k: set_text(v) for k, v in overrides.items()},
              "space": [dataclasses.asdict(p) for p in params], "sampler": sampler, "prune": prune,
              "penalty_seconds": PENALTY_S if objective == "time" else None,
              "complete": interrupt is None, "interrupted": isinstance(interrupt, KeyboardInterrupt), "failed": stop,
              "trials_total": len(everything), "trials_this_process": mine, "runs_finished": finished_runs,
              "warmup_seconds": warmup_seconds,
              "trials": [_trial_row(t) for t in everything[-MAX_REPORT_TRIALS:]],
              "best": best, "importances": importances, "importances_note": why_not,
              "timed_region": family.timed_region(base), "environment": env,
              "_interrupt": interrupt}
    return report


def best_settings(report: dict) -> dict[str, str]:
    """The best trial's configuration as --set takes it: the sweep's --set values, then the trial's parameters."""
    if report.get("best") is None:
        raise ValueError(f"study {report['study']!r} has no completed trial yet: no best settings to write")
    return {**report["set"], **{k: set_text(v) for k, v in report["best"]["params"].items()}}
