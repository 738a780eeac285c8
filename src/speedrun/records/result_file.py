"""Result files: one self-describing JSON file per command, written atomically, never overwritten, and read back
with bounded memory (a result file is a file from elsewhere). What a result records of where it ran is
environment.py's. Tables and README records are generated from these files."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import stat
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from speedrun.errors import clip
from speedrun.paths import check_file_name, check_writable, folder_trouble, make_dirs, user_path
from speedrun.records.stats import summarize
from speedrun.records.typed_files import SWEEP_REPORT, TRAIN_RESULT, FinishedRun, checked


def _to_json(obj):
    """json.dump's default=: the non-JSON types results carry. Tuples need nothing: json writes them as lists."""
    if isinstance(obj, Path):
        return str(obj)
    # torch's types by name: this module is read by the file commands, which must not import torch
    kind = (type(obj).__module__.split(".")[0], type(obj).__name__)
    if kind in (("torch", "dtype"), ("torch", "device")):
        return str(obj)  # "torch.bfloat16", "cuda:0"
    if isinstance(obj, (np.generic, np.ndarray)) or kind == ("torch", "Tensor"):
        return obj.tolist()  # numpy scalars and 0-d tensors become Python numbers
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)  # configs and stats.Summary
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    raise TypeError(f"cannot store {type(obj).__name__} in a result JSON; convert it to str, number, list or dict")


def _finite_or_null(obj):
    """A copy with every NaN/inf float as None: json would write bare NaN, which strict parsers reject. Where a
    non-finite value is the news (a diverged loss), the writer stores it as a string itself."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return obj


def portable(obj):
    """`obj` exactly as write_json stores it and load_result reads it back (strict JSON: NaN as null)."""
    return json.loads(json.dumps(_finite_or_null(obj), default=_to_json, allow_nan=False))


def unencodable(obj) -> str | None:
    """Where in parsed JSON `obj` a string (a key or a value) is that UTF-8 cannot encode, as "device_name" or
    "measured.rows[2]"; None when there is none. JSON's escape "\\udc80" reads as a lone surrogate, which Python
    keeps but no database or strict JSON writer takes: a file that holds one, stored in a result, would lose the
    result's row at the end of the run. Walked without recursion: `obj` may be nested deep."""
    stack: list[tuple[object, str]] = [(obj, "")]
    while stack:
        value, where = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            at = f"{where}[{key}]" if isinstance(value, list) else f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and not _encodes(key):
                return f"a key in {clip(where, 80) if where else 'the top object'}"
            stack.append((child, at))
        if isinstance(value, str) and not _encodes(value):
            return clip(where, 80) if where else "the whole value"
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def write_json(path: str | Path, obj) -> Path:
    """Write obj as JSON at path atomically: readers see the old file or the whole new one, never a part.

    The temp file sits in the same directory because os.replace is atomic only within one filesystem; fsync
    before the rename so a crash cannot leave the new name pointing at unwritten blocks (the ext4 delayed-
    allocation lesson, see LWN "ext4 and data loss", 2009).
    """
    text = json.dumps(_finite_or_null(obj), indent=2, sort_keys=False, default=_to_json, allow_nan=False)
    return write_text(path, text + "\n")


def write_text(path: str | Path, text: str, mode: int = 0o644) -> Path:
    """Write text (UTF-8) at path atomically, as write_json does (its docstring says why each step); `mode`: the
    file's permissions. An error names `path`, never the temporary file."""
    path = Path(path)
    try:
        return _write_atomically(path, text, mode)
    except OSError as e:
        if e.strerror is None or e.filename is None or e.filename == str(path):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None  # it named the temporary file


def _write_atomically(path: Path, text: str, mode: int) -> Path:
    make_dirs(path.parent)
    # A short temporary name: the result's own name may be near the file system's 255-character limit.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".speedrun-result-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600; results are meant to be shared and read by other users
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: never leave the temp file behind
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable; directories cannot be opened this way on Windows
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return path


