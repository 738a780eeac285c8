"""The generated Markdown of `speedrun report`: README.md's front page (--readme: the races side by side with
airbench94, then the records) and BENCHMARKS.md's ablation and waterfall tables (--benchmarks), each between its
marker lines (`<!-- NAME:begin -->` ... `<!-- NAME:end -->`, the convention benchmarks/table.py shares), so no
number there is typed by hand.

Stored text is hostile: escaped so that it never becomes markup, and never a marker line; the absolute paths of
the machines that ran a command are shown portably (portable.portable_paths).
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
from pathlib import Path

from speedrun.errors import counted, printable
from speedrun.paths import check_file_name
from speedrun.records.result_file import write_text
from speedrun.records.stats import record_alpha
from speedrun.report.portable import portable_paths
from speedrun.report.queries import (NO_TARGET, ablation_rows, baseline_text, ci_text, clip_text, has_reached,
                                     leaderboards, newest_reports, p_text, pm_text, provenance, ratio_text,
                                     record_p_cell, report_title, tune_recommended, tune_rows, unranked_text,
                                     waterfall_rows)
from speedrun.report.races import ANCHOR, diff_cell, race_label, race_rows, ratio_cell, runs_cell


def _md_provenance(report: dict) -> str:
    """provenance for Markdown: the text escaped, the command a code span."""
    text, command = provenance(report).rsplit(": `", 1)
    return f"{_md(text)}: {_code(command[:-1])}"


# Characters that start Markdown (CommonMark and GitHub's) inside a line: code spans, emphasis, strikethrough, links
# and images, cell ends, math, and the address (a@b) GitHub links by itself. Each is shown as itself when
# backslash-escaped (CommonMark: any ASCII punctuation).
_MARKUP = frozenset("`*~[]|$@")
# Escaped only where they could act, so that names stay readable in the file: an underscore not inside a word
# (CommonMark: one between two letters or digits never opens or closes emphasis, as in label_smoothing), the colon of
# a bare "http://..." and the dot of "www...." (GitHub links both by themselves; a title's own ": " stays as it is).
_WHERE_ACTIVE = re.compile(r"(?<![^\W_])_|_(?![^\W_])|(?i::(?=/)|(?<=(?<![a-z0-9])www)\.)")


def _md(cell: str) -> str:
    """Stored text as Markdown shows it, character for character, in a table cell or a heading: it must not become
    markup (a `<script>`, a marker line, a `[link](url)`, an image, *emphasis*, a code span, $math$, a bare
    URL), nor end its cell (a `|`) or its row (a newline: whitespace folds to one space, control characters are
    escaped as errors.printable shows them). Backslashes are doubled first, so that one before a `|` cannot undo
    its escape; <, > and & become entities. An absolute path of a machine is shown portably first."""
    text = printable(" ".join(portable_paths(cell).split()))
    text = text.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = "".join("\\" + c if c in _MARKUP else c for c in text)
    return _WHERE_ACTIVE.sub(lambda found: "\\" + found.group(), text)


class _Code(str):
    """A cell already written as a code span by _code: _md_table keeps it as it is. Marked by its type, never
    guessed from its text (stored text that looks like a code span is still escaped)."""


def _code(text: str) -> _Code:
    """A command in a code span, on one line: markup is inert there, but a marker inside would still be found as
    one, and a `|` would end the table's cell (GitHub reads `\\|` there as `|`). The span's fence is one backtick
    longer than the longest run inside, so a backtick in the command shows as itself. An absolute path of the
    machine it ran on is shown portably."""
    text = printable(" ".join(portable_paths(text).split()))
    text = text.replace("|", "\\|").replace("<!--", "<!- -").replace("-->", "- ->")
    fence = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return _Code(fence + pad + text + pad + fence)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Cells that are code spans (from _code) are kept; the others pass through _md."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell if isinstance(cell, _Code) else _md(cell) for cell in row) + " |" for row in rows]


def benchmarks_lines(conn: sqlite3.Connection) -> list[str]:
    """BENCHMARKS.md's generated section: the newest ablation and waterfall tables per recipe, dataset, device."""
    lines: list[str] = []
    left_out: list[str] = []  # every stored report these tables cannot show, named in the section
    for report in newest_reports(conn, ("ablate", "waterfall", "tune"), left_out):
        env = report.get("environment") if isinstance(report.get("environment"), dict) else {}
        where = (f"{clip_text(env.get('device_name') or report.get('device'), 60)}, "
                 f"torch {clip_text(env.get('torch'), 30)}")
        if report.get("benchmark") == "ablate":
            rows = ablation_rows(report)
            lines += [f"#### Ablation: {_md(report_title(report, 'each trick off alone'))}", "",
                      f"{_md(where)}; {_md_provenance(report)}. Gain = baseline − trick off, in accuracy points; "
                      f"the baseline (the recipe): {baseline_text(report) or 'n/a'}.", ""]
            lines += _md_table(["trick", "off value", "gain, points (95% CI)", "p", "time off/on", "what"],
                               [[r["trick"], r["off"], ci_text(r), p_text(r["p"]), "-" if r["ratio"] is None
                                 else f"{r['ratio']:.3f}", r["what"]] for r in rows])
        elif report.get("benchmark") == "tune":
            rows = tune_rows(report)
            lines += [f"#### The doctor: {_md(report_title(report, 'each setting against the current one'))}", "",
                      f"{_md(where)}; {_md_provenance(report)}. Time ratio = setting / current (below 1: faster); "
                      "Δ accuracy only for settings that change the numbers, at the same short budget. "
                      f"Recommended: {_md(tune_recommended(report))}.", ""]
            lines += _md_table(["setting", "guide", "n", "time ratio (95% CI)", "p", "Δ acc, points (95% CI)",
                                "verdict"],
                               [[r["setting"], r["guide"], "-" if r["n"] is None else str(int(r["n"])), ratio_text(r),
                                 p_text(r["p"]), ci_text(r) if r["changes_numbers"] else "(same numbers)",
                                 r["verdict"]] for r in rows])
        elif report.get("benchmark") == "waterfall":
            rows = waterfall_rows(report)
            lines += [f"#### Waterfall: {_md(report_title(report, 'tricks added one at a time'))}", "",
                      f"{_md(where)}; {_md_provenance(report)}.", ""]
            lines += _md_table(["step", "test acc %", "bought, points (95% CI)", "p", "timed s"],
                               [[r["label"], pm_text(r["accuracy"], r["std"], 100), ci_text(r), p_text(r["p"]),
                                 pm_text(r["seconds"], None)] for r in rows])
        else:  # newest_reports passes only the kinds asked for
            left_out.append(f"report #{report['_id']} could not be shown")
            continue
        lines.append("")
    if left_out:
        lines += ["Stored, but not shown here:", "", *(f"- {_md(line)}" for line in left_out)]
    return lines or ["No ablation or waterfall report is stored yet (`speedrun ablate`)."]


