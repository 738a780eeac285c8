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
must not propose the same points. The storage must outlive the process (an in-memory SQLite URL is refused). An
SQLite storage is a file that is absent, empty or already an Optuna study storage: another program's database (the
results database among them) is refused and left byte for byte as it was, since Optuna would write its tables into
it; an SQLite URL takes no arguments (?mode=ro: SQLAlchemy would ignore it with a warning and the study be written
anyway). Another process's lock on the file (a second sweep, a backup tool) is waited for, said at once, up to
SQLITE_TIMEOUT_S, and then named in the sweep's last line with what to do.

Every trial's finished runs are stored in the results database as a training result of their own (its command line
ends `# setting trial N of STUDY: k=v ...`), and at the end the whole study (every trial of every process so far,
the best with its interval, Optuna's parameter importances where it gives them) as a "sweep" report, which the
report's study section (report/study.py) draws; the report carries this process's trials' training results too
("results", as bench's does its settings'), which `speedrun results import` stores as rows. A sweep that stops part
way (Ctrl-C, an error after some runs, a study storage that fails or stays locked) keeps the interrupted trial's
finished runs and statistics the same way as a finished trial's, and still writes and hands on its report
(on_report); the runs go into the results database and the report before the study hears of them, so that a failing
storage costs none.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import shlex
import sqlite3
import stat
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from speedrun.config import RUN_OPTIONS, check_int, field_types, parse_value
from speedrun.engine.loop import Diverged, RunResult, signals_held
from speedrun.errors import counted, note_kept, print_line, printable, warn
from speedrun.instruments.bench import PartialReport, warm_up
from speedrun.instruments.study_url import check_storage_url, default_storage, results_path, shown_url, storage_file
from speedrun.instruments.variants import set_text
from speedrun.paths import check_writable, make_folder
from speedrun.recipes import get_recipe
from speedrun.records import db, stats
from speedrun.records.environment import environment
from speedrun.records.result_file import (check_result_path, claim_result_path, default_result_path, portable,
                                          release_result_path, write_json)
from speedrun.run import tensorboard as boards
from speedrun.run.prepared import MAX_RUNS, PreparedRun, RunRequest, make_config, prepare

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
# The last seed a sweep takes: Optuna's samplers seed NumPy's RandomState, which takes [0, 2**32 - 1]; a trial's runs
# take --seed .. --seed + --runs - 1 and are held to the same range, so that every seed a sweep states is one a
# library takes as it is.
MAX_SEED = 2**32 - 1
# Config keys that define what a trial is judged by, not what it trains: searching them lets the sweep win by
# moving the yardstick. objective -> key -> why (None: every objective).
MEASURE_KEYS = {
    None: {"target_accuracy": "it is the target the trials are judged against; set it with --set target_accuracy=",
           "eval_each_epoch": "it changes no training, only whether the pruner sees a trial's epochs; set it with "
                              "--set eval_each_epoch="},
    "accuracy": {"epochs": "the accuracy objective is measured at a fixed budget, and a search of the budget finds "
                           "the longest run; give --epochs, or search it with --objective time"},
}


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What `speedrun sweep` is asked to do: its options, built once by the caller (the CLI from its flags) and
    checked by sweep() (check()) before anything is opened; the options that need the recipe (the space, --prune's
    default, the grid) are checked there against its config. None where a field has a default decided later."""

    recipe: str
    space: tuple[str, ...]  # --space entries, as given: KEY=LOW:HIGH[:log] or KEY=A,B,C (parse_space)
    trials: int = 10  # trials this process adds to the study
    runs: int = 3  # seeds per trial, the same in every trial
    objective: str = "accuracy"  # a key of OBJECTIVES
    sampler: str = "tpe"  # one of SAMPLERS
    prune: bool | None = None  # None: on when the recipe evaluates every epoch (eval_each_epoch)
    seed: int = 0  # the first run's seed in every trial, and a new study's sampler's
    epochs: float | None = None  # --epochs, the whole schedule compressed to it; None: the recipe's budget
    dataset: str | None = None  # None: the recipe's default dataset
    data_dir: str | os.PathLike | None = None  # where a named dataset's files are; None: $SPEEDRUN_DATA's
    device: str = "auto"  # auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N, mps
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # --set, under every trial
    storage_url: str | None = None  # an Optuna RDB storage URL; None: an SQLite file beside the results database
    study_name: str | None = None  # None: derived from what the study asks (default_study_name)
    resume: bool = False  # add trials to an existing study instead of starting one
    db_path: str | Path | None = None  # the results database; None: the default one, as train's
    json_path: str | Path | None = None  # the report file; None: a new one under results/
    tensorboard_dir: str | Path | None = None  # a folder for TensorBoard event files; None: none
    command: str | None = None  # the command line, as the results record it

    def __post_init__(self) -> None:
        # copies, so that a caller's list or dict changed later leaves the spec as it was built
        object.__setattr__(self, "space", tuple(self.space or ()))
        object.__setattr__(self, "overrides", dict(self.overrides or {}))

    def check(self) -> None:
        """The options that need no recipe, each refusal one line naming the flag and the fix (a ValueError)."""
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective {self.objective!r:.40}: choose accuracy or time")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler {self.sampler!r:.40}: choose {', '.join(SAMPLERS)}")
        check_int("trials", "--trials", self.trials, 1, MAX_TRIALS)
        runs = check_int("runs", "--runs", self.runs, 1, MAX_RUNS)
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED - (runs - 1):
            raise ValueError(f"--seed {seed!r:.40}: a sweep's seeds (the sampler's, and its runs' --seed .. --seed + "
                             f"--runs - 1) lie in [0, 2**32 - 1], as Optuna's samplers take them; give --seed from 0 "
                             f"to {MAX_SEED - (runs - 1)}" + (f" with --runs {runs}" if runs > 1 else ""))
        if self.objective == "time" and runs < 2:
            raise ValueError("--objective time judges each trial by the records rule, a t-test that needs n >= 2: "
                             "give --runs 2 or more")
        study = self.study_name
        if study is not None and (not isinstance(study, str) or not study.strip() or len(study) > 200):
            raise ValueError("--study: give a name of 1 to 200 characters, not blank (or leave out --study for the "
                             "default name)")
        if study is not None and not study.isprintable():
            # every line that names the study escapes such a character (errors.printable): the --resume hint
            # pasted back would name another study
            raise ValueError(f"--study {printable(study)}: the name holds a control or other unprintable character "
                             "(a newline, ESC ...), which no message can show as it is; give a name of printable "
                             "characters")


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
    line naming the entry and the fix; an example it gives is one this function accepts (_Hints)."""
    return _parse_space(items, rec, epochs, overrides, objective, suggest=True)


def _parse_space(items: list[str], rec, epochs: float | None, overrides: dict[str, Any], objective: str, *,
                 suggest: bool) -> list[Param]:
    """parse_space; suggest=False: refusals without examples (how an example is itself tried, _Hints)."""
    if not items:
        raise ValueError("give the space to search: --space KEY=LOW:HIGH[:log] or --space KEY=A,B,C (repeatable)")
    cfg = make_config(rec, epochs, overrides)
    types = field_types(type(cfg))
    params: list[Param] = []
    for item in items:
        key, sep, spec = (part.strip() for part in item.partition("="))
        shown = item.strip()[:200]
        hints = _Hints(rec, epochs, overrides, objective, key, types.get(key), getattr(cfg, key, None)) \
            if suggest else None
        if not sep or not key or not spec:
            example = _any_example(rec, epochs, overrides, objective, types, key) if suggest else ""
            raise ValueError(f"--space {shown!r}: expected KEY=LOW:HIGH[:log] or KEY=A,B,C"
                             + (f", e.g. --space {example}" if example else ""))
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
        if key == "epochs" and epochs is not None:  # runner.make_config would name a --set never given
            raise ValueError("--space epochs and --epochs both set the budget; keep one (leave out --epochs to search "
                             "it)")
        tp = types[key]
        if tp in (int, float) and ":" in spec:
            param = _range(shown, key, spec, tp, hints)
            values = [param.low, param.high]
        else:
            param = _choices(shown, key, spec, tp, hints)
            values = list(param.choices)
        for value in values:  # the config takes each bound and value: a range's inner values lie between
            try:
                make_config(rec, epochs, {**overrides, key: value})
            except ValueError as e:
                raise ValueError(f"--space {shown}: {e}") from None
        params.append(param)
    return params


def _number_text(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclasses.dataclass(frozen=True)
class _Hints:
    """The examples one key's refusals give, each tried first: an example is shown only when _parse_space (for this
    recipe, --set and --epochs) or the config (a --set) accepts it, so that no refusal suggests what is refused
    next (a fixed 8:14 suits lr_per_1024 and not label_smoothing, in [0, 1))."""

    rec: Any
    epochs: float | None
    overrides: dict[str, Any]
    objective: str
    key: str
    tp: Any
    current: Any  # the key's value in the config the space is drawn over

    def _candidates(self, given: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """(ranges, lists) worth trying, from the user's values and the config's own."""
        tp, current = self.tp, self.current
        if tp is bool:
            return [], ["true,false"]
        if get_origin(tp) is Literal:
            choices = [c for c in get_args(tp) if isinstance(c, str)]
            first = [current] if current in choices else []
            return [], [",".join(dict.fromkeys(first + choices))[:200]] if len(choices) > 1 else []
        if tp not in (int, float) or isinstance(current, bool) or not isinstance(current, (int, float)):
            return [], []
        points: list[float | int] = []
        for text in given:
            with contextlib.suppress(ValueError):
                points.append(parse_value(self.key, text, tp))
        if tp is int:
            points += [current, current * 2, current // 2, current + 1, current - 1, 0, 1]
        else:
            points += [current, current * 2, current / 2, current + 0.1, current - 0.1, 0.0, 0.1, 1.0]
        points = list(dict.fromkeys(points))
        pairs = [(a, b) for i, a in enumerate(points) for b in points[i + 1:] if a != b]
        pairs = [(min(a, b), max(a, b)) for a, b in pairs]
        return ([f"{_number_text(a)}:{_number_text(b)}" for a, b in pairs],
                [f"{_number_text(a)},{_number_text(b)}" for a, b in pairs])

    def _accepted(self, spec: str) -> bool:
        try:
            _parse_space([f"{self.key}={spec}"], self.rec, self.epochs, self.overrides, self.objective, suggest=False)
        except ValueError:
            return False
        return True

    def space(self, kind: str, *given: str) -> str:
        """KEY=SPEC of `kind` ("range" or "list") that --space takes, else ""."""
        ranges, lists = self._candidates(given)
        return next((f"{self.key}={spec}" for spec in (ranges if kind == "range" else lists)
                     if self._accepted(spec)), "")

    def set(self, text: str) -> str:
        """`--set KEY=TEXT` when the config takes it, else ""."""
        try:
            make_config(self.rec, self.epochs, {**self.overrides, self.key: parse_value(self.key, text,
                                                                                                 self.tp)})
        except ValueError:
            return ""
        return f"--set {self.key}={text}"


def _any_example(rec, epochs, overrides, objective: str, types: dict, key: str) -> str:
    """An example --space entry for this recipe: for `key` when it is a config key, else for a key most sweeps
    search (a learning rate, label smoothing); "" when none is accepted."""
    cfg = make_config(rec, epochs, overrides)
    keys = [key] if key in types else [k for k in ("lr_per_1024", "lr_per_256", "lr", "label_smoothing")
                                       if k in types]
    for k in keys:
        hints = _Hints(rec, epochs, overrides, objective, k, types[k], getattr(cfg, k))
        example = hints.space("range") or hints.space("list")
        if example:
            return example
    return ""


def _range(shown: str, key: str, spec: str, tp: type, hints: _Hints | None) -> Param:
    parts = [p.strip() for p in spec.split(":")]
    if len(parts) not in (2, 3) or len(parts) == 3 and parts[2] != "log":
        example = hints.space("range", *parts[:2]) if hints else ""
        raise ValueError(f"--space {shown}: a range is LOW:HIGH or LOW:HIGH:log"
                         + (f", e.g. {example}" if example else ""))
    kind = "int" if tp is int else "float"
    try:
        low, high = (parse_value(key, p, tp) for p in parts[:2])
    except ValueError:
        raise ValueError(f"--space {shown}: {key} is {'an int' if tp is int else 'a number'} field, so LOW and "
                         f"HIGH must be {'integers' if tp is int else 'finite numbers'}") from None
    log = len(parts) == 3
    if not low < high:
        one = hints.set(parts[0]) if hints else ""
        example = hints.space("range", *parts[:2]) if hints else ""
        fixes = [f"to try one value, {one}" if one else "", f"e.g. {example}" if example else ""]
        raise ValueError(f"--space {shown}: LOW must be below HIGH"
                         + (f" ({'; '.join(f for f in fixes if f)})" if any(fixes) else ""))
    if log and low <= 0:
        raise ValueError(f"--space {shown}: a log range needs LOW > 0; give a positive LOW, or leave out :log")
    return Param(key, kind, shown, low=low, high=high, log=log)


def _choices(shown: str, key: str, spec: str, tp: Any, hints: _Hints | None) -> Param:
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
        fixes = []
        if hints is not None:
            listed, ranged = hints.space("list", *texts), hints.space("range", *texts) if tp in (int, float) else ""
            one = hints.set(texts[0])
            fixes = [f"e.g. {listed}" if listed else "", f"a range is LOW:HIGH, e.g. {ranged}" if ranged else "",
                     f"to use one, {one}" if one else ""]
        raise ValueError(f"--space {shown}: give two or more values to choose from"
                         + (f" ({'; '.join(f for f in fixes if f)})" if any(fixes) else ""))
    return Param(key, "categorical", shown, choices=tuple(choices))


def default_study_name(recipe: str, dataset: str, objective: str, question: dict) -> str:
    """recipe-dataset-objective-HASH, the hash of what the study asks (space, budget, --set), so that another
    question gets another study and the same one, the same study (--resume)."""
    digest = hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()[:10]
    name = Path(str(dataset).rstrip("/\\")).name or str(dataset)
    return f"{recipe}-{name[:60]}-{objective}-{digest}"


# The tables of an Optuna RDB storage (optuna/storages/_rdb/models.py, and Alembic's version table that its
# migrations add). A file is taken as a study storage only when every table it holds is one of these.
OPTUNA_TABLES = frozenset({"studies", "version_info", "study_directions", "study_user_attributes",
                           "study_system_attributes", "trials", "trial_user_attributes", "trial_system_attributes",
                           "trial_params", "trial_values", "trial_intermediate_values", "trial_heartbeats",
                           "alembic_version"})
# What every Optuna storage holds since its schema took Alembic's migrations (Optuna 1.0): a file that has them is
# one Optuna made, not another program's that happens to use one of its table names.
OPTUNA_MARKS = {"studies": {"study_id", "study_name"}, "version_info": {"schema_version", "library_version"},
                "alembic_version": {"version_num"}}
RESULTS_TABLES = frozenset({"results", "runs", "reports"})  # records/db.py's
LOCK_POLL_S = 2.0  # SQLite's own wait for a lock, after which the wait is said (_patiently) and goes on
_STORAGE_FIX = "give a new file, or one that holds Optuna studies, with --storage sqlite:///FILE"


class StorageFailed(ValueError):
    """The study storage cannot be used (locked past SQLITE_TIMEOUT_S, damaged, gone, not a study storage): one line
    naming it and the fix. A ValueError, as every refusal is: the CLI prints it and exits 2. A sweep that meets it
    part way keeps its finished runs (the report file, the results database) before raising it."""


def _locked(e: BaseException | None) -> bool:
    """SQLite's "database is locked" (SQLITE_BUSY, SQLITE_LOCKED) in `e` or what it wraps (SQLAlchemy's .orig,
    the cause of Optuna's StorageInternalError); a StorageFailed already said so, and is not waited on again."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen and not isinstance(e, StorageFailed):
        seen.add(id(e))
        if isinstance(e, sqlite3.OperationalError):
            code = getattr(e, "sqlite_errorname", None) or ""  # Python 3.11+; the message decides on 3.10
            return code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in str(e)
        e = getattr(e, "orig", None) or e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return False


@dataclasses.dataclass
class _Lock:
    """What a wait for the study storage's lock says: the file (`where`), the log, and what to do once the other
    process is done (`then`: run again, or, once the study exists, add trials to it with --resume)."""

    where: str
    log: Callable[[str], None]
    then: str = "run this again"

    def refusal(self) -> StorageFailed:
        return StorageFailed(f"the study storage {self.where} stayed locked by another process for "
                             f"{SQLITE_TIMEOUT_S:.0f} s (another sweep writing it, or a program such as a backup "
                             f"holding the file); wait until that process has finished and {self.then}, or give "
                             "another --storage")


def _patiently(call: Callable[[], Any], lock: _Lock) -> Any:
    """call(), tried again while another process holds the SQLite file's lock, up to SQLITE_TIMEOUT_S in all; the
    first wait is said at once. Each try is whole or nothing: Optuna rolls back a session that failed, and SQLite
    gives up the lock it did not get, so trying again repeats nothing."""
    deadline = None
    while True:
        try:
            return call()
        except Exception as e:
            if not _locked(e):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + SQLITE_TIMEOUT_S - LOCK_POLL_S
                lock.log(f"the study storage {lock.where} is locked by another process; waiting up to "
                         f"{SQLITE_TIMEOUT_S:.0f} s for it")
            if now >= deadline:
                raise lock.refusal() from None
            time.sleep(0.05)  # a lock refused at once (two readers turning writers) is not retried in a spin


def _sqlite_tables(path: Path, lock: _Lock) -> tuple[int, dict[str, set[str]]]:
    """(the number of objects, {table: its columns}) of the SQLite file `path`, read without changing it or
    creating a file beside it: a WAL file that no process has open (no -wal beside it) is read as immutable, since
    a read-only open of it would leave -wal and -shm files; any other is opened read-only, waiting for a writer's
    lock."""
    with open(path, "rb") as f:
        header = f.read(100)
    idle_wal = len(header) > 18 and header[18] == 2 and not os.path.lexists(f"{path}-wal")
    uri = f"{path.absolute().as_uri()}?mode=ro" + ("&immutable=1" if idle_wal else "")

    def read() -> tuple[int, dict[str, set[str]]]:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=LOCK_POLL_S)) as conn:
            conn.execute("BEGIN")  # one snapshot for both reads
            objects = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            tables: dict[str, set[str]] = {}
            for table, column in conn.execute("SELECT m.name, p.name FROM sqlite_master AS m, pragma_table_info("
                                              "m.name) AS p WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite!_%' "
                                              "ESCAPE '!'"):
                tables.setdefault(table, set()).add(column)
            return objects, tables

    return _patiently(read, lock)


def _storage_state(path: Path, what: str, lock: _Lock, *, own_folder: bool = False) -> str:
    """"new" for an SQLite storage file that is absent, empty or holds nothing, "optuna" for an Optuna study storage;
    anything else is refused in one line and left as it is, byte for byte: Optuna would write its tables into
    another program's database, speedrun's results among them, or fail on a table of its name. `what`: the
    storage as the refusal names it (--storage URL, or the default one). own_folder: the storage's folder is
    speedrun's own (the default storage's, the results database's), made when missing, as the database's is."""
    where = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if not own_folder and not path.absolute().parent.is_dir():
            raise StorageFailed(f"{what}: the folder {path.parent} does not exist; create it, or "
                                f"{_STORAGE_FIX}") from None
        return "new"
    except (OSError, ValueError) as e:  # a symlink loop, a name too long, a folder we may not search
        raise StorageFailed(f"{what}: cannot use {where} ({getattr(e, 'strerror', None) or e}); "
                            f"{_STORAGE_FIX}") from None
    if not stat.S_ISREG(info.st_mode):
        raise StorageFailed(f"{what}: {where} is not a file (a folder, device or pipe); {_STORAGE_FIX}")
    if info.st_size == 0:
        return "new"
    try:
        with open(path, "rb") as f:
            magic = f.read(16)
        if magic != b"SQLite format 3\0":
            raise StorageFailed(f"{what}: {where} is not an SQLite database (another program's file); it "
                                f"is left as it is; {_STORAGE_FIX}")
        objects, tables = _sqlite_tables(path, lock)
    except OSError as e:
        raise StorageFailed(f"{what}: cannot read {where} ({e.strerror or e}); {_STORAGE_FIX}") from None
    except sqlite3.Error as e:
        raise StorageFailed(f"{what}: cannot read {where} as an SQLite database ({' '.join(str(e).split())}"
                            f"); it is left as it is; {_STORAGE_FIX}") from None
    if not objects:
        return "new"
    if RESULTS_TABLES <= set(tables):
        raise StorageFailed(f"{what}: {where} is speedrun's results database, and a study needs a file of "
                            "its own; it is left as it is; leave out --storage (the study goes beside it, as "
                            "NAME.sweeps.db) or give another file")
    if set(OPTUNA_MARKS) <= set(tables) <= OPTUNA_TABLES and all(
            columns <= tables[table] for table, columns in OPTUNA_MARKS.items()):
        return "optuna"
    listed = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
    raise StorageFailed(f"{what}: {where} is another program's SQLite database, not an Optuna study "
                        f"storage (its tables: {listed or 'none, but other objects'}); it is left as it is; "
                        f"{_STORAGE_FIX}")


def _open_storage(optuna, url: str, lock: _Lock):
    """Optuna's RDB storage at `url`; on an SQLite file every call waits out another process's lock (_patiently)."""
    shown = shown_url(url)
    check_storage_url(url)
    sqlite = storage_file(url) is not None

    class PatientStorage(optuna.storages.RDBStorage):
        """Each of Optuna's calls on the storage tried again while the SQLite file is locked (_patiently)."""

    if sqlite:
        for name in dir(optuna.storages.BaseStorage):
            method = getattr(optuna.storages.RDBStorage, name, None)
            if not name.startswith("_") and callable(method):
                setattr(PatientStorage, name, _patient_method(method, lock))
    engine = {"connect_args": {"timeout": LOCK_POLL_S}} if sqlite else None
    try:
        with warnings.catch_warnings():  # the library's notes on a URL: the one-line refusal below says it
            warnings.simplefilter("ignore")
            return _patiently(lambda: PatientStorage(url, engine_kwargs=engine), lock)
    except StorageFailed:
        raise
    except Exception as e:  # noqa: BLE001 -- SQLAlchemy's and the driver's errors: one line naming the storage
        cause = _cause_text(e)
        fix = ("install the database driver it names, or give an SQLite file with --storage sqlite:///FILE"
               if cause.startswith(("ModuleNotFoundError", "ImportError")) else
               f"check that the database is reachable and the URL right, or {_STORAGE_FIX}" if not sqlite else
               _STORAGE_FIX)
        raise StorageFailed(f"cannot open the study storage {shown} ({cause}); {fix}") from None


def _patient_method(method: Callable, lock: _Lock) -> Callable:
    def patient(self, *args, **kwargs):
        return _patiently(lambda: method(self, *args, **kwargs), lock)

    patient.__name__ = method.__name__
    return patient


def _cause_text(e: BaseException) -> str:
    """The innermost error `e` wraps, as "Type: text" (Optuna's StorageInternalError says only that a commit
    failed; SQLAlchemy's own text carries the statement)."""
    inner = e
    for _ in range(10):
        nxt = getattr(inner, "orig", None) or inner.__cause__
        if nxt is None:
            break
        inner = nxt
    return f"{type(inner).__name__}: {' '.join(str(inner).split())[:200]}"


def _storage_errors(optuna) -> tuple[type[BaseException], ...]:
    """What a failing study storage raises: ours (StorageFailed), Optuna's wrapper of a failed session, and
    SQLAlchemy's own errors where Optuna lets them through."""
    from sqlalchemy.exc import SQLAlchemyError

    return StorageFailed, optuna.exceptions.StorageInternalError, SQLAlchemyError


def _storage_failure(optuna, e: BaseException, lock: _Lock) -> StorageFailed | None:
    """`e` as the one line a failing study storage gives (None: `e` is not the storage's)."""
    if isinstance(e, StorageFailed):
        return e
    if not isinstance(e, _storage_errors(optuna)):
        return None
    return StorageFailed(f"the study storage {lock.where} failed ({_cause_text(e)}); check it (a full disk, a damaged "
                         f"or removed file, a database server that is down), then {lock.then}, or give another "
                         "--storage")


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


def check_grid(params: list[Param]) -> dict[str, list]:
    """The grid a grid sampler walks, refused (one line) when a range is a float's or it holds more than MAX_GRID
    points."""
    grid = {p.key: p.grid() for p in params}
    if math.prod(len(v) for v in grid.values()) > MAX_GRID:
        raise ValueError(f"--sampler grid: the grid holds more than {MAX_GRID:,} points; give fewer values, or use "
                         "--sampler tpe")
    return grid


def _sampler(optuna, name: str, params: list[Param], seed: int | None):
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)

    class Grid(optuna.samplers.GridSampler):
        # GridSampler ends study.optimize's loop (study.stop) after the grid's last point; this loop asks and tells
        # itself, where stop() is an error, and ends on is_exhausted before it asks.
        def after_trial(self, study, trial, state, values) -> None:
            pass

    return Grid(check_grid(params), seed=seed)


def _check_study(optuna, storage, name: str, *, shown: str, resume: bool, direction: str, question: dict, sampler,
                 pruner):
    """Before anything is created: with `resume`, the study `name` loaded (refused when it is not there, or asks
    another question); without, None (refused when it exists). Reads only."""
    exists = name in optuna.study.get_all_study_names(storage)
    if exists and not resume:
        raise ValueError(f"study {name!r} already exists in {shown}: add --resume to add trials to it, or give "
                         "another --study NAME")
    if resume and not exists:
        raise ValueError(f"--resume: there is no study {name!r} in {shown}; leave out --resume to start it")
    if not resume:
        return None
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
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


def _create_study(optuna, storage, name: str, *, shown: str, direction: str, question: dict, sampler, pruner):
    try:
        study = optuna.create_study(storage=storage, sampler=sampler, pruner=pruner, study_name=name,
                                    direction=direction)
    except optuna.exceptions.DuplicatedStudyError:  # another process created it since _check_study
        raise ValueError(f"study {name!r} was created meanwhile in {shown} (by another process): add --resume to "
                         "add trials to it") from None
    study.set_user_attr("question", question)
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


# The attributes a trial carries in the study (and a report's row of it)
TRIAL_KEYS = ("mean", "ci95", "n", "p", "reached", "penalized", "diverged", "accuracy", "seconds", "result_id",
              "error", "pruned_at_epoch", "run_seeds", "warmup_seconds")
SCORE_KEYS = ("mean", "ci95", "n", "p", "reached", "penalized", "diverged", "accuracy", "seconds")
MAX_REPORT_RESULT_BYTES = 16 * 2**20  # the trials' training results a report carries, newest first


def _utc(moment) -> str | None:
    return moment.astimezone(timezone.utc).isoformat(timespec="seconds") if moment else None


def _trial_row(t) -> dict:
    """A FrozenTrial as the report keeps it."""
    attrs = t.user_attrs
    return {"number": t.number, "state": t.state.name.lower(), "value": t.value,
            "params": {k: v for k, v in t.params.items()}, **{k: attrs.get(k) for k in TRIAL_KEYS},
            "started_utc": _utc(t.datetime_start), "finished_utc": _utc(t.datetime_complete)}


def _local_row(number: int) -> dict:
    """A trial of this process as _trial_row has it, kept here as well as in the study: the report's account of
    its trials when the storage cannot be read."""
    return {"number": number, "state": "running", "value": None, "params": {}, **dict.fromkeys(TRIAL_KEYS),
            "started_utc": _utc(datetime.now(timezone.utc)), "finished_utc": None}


# fANOVA fits a random forest to the completed trials: on a handful it returns confident-looking shares of noise
# (2 and 4 trials of chance-level runs both gave one parameter 0.98), so none are shown below this many.
MIN_IMPORTANCE_TRIALS = 8


def _importances(optuna, study, completed: int) -> tuple[dict | None, str | None]:
    """Optuna's parameter importances (fANOVA) of the study, or None and why not."""
    if completed < MIN_IMPORTANCE_TRIALS:
        return None, f"{counted(completed, 'completed trial')}: importances need {MIN_IMPORTANCE_TRIALS} or more"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study)
    except Exception as e:  # noqa: BLE001 -- a library's estimate, never a reason to lose the sweep's report
        return None, f"Optuna could not estimate them ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return {k: float(v) for k, v in found.items()}, None


def sweep(spec: SweepSpec, *, on_report: Callable[[dict, Path, int | None], None] | None = None,
          on_checked: Callable[[], None] | None = None,
          log: Callable[[str], None] = print_line) -> tuple[dict, Path | None, int | None]:
    """Run spec.trials trials of the study (see the module); (the report, its file, its id in the results
    database).

    Nothing is created before everything is checked: the options (spec.check()) and the space; the grid's size; the
    storage's URL; the data and the recipe's check of it (the data's identity is part of the study's question);
    the storage (an SQLite file must be absent, empty or an Optuna study storage, and an existing storage is read
    for the study and its question); the TensorBoard folder; that every file and folder the sweep makes can be made
    there (a folder this process may write); an existing results database.
    (That no two of its outputs are one file, the study storage and the results database among them, the CLI checks
    first: storage_output.) Then a new storage is opened, made (with the default storage's folder, the results
    database's), the report file claimed (spec.json_path; None: a new results/<time>-sweep-<recipe>-<dataset>.json),
    the TensorBoard folder made, the results database and the study created.
    spec.tensorboard_dir: a folder for TensorBoard event files (run/tensorboard.py): a new <time>-<recipe> folder in
    it, each run as trial-<n>/seed-<s>. on_report(report, its file, its id): called once the report is written and
    stored, whether the sweep finished or stopped part way (before that stop is raised again), so that what a
    caller does with the report (a settings file) happens on both paths. on_checked(): called once everything is
    checked and the storage opened, before the report file is claimed, for a caller to claim a file of its own (the
    settings file) only where the sweep goes on."""
    optuna = optuna_module()
    rec = get_recipe(spec.recipe)
    overrides = dict(spec.overrides)
    spec.check()
    alpha = stats.record_alpha()  # a bad $SPEEDRUN_RECORD_P: refused before any storage or data is touched
    params = parse_space(list(spec.space), rec, spec.epochs, overrides, spec.objective)
    base = make_config(rec, spec.epochs, overrides)
    prune = spec.prune
    if prune is None:
        prune = bool(getattr(base, "eval_each_epoch", False))
    elif prune and not getattr(base, "eval_each_epoch", False):
        raise ValueError("--prune needs each epoch's test accuracy: add --set eval_each_epoch=true (untimed), or "
                         "leave out --prune")
    if spec.sampler == "grid":
        check_grid(params)
    url = spec.storage_url if spec.storage_url is not None else default_storage(spec.db_path)
    check_storage_url(url)
    shown = shown_url(url)
    file = storage_file(url)
    lock = _Lock(shown if file is None else str(file), log)
    run = prepare(RunRequest(rec.name, spec.dataset, spec.device, spec.epochs, overrides, spec.data_dir), cfg=base,
                  join=False)  # one process: the CLI refuses sweep under torchrun
    # The data and the recipe's check of it, before the study is named: a copy of a named dataset that is not its
    # published files is another data set (recorded under its path), and so another question and study.
    run.load(log)
    run.checked()  # the base config's notes, as train shows them
    dataset = run.dataset
    question = {"recipe": rec.name, "dataset": str(dataset), "objective": spec.objective, "epochs": spec.epochs,
                "set": {k: str(v) for k, v in sorted(overrides.items())}, "space": sorted(p.text for p in params)}
    # the name follows what is searched; runs, seeds and the threshold judge every trial alike, so a resume
    # that changes them finds the study and is refused naming its values (_check_study)
    name = spec.study_name if spec.study_name is not None else \
        default_study_name(rec.name, dataset, spec.objective, question)
    question.update(runs=spec.runs, seed=spec.seed, **({"record_p": alpha} if spec.objective == "time" else {}))
    if spec.tensorboard_dir is not None:
        boards.check_board(spec.tensorboard_dir)
    what = f"--storage {shown}" if spec.storage_url is not None else \
        f"the study storage {shown} (beside {'--db' if spec.db_path is not None else 'the results database'})"
    state = "server" if file is None else _storage_state(file, what, lock, own_folder=spec.storage_url is None)
    if state == "new" and spec.resume:
        raise ValueError(f"--resume: there is no study {name!r} in {shown}; leave out --resume to start it")
    # every file the sweep makes, checked to be makeable before it makes any (a folder it may not write would
    # refuse the last one after the others were made)
    if file is not None:
        check_writable(file, f"{what}, the file", _STORAGE_FIX)
    check_result_path(spec.json_path, "--json")
    db.check_writable(spec.db_path)
    direction = OBJECTIVES[spec.objective]
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our lines say what each trial did
    # an existing results database is checked now (a file of another program's is refused); a new one is made last
    conn = db.connect(spec.db_path) if os.path.lexists(results_path(spec.db_path)) else None
    path, written, board = None, False, None
    try:
        pruner = _pruner(optuna) if prune else optuna.pruners.NopPruner()
        the_sampler = _sampler(optuna, spec.sampler, params, None if spec.resume else spec.seed)
        store = the_study = None
        if state != "new":  # the study in an existing storage: refused (exists, absent, asks another question) now
            with _storage_refusals(optuna, lock):
                store = _open_storage(optuna, url, lock)
                the_study = _check_study(optuna, store, name, shown=shown, resume=spec.resume, direction=direction,
                                         question=question, sampler=the_sampler, pruner=pruner)
        if store is None:  # a new storage, opened (and so made) first of the sweep's files: the likeliest to fail
            if spec.storage_url is None:  # speedrun's own folder, the results database's, made as connect makes it
                make_folder(file.parent, "the folder of the results database and the study storage",
                            "give another --db, or a --storage URL")
            with _storage_refusals(optuna, lock):
                store = _open_storage(optuna, url, lock)
        if on_checked is not None:
            on_checked()
        path = (claim_result_path(spec.json_path, "--json") if spec.json_path is not None
                else default_result_path(f"sweep-{rec.name}", dataset))
        if spec.tensorboard_dir is not None:
            board = boards.open_board(spec.tensorboard_dir, rec.name)
        if conn is None:
            conn = db.connect(spec.db_path)
        with _storage_refusals(optuna, lock):
            if the_study is None:
                the_study = _create_study(optuna, store, name, shown=shown, direction=direction, question=question,
                                          sampler=the_sampler, pruner=pruner)
            lock.then = f"add trials with --resume --study {shlex.quote(name)}"
            log(f"study {name} in {shown}: {counted(len(the_study.trials), 'trial')} so far; {spec.trials} more, "
                f"{counted(spec.runs, 'run')} each, {spec.objective} ({direction}), sampler {spec.sampler}, "
                f"pruning {'on' if prune else 'off'}")
        prepared = _Prepared(run=run, params=params, overrides=overrides, prune=prune, alpha=alpha, dataset=dataset,
                             shown=shown, lock=lock, conn=conn, board=board, log=log)
        interrupt: BaseException | None = None  # what stopped the trials: raised once what finished is kept
        try:
            report = _trials(optuna, the_study, spec, prepared)
        except PartialReport as stopped:  # the finished trials' report, written and stored as a whole one is
            report, interrupt = stopped.report, stopped.interrupt
        report["command"] = spec.command
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
        optuna.logging.set_verbosity(level)
        if conn is not None:
            conn.close()
        if board is not None:
            board.close()
        if path is not None and not written:
            release_result_path(Path(path))


@contextlib.contextmanager
def _storage_refusals(optuna, lock: _Lock):
    """A failing study storage's errors (Optuna's, SQLAlchemy's) as one line (_storage_failure)."""
    try:
        yield
    except _storage_errors(optuna) as e:
        raise _storage_failure(optuna, e, lock) from None


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What sweep() resolved from its spec and opened before the first trial, as the trials, their stored runs
    and the report read it."""

    run: PreparedRun  # recipe, family, base config (--set and --epochs: every trial's parameters go over it),
    # device, the data and the dataset as results record it (its path for an unofficial copy)
    params: list[Param]  # the space, parsed and checked against the config
    overrides: dict[str, Any]  # --set
    prune: bool  # spec.prune, or where it is None whether the recipe evaluates every epoch
    alpha: float  # the records rule's p threshold (stats.record_alpha)
    dataset: str  # spec.dataset, or the recipe's default
    shown: str  # the storage's URL as messages show it (a password masked)
    lock: _Lock
    conn: db.Connection  # the results database
    board: boards.Board | None  # the TensorBoard folder, where one is written
    log: Callable[[str], None]


@dataclasses.dataclass
class _Tally:
    """What this process's trials came to so far, as the trials add to it and the report states it."""

    mine: list[int] = dataclasses.field(default_factory=list)  # the numbers of the trials this process asked for
    local: list[dict] = dataclasses.field(default_factory=list)  # those trials as the report's rows (_local_row)
    results: list[dict] = dataclasses.field(default_factory=list)  # each trial's training result, as stored
    finished_runs: int = 0
    warmup_seconds: float = 0.0  # every trial's untimed warm-up, together
    interrupt: BaseException | None = None  # what stopped the trials (Ctrl-C, an error), if anything
    failed: StorageFailed | None = None  # the study storage's failure: not touched again once it has failed


def _trials(optuna, study, spec: SweepSpec, prep: _Prepared) -> dict:
    """Run the trials, each after a warm-up of its own configuration; the report, or where something stopped them
    (Ctrl-C, an error, the storage failing) PartialReport with the report of what finished.

    What a trial finished is kept whatever stops it: its runs go into the results database (and the report) first,
    into the study's attributes after, so that a storage that fails (locked past SQLITE_TIMEOUT_S, damaged) costs
    no run. Once it has failed it is not touched again (each touch would wait out the lock anew), and the report
    is made from this process's own account of its trials."""
    tally = _Tally()
    storage_errors = _storage_errors(optuna)
    log = prep.log
    for _ in range(spec.trials):
        trial, row = None, None
        done: list[RunResult] = []
        reported: list[BaseException] = []  # what the storage raised while a run reported to it (_reporter)
        cfg, shown_params, kept = None, "", False

        def keep() -> tuple[dict, dict]:
            """The trial's finished runs stored and its statistics set in this process's account, once, on the
            normal and the stopped path alike; (its score, the attributes for the study)."""
            nonlocal kept
            score = _score(spec.objective, done, cfg.target_accuracy, prep.alpha)
            attrs = {}
            if not kept:
                kept = True
                tally.finished_runs += len(done)
                result_id = None
                if done:
                    result_id, result = _store_runs(spec, prep, cfg, done, study.study_name, trial.number,
                                                    shown_params)
                    tally.results.append(result)
                attrs = {"result_id": result_id, **{key: score[key] for key in SCORE_KEYS},
                         "run_seeds": [r.seed for r in done]}
                row.update(attrs)
            return score, attrs

        def mark(attrs: dict) -> None:
            for key, value in attrs.items():
                trial.set_user_attr(key, value)

        try:
            if spec.sampler == "grid" and study.sampler.is_exhausted(study):
                log("the grid is exhausted: every point has a trial")
                break
            trial = study.ask()
            tally.mine.append(trial.number)
            row = _local_row(trial.number)
            tally.local.append(row)
            values = {p.key: p.suggest(trial) for p in prep.params}
            row["params"] = values
            shown_params = " ".join(f"{k}={set_text(v)}" for k, v in values.items())
            try:
                cfg = prep.run.config(values)
                prep.run.checked(cfg, quiet=True)
            except ValueError as e:  # a combination the recipe refuses: that trial failed, the search goes on
                row.update(state="fail", error=" ".join(str(e).split())[:300])
                trial.set_user_attr("error", row["error"])
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                row["finished_utc"] = _utc(datetime.now(timezone.utc))
                log(f"trial {trial.number}: {shown_params}: refused by the recipe ({e}); marked failed")
                continue
            log(f"trial {trial.number}: {shown_params}; warm-up (untimed)")
            # this configuration's own compile, autotune and first-run costs, outside its timed seconds
            warmed = warm_up(prep.run.family, cfg, prep.run.data, prep.run.device, None, f"trial {trial.number}", log)
            tally.warmup_seconds += warmed
            row["warmup_seconds"] = warmed
            trial.set_user_attr("warmup_seconds", warmed)
            pruned_at = None
            for r in range(spec.runs):
                seed = spec.seed + r
                hook = _reporter(trial, r, spec.objective, reported, storage_errors) if prep.prune else None
                try:
                    with boards.run_log(prep.board, cfg, seed=seed, dataset=prep.run.dataset,
                                        steps=prep.run.family.run_steps(cfg, prep.run.data.num_train),
                                        setting=f"trial-{trial.number}") as scalars:
                        run = prep.run.family.train_run(cfg, prep.run.data, prep.run.device, seed,
                                                        hooks=boards.run_hooks(scalars, on_epoch=hook))
                except Diverged as e:
                    warn(f"trial {trial.number}, seed {seed}: {e}")
                    run = e.as_run(seed, cfg.epochs)
                except _Pruned as e:
                    pruned_at = e.args[0]
                    break
                run.model = None
                done.append(run)
                if reported:  # the storage failed while this run reported to it: the run is kept, the sweep stops
                    raise reported[0]
            with signals_held():  # the runs stored and the statistics set whole
                score, attrs = keep()
                mark(attrs)
            if pruned_at is not None:
                row.update(state="pruned", pruned_at_epoch=pruned_at)
                trial.set_user_attr("pruned_at_epoch", pruned_at)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                log(f"trial {trial.number}: pruned at run {len(done) + 1}, epoch {pruned_at} "
                    f"({counted(len(done), 'run')} finished)")
            elif score["value"] is None:
                row["state"] = "fail"
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                log(f"trial {trial.number}: no run finished; marked failed")
            else:
                row.update(state="complete", value=score["value"])
                study.tell(trial, score["value"])
                log(f"trial {trial.number}: {_value_text(spec.objective, score)}")
            row["finished_utc"] = _utc(datetime.now(timezone.utc))
        except (KeyboardInterrupt, Exception) as e:  # Ctrl-C, SIGTERM, an error: the finished trials are kept
            tally.failed = _storage_failure(optuna, e, prep.lock)
            stop = e if tally.failed is None else tally.failed
            error = f"{type(stop).__name__}: {' '.join(str(stop).split())[:300]}"
            with signals_held():
                attrs = keep()[1] if cfg is not None and not kept else {}
                if row is not None and row["state"] == "running":
                    row.update(state="fail", error=error, finished_utc=_utc(datetime.now(timezone.utc)))
                for touch in (lambda: trial.set_user_attr("error", error), lambda: mark(attrs),
                              lambda: study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)):
                    if trial is None or tally.failed is not None:
                        break
                    try:
                        touch()
                    except optuna.exceptions.UpdateFinishedTrialError:
                        pass
                    except storage_errors as also:  # the storage fails too: what finished is kept all the same
                        tally.failed = _storage_failure(optuna, also, prep.lock)
            if done:
                log(f"trial {trial.number}: stopped ({type(stop).__name__}) after {len(done)} of "
                    f"{counted(spec.runs, 'run')}; those are kept, the trial marked failed")
            if not isinstance(e, KeyboardInterrupt) and not tally.finished_runs:
                if stop is not e:
                    raise stop from None
                raise
            tally.interrupt = stop
            break
    return _report(optuna, study, spec, prep, tally)


def _reporter(trial, run_index: int, objective: str, failures: list[BaseException] | None = None,
              storage_errors: tuple[type[BaseException], ...] = ()) -> Callable[[dict], None]:
    """The on_epoch callback of run `run_index`: each row with a test accuracy reported to the trial, and the run
    stopped (_Pruned) when the pruner says so. A storage error (`storage_errors`) is put in `failures` and the run
    goes on unpruned, reporting nothing more: a run the storage cannot hear of still finishes and is kept."""
    def on_epoch(row: dict) -> None:
        accuracy = row.get("val_acc")
        if accuracy is None or failures:
            return
        epoch = math.ceil(row.get("epoch") or 0)
        try:
            trial.report(accuracy if objective == "accuracy" else 1.0 - accuracy, run_index * STEP_STRIDE + epoch)
            prune = trial.should_prune()
        except storage_errors as e:
            if failures is None:
                raise
            failures.append(e)
            return
        if prune:
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


def _store_runs(spec: SweepSpec, prep: _Prepared, cfg, done: list[RunResult], study_name: str, number: int,
                shown_params: str) -> tuple[int | None, dict]:
    """Trial `number`'s finished runs (`done`, of its config `cfg`, its parameters `shown_params` as --set takes
    them) as a training result in the results database: (its id, None where it could not be stored (warned), and
    the result, which the report carries either way)."""
    result = prep.run.result(done, cfg, runs_requested=spec.runs, complete=len(done) == spec.runs, kind="sweep",
                             command=f"{spec.command or 'speedrun sweep'}  # setting trial {number} of {study_name}: "
                                     f"{shown_params}")
    row = portable(result.to_dict())
    try:
        return db.insert_result(prep.conn, row), row
    except ValueError as e:  # db.UnusableDatabase: the runs are still in the report and the study's attributes
        warn(f"trial {number}'s runs were not stored in the results database ({e}); the sweep's report holds them")
        return None, row


def _carried(results: list[dict]) -> tuple[list[dict], int]:
    """The newest training results that fit in MAX_REPORT_RESULT_BYTES, oldest first; how many were left out."""
    kept, size = [], 0
    for result in reversed(results):
        size += len(json.dumps(result, default=str))
        if size > MAX_REPORT_RESULT_BYTES:
            break
        kept.append(result)
    return kept[::-1], len(results) - len(kept)


def _report(optuna, study, spec: SweepSpec, prep: _Prepared, tally: _Tally) -> dict:
    """The study as the results database keeps it: every trial of every process so far, the best, importances,
    and this process's trials' training results ("results", which `speedrun results import` stores as rows).
    Where the storage failed (tally.failed, or now), the trials are this process's own (tally.local). Where
    something stopped the trials (tally.interrupt) or the storage fails now, raised as PartialReport."""
    direction = OBJECTIVES[spec.objective]
    failed, interrupt = tally.failed, tally.interrupt
    if failed is None:
        try:
            everything = [_trial_row(t) for t in study.get_trials(deepcopy=False)]
            completed = [t for t in everything if t["state"] == "complete"]
            best = _trial_row(study.best_trial) if completed else None
            importances, why_not = _importances(optuna, study, len(completed))
        except _storage_errors(optuna) as e:
            failed = _storage_failure(optuna, e, prep.lock)
            interrupt = interrupt or failed
    if failed is not None:
        everything = tally.local
        completed = [t for t in tally.local if t["state"] == "complete"]
        pick = max if direction == "maximize" else min
        best = pick(completed, key=lambda t: t["value"]) if completed else None
        importances, why_not = None, "the study storage failed: these are this process's trials only"
    stop = None if interrupt is None or isinstance(interrupt, KeyboardInterrupt) else \
        f"{type(interrupt).__name__}: {' '.join(str(interrupt).split())[:500]}"
    carried, left_out = _carried(tally.results)
    env = environment(prep.run.device)
    report = {"benchmark": "sweep", "recipe": prep.run.recipe.name, "dataset": str(prep.dataset),
              "device": prep.run.device.type,
              "study": study.study_name, "storage": prep.shown, "objective": spec.objective,
              "direction": direction, "target": prep.run.cfg.target_accuracy, "runs": spec.runs, "epochs": spec.epochs,
              "seed": spec.seed, "set": {k: set_text(v) for k, v in prep.overrides.items()},
              "space": [dataclasses.asdict(p) for p in prep.params], "sampler": spec.sampler, "prune": prep.prune,
              "penalty_seconds": PENALTY_S if spec.objective == "time" else None,
              "complete": interrupt is None, "interrupted": isinstance(interrupt, KeyboardInterrupt), "failed": stop,
              "storage_failed": None if failed is None else str(failed),
              "trials_total": len(everything), "trials_this_process": tally.mine,
              "runs_finished": tally.finished_runs, "warmup_seconds": tally.warmup_seconds,
              "trials": everything[-MAX_REPORT_TRIALS:],
              "best": best, "importances": importances, "importances_note": why_not,
              "timed_region": prep.run.family.timed_region(prep.run.cfg), "environment": env,
              "results": carried, "results_left_out": left_out}
    if interrupt is not None:
        raise PartialReport(report, interrupt)
    return report


def best_settings(report: dict) -> dict[str, str]:
    """The best trial's configuration as --set takes it: the sweep's --set values, then the trial's parameters."""
    if report.get("best") is None:
        raise ValueError(f"study {report['study']!r} has no completed trial yet: no best settings to write")
    return {**report["set"], **{k: set_text(v) for k, v in report["best"]["params"].items()}}
