"""Paths: the ones the user gives (flags, environment variables, the Python API's arguments), expanded in one
place, and the folders speedrun creates.

`~user/...` names a home folder; Python's expansion raises RuntimeError when no such user exists, which would
reach the user as an internal error. Every user-given path goes through `user_path`, which turns that into a
one-line refusal naming where the path came from.

Folders speedrun creates (the data root's downloads/ and cache/, imagenet-debug's shards, a prepare DST): when one
cannot be created because a file stands where it or one of its parents should be, the message says that, not the
system's "File exists" or "Not a directory" with advice about permissions that is not the problem.
"""

from __future__ import annotations

import os
import stat
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
    # Empty (given="" or SPEEDRUN_DATA=""): not given, the default, as a shell's `SPEEDRUN_DATA= speedrun ...`
    # means. Only whitespace is no folder anyone means (Path("  ") is a folder named two spaces in the working
    # folder), so it is refused.
    env = os.environ.get("SPEEDRUN_DATA", "")
    if given:
        _not_blank(given, what, "leave it out")
        root = user_path(given, what)
    elif env:
        _not_blank(env, "SPEEDRUN_DATA", "leave it empty or unset it")
        root, what = user_path(env, "SPEEDRUN_DATA"), "SPEEDRUN_DATA"
    else:
        try:
            root, what = Path.home() / ".cache" / "speedrun", "the default data folder"
        except RuntimeError:
            raise ValueError("this account has no home folder for the default data folder ~/.cache/speedrun; "
                             "set SPEEDRUN_DATA to a folder") from None
    # The root itself only: a data root below a file still serves what needs no cache (a folder dataset loads,
    # with a warning naming the file, where its cache would be written).
    if os.path.lexists(root) and not root.is_dir():
        raise ValueError(f"{what} {os.fspath(root)} is a file, not a folder; point {what} at a folder "
                         "(it holds downloads and caches)")
    return root


def _not_blank(path: str | os.PathLike, what: str, default: str) -> None:
    text = os.fsdecode(path)
    if not text.strip():
        raise ValueError(f"{what} is {text!r}, only whitespace; name a folder, or {default} for the default "
                         "~/.cache/speedrun")


def in_the_way(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be (or be made) a folder: "PATH is a file, not a folder" for the outermost of it and its
    parents that exists and is not a folder (a file, a link to one, a broken link, a FIFO ...); None when nothing
    is in the way."""
    path = Path(os.path.abspath(path))
    for p in [*reversed(path.parents), path]:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if os.path.islink(p):
                return f"{p} is a broken link, not a folder"
            return None  # the rest is missing: mkdir makes it
        except OSError:  # ELOOP, EACCES ...: not "in the way"; the caller reports its own error
            return None
        if stat.S_ISREG(st.st_mode):
            return f"{p} is a file, not a folder"
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a folder (a device, FIFO or socket)"
    return None


def make_folder(path: str | os.PathLike, what: str, fix: str) -> None:
    """Create the folder `path` (`what`, for the message) and its parents. Raises ValueError when it cannot: a
    file in the way is named as such (in_the_way), any other failure gives the system's reason; both end with
    `fix`."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = in_the_way(path) or f"{e.strerror or e}"
        raise ValueError(f"cannot create {what} {os.fspath(path)} ({why}); {fix}") from None
