"""`speedrun report`: the results database as one self-contained HTML page, and the generated Markdown tables.

The page (no script, no network at view time: every chart is a PNG inside the file) holds a leaderboard per
dataset and target accuracy, accuracy against time per recipe, per-epoch learning curves, the newest ablation
bars, waterfall and --to-target charts per recipe, dataset and device, and every stored benchmark report.
`--readme FILE` and `--benchmarks FILE` rewrite the text between the marker lines `<!-- records:begin -->` ...
`<!-- records:end -->` (the README's records table) and `<!-- ablation:begin -->` ... (BENCHMARKS.md's ablation
and waterfall tables), the convention of benchmarks/table.py, so no number there is typed by hand.

What the leaderboard ranks: `speedrun train` results (imported files included) that are not smoke tests and have
at least one finished run; the runs of a bench or ablation (commands ending "# setting ...") live in their reports.
Within a dataset and target, results whose mean accuracy reaches the target come first, fastest mean timed region
first (the airbench rule: the mean over runs must reach the target, not the best run); then the others, most
accurate first. Everything read from the database is treated as hostile: escaped, type-checked, cut to length.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
from pathlib import Path

from speedrun.errors import printable
from speedrun.report_charts import finite

GENERATOR = '<meta name="generator" content="speedrun report">'
ROWS_PER_BOARD, CURVES_PER_CHART = 25, 8
_NO_TARGET = "no target"
_LEADERBOARD_SQL = """SELECT id, created_utc, recipe, dataset, device, device_name, n, mean_accuracy, std_accuracy,
    mean_seconds, std_seconds, hit_rate, cost, command, git_commit, git_dirty, torch_version, world_processes,
    coalesce(json_extract(json, '$.config.target_accuracy'), json_extract(json, '$.target_accuracy')),
    json_extract(json, '$.environment.gpu_driver'), json_extract(json, '$.environment.torch_cuda')
    FROM results WHERE n > 0 AND mean_accuracy IS NOT NULL AND NOT coalesce(json_extract(json, '$.smoke_test'), 0)
    AND instr(coalesce(command, ''), '  # setting ') = 0"""
_KEYS = ["id", "date", "recipe", "dataset", "device", "device_name", "n", "accuracy", "std_accuracy", "seconds",
         "std_seconds", "hit_rate", "cost", "command", "commit", "dirty", "torch", "processes", "target", "driver",
         "cuda"]


def _text(value, limit: int = 400) -> str:
    """A stored value as one printable line of at most `limit` characters (a command can be long; a name is not)."""
    text = printable(" ".join(str("" if value is None else value).split()))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def leaderboards(conn: sqlite3.Connection) -> list[dict]:
    """[{"dataset", "target", "rows": ranked}] per dataset and target accuracy, datasets in name order."""
    groups: dict[tuple, list[dict]] = {}
    for values in conn.execute(_LEADERBOARD_SQL):
        row = dict(zip(_KEYS, values))
        target = finite(row["target"])
        row["target"] = target if target is not None and 0 < target <= 1 else None
        if finite(row["accuracy"]) is None:
            continue
        groups.setdefault((str(row["dataset"]), row["target"]), []).append(row)
    boards = []
    for (dataset, target), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        def rank(r):
            reached = target is not None and r["accuracy"] >= target
            seconds = finite(r["seconds"])
            return (not reached, (seconds if seconds is not None else float("inf")) if reached else -r["accuracy"],
                    r["id"])
        boards.append({"dataset": dataset, "target": target, "rows": sorted(rows, key=rank)})
    return boards


def _reached(row: dict) -> bool:
    return row["target"] is not None and row["accuracy"] >= row["target"]


def _pm(value, std, scale: float = 1.0, digits: int = 2) -> str:
    value, std = finite(value), finite(std)
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}" + ("" if std is None else f" ± {std * scale:.{digits}f}")


def _hits(row: dict) -> str:
    hit = finite(row["hit_rate"])
    return "-" if hit is None else f"{round(hit * row['n'])}/{row['n']}"


def _fingerprint(row: dict) -> str:
    commit = "-" if not isinstance(row["commit"], str) else row["commit"][:10] + ("+dirty" if row["dirty"] else "")
    return " · ".join(_text(part, 60) for part in (
        f"commit {commit}", f"torch {row['torch'] or '-'}", f"CUDA {row['cuda'] or '-'}",
        f"driver {row['driver'] or '-'}", f"{row['processes'] or 1} process(es)"))


def _newest_reports(conn: sqlite3.Connection, kinds: tuple[str, ...]) -> list[dict]:
    """The newest stored report of each kind per (recipe, dataset, device), as dicts with "_id" and "_date"."""
    seen, out = set(), []
    sql = (f"SELECT id, created_utc, json FROM reports WHERE kind IN ({', '.join('?' * len(kinds))}) "
           "ORDER BY created_utc DESC, id DESC")
    for id_, date, text in conn.execute(sql, kinds):
        try:
            report = json.loads(text)
        except (ValueError, RecursionError):
            continue  # the database stores strict JSON; a file edited by hand is skipped, not fatal
        if not isinstance(report, dict):
            continue
        key = tuple(_text(report.get(k), 200) for k in ("benchmark", "recipe", "dataset", "device"))
        if key not in seen:
            seen.add(key)
            out.append({**report, "_id": id_, "_date": _text(date, 40)})
    return out


def _curves(conn: sqlite3.Connection, rows: list[dict]) -> list[dict]:
    """Per result: the mean test accuracy after each epoch over its finished runs (epochs that every run has)."""
    curves = []
    for row in rows:
        runs = []
        for (text,) in conn.execute("SELECT history FROM runs WHERE result_id = ? AND NOT diverged AND history IS "
                                    "NOT NULL ORDER BY run_index", (row["id"],)):
            try:
                history = json.loads(text)
            except (ValueError, RecursionError):
                continue
            points = [(finite(h.get("epoch")), finite(h.get("val_acc"))) for h in history if isinstance(h, dict)]
            points = [(e, a) for e, a in points if e is not None and a is not None]
            if points:
                runs.append(points)
        length = min((len(points) for points in runs), default=0)
        if length:
            device = _text(row["device_name"] or row["device"], 30)
            curves.append({"label": f"#{row['id']} {_text(row['recipe'], 40)}, {device}, n={len(runs)}, "
                                    f"{_text(row['date'], 10)[:10]}",
                           "epochs": [e for e, _ in runs[0][:length]],
                           "accuracy": [sum(points[i][1] for points in runs) / len(runs) for i in range(length)]})
    return curves[:CURVES_PER_CHART]


def _ablation_rows(report: dict) -> list[dict]:
    rows = []
    for r in report.get("tricks") or []:
        ci = r.get("gain_ci95") if isinstance(r, dict) else None
        if not isinstance(r, dict) or not r.get("measured") or not isinstance(ci, list) or len(ci) != 2:
            continue
        gain, low, high = finite(r.get("gain_accuracy")), finite(ci[0]), finite(ci[1])
        if None not in (gain, low, high):
            rows.append({"trick": _text(r.get("trick"), 60), "off": _text(r.get("off"), 30), "gain": gain,
                         "low": low, "high": high, "p": finite(r.get("p")), "ratio": finite(r.get("time_ratio_off")),
                         "what": _text(r.get("what"), 120)})
    return rows


def _waterfall_rows(report: dict) -> list[dict]:
    rows = []
    for r in report.get("waterfall") or []:
        acc = r.get("accuracy") if isinstance(r, dict) else None
        if not isinstance(acc, dict) or finite(acc.get("mean")) is None:
            continue
        bought = r.get("bought") if isinstance(r.get("bought"), dict) else {}
        d = bought.get("accuracy") if isinstance(bought.get("accuracy"), dict) else {}
        ci = d.get("ci95") if isinstance(d.get("ci95"), list) and len(d["ci95"]) == 2 else [None, None]
        secs = r.get("train_seconds") if isinstance(r.get("train_seconds"), dict) else {}
        rows.append({"label": _text(r.get("step"), 60), "accuracy": finite(acc["mean"]), "std": finite(acc.get("std")),
                     "gain": finite(d.get("diff")), "low": finite(ci[0]), "high": finite(ci[1]),
                     "p": finite(d.get("p")), "seconds": finite(secs.get("mean"))})
    return rows


def _target_rows(report: dict) -> list[dict]:
    rows = []
    for v in report.get("variants") or []:
        if not isinstance(v, dict):
            continue
        probes = [p for p in v.get("probes") or [] if isinstance(p, dict) and finite(p.get("epochs")) is not None]
        needed = finite(v.get("epochs_needed"))
        epochs = needed if needed is not None else max((finite(p["epochs"]) for p in probes), default=None)
        if epochs is not None:
            rows.append({"name": _text(v.get("name"), 60), "epochs": epochs, "reached": needed is not None,
                         "seconds": finite(v.get("seconds_needed")), "probes": len(probes)})
    return rows


def _title(report: dict, what: str) -> str:
    return (f"{_text(report.get('recipe'), 60)} on {_text(report.get('dataset'), 80)} "
            f"({_text(report.get('device'), 20)}): {what}")


def _provenance(report: dict) -> str:
    return (f"report #{report['_id']} of {report['_date'][:10]}, {_text(report.get('runs'), 10)} run(s) per row: "
            f"`{_text(report.get('command'), 600)}`")


def _ci(row: dict, scale: float = 100) -> str:
    if row["gain"] is None or row["low"] is None or row["high"] is None:
        return "-"
    return f"{row['gain'] * scale:+.2f} ({row['low'] * scale:+.2f} .. {row['high'] * scale:+.2f})"


def _p(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("`", "'")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell if cell.startswith("`") and cell.endswith("`") else _md(cell) for cell in row) + " |"
        for row in rows]


def _code(text: str) -> str:
    return f"`{_md(text)}`"


def benchmarks_lines(conn: sqlite3.Connection) -> list[str]:
    """BENCHMARKS.md's generated section: the newest ablation and waterfall tables per recipe, dataset, device."""
    lines = []
    for report in _newest_reports(conn, ("ablate", "waterfall")):
        env = report.get("environment") if isinstance(report.get("environment"), dict) else {}
        where = f"{_text(env.get('device_name') or report.get('device'), 60)}, torch {_text(env.get('torch'), 30)}"
        if report.get("benchmark") == "ablate":
            rows = _ablation_rows(report)
            lines += [f"#### Ablation: {_title(report, 'each trick off alone')}", "",
                      f"{where}; {_provenance(report)}. Gain = baseline − trick off, in accuracy points.", ""]
            lines += _md_table(["trick", "off value", "gain, points (95% CI)", "p", "time off/on", "what"],
                               [[r["trick"], r["off"], _ci(r), _p(r["p"]), "-" if r["ratio"] is None
                                 else f"{r['ratio']:.3f}", r["what"]] for r in rows])
        else:
            rows = _waterfall_rows(report)
            lines += [f"#### Waterfall: {_title(report, 'tricks added one at a time')}", "",
                      f"{where}; {_provenance(report)}.", ""]
            lines += _md_table(["step", "test acc %", "bought, points (95% CI)", "p", "timed s"],
                               [[r["label"], _pm(r["accuracy"], r["std"], 100), _ci(r), _p(r["p"]),
                                 _pm(r["seconds"], None)] for r in rows])
        lines.append("")
    return lines or ["No ablation or waterfall report is stored yet (`speedrun ablate`)."]


