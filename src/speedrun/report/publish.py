"""`speedrun report`: the results database as one self-contained HTML page, and the generated Markdown tables.

The page (no script, no network at view time: every chart is a PNG inside the file) holds first the races side by
side with airbench94 (benchmarks/vs_airbench.py's reports), then a leaderboard per dataset and target accuracy
(real data; synthetic data's results in a speed-only section), accuracy against time per recipe, per-epoch
learning curves, each bench's and ablation's settings side by side, the newest ablation bars, waterfall and
--to-target charts per recipe, dataset and device, and every stored benchmark report. `--readme FILE` and
`--benchmarks FILE` rewrite the text between the marker lines `<!-- records:begin -->` ... `<!-- records:end -->`
(the README's front page: the races, then the records) and `<!-- ablation:begin -->` ... (BENCHMARKS.md's ablation
and waterfall tables), the convention of benchmarks/table.py, so no number there is typed by hand.

queries.py reads the database, html.py and markdown.py render; this module checks every file first, then writes.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from speedrun.errors import print_line
from speedrun.paths import check_file_name
from speedrun.records import db
from speedrun.records.result_file import write_text
from speedrun.report import html as report_html
from speedrun.report import markdown as md
from speedrun.report.queries import GENERATOR

DEFAULT_OUT = "speedrun-report.html"


def check_out(text: str | None, default: str = DEFAULT_OUT) -> Path:
    """The file --out names (a symlink followed): new, or an earlier report (the first KB carries GENERATOR);
    never another file."""
    if text == "":
        raise ValueError("--out needs a file name, e.g. --out report.html")
    where = text or default
    check_file_name(where, "--out")  # realpath would drop the "/" of "report/", a folder's form
    path = Path(os.path.realpath(text or default))
    try:
        info = os.stat(path)
    except FileNotFoundError:
        md.check_replaceable(path, "--out", where)
        return path
    except OSError as e:
        raise ValueError(f"cannot check --out {where} ({e.strerror}); give another file") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"--out {where} is a directory; give a file name such as report.html")
    try:
        if not stat.S_ISREG(info.st_mode):
            raise OSError(0, "not a regular file")
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError as e:
        raise ValueError(f"--out {where} exists and cannot be checked ({e.strerror}); give another file") from None
    if GENERATOR.encode() not in head:
        raise ValueError(f"--out {where} exists and is not a speedrun report; give another file name (an earlier "
                         "report is replaced, nothing else is)")
    md.check_replaceable(path, "--out", where, info)
    return path


def _not_markdown(out: str | None, out_path: Path, requests: list[tuple]) -> None:
    """The page's file is none of the Markdown files (an earlier page is all --out replaces; a README that
    happens to carry GENERATOR would be lost)."""
    for path, _, flag in requests:
        if md.same_file(path) == md.same_file(out_path):
            raise ValueError(f"--out {out or DEFAULT_OUT} and {flag} {path} are the same file; give --out another "
                             "file name")


def publish(db_path: str | os.PathLike | None = None, *, out: str | None = None, readme: str | None = None,
            benchmarks: str | None = None, log: Callable[[str], None] = print_line) -> None:
    """The page written to `out` (DEFAULT_OUT when neither readme nor benchmarks is given), and the generated
    sections of `readme` and `benchmarks` rewritten; `log` gets one line per file written. Everything is read and
    checked first, then written; a database that holds anything draws a bounded page, never a traceback."""

    path = db.default_db_path() if db_path is None else Path(db_path)
    if not os.path.exists(path):  # connect would create an empty database: say what is missing instead
        raise ValueError(f"no results database at {path}; train something first "
                         "(speedrun train) or give one with --db PATH")
    page = out is not None or (readme is None and benchmarks is None)
    out_path = check_out(out) if page else None
    requests = []  # (file, sections, flag); one write per file, whatever names it was given by
    with contextlib.closing(db.connect(path, readonly=True)) as conn:
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):  # a library's note on odd data is not ours
                warnings.simplefilter("ignore")
                if readme is not None:
                    requests.append((readme, {"records": "\n".join(md.readme_lines(conn))}, "--readme"))
                if benchmarks is not None:
                    requests.append((benchmarks, {"ablation": "\n".join(md.benchmarks_lines(conn))},
                                     "--benchmarks"))
                writes = md.prepare_marked_files(requests)
                if out_path is not None:
                    _not_markdown(out, out_path, requests)
                html = report_html.page(conn) if page else None
        except sqlite3.Error as e:  # a damaged file, or tables changed by hand
            raise ValueError(f"cannot read the results database {path} ({e}); it is damaged or "
                             f"was changed by another program; give another with --db PATH") from None
    for target, text, mode, names, flag in writes:
        _write(target, text, mode, flag)
        log(f"rewrote the generated {names} section{'s' if ' and ' in names else ''} of {target}")
    if html is not None:
        check_out(out)  # again: drawing takes seconds; a file may have appeared
        _write(out_path, html, 0o644, "--out")
        log(f"report: {out_path} ({len(html.encode()) // 1024} KB)")


def _write(target: Path, text: str, mode: int, flag: str) -> None:
    """write_text, its failure one line naming `flag`'s file and a fix (markdown.write_error)."""
    try:
        write_text(target, text, mode)
    except OSError as e:
        raise md.write_error(target, flag, e) from None