def readme_lines(conn: sqlite3.Connection, per_board: int = 3, alpha: float | None = None,
                 max_races: int = 8) -> list[str]:
    """README.md's generated section, what a reader sees first: the races side by side with airbench94 (the first
    `max_races` of races.race_rows), then the records: the first `per_board` rows of each leaderboard that reach
    their target by the records rule at threshold `alpha` (None: the setting, stats.record_alpha), or one line
    saying that no record is claimed yet, and why. Results short of their target (development runs) are left to
    the HTML report. Nothing ranked and no race: the one line of unranked_text."""
    races, boards = race_rows(conn), leaderboards(conn, alpha=alpha)
    if not races and not boards:
        return [unranked_text(conn)]
    lines: list[str] = []
    if races:
        lines += _md_table(["device", "race", "schedule", f"time, ours / {ANCHOR} (95% CI)",
                            "Δ accuracy, points (95% CI)", "runs each", "date", "dataset"],
                           [[r["device"], race_label(r), r["schedule"], ratio_cell(r), diff_cell(r), runs_cell(r),
                             r["date"], r["dataset"]] for r in races[:max_races]])
        more = f" {counted(len(races) - max_races, 'more race')} in the HTML report." if len(races) > max_races else ""
        lines += ["", f"Each race: one invocation of benchmarks/vs_airbench.py, the two systems' runs interleaved on "
                  f"one device and the same data; time is the ratio of mean timed regions (below 1: ours is faster), "
                  f"Δ accuracy ours − {ANCHOR}, with 95% CIs. On a CPU, {ANCHOR} runs in fp32 and the times say "
                  f"nothing about a GPU.{more}", ""]
    alpha = boards[0]["alpha"] if boards else record_alpha(alpha, "alpha")
    records = [(b, r) for b in boards for r in [r for r in b["rows"] if has_reached(r)][:per_board]]
    if records:
        lines += _md_table(["dataset", "target", "recipe", "device", "test acc %", "timed s", "n", "p", "date",
                            "command"],
                           [[clip_text(b["dataset"], 80), NO_TARGET if b["target"] is None else
                             f"{100 * b['target']:g}%", clip_text(r["recipe"], 40),
                             clip_text(r["device_name"] or r["device"], 40),
                             pm_text(r["accuracy"], r["std_accuracy"], 100), pm_text(r["seconds"], r["std_seconds"]),
                             str(r["n"]), record_p_cell(r), r["date"][:10],
                             _code(clip_text(portable_paths(r["command"]), 300))] for b, r in records])
        lines += ["", f"Records: results that reach their recipe's target by the records rule, p < {alpha:g} in a "
                  "one-sided t-test of their runs' accuracies against the target (n >= 2; a diverged run counts as "
                  "accuracy 0; SPEEDRUN_RECORD_P sets the threshold)."]
    elif boards:
        lines.append(f"No record is claimed yet: no stored result reaches its recipe's target on the recipe's own "
                     f"dataset by the records rule (p < {alpha:g} in a one-sided t-test of n >= 2 runs' accuracies "
                     "against the target); the development runs are in the HTML report.")
    else:
        lines.append(f"No record is claimed yet. {unranked_text(conn)}")
    return lines + ["", "Generated by `speedrun report --readme` from the results database; the leaderboards, "
                    "charts and fingerprints are in the HTML report (`speedrun report`)."]