def readme_lines(conn: sqlite3.Connection, per_board: int = 3) -> list[str]:
    """The README's records table: the first `per_board` rows of each leaderboard."""
    rows = [(board, r) for board in leaderboards(conn) for r in board["rows"][:per_board]]
    if not rows:
        return ["No result is stored yet."]
    table = _md_table(["dataset", "target", "recipe", "device", "test acc %", "timed s", "n", "reached", "date",
                       "command"],
                      [[_text(b["dataset"], 80), _NO_TARGET if b["target"] is None else f"{100 * b['target']:g}%",
                        _text(r["recipe"], 40), _text(r["device_name"] or r["device"], 40),
                        _pm(r["accuracy"], r["std_accuracy"], 100), _pm(r["seconds"], r["std_seconds"]), str(r["n"]),
                        "yes" if _reached(r) else "no", _text(r["date"], 10)[:10], _code(_text(r["command"], 300))]
                       for b, r in rows])
    return table + ["", f"Generated by `speedrun report --readme` from the results database ({len(rows)} row(s)); "
                        "the full leaderboard, charts and fingerprints are in the HTML report."]


def markers(name: str) -> tuple[str, str]:
    """The lines that bound a generated section of a Markdown file (benchmarks/table.py uses the same)."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_marked(doc: str, sections: dict[str, str], where: str) -> str:
    """`doc` with the text between each section's markers replaced; the rest kept byte for byte. Markers
    missing, repeated or out of order are a ValueError naming the lines to add."""
    for name, text in sections.items():
        begin, end = markers(name)
        if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
            raise ValueError(f"{where} needs one line {begin} and, after it, one line {end}; the generated "
                             f"{name} text goes between them")
        head, rest = doc.split(begin, 1)
        doc = head + begin + "\n" + text.rstrip("\n") + "\n" + end + rest.split(end, 1)[1]
    return doc


def rewrite_marked(path: str | Path, sections: dict[str, str]) -> None:
    """replace_marked on a file, written atomically only once every section is placed."""
    from speedrun.results import write_text

    path, where = Path(path), printable(str(path))
    try:
        doc = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {where} ({getattr(e, 'strerror', None) or e}); give the Markdown file "
                         "to update") from None
    write_text(path, replace_marked(doc, sections, where))


def _check_out(path: Path) -> None:
    """--out may replace an earlier report, never another file (the first KB must carry GENERATOR)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise ValueError(f"--out {printable(str(path))} is a directory; give a file name such as report.html") from None
    except OSError as e:
        raise ValueError(f"cannot check --out {printable(str(path))} ({e.strerror}); give another file") from None
    if GENERATOR.encode() not in head:
        raise ValueError(f"--out {printable(str(path))} exists and is not a speedrun report; give another file "
                         "name (an earlier report is replaced, nothing else is)")


