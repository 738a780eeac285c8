"""`--tensorboard DIR` (train, bench, ablate): every timed run's learning curve as TensorBoard event files, written
with torch.utils.tensorboard's SummaryWriter (the `tensorboard` package: `pip install 'speedrun[tensorboard]'`).

Layout: one TensorBoard run per seed, and per setting for bench and ablate:
  DIR/<time>-<recipe>/seed-<n>             train
  DIR/<time>-<recipe>/<setting>/seed-<n>   bench, ablate (the setting's name, e.g. lookahead=false)
<time> is the command's start (UTC, YYYYmmdd-HHMMSS). The command's folder is created before training, exclusively
(-2, -3, ... when the name is taken), so a command never writes into, nor replaces, an earlier command's event files;
a probe file made and removed in it proves it writable then. A folder that got no run is removed at the end.

What each run holds (step = optimizer steps taken, as the per-epoch table's):
  train/loss              every step: the step's loss, mean per example of its batch (of rank 0's share under
                          torchrun, where rank 0 alone writes)
  train/lr                every step: the lr the step was taken with, in the units of the setting the divergence
                          message names (lr_per_1024, muon_lr, lr, lr_per_256)
  train/images_per_second at each per-epoch row: steps x batch_size over the timed seconds between this row and
                          the one before (the timer's own seconds: the table's evaluations and checkpoint writes
                          are outside the timed region, so outside this rate; the first interval holds what the
                          timed region does before the first step, such as the whitening initialization)
  epoch/train_loss, epoch/train_acc, epoch/val_acc   the per-epoch table's row (each when the row has it)
  final/accuracy, final/train_seconds, final/images_per_second   the run's result; the rate over the whole timed
                          region, final evaluation included
  hparams                 the config, recipe, dataset, seed (and setting), with the final/ scalars as its metrics

Inside the timed region nothing is read from the device: reading each step's loss (.item()) would wait for the
step to finish, every step, as FiniteLossGuard avoids on CUDA. The per-step hook (engine.loop.Steps's on_scalars)
keeps only a reference to the detached 0-d loss and the lr (a Python float); they are read together, with one
synchronization, at the next per-epoch row or the run's end, where the timer is stopped. The guard's own lagged
host copies are not used: they exist only while the guard is on, and only on CUDA. The event files are written and
flushed there too, so no file work happens while the timer runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from speedrun.engine.loop import RunHooks
from speedrun.errors import warn
from speedrun.paths import check_writable, in_the_way, make_folder, note_made, user_path

FLAG = "--tensorboard"
INSTALL = "pip install 'speedrun[tensorboard]'"


def writer_module(flag: str = FLAG):
    """torch.utils.tensorboard (its SummaryWriter, and summary.hparams), imported now: a second or two, so never at
    speedrun's import. A one-line refusal naming the install command when the tensorboard package is missing."""
    try:
        import torch.utils.tensorboard as tensorboard
    except ImportError:
        raise ValueError(f"{flag} needs the tensorboard package, which is not installed: {INSTALL}") from None
    return tensorboard


def folder_name(text: str, default: str) -> str:
    """`text` as one folder name: letters, digits and _ . = + , - kept, every other run of characters (a path
    separator among them) as one _, at most 100 characters; `default` when nothing is left."""
    name = re.sub(r"[^A-Za-z0-9_.=+,-]+", "_", text).strip("._")[:100].strip("._")
    return name or default


