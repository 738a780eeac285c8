"""Paths the user gives (flags, environment variables, the Python API's arguments), expanded in one place.

`~user/...` names a home folder; Python's expansion raises RuntimeError when no such user exists, which would
reach the user as an internal error. Every user-given path goes through `user_path`, which turns that into a
one-line refusal naming where the path came from.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_path(path: str | os.PathLike, what: str) -> Path:
    """`path` with a leading ~ or ~user expanded. `what`: where the path came from, for the message
    ("--db", "SPEEDRUN_DATA", ...). Raises ValueError when the ~ cannot be expanded."""
    text = os.fsdecode(path)
    try:
        return Path(text).expanduser()
    except RuntimeError:  # "~nobody/x": no such user (or no home folder at all for "~")
        user = text[1:].split("/", 1)[0].split(os.sep, 1)[0]
        who = f"user {user!r} has no home folder here" if user else "this account has no home folder"
        raise ValueError(f"{what} {text!r}: cannot expand its ~ ({who}); give the path in full") from None


def data_root(given: str | os.PathLike | None = None, what: str = "--data-dir") -> Path:
    """Where downloads, decoded caches and measured peaks live: `given` (named `what` in messages) when given, else
    $SPEEDRUN_DATA, else ~/.cache/speedrun. Refused when it exists and is not a folder (a later write there would
    fail with advice about permissions that is not the problem)."""
    if given:
        root = user_path(given, what)
    elif os.environ.get("SPEEDRUN_DATA"):
        root, what = user_path(os.environ["SPEEDRUN_DATA"], "SPEEDRUN_DATA"), "SPEEDRUN_DATA"
    else:
        try:
            root, what = Path.home() / ".cache" / "speedrun", "the default data folder"
        except RuntimeError:
            raise ValueError("this account has no home folder for the default data folder ~/.cache/speedrun; "
                             "set SPEEDRUN_DATA to a folder") from None
    if os.path.lexists(root) and not root.is_dir():
        raise ValueError(f"{what} {os.fspath(root)} is a file, not a folder; point {what} at a folder "
                         "(it holds downloads and caches)")
    return root
