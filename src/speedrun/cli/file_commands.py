"""The commands that read and write files and the results database: results, results import, compare, report and
data prepare. Loading this module imports no torch, so these commands start quickly; the commands that train or
score a model are in train_commands.py."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import shlex
import sys

from speedrun.cli.output import err, out
from speedrun.data.prepare_tree import prepare_tree
from speedrun.errors import counted, printable
from speedrun.instruments.compare import METRICS, compare_stored
from speedrun.paths import user_path
from speedrun.records import db
from speedrun.records.stats import interval_text, mean_std_text, ratio_text
from speedrun.report.publish import publish


def _num(value, scale=1.0, std=None, digits=2) -> str:
    return "-" if value is None else f"{scale * value:.{digits}f}" + (f" ± {scale * std:.2f}" if std else "")


def _hits(hit_rate, n) -> str:
    """"2/3": the finished runs that reached the target, of n (hit_rate is that share), as the report shows them;
    the stored share itself where it is no share of n (a database from elsewhere may hold anything)."""
    if hit_rate is None:
        return "-"
    if isinstance(n, int) and 0 < n < 2**53 and isinstance(hit_rate, (int, float)) and 0 <= hit_rate <= 1:
        return f"{round(hit_rate * n)}/{n}"
    return _num(hit_rate) if isinstance(hit_rate, (int, float)) and math.isfinite(hit_rate) else str(hit_rate)


CELL_CHARS = 60  # the most characters of one cell of the terminal table; --json and --csv give every value whole
LINE_CHARS = 300  # the most characters of a line of `compare` that shows stored text


def _clip(text: str, limit: int = CELL_CHARS) -> str:
    """`text` escaped (errors.printable) as one line of at most `limit` characters, its end an ellipsis where it
    was cut: a stored name may be megabytes, and every row is padded to the widest cell. Only the first `limit`
    characters are escaped (escaping never shortens text)."""
    shown = printable(str(text)[:limit])
    return shown if len(shown) <= limit and len(str(text)) <= limit else shown[:limit - 1] + "…"


def _middle(text: str, limit: int = LINE_CHARS) -> str:
    """`text` escaped, cut in the middle past `limit` characters: both ends stay (a caveat names A's value, then
    B's)."""
    if len(text) > limit:
        text = f"{text[:limit // 2]}…[{len(text) - limit} characters]…{text[-(limit // 2):]}"
    return _clip(text, limit + 40)


def _table(rows: list[dict]) -> list[str]:
    table = [["ID", "KIND", "DATE", "RECIPE", "DATASET", "DEVICE", "N", "ACCURACY %", "SECONDS", "HITS", "COST $",
              "COMMIT"]]
    for r in rows:
        commit = "-" if r["git_commit"] is None else r["git_commit"][:8] + ("+" if r["git_dirty"] else "")
        # each cell escaped and cut before the widths are measured: a newline in a stored name must not break the
        # row, and one long name must not pad every row to its width
        table.append([_clip(cell) for cell in (
            # the user's network beside the recipe whose tricks trained it: its results are not the recipe's own
            str(r["id"]), r["kind"], r["date"][:16].replace("T", " "),
            r["recipe"] + (f" --model {r['model']}" if r["model"] else ""), r["dataset"],
            r["device_name"] or r["device"], str(r["n"]), _num(r["mean_accuracy"], 100, r["std_accuracy"]),
            _num(r["mean_seconds"], 1, r["std_seconds"]), _hits(r["hit_rate"], r["n"]), _num(r["cost"], digits=4),
            commit)])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]


def results_command(args) -> int:
    """`speedrun results`: args has recipe, dataset, device, since, until, command_text, limit, json, csv, db."""
    if args.json and args.csv:
        raise ValueError("--json and --csv are exclusive; choose one")
    filters = {"--recipe": args.recipe, "--dataset": args.dataset, "--device": args.device, "--since": args.since,
               "--until": args.until, "--command": args.command_text}
    with contextlib.closing(db.connect_to_read(args.db)[0]) as conn:  # a read-only database is read too
        rows = db.query(conn, recipe=args.recipe, dataset=args.dataset, device=args.device, since=args.since,
                        until=args.until, command=args.command_text, limit=args.limit)
        stored = bool(rows) or bool(db.query(conn, limit=1))
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.csv:
        # Text cells escaped as the table's are (a stored name's ESC or newline must not reach a terminal raw);
        # --json escapes control characters itself.
        csv.writer(sys.stdout, lineterminator="\n").writerows(
            [db.COLUMNS] + [[printable(v) if isinstance(v, str) else v for v in r.values()] for r in rows])
    elif rows:
        for line in _table(rows):
            out(line)
    elif stored:  # only filters leave nothing out of a database that holds results
        given = " ".join(f"{flag} {shlex.quote(_clip(value, 40))}" for flag, value in filters.items()
                         if value is not None)
        err(f"no stored result matches {given}; widen or drop these filters (`speedrun results` with none lists "
            "every stored result)")
    else:
        err("no stored result matches: the database holds none yet; `speedrun results import FILE` adds some "
            "(and so does `speedrun train`)")
    return 0


