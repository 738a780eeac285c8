"""What the user sees when something goes wrong: warnings, the SIGTERM interrupt, printable names.

Warnings the user should see even with --quiet (a rebuilt cache, a batch larger than the data, ...): library code
calls `warn(message)`; Python API users get a standard `SpeedrunWarning` they can filter, and the CLI shows each
as one line, `speedrun: warning: ...`, on stderr.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, TypeVar

_F = TypeVar("_F", bound=Callable)


class SpeedrunWarning(UserWarning):
    """Something worth knowing that does not stop the run."""


def warn(message: str) -> None:
    # Escaped here, where every warning passes: the CLI shows it as one line, and Python's own display (a Python
    # API user's) writes it to stderr as it is.
    warnings.warn(printable(message), SpeedrunWarning, stacklevel=3)


class Terminated(KeyboardInterrupt):
    """SIGTERM (sent by `timeout`, schedulers and container runtimes) as an interrupt: the finished runs are kept,
    as for Ctrl-C, and the CLI exits 143 (128 + 15)."""


def note_kept(exc: BaseException, runs_kept: int, result_path) -> None:
    """Tell the CLI's last line that `runs_kept` finished runs are in `result_path` (a result file, or the
    database when no file was asked for; None: neither), after `exc` stopped a command part way (an interrupt
    carries the same two attributes)."""
    try:
        exc.runs_kept, exc.result_path = runs_kept, result_path
    except AttributeError:  # an exception type without a __dict__: the line just says less
        pass


def note_stopped(exc: BaseException, where: str) -> None:
    """Tell the CLI's last line how far a command that keeps nothing part way got when `exc` stopped it
    ("evaluation of 2 models stopped at model 2/2 (m2) at 4,000/10,000 images"), in place of a training
    command's "no run had finished"."""
    try:
        exc.stopped_at = where
    except AttributeError:  # an exception type without a __dict__: the line just says less
        pass


def clip(text: str, limit: int) -> str:
    """`text` whole when it has at most `limit` characters, else cut at a word boundary before that and marked
    " ...": a reason cut mid-word ("from a unicode stri") reads as a garbled word, not a shortened one."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 4]
    space = cut.rfind(" ")
    return (cut[:space] if space >= limit // 2 else cut).rstrip(" ,;:(") + " ..."


def counted(n: int | float, one: str, many: str | None = None) -> str:
    """"1 run", "3 runs", "2.25 views" ("1 process", "2 processes" with `many`): a count with its noun, never
    "run(s)"."""
    shown = f"{n:,}" if isinstance(n, int) else f"{n:g}"
    return f"{shown} {one if n == 1 else many or one + 's'}"


def printable(text: str) -> str:
    """`text` as one printable line: file-name bytes that are not UTF-8 (os.fsdecode's surrogates) become \\xNN,
    control characters (a newline in a file name) become escapes. Messages carry names as they are; this runs
    where text is shown (cli/output.py's one_line, out and err, run/display.py, `warn`, and what the entry points
    of the Python API raise and log) and where a name is stored (a dataset's or a class's)."""
    if text.isascii() and text.isprintable():
        return text
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is not an escaped byte
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def escaped_refusals(function: _F) -> _F:
    """`function` with the message of what it refuses (a ValueError or an OSError of one message) escaped by
    `printable`: for the entry points a Python program calls (speedrun.train, speedrun.load, load_dataset,
    prepare_tree), which may print the message as it is. The messages name files as they are; the CLI escapes
    what it shows itself. The exception is the one raised, its type, attributes and cause kept."""
    @functools.wraps(function)
    def escaping(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (ValueError, OSError) as e:
            if len(e.args) == 1 and isinstance(e.args[0], str):
                e.args = (printable(e.args[0]),)
            raise

    return escaping  # type: ignore[return-value]


def escaped_log(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` given each line escaped (`printable`): a Python caller's log may print it as it is."""
    return lambda line: log(printable(line))


def print_line(line: str) -> None:
    """The library's default `log` for a Python caller: the line on stdout, escaped (`printable`)."""
    print(printable(line))
