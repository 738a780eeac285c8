"""Checkpoints and resume, as the runner (run/runner.py) uses them: which checkpoint to continue from, whether it
fits this run, when to save, and which result file a resumed command continues.

The file format (safetensors, checksummed, atomic, never unpickled) is engine/checkpoint.py's; what a family's training
state holds is the family's TrainState. This module joins them to a multi-run command:
- a checkpoint's metadata carries the recipe, config, data signature and first seed (which must match to resume),
  the run index and step, the runs finished before it (so a resumed command keeps them), and the result file;
- under torchrun, rank 0 chooses the checkpoint and every process loads that one file; only rank 0 writes;
- a worker group restarted by torchrun (--max-restarts) resumes from the newest usable checkpoint by itself.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from speedrun import dist
from speedrun.engine.checkpoint import (AFRESH, CheckpointError, check_compatible, find_checkpoint, list_checkpoints,
                                        load_checkpoint, save_checkpoint)
from speedrun.engine.loop import RunResult
from speedrun.errors import counted, warn
from speedrun.paths import make_folder, user_path
from speedrun.records import db as results_db
from speedrun.records.result_file import check_train_result, load_result, portable
from speedrun.records.typed_files import LOOP_STATE, RUN_RECORD, checked

Found = tuple[dict, dict, Path]  # (state, meta, path)
# Checkpoints per run when --checkpoint-every is not given (and always one at the run's last step).
DEFAULT_CHECKPOINTS_PER_RUN = 10


def check_precision(saved: dict, meta: dict, path: Path, afresh: str = AFRESH) -> None:
    """A resumed run continues at the precision its checkpoint ran at. precision=auto may resolve otherwise here
    (another device, or a version whose auto differs, as for a CPU with native bf16): then the line names the
    --set that continues it as it began. A checkpoint that predates the record ran at what auto meant then: bf16
    on CUDA, fp32 elsewhere (taken to be this run's device type)."""
    config = cast(dict, saved.get("config")) if isinstance(saved.get("config"), dict) else {}
    asked = config.get("precision", "auto")
    used = saved.get("precision_used")
    if not isinstance(used, str):
        used = asked if asked != "auto" else ("bf16" if meta.get("device_type") == "cuda" else "fp32")
    if used != meta.get("precision_used"):
        raise ValueError(f"checkpoint {path.name} ran in {used[:10]} (precision={str(asked)[:10]}); this run would "
                         f"run in {meta.get('precision_used')}: add --set precision={used[:10]} to continue it as it "
                         f"began, or {afresh}")
    # half weights or autocast at that precision (a checkpoint made before half weights existed: autocast)
    half = saved.get("half_weights_used", False)
    if "half_weights_used" in meta and half is not meta["half_weights_used"]:
        want = "on" if half is True else "off"
        raise ValueError(f"checkpoint {path.name} ran with half_weights {want}; this run would not: add --set "
                         f"half_weights={want} to continue it as it began, or {afresh}")


@dataclass
class Plan:
    directory: Path | None
    every_steps: int | None
    keep: int
    resume: str | None  # "auto", a checkpoint path, or None
    passed_over: list[str] = field(default_factory=list)  # why each newer checkpoint was unusable (rank 0's)

    @classmethod
    def make(cls, checkpoint_dir, every_steps: int | None, keep: int, resume, world: dist.World) -> Plan:
        """The flags checked together, before any work; rank 0 checks the folder it will write, and under torchrun
        its refusal ends the other processes too (dist.main_first: call this after dist.init)."""
        directory = None if checkpoint_dir is None else user_path(checkpoint_dir, "--checkpoint-dir")
        resume = None if resume is None else os.fspath(resume)
        if resume == "":
            raise ValueError("--resume is empty; give a checkpoint file or folder, or auto")
        if directory is None and every_steps is not None:
            raise ValueError("--checkpoint-every needs a folder to write to: add --checkpoint-dir DIR")
        if resume == "auto" and directory is None:
            raise ValueError("--resume auto looks in the checkpoint folder: add --checkpoint-dir DIR, or give "
                             "--resume a checkpoint file")
        if resume is None and directory is not None and world.restarts > 0:
            resume = "auto"  # torchrun restarted the worker group: continue where the last checkpoint left off
        if checkpoint_dir is not None and not os.fspath(checkpoint_dir).strip():  # Path("") would mean "."
            raise ValueError("--checkpoint-dir is empty; give a folder")

        def check_folder():  # rank 0's: it writes there
            if directory is not None:
                _check_writable_dir(directory)
                if resume is None and list_checkpoints(directory):
                    raise ValueError(f"{directory} already holds checkpoints (of another command, or "
                                     "an earlier one of this); add --resume auto to continue from them, or choose a "
                                     "new --checkpoint-dir")

        dist.main_first(world, check_folder, everyone=False)
        return cls(directory, every_steps, keep, resume)

    def afresh(self) -> str:
        """How to start afresh instead of resuming, for the flags given: each way works as said (a command without
        --resume refuses a --checkpoint-dir that holds checkpoints, and --resume auto resumes from them)."""
        if self.directory is not None and list_checkpoints(self.directory):
            elsewhere = f"in a new --checkpoint-dir (or remove the checkpoints in {self.directory})"
            return f"start afresh {elsewhere}" if self.resume == "auto" else \
                f"start afresh without --resume, {elsewhere}"
        return "start afresh without --resume"

    def find(self, world: dist.World, log: Callable[[str], None]) -> Found | None:
        """The checkpoint to resume: rank 0 chooses (the newest usable one), every process loads that file. Each
        newer one passed over as unusable is kept in passed_over, a warning once check_found accepts the one
        chosen: the command then resumes from an earlier step than the newest, which the user must see even with
        --quiet, while a refusal stays its one line."""
        if self.resume is None:
            return None
        # auto only with a folder: make refuses it without one
        where = cast(Path, self.directory) if self.resume == "auto" else user_path(self.resume, "--resume")
        found = dist.main_first(world, lambda: find_checkpoint(where, self.passed_over.append, self.afresh()),
                                everyone=False)
        chosen = dist.broadcast_object(None if found is None else str(found[2]), world)
        if not world.is_main and chosen is not None:
            state, meta = load_checkpoint(chosen)
            found = (state, meta, Path(chosen))
        if found is None and self.resume != "auto":
            # --resume auto only with a folder (Plan.make), and starting afresh only where it holds no checkpoints
            if self.directory is None:
                other = "or start afresh without --resume"
            elif list_checkpoints(self.directory):
                other = (f"or --resume auto to continue from the newest checkpoint in {self.directory}, or start "
                         "afresh without --resume in a new --checkpoint-dir")
            else:
                other = "or start afresh (without --resume, or with --resume auto)"
            raise ValueError(f"no checkpoint in {where} to resume; give --resume an existing checkpoint file or a "
                             f"folder holding them, {other}")
        if found is None:
            log(f"no checkpoint in {where} yet: starting afresh")
        else:
            run, step = found[1].get("run"), found[1].get("step")  # checked in check_found; shown as they are
            log(f"resuming from {found[2]} (run index {repr(run)[:20]}, step "
                f"{repr(step)[:20]})")
        return found

    def check_found(self, found: Found | None, meta: dict | None, may_differ: frozenset[str],
                    runs: int, defaults: dict | None = None) -> tuple[int, dict | None, list[RunResult]]:
        """(first run to train, its state to resume, the runs finished before it) after checking that the
        checkpoint was made by this recipe, config, data and seed."""
        if found is None:
            return 0, None, []
        assert meta is not None  # the runner builds meta whenever a checkpoint was found
        state, saved, path = found
        afresh = self.afresh()
        check_precision(saved, meta, path, afresh)
        # The dataset as typed may differ (a relative path, say): its content is in meta["data"]. The precision and
        # half_weights asked for may differ where they resolve to what the checkpoint ran at (check_precision).
        check_compatible(saved, meta, path, may_differ | {"dataset", "precision", "precision_used", "device_type",
                                                          "half_weights", "half_weights_used"}, afresh, defaults)
        # A file named by --resume is the user's, not ours to suggest deleting; one found by auto is passed over
        # for the one before it once deleted.
        fix = afresh if self.resume != "auto" else f"delete it to resume from the one before, or {afresh}"
        # Checked whole before any of it is adopted: its finished runs become this command's result, and its
        # state's history the resumed run's rows; nothing of a checkpoint refused here reaches a file or a row.
        try:
            run = saved["run"]
            if not _integer(run, 0, 2**62):
                raise TypeError("run index")
            finished = _check_finished(saved["finished"], meta["seed"])
            if len(finished) != run:
                raise TypeError(f"{counted(len(finished), 'finished run')} before run index {run}")
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint {path.name} has malformed run records ({e}); {fix}") from None
        try:
            _check_loop_state(state, saved.get("step"))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {path.name} does not fit this run (its training state: {e}); "
                                  f"{fix}") from None
        if run >= runs:
            raise ValueError(f"checkpoint {path.name} is of run {run + 1}, but --runs {runs} ends before "
                             f"it; ask for at least {run + 1} runs")
        for line in self.passed_over:
            warn(line)
        return run, state, finished

    def continued_result(self, found: Found | None, asked) -> Path | None:
        """The result file the checkpointed command was writing, when the resumed command asks for no particular
        file ("auto") or for that one, and it is still that command's partial result (same recipe, its runs those
        the checkpoint lists as finished): the resumed command continues it instead of starting a second file.
        Anything else is left alone (and a path given with --json must then be new)."""
        if found is None or not isinstance(found[1].get("result_path"), str):
            return None
        path = Path(found[1]["result_path"])
        if asked != "auto" and user_path(asked, "--json").resolve() != path.resolve():
            return None
        try:
            old = load_result(path) if path.is_file() and path.stat().st_size else None
        except (OSError, ValueError):
            return None
        meta = found[1]
        finished = meta.get("finished")
        if (old is None or old.get("complete") is not False or not isinstance(finished, list)
                or not all(isinstance(r, dict) for r in finished + old.get("runs", []))
                or [old.get(k) for k in ("recipe", "dataset", "config")] !=
                   [meta.get("recipe"), meta.get("dataset"), _as_json(meta.get("config"))]
                or [r.get("seed") for r in old.get("runs", [])] != [r.get("seed") for r in finished]):
            return None
        return path

    def finished_job(self, found: Found | None, runs: int, expected: dict, may_differ: frozenset[str],
                     database: sqlite3.Connection | None, world: dist.World, defaults: dict | None = None
                     ) -> dict | None:
        """The result of the job whose checkpoints --resume auto found, when that job has finished; None when there
        is anything left to run. `expected`: this command's recipe, dataset, config and seed; may_differ: the
        config fields a resume may change (the family's MAY_DIFFER_ON_RESUME).

        A requeued job (a scheduler running its script again, --resume auto and all) must neither train again nor
        store its result a second time: it is told where its result is, and the command does nothing. Finished
        means, from the checkpoint's meta and the result file it names: the newest checkpoint is of the last run
        this command asks for (run index runs - 1, the runs before it finished), and that file holds the whole job,
        complete, with this many runs asked for, its runs before the last the checkpoint's own and its last run
        ending at the checkpoint's step (a run's steps are its total, and its last checkpoint is at its last step).
        A newest checkpoint from before the end (the last one unusable) continues from there instead; so does one
        whose run ended without its result written (killed in its final evaluation): what it lacks is run again.
        Another job's checkpoint (a setting differs) is not this job's: check_found names the setting. The result's
        database id is looked up by its content (insert_result stores a result once: a file whose row was never
        stored, where storing failed, is stored now). Rank 0 decides and warns (shown with --quiet); every process
        returns the same answer."""
        def decide() -> dict | None:
            if found is None or self.resume != "auto":
                return None  # a file named by --resume is resumed as asked (a re-score of its last run, say)
            _, meta, path = found
            try:
                check_compatible(meta, expected, path, may_differ, defaults=defaults)
                if not (isinstance(meta.get("result_path"), str) and meta.get("run") == runs - 1
                        and type(meta.get("run")) is int and _integer(meta.get("step"), 1, 2**62)):
                    return None
                before = _check_finished(meta.get("finished"), expected["seed"])
                result = check_train_result(load_result(meta["result_path"]))
                ended = [_check_run(r, expected["seed"] + i) for i, r in enumerate(result["runs"])]
            except (OSError, ValueError, TypeError, KeyError):
                return None  # anything amiss: resume as for any other checkpoint, which checks it in full
            if not (result.get("complete") is True and result.get("runs_requested") == runs and len(ended) == runs
                    and [result.get(k) for k in ("recipe", "dataset", "config")]
                    == [meta.get("recipe"), meta.get("dataset"), _as_json(meta.get("config"))]
                    and result["runs"][:-1] == portable([r.to_dict() for r in before])
                    and ended[-1].steps == meta["step"]):
                return None
            stored = None
            if database is not None:
                try:
                    stored = results_db.insert_result(database, portable(result), source=meta["result_path"])
                except (ValueError, OSError, sqlite3.Error):
                    pass  # the file is the result; the line just names no row
            warn(f"the job in {self.directory} finished: its result is {meta['result_path']}"
                 + (f" (#{stored})" if stored is not None else "")
                 + "; nothing was run again (a new --checkpoint-dir starts it afresh)")
            return result

        done = dist.broadcast_object(dist.main_first(world, decide, everyone=False), world)
        return done  # the result file's dict (run/session.Result.from_dict reads it)

    def checkpoints(self, meta: dict | None, result_path, world: dist.World) -> Checkpoints | None:
        if self.directory is None:
            return None
        assert meta is not None  # the runner builds meta whenever there is a checkpoint folder
        return Checkpoints(self.directory, self.every_steps, self.keep, world,
                           {**meta, "result_path": None if result_path is None else str(Path(result_path).resolve())})