def import_command(args) -> int:
    """`speedrun results import FILE... [--db PATH]`: args has files and db. Exit 2 if any file failed."""
    db.check_writable(args.db)  # what connect would refuse, before any file is read
    opened = []

    def connect() -> db.Connection:  # at the first file that passes: files all refused make no database
        opened.append(db.connect(args.db))
        return opened[0]

    try:
        done = db.import_files(connect, args.files)
    finally:
        for conn in opened:
            conn.close()
    for name, new_id, error, new, results in done:
        if error:  # on stderr, the command's error line, with what to do
            err(f"speedrun: error: {name}: {' '.join(error.split())}; not imported (give a result JSON file of "
                "speedrun train or a benchmark script)")
        else:
            # a report's training results (a bench's settings, a sweep's trials) are rows `speedrun results` lists
            rows = f", with the {counted(results, 'training result')} it carries" if results else ""
            out(f"imported {name} as #{new_id}{rows}" if new else f"{name} already stored as #{new_id}{rows}")
    return 2 if any(entry.error for entry in done) else 0


def _compare_lines(report: dict) -> list[str]:
    def ms(s: dict | None, scale: float) -> str:
        return "no runs" if s is None else f"{mean_std_text(s, scale)} (n={s['n']})"

    # the labels name stored results or files, the caveats stored names: each line bounded
    lines = [_middle(f"A (baseline): {report['a']}"), _middle(f"B: {report['b']}"),
             *(_middle(f"caveat: {c}") for c in report["caveats"])]
    lines.append(f"{'':11} {'A':>24} {'B':>24} {'B - A (95% CI)':>28} {'p':>9} {'B / A (95% CI)':>24}")
    for key, name, scale in METRICS:
        m, t = report["metrics"][key], report["metrics"][key]["test"]
        if t is None:
            diff, p, ratio = "n/a (needs 2+ runs a side)", "n/a", "n/a"
        else:
            diff, p, ratio = interval_text(t["diff"], t["ci95"], scale), f"{t['p']:.3g}", ratio_text(t)
        lines.append(f"{name:11} {ms(m['a'], scale):>24} {ms(m['b'], scale):>24} {diff:>28} {p:>9} {ratio:>24}")
    return lines


def compare_command(args, argv: list[str]) -> int:
    """speedrun compare A B [--json] [--db PATH]; stores the comparison as a report in the database."""
    report, stored = compare_stored(args.a, args.b, db_path=args.db, command=shlex.join(["speedrun", *argv]))
    if stored is None:
        err(f"not stored: this process may not write the results database {args.db or db.default_db_path()}")
    if args.json:
        print(json.dumps({**report, "id": stored}, indent=2))
    else:
        for line in _compare_lines(report):
            out(line)
    return 0


def report_command(args) -> int:
    """`speedrun report [--out FILE] [--readme FILE] [--benchmarks FILE] [--db PATH]`: what it wrote on stderr."""
    path = None if args.db is None else user_path(args.db, "--db")  # --db=~/r.db: no shell expanded its ~
    publish(path, out=args.out, readme=args.readme, benchmarks=args.benchmarks, log=err)
    return 0


def prepare_command(args) -> int:
    """`speedrun data prepare`: prepare_tree with the command's flags, progress and the report on stdout."""
    # The speedrun.data package imports torch (its loaders) when it loads: deferred, so that the other commands
    # of this module load without it.

    report = prepare_tree(args.src, args.dst, max_side_px=args.max_side_px, quality=args.quality,
                          workers=args.workers, on_error=args.on_error, log=lambda line: out(line, flush=True))
    for line in report.lines():
        out(line, flush=True)
    return 0
