"""What the command prints and how it ends: exit codes, the one-line form of an error or warning, the lines of its
output, and which process of a torchrun job speaks (every process runs the same code; rank 0 shows what all would).

Messages and results carry names as they are (a file, folder, class or dataset name, a library's message): what
reaches the terminal is escaped here, as it is written (errors.printable), so that no ESC, newline or other control
character in a name can move the cursor, recolour the terminal or break a line.
"""

from __future__ import annotations

import os
import sys

from speedrun.errors import printable

EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_INTERNAL = 1


MAX_LINE = 1000  # characters of one error or warning line


def worker_message(text: str) -> str:
    """The message of an exception raised in a DataLoader worker process. torch re-raises it in the main process
    with the worker's whole traceback as its message ("Caught ValueError in DataLoader worker process 0.\nOriginal
    Traceback ..."): the one line is the original message, the last lines after the traceback's indented frames,
    without its "ValueError: " prefix."""
    if "\nOriginal Traceback (most recent call last):" not in text:
        return text
    lines = text.splitlines()
    last_frame = max(i for i, line in enumerate(lines) if line.startswith(" ") or i == 1)
    message = "\n".join(lines[last_frame + 1:]).strip()
    head, sep, rest = message.partition(": ")
    return (rest if sep and head.replace(".", "").replace("_", "").isalnum() else message) or lines[0]


def one_line(text: object, *, prose: bool = False) -> str:
    """Escaped (errors.printable: a newline in a file name shows as \\n), runs of spaces folded, and cut in the
    middle past MAX_LINE characters: a value echoed back (a 100,000-character --dataset, say) must not make the one
    line a screenful. An error from a DataLoader worker is its own message, not the worker's traceback.
    prose: text that is another program's (an unexpected exception, a library's warning), whose line breaks are
    its layout: they fold to spaces before the rest is escaped."""
    text = worker_message(str(text))
    if prose:
        text = " ".join(text.split())
    text = " ".join(printable(text).split())
    if len(text) <= MAX_LINE:
        return text
    return f"{text[:MAX_LINE // 2]} ...[{len(text) - MAX_LINE + 200} characters]... {text[-(MAX_LINE // 2 - 200):]}"


def say(line: str) -> None:
    """One line on stderr in one write: under torchrun every process shares the terminal, and print's two writes
    (text, then newline) let two processes' lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def out(line: str, *, flush: bool = False) -> None:
    """One line of the command's output on stdout, escaped: a newline in a name stays in its row, as \\n."""
    print(printable(line), flush=flush)


def err(line: str) -> None:
    """One line of progress or news on stderr, escaped, in one write (`say`)."""
    say(printable(line))


def prog_name() -> str:
    """'speedrun', or 'speedrun[rank R]' in a torchrun worker other than rank 0: a failure on any rank ends the
    job with that rank's one line, and the line says which."""
    rank, size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    return "speedrun" if rank == "0" or size == "1" else f"speedrun[rank {one_line(rank)[:8]}]"


def under_torchrun() -> bool:
    """This process is one of several that torchrun started (WORLD_SIZE > 1)."""
    return os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1")


def other_rank() -> bool:
    """A torchrun worker other than rank 0: it prints only its own fatal error (every process runs the same code,
    so a warning, a usage error or --help is rank 0's to show)."""
    return prog_name() != "speedrun"