def _as_json(value):
    """`value` as it reads back from a JSON file (tuples become lists)."""
    return json.loads(json.dumps(value))


def _integer(x, low: int, high: int) -> bool:
    return type(x) is int and low <= x <= high


def _check_run(r, seed: int) -> RunResult:
    """A finished run's record (a checkpoint's, or a result file's), checked field by field as a train result's
    runs are (records/typed_files.py's RunRecord), and every row of its history, against its own steps; else a
    TypeError saying what is wrong."""
    # its rows' steps are held to its steps as it states them (which are refused first where they are no count)
    checked(RUN_RECORD, r, TypeError, {"seed": seed, "steps": r.get("steps") if isinstance(r, dict) else None})
    return RunResult.from_dict({"diverged": None, **r})


def _check_finished(records, first_seed: int) -> list[RunResult]:
    """The runs a checkpoint lists as finished, checked like any field of a file from elsewhere."""
    if not isinstance(records, list):
        raise TypeError("'finished' is not a list")
    runs = []
    for i, r in enumerate(records):
        try:
            runs.append(_check_run(r, first_seed + i))
        except TypeError as e:
            raise TypeError(f"finished run {i + 1}: {e}") from None
    return runs


def _check_loop_state(state: dict, step) -> None:
    """The bookkeeping every family's state holds (records/typed_files.py's LoopState), checked as the loop
    restores it and against the checkpoint's own step: its history becomes the resumed run's rows. A TypeError
    says what is wrong. The family's own parts (model, optimizers, generators) are the family's to check as it
    loads them (checkpoint.restoring)."""
    checked(LOOP_STATE, state, TypeError, {"steps": step})