def markers(name: str) -> tuple[str, str]:
    """The lines that bound a generated section of a Markdown file (benchmarks/table.py uses the same)."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


_NEWLINE = re.compile(r"(\r\n|\r|\n)")  # CommonMark's line endings, each kept as the file has it
# A fenced code block's opening line (CommonMark): up to three spaces, then three or more backticks (an info string
# without a backtick after them) or tildes. It closes at a line of the same character, at least as many, alone.
_FENCE = re.compile(r" {0,3}(`{3,}(?!.*`)|~{3,})")


def _lines(doc: str) -> list[tuple[str, str]]:
    """(text, line ending) per line of `doc`: joined again, they are `doc` byte for byte; the last line's ending
    is "" where the file does not end with one."""
    parts = _NEWLINE.split(doc)
    lines = list(zip(parts[0::2], parts[1::2] + [""]))
    return lines[:-1] if lines[-1] == ("", "") else lines


def _live_lines(lines: list[tuple[str, str]]) -> tuple[list[tuple[int, str]], bool]:
    """(index, text) of the lines outside fenced code blocks (a marker inside one is an example, not a marker), the
    first line's text without the byte-order mark a file may start with; and whether a fence is left open."""
    live, fence = [], None
    for i, (text, _) in enumerate(lines):
        if i == 0:
            text = text.removeprefix("\ufeff")
        if fence is not None:
            closing = text.rstrip(" \t")
            run = closing.lstrip(" ")
            if len(closing) - len(run) <= 3 and len(run) >= len(fence) and run == fence[0] * len(run):
                fence = None
            continue
        opening = _FENCE.match(text)
        if opening:
            fence = opening.group(1)
            continue
        live.append((i, text))
    return live, fence is not None