def _slug(text: str, what: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._")
    if not slug:
        raise ValueError(f"{what} {text!r} has no usable characters for a file name; use letters, digits, _ . -")
    return slug


def results_root() -> Path:
    """The folder of default result files: $SPEEDRUN_RESULTS, else ./results."""
    # expanded as SPEEDRUN_DATA is: a literal "~" folder invites a later `rm -rf ~`
    return user_path(os.environ.get("SPEEDRUN_RESULTS") or "results", "SPEEDRUN_RESULTS")


def check_result_path(path: str | os.PathLike | None, flag: str = "--json") -> None:
    """What claim_result_path(path) (default_result_path, for None) would refuse for its name or for want of a
    folder it may write, checked by a command before it makes any of its files."""
    if path is None:
        check_writable(results_root(), "the results folder (SPEEDRUN_RESULTS, else ./results)",
                       f"set SPEEDRUN_RESULTS to a writable directory or give a path ({flag})", folder=True)
        return
    check_file_name(path, flag)
    path = user_path(path, flag)
    if os.path.lexists(path):
        raise _taken(path, flag)
    check_writable(path, flag, f"choose a writable path ({flag})")


def default_result_path(recipe: str, dataset: str, root: str | Path | None = None, extension: str = ".json") -> Path:
    """A fresh results/YYYYmmdd-HHMMSS-<recipe>-<dataset>.json (UTC; `extension` in place of .json), claimed so no
    other run can take it.

    root: $SPEEDRUN_RESULTS, else ./results. dataset may be a name or a path (its basename is used). If the name is
    taken (two runs in one second), -2, -3, ... is appended. The claim is an empty file created with O_EXCL, which is
    atomic even between processes; write_json later replaces it whole. An empty file therefore marks a run that
    never finished, and load_result says so.
    """
    root = results_root() if root is None else user_path(root, "SPEEDRUN_RESULTS")
    dataset_name = os.path.basename(str(dataset).rstrip("/\\")) or str(dataset)
    try:
        dataset_slug = _slug(dataset_name[:64], "dataset")
    except ValueError:  # a path such as "/" or one of punctuation only: the file name just says "dataset"
        dataset_slug = "dataset"
    stem = "-".join([datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), _slug(recipe, "recipe"), dataset_slug])
    suffix = 1
    try:
        make_dirs(root)
        while True:
            candidate = root / (f"{stem}{extension}" if suffix == 1 else f"{stem}-{suffix}{extension}")
            try:
                os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                suffix += 1
                continue
            return candidate
    except OSError as e:  # a file or a symlink loop named as such, not as "File exists"
        raise ValueError(f"cannot create a result file in {root} ({folder_trouble(root, e)}); set SPEEDRUN_RESULTS to "
                         "a writable directory or give a path (--json)") from None


def claim_result_path(path: str | Path, flag: str = "--json") -> Path:
    """Create `path` empty and exclusively, so a result never replaces a file and an unwritable path fails now.
    `flag`: what the user gave the path with, for the message (`--trace`, `--apply`, ...). An empty name, and one
    that names a folder by its form (a trailing separator, a last part "." or ".."), are refused: a Path drops
    the trailing "/" of "sub/dir/", which would become a file named dir."""
    check_file_name(path, flag)
    path = user_path(path, flag)
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError):  # a name too long, or holding a NUL byte: os.open below says which
        is_dir = False
    if is_dir:
        raise ValueError(f"result path {path} is a directory; give a file name ({flag})")
    try:
        make_dirs(path.parent)
    except OSError as e:  # a file or a symlink loop where a folder should be, a folder we may not write ...
        raise ValueError(f"cannot create the result file {path} ({folder_trouble(path.parent, e)}); choose another "
                         f"path ({flag})") from None
    except ValueError as e:  # a NUL byte in the name
        raise _cannot_create(path, e, flag) from None
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        raise _taken(path, flag) from None
    except (OSError, ValueError) as e:
        raise _cannot_create(path, e, flag) from None
    return path


