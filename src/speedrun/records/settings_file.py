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
import stat
from pathlib import Path

from speedrun.records.result_file import write_json

VERSION = 1
MAX_SETTINGS_BYTES = 64 * 1024
MAX_VALUE_CHARS = 200


def write_settings(path: Path, *, recipe: str, device: str, device_name: str | None, settings: dict[str, str],
                   measured: dict) -> Path:
    """Write a settings file at `path` (already claimed: never replaces a file). `measured`: where the numbers
    came from (the tune command, its time, the report's id)."""
    return write_json(path, {"speedrun_settings": VERSION, "recipe": recipe, "device": device,
                             "device_name": device_name, "settings": settings, "measured": measured})


def _read_bounded(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_SETTINGS_BYTES + 1)
    finally:
        os.close(fd)


def read_settings(path: str | os.PathLike) -> dict:
    """The settings file at `path`, checked (ValueError, one line naming the file and the fix)."""
    path = Path(path)
    fix = "write it with speedrun tune RECIPE --apply FILE"
    try:
        raw = _read_bounded(path)
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


def overrides_from(path: str | os.PathLike, recipe: str, device: str) -> tuple[dict[str, str], dict]:
    """(config overrides, what the result records) from the settings file at `path` for a run of `recipe` on a
    `device` ("cpu", "cuda", ...); a file measured for another recipe or device type is refused."""
    obj = read_settings(path)
    if obj["recipe"] != recipe:
        raise ValueError(f"settings file {path} was measured for {obj['recipe'][:60]!r}, not {recipe}: run speedrun "
                         f"tune {recipe} --apply FILE for this recipe, or leave out --settings")
    if obj["device"] != device:
        raise ValueError(f"settings file {path} was measured on {obj['device'][:20]!r}, not {device}: run speedrun "
                         f"tune {recipe} --apply FILE on this device, or leave out --settings")
    return dict(obj["settings"]), {"file": os.fspath(path), "settings": obj["settings"],
                                   "device_name": obj.get("device_name"), "measured": obj.get("measured")}