def check_board(directory: str | os.PathLike, flag: str = FLAG) -> Path:
    """What open_board refuses before it creates anything (the package, the path's form, a file in its way); the
    folder. For a command that creates other files first and must refuse a bad `flag` before it does."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"tensorboard={directory!r:.80} is not a folder path ({flag})")
    writer_module(flag)
    text = os.fsdecode(directory)
    if not text.strip():
        raise ValueError(f"{flag} {text!r} is empty; give a folder for the event files")
    if "\0" in text:  # no file system takes it; os.stat would raise a bare "embedded null byte"
        raise ValueError(f"{flag} {text!r} holds a NUL character; give a folder path")
    root = user_path(directory, flag)
    blocked = in_the_way(root)
    if blocked is not None:
        raise ValueError(f"{flag} {os.fspath(root)}: {blocked}; give a folder (it is created if missing)")
    check_writable(root, flag, f"choose a writable folder ({flag})", folder=True)
    return root


def open_board(directory: str | os.PathLike, recipe: str, flag: str = FLAG) -> Board:
    """Before training: the package importable, `directory` created if missing, and this command's own new folder
    made in it and proved writable (a file made and removed there). Every refusal is one line naming `flag`."""
    root = check_board(directory, flag)
    fix = f"choose a writable folder ({flag})"
    make_folder(root, "the TensorBoard folder", fix)
    stem = f"{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{folder_name(recipe, 'recipe')}"
    suffix = 1
    while True:
        folder = root / (stem if suffix == 1 else f"{stem}-{suffix}")
        try:
            folder.mkdir()
            note_made(folder)
            break
        except FileExistsError:  # a command that began in the same second: its folder stays its own
            suffix += 1
        except OSError as e:
            raise ValueError(f"cannot create a folder in the TensorBoard folder {root} ({e.strerror}); {fix}") \
                from None
    # Proved by making a file, as the writer will: access(2) passes root where no file can be made.
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
    except OSError as e:
        _remove_empty(folder)
        raise ValueError(f"cannot write in the TensorBoard folder {folder} ({e.strerror}); {fix}") from None
    os.close(fd)
    os.unlink(probe)
    return Board(folder, recipe)


def _why(error: BaseException) -> str:
    return getattr(error, "strerror", None) or str(error)


def _remove_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (a run wrote there), or gone: kept as it is
        folder.rmdir()


class Board:
    """One command's folder of TensorBoard runs (open_board)."""

    def __init__(self, folder: Path, recipe: str):
        self.folder, self.recipe = folder, recipe
        self._settings: dict[str, str] = {}  # setting name -> its folder's name, distinct per setting

    def _setting_folder(self, setting: str) -> str:
        if setting not in self._settings:
            name, taken, suffix = folder_name(setting, "setting"), set(self._settings.values()), 2
            unique = name
            while unique in taken:
                unique, suffix = f"{name}-{suffix}", suffix + 1
            self._settings[setting] = unique
        return self._settings[setting]

    def run(self, cfg: Any, *, seed: int, dataset: str, steps: int, setting: str | None = None) -> RunLog:
        """The log of one run of `cfg` (a family's config dataclass) of `steps` optimizer steps (the family's
        run_steps): the row at that step is the final one (Steps.final), every per-epoch row comes before it."""
        folder = self.folder / (f"seed-{seed}" if setting is None else
                                os.path.join(self._setting_folder(setting), f"seed-{seed}"))
        config = dataclasses.asdict(cfg)
        hparams = {"recipe": self.recipe, "dataset": os.fsdecode(dataset), "seed": seed,
                   **({} if setting is None else {"setting": setting}),
                   **{k: _hparam(v) for k, v in config.items() if k not in ("recipe", "dataset", "seed", "setting")}}
        return RunLog(folder, hparams, batch_size=cfg.batch_size, total_steps=steps)

    def close(self) -> None:
        _remove_empty(self.folder)


