"""Settings files: what `speedrun tune --apply FILE` recommends for a recipe on a device, read by `speedrun train
--settings FILE` (or $SPEEDRUN_SETTINGS), and recorded in every result trained with them.

A file holds config keys and values as `--set` takes them (strings), with the recipe and device they were measured
for. It is a file from elsewhere when read: bounded (MAX_SETTINGS_BYTES), a regular file, JSON of exactly this
shape (a UTF-8 byte order mark, which some editors write, is allowed); the values are then parsed and checked by the
recipe's config like any `--set`. It may hold only the performance settings tune measures (KEYS): a file set once
in $SPEEDRUN_SETTINGS must not change what a run measures (its epochs, its target) unseen. A file measured for
another recipe or device type is refused: what pays on one is not known to pay on another.

`speedrun sweep --write-settings FILE` writes the same shape with "written_by": "sweep": the best trial's
configuration, any key of the recipe's config (SweepSettings). Such a file changes what a run trains, so it applies
only when given with --settings (from $SPEEDRUN_SETTINGS it is skipped with a warning); its keys are checked against
the recipe's config (an unknown one is refused), and one written for another recipe is refused. Hyperparameters
found on one device type are the recipe's, not the device's: another device type is a warning there.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from speedrun.config import ConfigError
from speedrun.errors import warn
from speedrun.records.result_file import read_bounded, unencodable, write_json

VERSION = 1
ENVIRONMENT = "$SPEEDRUN_SETTINGS"
MAX_SETTINGS_BYTES = 64 * 1024
MAX_VALUE_CHARS = 200
# "measured", which every result trained with the file carries (overrides_from): what write_settings' callers give,
# a dict of numbers and strings whose deepest value is tune's measured.against.set[KEY] (3 levels), sweep's
# measured.ci95[i] (2). Deeper is not a settings file, and would reach Python's recursion limit in the writers of
# every result that carries it (result_file.write_json, the database's json.dumps).
MAX_MEASURED_DEPTH = 4
# What a settings file may set: the keys instruments/tune.py measures (its GUIDE), and compile_mode, which it sets
# beside compile. Each changes how fast a run goes; precision, half_weights and batch_size may change the numbers too,
# and tune recommends them only where the accuracy held (tests/test_redteam_models_settings.py keeps the two lists
# equal).
KEYS = frozenset({"precision", "channels_last", "compile", "compile_mode", "cudnn_benchmark", "cpu_threads",
                  "batch_size", "optimizer_kernel", "eval_batch_size", "workers", "pin_memory", "prefetch_factor",
                  "half_weights", "check_finite_every_steps", "index_free_eval_pool", "muon_ns_compile"})
# What wrote a file ("written_by"; absent: tune, which wrote every file before sweeps did).
WRITERS = ("tune", "sweep")
# Every key a settings file holds at its top (what write_settings writes): another one is a typo or another program's
# field, which must not pass as read.
TOP_KEYS = ("speedrun_settings", "recipe", "device", "device_name", "settings", "measured", "written_by")


class _RepeatedKey(ValueError):
    """A key that one JSON object of the file holds twice (json keeps the last without a word)."""


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: the object as a dict, refusing a key it holds twice."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)


def _nesting(text: str) -> int:
    """How deep the arrays and objects of JSON `text` go, counted without parsing (the parser recurses)."""
    depth = deepest = 0
    for c in re.sub(r'"(?:[^"\\]|\\.)*"', "", text):  # strings' brackets are not nesting
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


class SweepSettings(dict):
    """The overrides of a file `speedrun sweep` wrote: check_keys takes any key of the recipe's config from it."""


def write_settings(path: Path, *, recipe: str, device: str, device_name: str | None, settings: dict[str, str],
                   measured: dict, written_by: str = "tune") -> Path:
    """Write a settings file at `path` (already claimed: never replaces a file). `measured`: where the numbers
    came from (the tune or sweep command, its time, the report's id). written_by: "tune" or "sweep"."""
    assert written_by in WRITERS, written_by
    return write_json(path, {"speedrun_settings": VERSION, "recipe": recipe, "device": device,
                             "device_name": device_name, "settings": settings, "measured": measured,
                             **({} if written_by == "tune" else {"written_by": written_by})})