def replace_marked(doc: str, sections: dict[str, str], where: str) -> str:
    """`doc` with the text between each section's marker lines replaced, written with the newline of the begin
    line; every byte outside them kept (a byte-order mark, CRLF line ends, a last line without one). A marker is a
    line of its own (spaces around it aside) outside fenced code blocks; markers missing, repeated or out of order,
    a marker beside other text on its line, or sections that overlap, are a ValueError naming what to change."""
    lines = _lines(doc)
    live = _live_lines(lines)[0]
    found: dict[str, list[int]] = {}  # marker -> the indices of its lines
    for name, text in sections.items():
        begin, end = markers(name)
        # either would hide the end marker next time (a fence left open makes it an example), and a fence left open
        # would show the rest of the file as code
        if begin in text or end in text or _live_lines(_lines(text))[1]:
            raise ValueError(f"the generated {name} text holds one of its own markers or an open code fence; this "
                             "is a bug in speedrun")
        for marker in (begin, end):
            found[marker] = []
        for i, line in live:
            for marker in (begin, end):
                if line.strip(" \t") == marker:
                    found[marker].append(i)
                elif marker in line:
                    raise ValueError(f"{where} line {i + 1} holds {marker} beside other text; put the marker on a "
                                     "line of its own (the generated text replaces the lines between the markers)")
    spans = []
    for name in sections:
        begin, end = markers(name)
        if len(found[begin]) != 1 or len(found[end]) != 1 or found[begin][0] > found[end][0]:
            fenced = sum(marker in text for text, _ in lines for marker in (begin, end)) \
                - len(found[begin]) - len(found[end])
            note = (f" ({counted(fenced, 'marker')} inside fenced code blocks "
                    f"{'is an example' if fenced == 1 else 'are examples'}, not markers)" if fenced > 0 else "")
            raise ValueError(f"{where} needs one line {begin} and, after it, one line {end}; the generated "
                             f"{name} text goes between them{note}")
        spans.append((found[begin][0], found[end][0], name))
    spans.sort()
    for (_, first_end, first), (second_begin, _, second) in zip(spans, spans[1:]):
        if second_begin < first_end:
            raise ValueError(f"{where}: the {second} section (line {second_begin + 1}) begins inside the {first} "
                             f"section; end the {first} section first")
    out, kept = [], 0  # kept: the lines up to here are copied
    for begin_at, end_at, name in spans:
        newline = lines[begin_at][1]  # the begin line has one: the end line follows it
        out += [text + ending for text, ending in lines[kept:begin_at + 1]]
        out += [line + newline for line in _NEWLINE.split(sections[name].rstrip("\r\n"))[0::2]]
        kept = end_at
    out += [text + ending for text, ending in lines[kept:]]
    return "".join(out)


MAX_MARKDOWN_BYTES = 16 * 2**20  # a README or BENCHMARKS.md is far smaller; a bigger file is not one


def prepare_marked(path: str | Path, sections: dict[str, str], flag: str = "--write") -> tuple[Path, str, int]:
    """(the file to write, its new text, its permission bits) for rewrite_marked, every check made first: the
    file a symlink names (the link is kept), a regular UTF-8 file of bounded size that the user may write. The
    text is read as bytes decoded, never with newlines translated: what lies outside the sections is kept."""
    if not str(path):
        raise ValueError(f"{flag} needs a file name, e.g. {flag} README.md")
    check_file_name(path, flag, "README.md")  # realpath would drop the "/" of "README.md/", a folder's form
    where = str(path)
    real = Path(os.path.realpath(path))
    try:
        info = os.stat(real)
        if not stat.S_ISREG(info.st_mode):  # a fifo would block, a device never end
            raise ValueError(f"{flag} {where} is not a regular file; give the Markdown file to update")
        check_replaceable(real, flag, where, info)
        with open(real, "rb") as f:
            data = f.read(MAX_MARKDOWN_BYTES + 1)  # the size again: the file may have grown since stat
        if len(data) > MAX_MARKDOWN_BYTES:
            raise ValueError(f"{flag} {where} has more than {MAX_MARKDOWN_BYTES} bytes, more than a Markdown file "
                             "of ours; give the Markdown file to update")
        doc = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {flag} {where} ({getattr(e, 'strerror', None) or e}); give the Markdown "
                         "file to update") from None
    return real, replace_marked(doc, sections, where), stat.S_IMODE(info.st_mode)