def _hparam(value: Any) -> int | float | str | bool | None:
    """A config value as the hparams plugin takes it: numbers, strings and booleans as they are, None left out,
    anything else (a tuple of widths) as its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class RunLog:
    """The event file of one run; its methods are the loop's callbacks (Steps's on_scalars and on_epoch)."""

    def __init__(self, folder: Path, hparams: dict[str, Any], *, batch_size: int, total_steps: int):
        self.folder, self.hparams, self.batch_size, self.total_steps = folder, hparams, batch_size, total_steps
        self._pending: list[tuple[int, torch.Tensor, float, float | None]] = []
        self._last_row = (0, 0.0)  # (step, timed seconds) at the previous row
        self._result: dict[str, float] = {}
        self._closed = False
        try:  # a queue and a flush interval that never fill or expire: the rows flush (_writing), nothing else
            self._writer = writer_module().SummaryWriter(log_dir=os.fspath(folder), max_queue=1 << 20,
                                                         flush_secs=1 << 20)
        except OSError as e:
            warn(f"TensorBoard: cannot write {folder} ({_why(e)}); the run goes on without it")
            self._closed = True

    def scalars(self, step: int, loss: torch.Tensor, loss_scale: float, lr: float | None) -> None:
        """Steps's per-step hook: kept as is (the 0-d detached loss, still on the device), read at the next row."""
        if not self._closed:
            self._pending.append((step, loss, loss_scale, lr))

    def _add(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, global_step=step)

    def _write_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        # (S,): one synchronization for every step since the last row
        losses = torch.stack([loss.detach().reshape(()).double() for _, loss, _, _ in pending]).tolist()
        for (step, _, scale, lr), loss in zip(pending, losses):
            self._add("train/loss", loss * scale, step)
            if lr is not None:
                self._add("train/lr", lr, step)

    def _writing(self, write: Callable[[], None], failures: type[BaseException] | tuple = OSError) -> None:
        """write(), then the file flushed; a failure to write (a full disk: `failures`) is a warning and ends this
        log, never the run."""
        if self._closed:
            return
        try:
            write()
            self._writer.flush()
        except failures as e:
            warn(f"TensorBoard: stopped writing {self.folder} ({_why(e)}); the run goes on")
            self._pending.clear()
            self._closed = True
            with contextlib.suppress(Exception):
                self._writer.close()

    def row(self, row: dict) -> None:
        """Steps's on_epoch: a per-epoch row, or the final one (at the run's last step)."""
        self._writing(lambda: self._write_row(row))

    def _write_row(self, row: dict) -> None:
        self._write_pending()
        step, seconds = row["step"], row["train_seconds"]
        for key in ("train_loss", "train_acc") + (() if step >= self.total_steps else ("val_acc",)):
            if row.get(key) is not None:
                self._add(f"epoch/{key}", row[key], step)
        if step >= self.total_steps:  # the final row: its val_acc is the run's accuracy (with TTA)
            if row.get("val_acc") is not None:
                self._result["final/accuracy"] = row["val_acc"]
            self._result["final/train_seconds"] = seconds
            if seconds > 0:
                self._result["final/images_per_second"] = step * self.batch_size / seconds
            for tag, value in self._result.items():
                self._add(tag, value, step)
            return
        last_step, last_seconds = self._last_row
        if seconds > last_seconds and step > last_step:
            self._add("train/images_per_second", (step - last_step) * self.batch_size / (seconds - last_seconds),
                      step)
        self._last_row = (step, seconds)

    def close(self) -> None:
        """The steps not yet written (a run that diverged or was interrupted), the hparams with the run's metrics,
        and the file closed."""
        def write():
            self._write_pending()
            metrics = {tag: self._result.get(tag, math.nan)
                       for tag in ("final/accuracy", "final/train_seconds", "final/images_per_second")}
            given = {k: v for k, v in self.hparams.items() if v is not None}
            for summary in writer_module().summary.hparams(given, metrics):
                self._writer.file_writer.add_summary(summary)

        # Any failure here a warning: close() runs on the way out of a run that failed too, whose error must show.
        self._writing(write, (OSError, RuntimeError, ValueError))
        if not self._closed:
            self._closed = True
            self._writer.close()


@contextlib.contextmanager
def run_log(board: Board | None, cfg: Any, **run: Any) -> Iterator[RunLog | None]:
    """board.run(cfg, **run) for the block, closed after it whatever happens; None (no hooks) without a board."""
    if board is None:
        yield None
        return
    log = board.run(cfg, **run)
    try:
        yield log
    finally:
        log.close()


def run_hooks(log: RunLog | None, *, on_step: Callable[[int, int], None] | None = None,
              on_epoch: Callable[[dict], None] | None = None, checkpoints: Any = None) -> RunHooks:
    """A run's hooks (engine.loop.RunHooks) with the log's (each step's numbers, each table row) added to the
    caller's progress, table and checkpoints; the caller's alone without a log."""
    return RunHooks(on_step=on_step, on_epoch=on_epoch_too(log, on_epoch),
                    on_scalars=None if log is None else log.scalars, checkpoints=checkpoints)


def on_epoch_too(log: RunLog | None, on_epoch: Callable[[dict], None] | None) -> Callable[[dict], None] | None:
    """`on_epoch` (the display's, or None) and then the log's row, as one callback; `on_epoch` itself without a
    log."""
    if log is None or on_epoch is None:
        return on_epoch if log is None else log.row

    def both(row: dict) -> None:
        on_epoch(row)
        log.row(row)

    return both