def _taken(path: Path, flag: str) -> ValueError:
    """The refusal of a result path where something is (a result is never written over anything)."""
    if os.path.isdir(path):
        return ValueError(f"result path {path} is a directory; give a file name ({flag})")
    if os.path.islink(path) and not os.path.exists(path):  # O_EXCL refuses a link to nothing as well
        return ValueError(f"result path {path} is {_dangling(path)}; choose a new path ({flag}) or remove the link")
    with contextlib.suppress(OSError):
        if os.path.isfile(path) and os.path.getsize(path) == 0:  # a claim: a command writes it at its end
            return ValueError(f"result file {path} is empty: the claim of a command still running, or of one killed "
                              f"before it could write (SIGKILL); delete it if no command is writing it, or choose a "
                              f"new path ({flag})")
    return ValueError(f"result file {path} already exists and is never replaced; choose a new path ({flag}) or move "
                      "the old file away")


def _dangling(path: Path) -> str:
    """What the link `path`, which leads to no file, is: a loop, or a link to a missing name."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
    try:
        return f"a link to {os.readlink(path)}, which does not exist"
    except OSError:  # replaced meanwhile
        return "a link to a file that does not exist"


def _cannot_create(path: Path, e: OSError | ValueError, flag: str) -> ValueError:
    reason = e.strerror if isinstance(e, OSError) else str(e)
    return ValueError(f"cannot create the result file {path} ({reason}); choose a writable path ({flag})")


def release_result_path(path: Path) -> None:
    """Remove a claimed result file that never received a result (it is empty: nothing of the user's is lost)."""
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def read_bounded(path: str | os.PathLike, max_bytes: int) -> bytes:
    """At most max_bytes + 1 bytes of the regular file at `path` (a caller refuses the file when it gets more):
    opened without blocking, so a FIFO named like the file is an OSError, not a hang, and a device is refused."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", os.fspath(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(max_bytes + 1)
    finally:
        os.close(fd)


# The largest result file read back (load_result): 10,000 runs with their per-epoch histories are a few MB.
MAX_RESULT_BYTES = 64 * 2**20
# The deepest nesting of a result: a bench report's results[i].runs[j].history[k] is 7 levels. Anything deeper is
# not a result, and would reach Python's recursion limit in the comparisons and json.dumps that read it.
MAX_RESULT_DEPTH = 64
_FILE_FIX = "give a result JSON file"


class UnreadableResult(ValueError):
    """A result file or stored row that is not a result: one line, "WHERE: REASON; FIX". `reason` alone is kept for
    a caller that gives its own fix (`speedrun results import` names one for all its files)."""

    def __init__(self, where: str, reason: str, fix: str):
        super().__init__(f"{where}: {reason}; {fix}")
        self.reason = reason


def _depth(obj) -> int:
    """The nesting depth of parsed JSON (a number or string: 0), counted without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_RESULT_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def parse_result(text: str, where: str, fix: str = _FILE_FIX) -> dict:
    """The result in `text`, a file's or a database row's, checked as a result is read from anywhere: not empty,
    at most MAX_RESULT_BYTES, JSON, nested at most MAX_RESULT_DEPTH levels, an object. Otherwise an
    UnreadableResult naming `where` (a file, "row #3 of the results database r.db") and `fix`."""
    if len(text) > MAX_RESULT_BYTES:  # characters: a bound on the bytes' count too, for UTF-8 text of them
        raise UnreadableResult(where, f"{len(text)} characters, more than any result ({MAX_RESULT_BYTES} at most)",
                               fix)
    if not text.strip():
        raise UnreadableResult(where, "empty (a claimed result file whose run never finished)", fix)
    try:
        obj = json.loads(text)
    except RecursionError:
        obj = None
    except json.JSONDecodeError as e:
        raise UnreadableResult(where, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): truncated or "
                                      "not a result", fix) from None
    if obj is None or _depth(obj) > MAX_RESULT_DEPTH:
        raise UnreadableResult(where, f"JSON nested more than {MAX_RESULT_DEPTH} levels deep, too deep to be a "
                                      "result", fix)
    if not isinstance(obj, dict):
        raise UnreadableResult(where, f"a result is a JSON object, found {type(obj).__name__}", fix)
    return obj


