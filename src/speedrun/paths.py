"""Paths: the ones the user gives (flags, environment variables, the Python API's arguments), expanded in one
place, and the folders speedrun creates.

`~user/...` names a home folder; Python's expansion raises RuntimeError when no such user exists, which would
reach the user as an internal error. Every user-given path goes through `user_path`, which turns that into a
one-line refusal naming where the path came from.

Folders speedrun creates (the data root's downloads/ and cache/, imagenet-debug's shards, a prepare DST): when one
cannot be created because a file stands where it or one of its parents should be, the message says that, not the
system's "File exists" or "Not a directory" with advice about permissions that is not the problem.

A path deeper than MAX_PATH_DEPTH or longer than the system's limit is refused by `user_path` in one line: what
would meet it later is a RecursionError (os.makedirs, pathlib's mkdir(parents=True)) or an ENAMETOOLONG part way
through making its folders. Folders are made one level at a time (`make_dirs`), never by recursion.

Two outputs of one command that name one file would overwrite or refuse each other with a message about the
wrong thing ("already exists"): `distinct_outputs` names both options instead.

A command that stops (a refusal, an error, an interrupt) leaves no empty folder it made: the CLI runs every command
inside `tidy_folders`, which notes each folder `make_dirs` (or `note_made`) makes and removes those still empty when
the command ends with an exception. Only empty folders go (rmdir): nothing written is lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

# Folders a path given to speedrun may go down, counted from the file system's root. os.makedirs, pathlib's
# mkdir(parents=True) and what libraries call them (TensorBoard's writer) recurse once per missing level, and Python
# stops at 1,000 frames, some of them already the command's own. A real tree is a few dozen levels deep; 256 leaves
# it room and keeps any recursion over the path far from the limit.
MAX_PATH_DEPTH = 256
_PATH_MAX_FALLBACK = 4096  # Linux's PATH_MAX, with its terminating NUL


def _path_max() -> int:
    """The longest path, in bytes, the system takes in one call (PATH_MAX less its NUL)."""
    try:
        return os.pathconf("/", "PC_PATH_MAX") - 1
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or no answer for "/"
        return _PATH_MAX_FALLBACK - 1


def quoted_name(name: str, keep: int = 80) -> str:
    """A name from outside (a path, an archive member) for a message: quoted whole when short, else its start
    and its length: a refused name may be 900,000 characters, and the line must stay one readable line."""
    text = repr(name)
    return text if len(text) <= keep else f"{name[:keep * 3 // 4]!r}... ({len(name):,} characters)"


# The options and variables that name one file speedrun writes, each with a file name for the example of a refusal.
# user_path refuses a path of a folder's form given to one of them ("db/x/", "out/."): Path drops a trailing "/", so
# "db/x/", meant as a folder, would otherwise become a file named x.
FILE_OUTPUTS = {"--json": "result.json", "--trace": "trace.json", "--db": "results.db", "SPEEDRUN_DB": "results.db",
                "--out": "report.html", "--readme": "README.md", "--benchmarks": "BENCHMARKS.md",
                "--apply": "settings.json", "--write-settings": "settings.json"}


def check_file_name(path: str | os.PathLike, flag: str, example: str = "result.json") -> None:
    """Refuse (one line) an output path that is empty or names a folder by its form: what `flag` (--json, --trace,
    --apply ...) takes is a file's name, which a folder's form (the user's "sub/dir/", meant as a folder to put the
    result in) would silently turn into a file of the folder's name. The message's example file name is
    FILE_OUTPUTS' for `flag`, else `example`."""
    text = os.fsdecode(path)
    example = FILE_OUTPUTS.get(flag, example)
    if not text.strip():
        raise ValueError(f"{flag} {text!r} is empty; give a file name, e.g. {example}")
    separators = tuple(sep for sep in (os.sep, os.altsep, "/") if sep)
    last = re.split("|".join(map(re.escape, separators)), text)[-1]
    if text.endswith(separators) or last in (".", ".."):
        folder = text.rstrip("".join(separators)) or text
        raise ValueError(f"{flag} {text!r} names a folder; give a file name, e.g. {os.path.join(folder, example)}")


