"""What one train command keeps and shows: the Result (the JSON written by --json), rewritten after every run so
that a crash keeps the runs that ended; the database row; the summary; and, when a run fails or is interrupted
part way, the finished runs, written whole before the command ends."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from speedrun import dist
from speedrun.engine import peak
from speedrun.engine.flops import RunFlops
from speedrun.engine.loop import RunResult, signals_held
from speedrun.errors import counted, note_kept, warn
from speedrun.records import cost
from speedrun.records import db as results_db
from speedrun.records.result_file import portable, write_json
from speedrun.records.stats import FRACTION, NON_NEGATIVE, RECORD_ALPHA, reaches_target, record_alpha, summarize
from speedrun.run.display import Display


@dataclass
class Result:
    """What a multi-run training returns; `to_dict()` is the JSON written by --json.

    `runs` holds every run that ended, diverged ones included (their accuracy is None); the statistics (n, mean,
    std, hit rate) cover the runs that finished, the records rule (record()) every run.
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
    flops: RunFlops | None = None  # what one run computes (the family's flops(); None where it could not count)
    precision: str | None = None  # the precision the runs used (config's "auto" resolved for the device)
    peaks: dict | None = None  # this device's measured peaks (engine/peak.py's cache; None: never measured here)
    settings: dict | None = None  # the settings file applied (records/settings_file.py), and its values
    model: torch.nn.Module | None = field(default=None, repr=False)  # the last run's trained model
    # A result read back from its file (from_dict): the MFU it recorded, against the peak measured then
    recorded_mfu: dict | None = field(default=None, repr=False)
    # The records rule's threshold this result is judged at (stats.reaches_target): Session sets the setting
    # (stats.record_alpha: $SPEEDRUN_RECORD_P, else 0.01) that the summary shows, from_dict the reader's.
    record_p: float = RECORD_ALPHA
    # What stored this result (records/db.py KINDS): "train" for `speedrun train` and the Python API, "smoke" for its
    # --smoke; an instrument that stores each setting's runs names itself ("bench", "ablate", "sweep", ...).
    kind: str = "train"
    # What the data is, whatever path was typed: {"name", "fingerprint" (Dataset.fingerprint: its content),
    # "source" (the path or name as given), "own" (the recipe's own data set, Family.own_data)}; None in a result
    # read from a file written before it was recorded. Results are keyed by name and fingerprint (records/db.py).
    data: dict | None = None
    # Whether the config's target_accuracy is this result's target: on the recipe's own data set, or given by the
    # user (--set target_accuracy=). A target measured on CIFAR-10 says nothing of another data set, so elsewhere
    # no record is judged (record() is None) and the result file's "target" is null.
    target_applies: bool = True

    @property
    def finished(self) -> list[RunResult]:
        return [r for r in self.runs if r.diverged is None]

    @property
    def diverged_runs(self) -> int:
        return len(self.runs) - len(self.finished)

    @property
    def accuracies(self) -> list[float]:
        return cast("list[float]", [r.accuracy for r in self.finished])  # None only for a diverged run

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
        """Share of finished runs reaching the recipe's target accuracy; None where it does not apply (target_applies)
        or no run finished."""
        if not self.finished or not self.target_applies:
            return None
        return sum(a >= self.target_accuracy for a in self.accuracies) / len(self.finished)

    def record(self) -> dict | None:
        """The records rule on every run: {"reached", "p", "threshold", "n", "diverged", "test"}; reached only when
        the one-sided t-test of the runs' accuracies against the target gives p < threshold (n >= 2: p is None
        below). A diverged run counts as accuracy 0, as a sweep's trial counts it (instruments/sweep.py's _score): a
        recipe that diverges 7 times in 10 does not reach its target on the 3 runs that finished. None without a
        finished run. The mean and std shown and stored are the finished runs'."""
        if not self.finished or not self.target_applies:
            return None
        acc = summarize(cast("list[float]", [0.0 if r.diverged is not None else r.accuracy for r in self.runs]))
        reached, p = reaches_target(acc.mean, acc.std or 0.0, acc.n, self.target_accuracy, self.record_p)
        return {"reached": reached, "p": p, "threshold": self.record_p, "n": acc.n, "diverged": self.diverged_runs,
                "test": "one-sided t-test of every run's accuracy (a diverged run as 0), H1: mean > target"}

    def costs(self) -> dict | None:
        """US dollars: the mean timed region of a run, and the whole command, on every process's device."""
        if self.price is None:
            return None
        devices = self.world.get("processes", 1)
        # train_seconds is None only for a diverged run
        timed = summarize(cast("list[float]", [r.train_seconds for r in self.finished])).mean if self.finished else None
        return {**self.price.to_dict(), "devices": devices,
                "timed_usd_per_run": cost.dollars(timed, self.price, devices),
                "wall_usd": cost.dollars(self.wall_seconds, self.price, devices)}

    def mfu(self) -> dict | None:
        """A run's FLOPs over its mean timed seconds, against this device's peak (every process's device: the
        FLOPs are the global batch's); None without FLOPs or a finished run."""
        if self.recorded_mfu is not None:
            return self.recorded_mfu
        if self.flops is None or not self.finished or self.precision is None:
            return None
        seconds = summarize(cast("list[float]", [r.train_seconds for r in self.finished])).mean
        if not seconds or seconds <= 0:
            return None
        try:  # an instrument: a result is written whatever it finds
            per_device = self.flops.run / seconds / max(1, int(self.world.get("processes", 1)))
            return {**peak.mfu(per_device, self.peaks, self.precision, self.environment.get("device_name")),
                    "devices": self.world.get("processes", 1)}
        except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
            return None

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        """The Result a result file holds (`d` as to_dict() wrote it, its runs checked by the caller: resume.py's
        finished job). Its cost and FLOPs are the file's figures, kept as they are; the model is not in a file."""
        def get(key, types, default=None):
            value = d.get(key)
            return value if isinstance(value, types) and not (isinstance(value, bool) and bool not in types) \
                else default

        flops = get("flops", (dict,))
        try:
            run_flops = None if flops is None else RunFlops(train=int(flops["train"]), steps=int(flops["steps"]),
                                                             evaluation=int(flops["evaluation"]),
                                                             counted=str(flops["counted"]))
        except (KeyError, TypeError, ValueError, OverflowError):
            run_flops = None
        recorded_mfu = get("mfu", (dict,))
        try:  # the summary shows it with peak.mfu_text: one it cannot show is left out
            if recorded_mfu is not None:
                peak.mfu_text(recorded_mfu)
        except (KeyError, TypeError, ValueError, OverflowError):
            recorded_mfu = None
        price = get("cost", (dict,))
        try:
            price = None if price is None else cost.Price(float(price["price_per_hour"]), str(price["price_source"]))
        except (KeyError, TypeError, ValueError):
            price = None
        return cls(recipe=get("recipe", (str,), ""), dataset=get("dataset", (str,), ""),
                   device=get("device", (str,), ""), config=get("config", (dict,), {}),
                   runs=[RunResult.from_dict(r) for r in d["runs"]], environment=get("environment", (dict,), {}),
                   data_seconds=get("data_seconds", (int, float), 0.0),
                   warmup_seconds=get("warmup_seconds", (int, float), 0.0),
                   interrupted=get("interrupted", (bool,), False), complete=get("complete", (bool,), False),
                   runs_requested=get("runs_requested", (int,), 0), smoke_test=get("smoke_test", (bool,), False),
                   image_size=get("image_size", (int,)), command=get("command", (str,)),
                   timed_region=get("timed_region", (str,), ""), world=get("world", (dict,), dist.World().to_dict()),
                   resumed_from=[str(x) for x in get("resumed_from", (list,), [])],
                   saved_model=get("saved_model", (str,)), wall_seconds=get("wall_seconds", (int, float), 0.0),
                   price=price, flops=run_flops, precision=get("precision", (str,)), settings=get("settings", (dict,)),
                   recorded_mfu=recorded_mfu, record_p=record_alpha(),  # re-judged at the reader's threshold
                   kind=get("kind", (str,), "train"), data=get("data", (dict,)),
                   # a file written before "target" was recorded: the rule it was written under (db.identity)
                   target_applies=results_db.identity(d, d.get("command"), d.get("dataset"))[3] is not None)

    def to_dict(self) -> dict:
        acc = summarize(self.accuracies, FRACTION).to_dict() if self.finished else None
        secs = (summarize(cast("list[float]", [r.train_seconds for r in self.finished]), NON_NEGATIVE).to_dict()
                if self.finished else None)
        return {
            "recipe": self.recipe, "dataset": self.dataset, "device": self.device, "command": self.command,
            "kind": "smoke" if self.smoke_test else self.kind, "smoke_test": self.smoke_test,
            "mean_accuracy": self.mean_accuracy, "std_accuracy": self.std_accuracy, "n": len(self.finished),
            "accuracy": acc, "train_seconds": secs,
            "data": self.data, "target": self.target_accuracy if self.target_applies else None,
            "target_accuracy": self.target_accuracy, "hit_rate": self.hit_rate, "record": self.record(),
            "timed_region": self.timed_region,
            "data_seconds": self.data_seconds, "warmup_seconds": self.warmup_seconds,
            "complete": self.complete, "interrupted": self.interrupted, "runs_requested": self.runs_requested,
            "diverged_runs": self.diverged_runs, "image_size": self.image_size,
            "world": self.world, "resumed_from": self.resumed_from, "saved_model": self.saved_model,
            "wall_seconds": self.wall_seconds, "cost": self.costs(),
            "flops": None if self.flops is None else self.flops.to_dict(), "precision": self.precision,
            "mfu": self.mfu(), "settings": self.settings,
            "seeds": [r.seed for r in self.runs],
            "runs": [r.to_dict() for r in self.runs], "config": self.config,
            "environment": self.environment,
        }


