"""What the user sees when something goes wrong: warnings, the SIGTERM interrupt, printable names.

Warnings the user should see even with --quiet (a rebuilt cache, a batch larger than the data, ...): library code
calls `warn(message)`; Python API users get a standard `SpeedrunWarning` they can filter, and the CLI shows each
as one line, `speedrun: warning: ...`, on stderr.
"""

from __future__ import annotations

import warnings


class SpeedrunWarning(UserWarning):
    """Something worth knowing that does not stop the run."""


def warn(message: str) -> None:
    warnings.warn(message, SpeedrunWarning, stacklevel=3)


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


def printable(text: str) -> str:
    """`text` as one printable line: file-name bytes that are not UTF-8 (os.fsdecode's surrogates) become \\xNN,
    control characters (a newline in a file name) become escapes. Paths go through this before any message."""
    if text.isascii() and text.isprintable():
        return text
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is not an escaped byte
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
