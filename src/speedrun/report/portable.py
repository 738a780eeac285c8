"""Stored commands and paths as a page shows them: every absolute path of the machine that ran a command replaced
by one that means something on any machine.

A stored command names the files of the machine it ran on (`--dataset /tmp/c10subsh`, `--out /root/out/x.json`);
on a page those say nothing to a reader and tell where a machine keeps its files. portable_paths shows each as its
last component after an ellipsis (`…/c10subsh`), or relative to a repository given as `root` when it lies inside it
(`benchmarks/results/x.json`). Relative paths (`../data`, `~/data`, `a/b`), URLs and the few paths that name the
same thing on every Unix machine (KEPT) stay as they are.
"""

from __future__ import annotations

import os
import posixpath
import re

# Where a path may begin: the start of the text, or after a character that ends a shell word or begins a value:
# `--out=/x`, `PYTHONPATH=a:/x`, `'/x y'`, `(/x)`. After anything else a "/" is inside a word: a relative path
# (`../a/b`, `~/a`), a URL's path (`http://h/a`), a fraction (`1/2`), a closing tag (`</td>`).
_STARTS = frozenset(" \t\n\r\f\v'\"`=:,;|&([{@+")  # and any other whitespace (a no-break space, ...)
# Where a path outside quotes ends: the shell's word and list separators, quotes, brackets, and the separators of
# path lists and option values (`a:/x:/y`, `--models /a,/b`). A backslash escapes the next character (`/a\ b`).
_ENDS = frozenset(" \t\n\r\f\v'\"`:,;|&()[]{}<>")
# The same on every Unix machine (POSIX's null device and standard streams, the kernel's /proc and /sys, a script's
# interpreter line), so they tell nothing of one and a reader can use them as they are.
KEPT = frozenset(("/dev/null", "/dev/stdin", "/dev/stdout", "/dev/stderr", "/usr/bin/env", "/bin/sh", "/bin/bash"))
KEPT_UNDER = ("/proc/", "/sys/")
ELLIPSIS = "…"  # not "...": "../x" is a path a reader could type


def portable_paths(value, root: str | os.PathLike | None = None) -> str:
    """`value` (a stored command, path or sentence; None: "") as text with each absolute path shown portably:
    "…/" and its last component (a trailing "/" kept), or, when `root` (an absolute path) is given and the path is
    `root` or lies under it, the path relative to it ("." for `root` itself). A path in quotes that open its shell
    word (`'/my data/x'`, `'--out=/a b'`) runs to the closing quote; `file:///x` and `sqlite:////x` hold the local
    path /x. Applied twice, the text does not change again."""
    text = _WINDOWS.sub(lambda m: f"{ELLIPSIS}\\{m.group(1)}", "" if value is None else str(value))
    text = text.replace("file://localhost/", "file:///")  # RFC 8089: the same local path
    if "/" not in text:
        return text
    base = None
    if root is not None and posixpath.isabs(os.fspath(root)):
        base = posixpath.normpath(os.fspath(root))
    out, i = [], 0
    while i < len(text):
        start = _path_start(text, i)
        if start is None:
            run = _slash_run_end(text, i) if text[i] == "/" else i + 1
            out.append(text[i:run])
            i = run
            continue
        end = _path_end(text, start)
        out += [text[i:start], _shown(text[start:end], base)]
        i = end
    return "".join(out)


# A Windows path, drive (C:\x) or network share (\\host\share\x), that begins a word: shown by its last
# component alone, as a POSIX one is. The part before "\" ends at what ends a word (_ENDS, but not ":").
_WINDOWS = re.compile(r"(?<![\w\\])(?:[A-Za-z]:\\|\\\\)(?:[^\s'\"`,;|&()\[\]{}<>]*\\)?([^\s'\"`,;|&()\[\]{}<>\\]*)")


def _slash_run_end(text: str, i: int) -> int:
    while i < len(text) and text[i] == "/":
        i += 1
    return i


def _path_start(text: str, i: int) -> int | None:
    """Where the absolute path that begins with the run of slashes at `i` starts, or None: no run begins at `i`,
    the run follows a character inside a word, or nothing follows it. After a colon, one slash begins a path
    (`a:/x`), two a URL's host (`http://h`), three or more an empty host and then a local path (RFC 8089's
    `file:///x`, SQLAlchemy's `sqlite:////x`): that path starts after the host's two slashes, so that it is shown
    as `sqlite://…/x`, a URL again."""
    if text[i] != "/" or i > 0 and text[i - 1] == "/":
        return None
    end = _slash_run_end(text, i)
    if end == len(text) or text[end] in _ENDS:
        return None  # "/" alone, "cd /", "a / b"
    before = text[i - 1] if i > 0 else " "
    if before not in _STARTS and not before.isspace():
        return None
    if before != ":" or end - i == 1:
        return i
    return i + 2 if end - i >= 3 else None


def _path_end(text: str, start: int) -> int:
    """The end of the path at `start`: the quote that closes the shell word it is in when that word opens with a
    quote (right before the path, or before `--flag=`), else the first character of _ENDS not escaped."""
    word = start
    while word > 0 and text[word - 1] not in " \t\n\r\f\v":
        word -= 1
    quote = text[word] if word < start and text[word] in "'\"" else None
    if quote is not None and quote not in text[word + 1:start]:
        i = start
        while i < len(text) and text[i] != quote:
            i += 2 if text[i] == "\\" and quote == '"' else 1
        if i < len(text):
            return i
    i = start
    while i < len(text) and text[i] not in _ENDS:
        i += 2 if text[i] == "\\" else 1
    return min(i, len(text))


def _shown(path: str, base: str | None) -> str:
    """One absolute path as a page shows it (portable_paths)."""
    single = "/" + path.lstrip("/")
    if single in KEPT or single.startswith(KEPT_UNDER):
        return path
    if base is not None:
        normal = posixpath.normpath(single)
        if normal == base:
            return "."
        if normal.startswith(base.rstrip("/") + "/"):
            return normal[len(base.rstrip("/")) + 1:]
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return f"{ELLIPSIS}/{last}" + ("/" if path.endswith("/") else "")
