"""Settings files: what `speedrun tune --apply FILE` recommends for a recipe on a device, read by `speedrun train
--settings FILE` (or $SPEEDRUN_SETTINGS), and recorded in every result trained with them.

A file holds config keys and values as `--set` takes them (strings), with the recipe and device they were measured
for. It is a file from elsewhere when read: bounded (MAX_SETTINGS_BYTES), a regular file, JSON of exactly this
shape; the values are then parsed and checked by the recipe's config like any `--set`. A file measured for another
recipe or device type is refused: what pays on one is not known to pay on another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from speedrun.errors import warn
from speedrun.records.result_file import read_bounded, write_json

VERSION = 1
ENVIRONMENT = "$SPEEDRUN_SETTINGS"
MAX_SETTINGS_BYTES = 64 * 1024
MAX_VALUE_CHARS = 200


def write_settings(path: Path, *, recipe: str, device: str, device_name: str | None, settings: dict[str, str],
                   measured: dict) -> Path:
    """Write a settings file at `path` (already claimed: never replaces a file). `measured`: where the numbers
    came from (the tune command, its time, the report's id)."""
    return write_json(path, {"speedrun_settings": VERSION, "recipe": recipe, "device": device,
                             "device_name": device_name, "settings": settings, "measured": measured})


def read_settings(path: str | os.PathLike) -> dict:
    """The settings file at `path`, checked (ValueError, one line naming the file and the fix)."""
    path = Path(path)
    fix = "write it with speedrun tune RECIPE --apply FILE"
    try:
        raw = read_bounded(path, MAX_SETTINGS_BYTES)
    except OSError as e:
        raise ValueError(f"settings file {path}: {e.strerror or e}; {fix}") from None
    if len(raw) > MAX_SETTINGS_BYTES:
        raise ValueError(f"settings file {path}: over {MAX_SETTINGS_BYTES:,} bytes, not a settings file; {fix}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"settings file {path}: not JSON; {fix}") from None
    if not isinstance(obj, dict) or obj.get("speedrun_settings") != VERSION:
        raise ValueError(f"settings file {path}: not a speedrun settings file (version {VERSION}); {fix}")
    settings = obj.get("settings")
    if not (isinstance(obj.get("recipe"), str) and isinstance(obj.get("device"), str) and isinstance(settings, dict)):
        raise ValueError(f"settings file {path}: recipe, device and settings are missing or malformed; {fix}")
    for key, value in settings.items():
        if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS or len(key) > MAX_VALUE_CHARS:
            raise ValueError(f"settings file {path}: {key[:40]!r} must map to a string as --set takes it; {fix}")
    return obj


def overrides_from(path: str | os.PathLike, recipe: str, device: str, device_name: str | None = None,
                   source: str = "--settings") -> tuple[dict[str, str], dict | None]:
    """(config overrides, what the result records) from the settings file at `path` for a run of `recipe` on a
    `device` ("cpu", "cuda", ...) named `device_name`. `source` says where the path came from: a file given with
    --settings that was measured for another recipe or device type is refused; one from $SPEEDRUN_SETTINGS (set
    once for every command) is skipped with a warning. Measured on another device of the same type: a warning."""
    obj = read_settings(path)
    mismatch = None
    if obj["recipe"] != recipe:
        mismatch = f"was measured for {obj['recipe'][:60]!r}, not {recipe}"
    elif obj["device"] != device:
        mismatch = f"was measured on {obj['device'][:20]!r}, not {device}"
    if mismatch is not None:
        fix = "unset SPEEDRUN_SETTINGS" if source == ENVIRONMENT else "leave out --settings"
        text = f"settings file {path} ({source}) {mismatch}: run speedrun tune {recipe} --apply FILE here, or {fix}"
        if source == ENVIRONMENT:
            warn(text + "; not applied")
            return {}, None
        raise ValueError(text)
    measured_on = obj.get("device_name")
    if isinstance(measured_on, str) and device_name and measured_on != device_name:
        warn(f"settings file {path} was measured on {measured_on[:60]!r}; this is {device_name[:60]!r}: what paid "
             f"there may not here (speedrun tune {recipe} measures this device)")
    return dict(obj["settings"]), {"file": os.fspath(path), "source": source, "settings": obj["settings"],
                                   "device_name": measured_on if isinstance(measured_on, str) else None,
                                   "measured": obj.get("measured")}