def _check_writable_dir(directory: Path) -> None:
    # what is in the way is named (a file, a symlink loop), never the system's "File exists"
    make_folder(directory, "the checkpoint folder", "choose a writable folder (--checkpoint-dir)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint folder {directory} is not writable; choose another "
                         "(--checkpoint-dir)")


class Checkpoints:
    """When to save a run's training state, and the metadata that goes with it. Rank 0 writes; every process
    makes the same decisions (they depend only on the step), so they stay in step."""

    finished: list[dict]  # the finished runs' RunResult.to_dict(), saved with each checkpoint

    def __init__(self, directory: Path, every_steps: int | None, keep: int, world: dist.World, meta: dict):
        self.directory, self.every_steps, self.keep, self.world, self.meta = directory, every_steps, keep, world, meta
        self.run, self.finished = 0, []

    def begin(self, run: int, finished: list[RunResult]) -> None:
        self.run, self.finished = run, [r.to_dict() for r in finished]

    def due(self, step: int, total_steps: int) -> bool:
        """At every `every_steps`-th step (default: ten times a run) and at the run's last step."""
        every = self.every_steps or max(1, math.ceil(total_steps / DEFAULT_CHECKPOINTS_PER_RUN))
        return step == total_steps or step % every == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.world.is_main:
            save_checkpoint(self.directory, self.run, step, state,
                            {**self.meta, "run": self.run, "step": step, "finished": self.finished}, self.keep)