def user_path(path: str | os.PathLike, what: str) -> Path:
    """`path` with a leading ~ or ~user expanded. `what`: where the path came from, for the message
    ("--db", "SPEEDRUN_DATA", ...). Raises ValueError when the ~ cannot be expanded, for a path deeper than
    MAX_PATH_DEPTH or longer than the system takes, and for one that is empty or of a folder's form given to an
    option that names a file (FILE_OUTPUTS)."""
    text = os.fsdecode(path)
    if what in FILE_OUTPUTS:
        check_file_name(text, what)
    try:
        expanded = Path(text).expanduser()
    except RuntimeError:  # "~nobody/x": no such user (or no home folder at all for "~")
        user = text[1:].split("/", 1)[0].split(os.sep, 1)[0]
        who = f"user {user!r} has no home folder here" if user else "this account has no home folder"
        raise ValueError(f"{what} {text!r}: cannot expand its ~ ({who}); give the path in full") from None
    _check_size(expanded, text, what)
    return expanded


def _check_size(path: Path, text: str, what: str) -> None:
    """Refuse a path deeper than MAX_PATH_DEPTH or longer than the system takes (see the module)."""
    if "\0" in text:  # no file system takes it; the caller's own open or stat names it
        return
    try:
        full = os.path.abspath(path)
    except OSError:  # the working folder was removed: the path as given is all there is to measure
        full = os.fspath(path)
    # Both counts: "a/../a/../..." is shallow once normalized (abspath) but os.makedirs walks it part by part.
    depth = max(len(path.parts), len(Path(full).parts))
    if depth > MAX_PATH_DEPTH:
        raise ValueError(f"{what} {quoted_name(text)} is {depth:,} folders deep, more than the {MAX_PATH_DEPTH} "
                         "speedrun takes; give a shorter path")
    size, limit = len(os.fsencode(full)), _path_max()
    if size > limit:
        raise ValueError(f"{what} {quoted_name(text)} is {size:,} bytes long in full, more than this system's limit of "
                         f"{limit:,}; give a shorter path")


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