def check_replaceable(real: Path, flag: str, where: str, info: os.stat_result | None = None) -> None:
    """Refuse (ValueError naming `flag` `where` and a fix that works) a file, `real` as resolved, that this process
    could not replace: an atomic write (write_text) makes a new file in its folder and renames it over the old one,
    so the folder must take a new file; an existing file (`info`, its stat) must be writable too, as the user's
    read-only file is theirs to keep. Checked before anything is written, so that no file of a command is left half
    done."""
    if info is not None and not os.access(real, os.W_OK):
        raise ValueError(f"{flag} {where} {_unwritable(info)}")
    folder = real.parent  # or the nearest folder above it that exists: write_text makes the rest
    while not os.path.exists(folder) and folder != folder.parent:
        folder = folder.parent
    if os.path.isdir(folder) and not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {where}: this process may not make files in the folder {folder} (the file is "
                         "written anew there and renamed into place); make the folder writable, or give a file in "
                         "a folder you may write")


def _unwritable(info: os.stat_result) -> str:
    """Why this process may not write a file of stat `info` (os.access said so), with the fix that works. The
    system says no more than "not permitted": chmod mends only a file of ours whose owner may not write it."""
    euid = os.geteuid() if hasattr(os, "geteuid") else None
    if euid not in (None, 0) and info.st_uid == euid and not info.st_mode & stat.S_IWUSR:
        return "is read-only; make it writable (chmod u+w) or give another file"
    return ("cannot be written: the system refuses this process's writes to it (its owner and permissions, an "
            "immutable or append-only attribute, a read-only mount); check its permissions (ls -l) and attributes "
            "(lsattr), or give another file")


def write_error(target: Path, flag: str, e: OSError) -> ValueError:
    """A write of `target` (`flag`'s file) that failed, as one line naming it and a fix that works. write_text
    writes a new file and renames it over the old, so `target` is as it was."""
    if e.errno in (errno.EPERM, errno.EACCES):
        why = ("the system refused it (its folder's permissions, an immutable or append-only attribute of the file "
               "or folder, a security policy); check their permissions (ls -ld) and attributes (lsattr), or give "
               "another file")
    elif e.errno == errno.EROFS:
        why = "its file system is mounted read-only; give a file on a writable one"
    elif e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        why = "the disk (or your quota) is full; free space and run again"
    else:
        why = f"{e.strerror or e}; give another file"
    return ValueError(f"cannot write {flag} {target} (left as it was): {why}")


def same_file(path: str | Path) -> tuple:
    """What tells one file from another: its device and inode (two names of one file, a symlink's or a hard
    link's, are one), or its resolved path where it cannot be read (prepare_marked says why)."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return ("path", real)
    return ("file", info.st_dev, info.st_ino)


def prepare_marked_files(requests: list[tuple[str | Path, dict[str, str], str]]
                         ) -> list[tuple[Path, str, int, str, str]]:
    """prepare_marked for each (path, sections, flag), the sections meant for one file (by any of its names)
    placed in one text: written one after the other, the second write, made from the file as it was read, would
    undo the first. Per file to write: (the file, its new text, its permission bits, the names of its sections, as
    "records" or "records and ablation", the flags that name it, as "--readme/--benchmarks"). Two hard links to one
    file are two files to write, with the same text (an atomic write replaces the name it writes, so the link cannot
    be kept)."""
    groups: dict[tuple, tuple[list[str | Path], dict[str, str], list[str]]] = {}
    for path, sections, flag in requests:
        if not str(path):
            raise ValueError(f"{flag} needs a file name, e.g. {flag} README.md")
        paths, merged, flags = groups.setdefault(same_file(path), ([], {}, []))
        for name in sections:
            if name in merged:
                raise ValueError(f"{' and '.join([*flags, flag])} name the same file {path} and both its {name} "
                                 "section; give each flag its own file")
        merged.update(sections)
        paths.append(path)
        flags.append(flag)
    writes = []
    for paths, sections, flags in groups.values():
        flag = "/".join(flags)
        real, text, mode = prepare_marked(paths[0], sections, flag)
        names = " and ".join(sections)
        writes.append((real, text, mode, names, flag))
        others = {Path(os.path.realpath(path)) for path in paths[1:]} - {real}
        for other in sorted(others):
            check_replaceable(other, flag, str(other), os.stat(other))
            writes.append((other, text, mode, names, flag))
    return writes


def rewrite_marked(path: str | Path, sections: dict[str, str], flag: str = "--write") -> None:
    """replace_marked on a file, written atomically (its permissions kept) once every section is placed."""
    write_text(*prepare_marked(path, sections, flag))