class Session:
    """The outputs of one train command around its runs. Only rank 0 writes (under torchrun every process holds
    one, and the others' writes are no-ops)."""

    def __init__(self, result: Result, *, json_path: Path | str | None, database: sqlite3.Connection | None,
                 db, world: dist.World, show: Display, began: float):
        self.result, self.json_path, self.database, self.db = result, json_path, database, db
        self.world, self.show, self.began = world, show, began
        self.written = False
        result.record_p = show.record_p  # the threshold the summary judges at: the result file records it
        self.stored_id: int | None = None  # the database row of the result, once stored
        # The runs the result took from the checkpoint it resumed (resume.py checked them): an earlier command's,
        # which that command kept. Until this command ends a run of its own, a failure keeps nothing.
        self.adopted = len(result.runs)
        self.told_resumed = False

    def save(self) -> None:
        """The result file as it stands (after every run: a crash or kill later keeps this one)."""
        self.result.wall_seconds = time.perf_counter() - self.began
        if self.json_path is not None and self.world.is_main:
            write_json(self.json_path, self.result.to_dict())
            self.written = True
        self._tell_resumed()

    def _tell_resumed(self) -> None:
        """With --quiet (the summary shown, progress lines not), the line that says the result continues a
        checkpoint: its runs before the resumed one, and that run's first steps, are an earlier command's. Said
        once the resumed run has ended, after every check of the checkpoint (the family's restoring its state
        among them), so that a refused checkpoint still costs one line; verbose output says it at the start."""
        result, show = self.result, self.show
        if self.told_resumed or not result.resumed_from or show.verbose or not show.show_summary \
                or not self.world.is_main:
            return
        self.told_resumed = True
        earlier = f"; runs 1-{self.adopted} are the checkpoint's" if self.adopted > 1 else \
            "; run 1 is the checkpoint's" if self.adopted == 1 else ""
        warn(f"resumed from {result.resumed_from[0]} (run {self.adopted + 1} continued from it{earlier})")

    def store(self) -> None:
        """The final result (complete or not) into the database too, as the JSON file has it."""
        if self.database is None:
            return
        try:
            stored = results_db.insert_result(self.database, portable(self.result.to_dict()),
                                              source=str(self.json_path))
            self.stored_id = stored
            self.show.line(f"stored in {self.db} as #{stored}")
        except (ValueError, OSError, sqlite3.Error) as e:
            kept = (f"it is in {self.json_path}" if self.written else "no result file holds it either (json_path=None)"
                    if self.json_path is None else f"nor was its file {self.json_path} written")
            # Import adds the file later only where the database was what failed (locked, full, read-only), not where
            # the database refused what the result holds: an import would meet the same refusal.
            later = self.written and (not isinstance(e, ValueError) or isinstance(e, results_db.UnusableDatabase))
            warn(f"the result was not stored in the database {self.db} ({e}); {kept}"
                 + ("; `speedrun results import` adds it later" if later else ""))

    def report(self) -> None:
        self.show.summary(self.result)
        if self.json_path is not None:
            self.show.line(f"result: {self.json_path}")

    def keep_interrupted(self, interrupt: BaseException, checkpoint_dir: Path | None) -> None:
        """Ctrl-C or SIGTERM: the finished runs written and stored, and what the CLI's last line says (how many
        runs were kept, where, and the checkpoint to continue from)."""
        result = self.result
        result.interrupted = True
        marked: Any = interrupt  # the CLI's last line reads these attributes off the exception
        marked.runs_kept = len(result.runs)
        marked.result_path = self.json_path if result.runs else None
        marked.checkpoint_dir = checkpoint_dir
        if not result.runs:
            return
        self.show.line(f"interrupted: keeping the {counted(len(result.runs), 'finished run')}")
        with signals_held():  # a second Ctrl-C must not cut this write short: it would keep the last file
            with contextlib.suppress(Exception):  # a full disk now must not replace the interrupt with its error
                self.save()
            self.store()
        self._note_stored(interrupt)
        self.report()

    def keep_failed(self, failure: BaseException) -> None:
        """An error after some runs ended (a later run, saving the model): those runs are kept too, and the one
        line says where (errors.note_kept). Runs taken from a checkpoint alone are not this command's to keep: a
        checkpoint refused as its state is restored (checkpoint.restoring) keeps nothing of it, and a legitimate
        one's runs stay where the command that ran them kept them (its result file and row, the checkpoint)."""
        if len(self.result.runs) <= self.adopted:
            return
        with signals_held():
            with contextlib.suppress(Exception):  # the first failure is the one to report
                self.save()
            self.store()
        if self.world.is_main:  # the others keep nothing (and their line, if any, says so)
            where = self.json_path if self.written else self.db if self.database else None
            note_kept(failure, len(self.result.runs), where)
            self._note_stored(failure)

    def _note_stored(self, exc: BaseException) -> None:
        """Tell the CLI's last line the database row that holds the finished runs (it names it beside the file,
        which a full disk may have left behind)."""
        if self.stored_id is not None:
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__
                cast(Any, exc).stored_as = (str(self.db), self.stored_id)  # read by the CLI's last line