def report_command(args) -> int:
    """`speedrun report [--out FILE] [--readme FILE] [--benchmarks FILE] [--db PATH]`."""
    from speedrun import db, report_html
    from speedrun.results import write_text

    path = db.default_db_path() if args.db is None else Path(args.db)
    if not os.path.exists(path):  # connect would create an empty database: say what is missing instead
        raise ValueError(f"no results database at {printable(str(path))}; train something first "
                         "(speedrun train) or give one with --db PATH")
    out = None if args.out is None and (args.readme or args.benchmarks) else Path(args.out or "speedrun-report.html")
    if out is not None:
        _check_out(out)
    with contextlib.closing(db.connect(path)) as conn:
        if args.readme:
            rewrite_marked(args.readme, {"records": "\n".join(readme_lines(conn))})
            print(f"rewrote the records table in {printable(str(args.readme))}", file=sys.stderr)
        if args.benchmarks:
            rewrite_marked(args.benchmarks, {"ablation": "\n".join(benchmarks_lines(conn))})
            print(f"rewrote the ablation tables in {printable(str(args.benchmarks))}", file=sys.stderr)
        if out is not None:
            text = report_html.page(conn)
            _check_out(out)  # again: drawing takes seconds, and a file may have appeared meanwhile
            write_text(out, text)
            print(f"report: {printable(str(out))} ({len(text.encode()) // 1024} KB)", file=sys.stderr)
    return 0