def _outermost_trouble(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(the outermost of `path` and its parents that exists and is not a folder, what it is: "a file", "a broken
    link", "a symlink loop", "a device, FIFO or socket"); None when nothing is in the way, or when a part cannot be
    searched (EACCES ...: the caller's own error says so)."""
    path = Path(os.path.abspath(path))
    for p in [*reversed(path.parents), path]:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return (p, "a broken link") if os.path.islink(p) else None  # else the rest is missing: mkdir makes it
        except OSError as e:  # the outermost loop (its parents stat): mkdir would say "File exists"
            return (p, "a symlink loop") if e.errno == errno.ELOOP else None
        if stat.S_ISREG(st.st_mode):
            return p, "a file"
        if not stat.S_ISDIR(st.st_mode):
            return p, "a device, FIFO or socket"
    return None


def in_the_way(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be (or be made) a folder: "PATH is a file, not a folder" for the outermost of it and its
    parents that exists and is not a folder (a file, a link to one, a broken link, a symlink loop, a FIFO ...); None
    when nothing is in the way."""
    trouble = _outermost_trouble(path)
    if trouble is None:
        return None
    p, what = trouble
    return f"{p} is not a folder ({what})" if what.startswith("a device") else f"{p} is {what}, not a folder"


def symlink_loop(path: str | os.PathLike) -> str | None:
    """"PATH is a symlink loop" for the outermost of `path` and its parents that is one (the system says "Too many
    levels of symbolic links", or "File exists" when asked to make a folder there); None when none is."""
    trouble = _outermost_trouble(path)
    return f"{trouble[0]} is a symlink loop" if trouble is not None and trouble[1] == "a symlink loop" else None


def check_writable(path: str | os.PathLike, what: str, fix: str, *, folder: bool = False) -> None:
    """Refuse (ValueError: `what` PATH, why, `fix`) an output this process could not make or write, before a
    command makes anything: the file `path` (folder=True: the folder `path`, whose files it makes) where it is
    there and may not be written, or where the nearest folder of it (or above it) that exists may not be written
    to make what is missing. A command that made its other outputs first would meet the same refusal part way,
    those outputs left behind. os.access asks the kernel, which counts a read-only mount and an immutable file
    (that stop root too) as well as the permissions."""
    path = Path(os.path.abspath(path))
    blocked = in_the_way(path if folder else path.parent)
    if blocked is not None:
        raise ValueError(f"{what} {path}: {blocked}; {fix}")
    if os.path.exists(path) and not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
        raise ValueError(f"{what} {path}: this process may not write it (a read-only mount or file, another "
                         f"user's); {fix}")
    nearest = path if folder else path.parent
    while not os.path.exists(nearest) and nearest != nearest.parent:
        nearest = nearest.parent
    if not os.access(nearest, os.W_OK | os.X_OK):
        made = "write in" if nearest == (path if folder else path.parent) else "create folders in"
        raise ValueError(f"{what} {path}: this process may not {made} {nearest} (a read-only mount, another "
                         f"user's folder); {fix}")


def make_folder(path: str | os.PathLike, what: str, fix: str) -> None:
    """Create the folder `path` (`what`, for the message) and its parents. Raises ValueError when it cannot: a
    file in the way is named as such (in_the_way), any other failure gives the system's reason; both end with
    `fix`."""
    try:
        make_dirs(path)
    except OSError as e:
        raise ValueError(f"cannot create {what} {os.fspath(path)} ({folder_trouble(path, e)}); {fix}") from None


def folder_trouble(path: str | os.PathLike, error: OSError) -> str:
    """Why the folder `path` could not be made (`error`, what make_dirs raised), in words: what is in the way
    (in_the_way), else the system's reason."""
    return in_the_way(path) or f"{error.strerror or error}"


def make_dirs(path: str | os.PathLike) -> None:
    """mkdir -p: the folder `path` and its missing parents, made one level at a time (os.makedirs recurses once
    per level). Raises OSError as os.mkdir does; a folder (or a link to one) already there is no error."""
    path = Path(path)
    if path.is_dir():
        return
    missing = []
    for p in [path, *path.parents]:
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p)
        except FileExistsError:
            if not p.is_dir():  # made by another process meanwhile: fine when it is a folder
                raise
        else:
            note_made(p)
    if not path.is_dir():  # `path` itself was there and is no folder (a file, a symlink loop ...)
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))


# The folders made inside each open tidy_folders() block, the innermost block's last.
_MADE: list[list[Path]] = []


def note_made(folder: str | os.PathLike) -> None:
    """`folder` was just made by this process (make_dirs notes its own): the open tidy_folders block removes it
    again if the block fails while it is still empty."""
    if _MADE:
        _MADE[-1].append(Path(folder))


@contextlib.contextmanager
def tidy_folders() -> Iterator[None]:
    """While inside, the folders this process makes are noted (note_made); when the block ends with an exception,
    those still empty are removed, the deepest and latest first, and the exception goes on. A block that ends
    normally keeps them all."""
    made: list[Path] = []
    _MADE.append(made)
    try:
        yield
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # not empty (a file was written there), gone, or not ours to remove
                os.rmdir(folder)
        raise
    finally:
        _MADE.pop()


# distinct_outputs' kind of an output that rewrites its own marked sections of a text file (report's --readme and
# --benchmarks): two of them may name one file, which is then written once with both sections.
SECTIONS = "sections"


def distinct_outputs(outputs: Sequence[tuple[str, str, str | os.PathLike, bool | str]]) -> None:
    """Refuse (ValueError naming both options) two outputs of one command that name one file. `outputs`: for each
    output given, (its option, the path as given, the path it writes, its kind: True for a folder, False for a
    file, SECTIONS for a file whose own sections it rewrites); a --save PATH writes two files, given as two
    entries. Two folders may be one (TensorBoard's runs beside the checkpoints), and so may two SECTIONS files; a
    file may not be another file or a folder. Paths are compared as the system resolves them: a link and its
    target, "a/../b" and "b" are one."""
    seen: list[tuple[str, str, str, bool | str]] = []
    for option, given, path, kind in outputs:
        text = os.fsdecode(path)
        if not text.strip() or "\0" in text:  # the option's own check refuses it, in its words
            continue
        resolved = os.path.normcase(os.path.realpath(user_path(text, option)))
        folder = kind is True
        for other, other_given, other_resolved, other_kind in seen:
            if resolved != other_resolved or (kind == other_kind and kind in (True, SECTIONS)):
                continue
            other_folder = other_kind is True
            shown = (quoted_name(given) if given == other_given else
                     f"{quoted_name(other_given)} and {quoted_name(given)}, both {quoted_name(resolved)}")
            if folder == other_folder:
                said = f"the same file ({shown}): one would refuse or overwrite the other"
            else:
                said = (f"the same path ({shown}), a folder for {option if folder else other} and a file for "
                        f"{other if folder else option}")
            raise ValueError(f"{other} and {option} name {said}; give each its own path")
        seen.append((option, given, resolved, kind))