def read_settings(path: str | os.PathLike) -> dict:
    """The settings file at `path`, checked (ValueError, one line naming the file and the fix)."""
    shown, path = os.fspath(path), Path(path)  # shown as given: the caller names the same text
    fix = "write it with speedrun tune RECIPE --apply FILE or speedrun sweep RECIPE ... --write-settings FILE"
    try:
        raw = read_bounded(path, MAX_SETTINGS_BYTES)
    except OSError as e:
        raise ValueError(f"settings file {shown}: {e.strerror or e}; {fix}") from None
    if len(raw) > MAX_SETTINGS_BYTES:
        raise ValueError(f"settings file {shown}: over {MAX_SETTINGS_BYTES:,} bytes, not a settings file; {fix}")
    try:
        text = raw.decode("utf-8-sig")  # utf-8-sig: a leading byte order mark is skipped
    except UnicodeDecodeError as e:
        raise ValueError(f"settings file {shown}: not JSON: not UTF-8 text ({e.reason} at byte {e.start}); "
                         f"{fix}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_repeats)
    except _RepeatedKey as e:
        raise ValueError(f"settings file {shown}: the key {_key(e.args[0])} appears twice in one object (a JSON "
                         f"reader keeps the last unseen); keep the one meant; {fix}") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise ValueError(f"settings file {shown}: not JSON ({e}); {fix}") from None
    except RecursionError:
        raise ValueError(f"settings file {shown}: JSON nested {_nesting(text):,} levels deep, too deep to read (a "
                         f"settings file nests {MAX_MEASURED_DEPTH + 1} levels at most); {fix}") from None
    # exactly the int: true == 1 and 1.0 == 1 in Python, and neither is what write_settings writes
    version = obj.get("speedrun_settings") if isinstance(obj, dict) else None
    if type(version) is not int or version != VERSION:
        raise ValueError(f"settings file {shown}: not a speedrun settings file (version {VERSION}); {fix}")
    unknown = [key for key in obj if key not in TOP_KEYS]
    if unknown:
        raise ValueError(f"settings file {shown}: unknown key {_key(unknown[0])}; a settings file holds "
                         f"{', '.join(TOP_KEYS)}; remove it, or {fix}")
    where = unencodable(obj)
    if where is not None:  # every result trained with the file carries its strings: its row would be lost
        raise ValueError(f"settings file {shown}: the string at {where} is no text UTF-8 can hold (a lone surrogate, "
                         f"as a JSON escape such as \\udc80 writes), which no result can store; {fix}")
    settings = obj.get("settings")
    if not (isinstance(obj.get("recipe"), str) and isinstance(obj.get("device"), str) and isinstance(settings, dict)):
        raise ValueError(f"settings file {shown}: recipe, device and settings are missing or malformed; {fix}")
    for key, value in settings.items():
        if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS or len(key) > MAX_VALUE_CHARS:
            raise ValueError(f"settings file {shown}: {key[:40]!r} must map to a string as --set takes it; {fix}")
    measured_on = obj.get("device_name")
    if measured_on is not None and not (isinstance(measured_on, str) and len(measured_on) <= MAX_VALUE_CHARS):
        raise ValueError(f"settings file {shown}: device_name must be null or a name of at most {MAX_VALUE_CHARS} "
                         f"characters; {fix}")
    problem = _measured_problem(obj.get("measured"))
    if problem is not None:
        raise ValueError(f"settings file {shown}: measured {problem}, not what speedrun tune or sweep writes; {fix}")
    if obj.get("written_by", "tune") not in WRITERS:
        raise ValueError(f"settings file {shown}: written_by is {str(obj.get('written_by'))[:40]!r}, not one of "
                         f"{', '.join(WRITERS)}; {fix}")
    return obj


def _key(key: str) -> str:
    """A key from the file for a message: quoted, and cut short (a key may be 60,000 characters)."""
    return repr(key) if len(key) <= 60 else f"{key[:40]!r}... ({len(key):,} characters)"


def _measured_problem(measured) -> str | None:
    """What is wrong with a settings file's parsed "measured" (null, or an object nested at most MAX_MEASURED_DEPTH
    levels whose numbers are finite and integers fit 64 bits); None when nothing is. Walked without recursion: the
    value may be nested past Python's recursion limit."""
    if measured is None:
        return None
    if not isinstance(measured, dict):
        return f"is {type(measured).__name__}, not an object"
    stack = [(measured, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (dict, list)):
            if level > MAX_MEASURED_DEPTH:
                return f"is nested more than {MAX_MEASURED_DEPTH} levels deep"
            stack.extend((child, level + 1) for child in (value.values() if isinstance(value, dict) else value))
        elif isinstance(value, float) and not math.isfinite(value):
            return f"holds {value}, not a finite number"
        elif isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            return "holds an integer past 64 bits"
    return None


def check_keys(settings: dict[str, str], config_keys) -> None:
    """Refuse (ValueError naming the key and the fix) a key of `settings` that is not one of KEYS in `config_keys`
    (the recipe's config fields); from a sweep's file (SweepSettings), a key that is not in `config_keys`."""
    if isinstance(settings, SweepSettings):
        for key in settings:
            if key not in config_keys:
                raise ValueError(f"unknown config key {key[:60]!r} in a settings file written by speedrun sweep; "
                                 f"valid keys: {', '.join(sorted(config_keys))}; remove it from the file")
        return
    allowed = ", ".join(sorted(KEYS & set(config_keys)))
    for key in settings:
        shown = key[:60]
        if key not in config_keys:
            raise ValueError(f"unknown config key {shown!r}: a settings file holds only the performance settings "
                             f"speedrun tune measures ({allowed}); remove it from the file")
        if key not in KEYS:
            raise ValueError(f"{shown} is not a performance setting: a settings file holds only what speedrun tune "
                             f"measures ({allowed}), which change how fast a run goes, not what it measures; remove "
                             f"it from the file (give --set {shown}=... for a run meant to change it)")


def leave_out(source: str) -> str:
    """How to run without the settings file that came from `source`."""
    return "unset SPEEDRUN_SETTINGS" if source == ENVIRONMENT else "leave out --settings"


def named_values(error: BaseException | str, settings: dict[str, str]) -> str:
    """The keys of `settings` that `error` is about, each as key=value, comma-separated; empty where it is about
    none. A config.ConfigError carries them; for a refusal that carries none (a range check's text, an error from
    outside config, a message alone), they are the keys its text names as whole words ("batch_size" is not named by
    "eval_batch_size")."""
    keys = error.keys if isinstance(error, ConfigError) else ()
    if not keys:
        text = str(error)
        keys = tuple(k for k in settings if re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", text))
    return ", ".join(f"{k}={settings[k]}" for k in settings if k in keys)


def overrides_from(path: str | os.PathLike, recipe: str, device: str, device_name: str | None = None,
                   source: str = "--settings") -> tuple[dict[str, str], dict | None]:
    """(config overrides, what the result records) from the settings file at `path` for a run of `recipe` on a
    `device` ("cpu", "cuda", ...) named `device_name`. `source` says where the path came from: a file given with
    --settings that was measured for another recipe or device type is refused; one from $SPEEDRUN_SETTINGS (set
    once for every command) is skipped with a warning. Measured on another device of the same type: a warning."""
    obj = read_settings(path)
    swept = obj.get("written_by") == "sweep"
    if swept and source == ENVIRONMENT:
        warn(f"settings file {path} ({source}) was written by speedrun sweep: its values change what a run trains, "
             "so it applies only when given with --settings FILE; not applied")
        return {}, None
    mismatch = None
    if obj["recipe"] != recipe:
        mismatch = f"was measured for {obj['recipe'][:60]!r}, not {recipe}"
    elif obj["device"] != device and not swept:
        mismatch = f"was measured on {obj['device'][:20]!r}, not {device}"
    if mismatch is not None:
        write = (f"speedrun sweep {recipe} ... --write-settings FILE" if swept
                 else f"speedrun tune {recipe} --apply FILE")
        text = f"settings file {path} ({source}) {mismatch}: run {write} here, or {leave_out(source)}"
        if source == ENVIRONMENT:
            warn(text + "; not applied")
            return {}, None
        raise ValueError(text)
    measured_on = obj.get("device_name")
    if swept and obj["device"] != device:
        warn(f"settings file {path} was found by a sweep on {obj['device'][:20]!r}; this run is on {device}: the "
             f"best hyperparameters there may not be the best here")
    elif isinstance(measured_on, str) and device_name and measured_on != device_name:
        warn(f"settings file {path} was measured on {measured_on[:60]!r}; this is {device_name[:60]!r}: what paid "
             f"there may not here (speedrun tune {recipe} measures this device)")
    found = (SweepSettings if swept else dict)(obj["settings"])
    return found, {"file": os.fspath(path), "source": source, "settings": obj["settings"],
                   "device_name": measured_on if isinstance(measured_on, str) else None,
                   "measured": obj.get("measured"), **({"written_by": "sweep"} if swept else {})}