def load_result(path: str | Path) -> dict:
    """A stored result as a dict; a truncated, empty or non-JSON file raises a one-line ValueError naming it
    (UnreadableResult)."""
    path = Path(path)
    info = path.stat()  # FileNotFoundError / PermissionError name the path
    if not stat.S_ISREG(info.st_mode):  # a fifo would block forever, /dev/zero never end
        raise UnreadableResult(str(path), "not a regular file", _FILE_FIX)
    if info.st_size > MAX_RESULT_BYTES:
        raise UnreadableResult(str(path), f"{info.st_size} bytes, more than any result ({MAX_RESULT_BYTES} at most)",
                               _FILE_FIX)
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_RESULT_BYTES + 1).decode("utf-8-sig")  # a BOM some editors add is not content
    except UnicodeDecodeError as e:
        raise UnreadableResult(str(path), f"not a result JSON (not UTF-8 text: {e.reason})", _FILE_FIX) from None
    return parse_result(text, str(path))


def check_train_result(result: dict) -> dict:
    """`result` when it is a training result whose runs can be compared and stored; else a ValueError saying what is
    wrong (the reason alone: the caller names the file or stored id, and the fix).

    Every reader of a training result's runs takes them through this one check: `speedrun results import` and every
    insert into the database, and `speedrun compare` of a file or a stored id. What a run must be is typed_files.py's
    TrainResult: a dict whose "diverged" is null (or absent, as before divergence was recorded) or a dict; a finished
    run has an accuracy in [0, 1] and timed seconds in [0, 3.2e8] (ten years), as finite numbers; seed and steps are
    integers or null. The summary a result states (n, mean_accuracy ...) is not checked here: whoever ranks or
    stores it takes runs_summary."""
    checked(TRAIN_RESULT, result)
    return result


def check_sweep_report(report: dict) -> dict:
    """`report` when it is a sweep report (instruments/sweep.py) whose trials can be drawn as stored; else a
    ValueError naming the field and what it holds (the caller names the file or stored id). What a trial must be
    is typed_files.py's SWEEP_REPORT: objective "accuracy" or "time"; trials a list and best null or one trial, each
    a dict with a non-negative integer number, a state, params a dict, n a non-negative integer or null, p in
    [0, 1], mean and each end of ci95 ([low, high], low <= high) in [0, 1] for accuracy or in [0, 3.2e8] seconds for
    time (RUN_RANGES), value in [0, 1], or [0, MAX_SWEEP_TIME_VALUE]."""
    checked(SWEEP_REPORT, report)
    return report


def runs_summary(result: dict) -> dict:
    """The summary of a training result (check_train_result's ValueError where it is none) as its finished runs give
    it, whatever the result states: {"n", "mean_accuracy", "std_accuracy", "hit_rate", "mean_seconds",
    "std_seconds"} (None where the runs give none: no finished run, one run's std, no target_accuracy). The database
    stores these as a row's columns, which the leaderboard ranks and judges by the records rule: a file stating n=50
    and mean 0.99 beside one run at 0.5 must not rank as a record."""
    typed = checked(TRAIN_RESULT, result)
    finished = [run for run in typed.runs if isinstance(run, FinishedRun)]
    n = len(finished)
    accuracy = [run.accuracy for run in finished]
    if not n:
        return {"n": 0, "mean_accuracy": None, "std_accuracy": None, "hit_rate": None, "mean_seconds": None,
                "std_seconds": None}
    acc = summarize(accuracy)  # the sample std (ddof=1); None for one run
    secs = summarize([run.train_seconds for run in finished])
    in_config = None if typed.config is None else typed.config.target_accuracy  # where older results hold it
    target = in_config if typed.target_accuracy is None else typed.target_accuracy
    hits = sum(a >= target for a in accuracy) / n if target is not None else None
    return {"n": n, "mean_accuracy": acc.mean, "std_accuracy": acc.std, "hit_rate": hits, "mean_seconds": secs.mean,
            "std_seconds": secs.std}
