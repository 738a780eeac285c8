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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from speedrun import dist
from speedrun.engine.checkpoint import (CheckpointError, check_compatible, find_checkpoint, list_checkpoints,
                                        load_checkpoint, save_checkpoint)
from speedrun.engine.loop import RunResult
from speedrun.paths import user_path
from speedrun.records.result_file import load_result

Found = tuple[dict, dict, Path]  # (state, meta, path)
# Checkpoints per run when --checkpoint-every is not given (and always one at the run's last step).
DEFAULT_CHECKPOINTS_PER_RUN = 10


def check_precision(saved: dict, meta: dict, path: Path) -> None:
    """A resumed run continues at the precision its checkpoint ran at. precision=auto may resolve otherwise here
    (another device, or a version whose auto differs, as for a CPU with native bf16): then the line names the
    --set that continues it as it began. A checkpoint that predates the record ran at what auto meant then: bf16
    on CUDA, fp32 elsewhere (taken to be this run's device type)."""
    config = saved.get("config") if isinstance(saved.get("config"), dict) else {}
    asked = config.get("precision", "auto")
    used = saved.get("precision_used")
    if not isinstance(used, str):
        used = asked if asked != "auto" else ("bf16" if meta.get("device_type") == "cuda" else "fp32")
    if used != meta.get("precision_used"):
        raise ValueError(f"checkpoint {path.name} ran in {used[:10]} (precision={str(asked)[:10]}); this run would "
                         f"run in {meta.get('precision_used')}: add --set precision={used[:10]} to continue it as it "
                         "began, or start afresh without --resume")


@dataclass
class Plan:
    directory: Path | None
    every_steps: int | None
    keep: int
    resume: str | None  # "auto", a checkpoint path, or None

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

    def find(self, world: dist.World, log: Callable[[str], None]) -> Found | None:
        """The checkpoint to resume: rank 0 chooses (the newest usable one), every process loads that file."""
        if self.resume is None:
            return None
        where = self.directory if self.resume == "auto" else user_path(self.resume, "--resume")
        found = dist.main_first(world, lambda: find_checkpoint(where, log), everyone=False)
        chosen = dist.broadcast_object(None if found is None else str(found[2]), world)
        if not world.is_main and chosen is not None:
            state, meta = load_checkpoint(chosen)
            found = (state, meta, Path(chosen))
        if found is None and self.resume != "auto":
            raise ValueError(f"no checkpoint in {where} to resume; give a checkpoint file or folder "
                             "(--resume), or --resume auto to start afresh when there is none yet")
        if found is None:
            log(f"no checkpoint in {where} yet: starting afresh")
        else:
            run, step = found[1].get("run"), found[1].get("step")  # checked in check_found; shown as they are
            log(f"resuming from {found[2]} (run index {repr(run)[:20]}, step "
                f"{repr(step)[:20]})")
        return found

    def check_found(self, found: Found | None, meta: dict | None, may_differ: frozenset[str],
                    runs: int) -> tuple[int, dict | None, list[RunResult]]:
        """(first run to train, its state to resume, the runs finished before it) after checking that the
        checkpoint was made by this recipe, config, data and seed."""
        if found is None:
            return 0, None, []
        state, saved, path = found
        check_precision(saved, meta, path)
        # The dataset as typed may differ (a relative path, say): its content is in meta["data"]. The precision
        # asked for may differ where it resolves to the one the checkpoint ran at (check_precision).
        check_compatible(saved, meta, path, may_differ | {"dataset", "precision", "precision_used", "device_type"})
        try:
            run = saved["run"]
            finished = _check_finished(saved["finished"], meta["seed"])
            if not isinstance(run, int) or isinstance(run, bool) or run < 0 or len(finished) != run:
                raise TypeError("run index")
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint {path.name} has malformed run records ({e}); delete it "
                                  "or start afresh without --resume") from None
        if run >= runs:
            raise ValueError(f"checkpoint {path.name} is of run {run + 1}, but --runs {runs} ends before "
                             f"it; ask for at least {run + 1} runs")
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

    def checkpoints(self, meta: dict, result_path, world: dist.World) -> Checkpoints | None:
        if self.directory is None:
            return None
        return Checkpoints(self.directory, self.every_steps, self.keep, world,
                           {**meta, "result_path": None if result_path is None else str(Path(result_path).resolve())})


def _as_json(value):
    """`value` as it reads back from a JSON file (tuples become lists)."""
    return json.loads(json.dumps(value))


def _check_finished(records, first_seed: int) -> list[RunResult]:
    """The runs a checkpoint lists as finished, checked like any field of a file from elsewhere."""
    def number(x, low=0.0, high=math.inf, none=False) -> bool:
        return (x is None and none) or (isinstance(x, (int, float)) and not isinstance(x, bool)
                                        and math.isfinite(x) and low <= x <= high)

    if not isinstance(records, list):
        raise TypeError("'finished' is not a list")
    runs = []
    for i, r in enumerate(records):
        ok = (isinstance(r, dict) and r.get("seed") == first_seed + i and number(r.get("accuracy"), 0, 1, True)
              and number(r.get("train_seconds"), none=True) and number(r.get("epochs"))
              and isinstance(r.get("steps"), int) and r["steps"] >= 0 and isinstance(r.get("history"), list)
              and all(isinstance(h, dict) for h in r["history"]) and isinstance(r.get("diverged"), (dict, type(None)))
              and (r.get("diverged") is None) == (r.get("accuracy") is not None))
        if not ok:
            raise TypeError(f"finished run {i + 1}")
        runs.append(RunResult.from_dict(r))
    return runs


def _check_writable_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"checkpoint folder {directory} is a file (or under one); choose a folder "
                         "(--checkpoint-dir)") from None
    except OSError as e:
        raise ValueError(f"cannot create the checkpoint folder {directory} ({e.strerror}); choose "
                         "a writable folder (--checkpoint-dir)") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint folder {directory} is not writable; choose another "
                         "(--checkpoint-dir)")


class Checkpoints:
    """When to save a run's training state, and the metadata that goes with it. Rank 0 writes; every process
    makes the same decisions (they depend only on the step), so they stay in step."""

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
