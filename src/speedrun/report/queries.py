"""What `speedrun report` reads from the results database: leaderboards, learning curves and the instruments'
newest reports, every value checked, with their text forms (html.py and markdown.py render them, publish.py
writes the files).

What the leaderboard ranks: `speedrun train` results (imported files included) that are not smoke tests and have
at least one finished run (a row's kind, db.KINDS); the runs of a bench, an ablation or a sweep live in their reports.
A leaderboard is one data set (its content's fingerprint, whatever path it was read from), recipe family and target:
the recipe's target applies on its own data set only, or where the user gave one (db.identity).
Within it, results that reach the target come first, fastest mean timed region first; then the
others, most accurate first. A result reaches its target by the records rule (stats.reaches_target, modded-nanogpt's):
a one-sided t-test of its runs' accuracies against the target gives p < the threshold (0.01, or $SPEEDRUN_RECORD_P),
with n >= 2 runs; the mean over runs is tested, never the best run. Every stored row is judged as it is read, from
its stored mean, sample std (ddof=1) and n, so rows stored before the rule are judged by it too. Results on
synthetic data (random images and labels: nothing is learnable, accuracy is chance) rank on boards of their own, by
speed alone. Everything read from the database is treated as hostile: escaped, type-checked, cut to length.
"""

from __future__ import annotations

import json
import math
import sqlite3

from speedrun.errors import counted, printable
from speedrun.recipes import RECIPES
from speedrun.records import stats
from speedrun.records.db import json_at
from speedrun.records.stats import interval_text, reaches_target, record_alpha, record_p_text
from speedrun.report.charts import finite

GENERATOR = '<meta name="generator" content="speedrun report">'
# Bounds, so that a database holding anything draws a page of bounded size in bounded time and memory.
ROWS_PER_BOARD, CURVES_PER_CHART, POINTS_PER_CHART = 25, 8, 300
MAX_BOARDS, MAX_REPORTS, MAX_ITEMS = 30, 20, 60  # leaderboards; reports shown; rows of one report's table
MAX_LEFT_OUT = 20  # reports named as not drawn
MAX_HISTORY_CHARS, MAX_EPOCHS = 2_000_000, 1000  # one run's stored history; points on one curve
MAX_REPORT_CHARS = 64 * 2**20  # results.MAX_RESULT_BYTES: what `results import` takes
NO_TARGET = "no target"


_LEADERBOARD_SQL = f"""SELECT id, created_utc, recipe, dataset_name, device, device_name, n, mean_accuracy,
    std_accuracy, mean_seconds, std_seconds, hit_rate, cost, command, git_commit, git_dirty, torch_version,
    world_processes, target, {json_at('$.environment.gpu_driver')}, {json_at('$.environment.torch_cuda')},
    (SELECT COUNT(*) FROM runs WHERE runs.result_id = results.id AND runs.diverged), {json_at('$.config.model')},
    dataset_fingerprint, dataset
    FROM results WHERE mean_accuracy IS NOT NULL AND kind = 'train' AND coalesce({json_at('$.complete')}, 1)"""
# `speedrun train` results only (db.KINDS: not smoke tests, not an instrument's settings), complete ones: an
# interrupted command's partial result is not a record (and the --resume that finishes it stores the same runs
# again as a complete one). Older files without "complete" count as complete. `target` is the one that applies on
# the row's data set (db.identity: the recipe's on its own data set, the user's where given, else none).
_KEYS = ["id", "date", "recipe", "dataset", "device", "device_name", "n", "accuracy", "std_accuracy", "seconds",
         "std_seconds", "hit_rate", "cost", "command", "commit", "dirty", "torch", "processes", "target", "driver",
         "cuda", "diverged", "model", "fingerprint", "source"]


def clip_text(value, limit: int = 400) -> str:
    """A stored value as one printable line of at most `limit` characters (a command can be long; a name is not)."""
    text = printable(" ".join(str("" if value is None else value).split()))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _within(value, low: float, high: float) -> float | None:
    """A stored number if it is finite and in [low, high], else None (shown as "-", never trusted)."""
    value = finite(value)
    return value if value is not None and low <= value <= high else None


def _items(value, limit: int = MAX_ITEMS) -> list[dict]:
    """The dicts of a stored list (anything else: none), at most `limit` of them."""
    return [item for item in value[:limit] if isinstance(item, dict)] if isinstance(value, list) else []


def _clean(values) -> dict | None:
    """A leaderboard row with every value checked: None for a row that cannot be ranked (no plausible accuracy or
    run count); an implausible optional number becomes None."""
    row = dict(zip(_KEYS, values))
    n = row["n"]
    accuracy = _within(row["accuracy"], 0.0, 1.0)
    if accuracy is None or isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10**6:
        return None
    spread = n > 1  # one run has no spread (an old result file may say 0.0)
    row.update(accuracy=accuracy, std_accuracy=_within(row["std_accuracy"], 0.0, 1.0) if spread else None,
               seconds=_within(row["seconds"], 1e-9, 1e9),
               std_seconds=_within(row["std_seconds"], 0.0, 1e9) if spread else None,
               hit_rate=_within(row["hit_rate"], 0.0, 1.0), cost=_within(row["cost"], 0.0, 1e9),
               target=_within(row["target"], 1e-9, 1.0), date=clip_text(row["date"], 40),
               processes=_within(row["processes"], 1, 10**6), dirty=row["dirty"] in (1, True),
               fingerprint=row["fingerprint"] if isinstance(row["fingerprint"], str) else None,
               dataset=clip_text(row["dataset"] if isinstance(row["dataset"], str) else row["source"], 300))
    return row


def family_of(recipe) -> str:
    """The family that trains a stored recipe (recipes.RECIPES), or "other" for a name this version does not know.
    Two families can name different data alike ("synthetic"): a leaderboard is per dataset *and* family."""
    known = RECIPES.get(recipe) if isinstance(recipe, str) else None
    return known.family if known is not None else "other"


def data_key(row: dict) -> str:
    """What a leaderboard groups a row by: its data set's content fingerprint (the same folder by any path, or a
    copy of it, is one data set; a changed one is another), or, for a row stored without one (before speedrun
    recorded it), its name."""
    return clip_text(row["fingerprint"] or f"name:{row['dataset']}", 300)


def _join_unfingerprinted(groups: dict[tuple, list[dict]]) -> None:
    """Rows stored before speedrun fingerprinted data (grouped by name, data_key "name:...") join the one board
    of the same name, family and target that fingerprinted rows make, where there is exactly one: `cifar10`
    measured before and after is one leaderboard. Where several data sets share that name, they stay apart."""
    for key in [k for k in groups if k[0].startswith("name:")]:
        name = key[0][len("name:"):]
        matches = [k for k in groups if not k[0].startswith("name:") and k[1:] == key[1:]
                   and any(r["dataset"] == name for r in groups[k])]
        if len(matches) == 1:
            groups[matches[0]] += groups.pop(key)


def is_synthetic(dataset) -> bool:
    """Random images and labels, by data/sources.py's rule (`synthetic` or `synthetic:key=val,...`): a result there
    measures speed only; its accuracy is chance."""
    text = dataset.strip().lower() if isinstance(dataset, str) else ""
    return text == "synthetic" or text.startswith("synthetic:")


def board_name(board: dict) -> str:
    """"cifar10 (cifar family)", "... (cifar family, network mobile_net:build)" for the user's network, with the
    data's fingerprint where two boards' data sets share a name: what a leaderboard and its charts are about."""
    family, _, network = board["family"].partition(", network ")
    data = clip_text(board["dataset"], 200)
    if board.get("same_name"):  # two data sets of one name: which is which
        fingerprint = board.get("fingerprint")
        data += f" [data {clip_text(fingerprint[7:19], 12)}]" if isinstance(fingerprint, str) else \
            " [data not fingerprinted]"
    return f"{data} ({family} family{f', network {network}' if network else ''})"


# What an instrument's stored setting is, by the instrument that stored it (db.result_kind); any other: a bench's
SETTING_NAMES = {"sweep": ("sweep trial", "sweep trials"),
                 "tune": ("setting of the doctor (tune)", "settings of the doctor (tune)"),
                 "ablate": ("setting of a bench or an ablation", "settings of benches or ablations")}


def unranked_text(conn: sqlite3.Connection) -> str:
    """Why the leaderboards hold nothing though results are stored, in words: "No result is stored yet.", or how
    many stored results are smoke tests, incomplete, an instrument's settings (a bench's or ablation's, a sweep's
    trials, the doctor's), or without an accuracy (the leaderboards rank none of these), and what ranks."""
    smoke, incomplete, stored = conn.execute(
        f"""SELECT coalesce(sum(coalesce({json_at('$.smoke_test')}, 0) != 0), 0),
        coalesce(sum(NOT coalesce({json_at('$.complete')}, 1)), 0), count(*) FROM results""").fetchone()
    if not stored:
        return "No result is stored yet."
    settings: dict[tuple[str, str], int] = {}
    for (kind,) in conn.execute("SELECT kind FROM results WHERE kind NOT IN ('train', 'smoke')"):
        what = SETTING_NAMES.get(kind, SETTING_NAMES["ablate"])
        settings[what] = settings.get(what, 0) + 1
    parts = [counted(n, *what) for n, what in ((smoke, ("smoke test", "smoke tests")),
                                                (incomplete, ("incomplete (interrupted)", "incomplete (interrupted)")),
                                                *((n, what) for what, n in settings.items())) if n]
    if smoke:  # the first part: what a smoke test is, once
        parts[0] += ": pipeline checks, not results"
    return (f"No stored result is ranked: of the {stored} stored, " + ("; ".join(parts) or "none has an accuracy")
            + ". A `speedrun train` without --smoke, run to its end, is ranked.")


def judge(row: dict, alpha: float) -> tuple[bool, float | None]:
    """(reached, p) of a leaderboard row by the records rule at threshold `alpha`; (False, None) without a target,
    with one run, or without a plausible std."""
    if row["target"] is None:
        return False, None
    mean, std, n = row["accuracy"], row["std_accuracy"], row["n"]
    zeros = row.get("diverged") or 0
    if zeros and (std is not None or n == 1):
        # a diverged run counts as accuracy 0 (as in train's summary and sweep): the finished runs' n, mean and
        # sample std pooled with `zeros` values of 0, from the sums they imply
        std = std or 0.0
        total = n + zeros
        squares = (n - 1) * std * std + n * mean * mean  # sum of the finished runs' squared accuracies
        pooled = n * mean / total
        std = math.sqrt(max(squares - total * pooled * pooled, 0.0) / (total - 1))
        mean, n = pooled, total
    return reaches_target(mean, std, n, row["target"], alpha)


def leaderboards(conn: sqlite3.Connection, *, synthetic: bool = False, alpha: float | None = None) -> list[dict]:
    """[{"dataset", "fingerprint", "family", "target", "alpha", "rows": ranked}] per data set (data_key: its content
    fingerprint; "dataset" is its name as its newest row gives it), recipe family and the target that applies there,
    sorted by name; at most MAX_BOARDS of them (the "more" key of the last counts the rest). Each row carries "reached"
    and "p", the records rule's verdict at threshold `alpha` (None: the setting, stats.record_alpha). Real data only;
    synthetic=True: synthetic data only, per dataset and family (no target: their accuracy is chance), fastest
    first."""
    alpha = record_alpha(alpha, "alpha")
    groups: dict[tuple, list[dict]] = {}
    for values in conn.execute(_LEADERBOARD_SQL):
        row = _clean(values)
        if row is not None and is_synthetic(row["source"]) == synthetic:
            row["reached"], row["p"] = (False, None) if synthetic else judge(row, alpha)
            # the user's network (--model) is its own board: its result is not the recipe's network's
            network = clip_text(row["model"], 100) if isinstance(row["model"], str) and row["model"] else ""
            family = family_of(row["recipe"]) + (f", network {network}" if network else "")
            key = (data_key(row), family, None if synthetic else row["target"])
            groups.setdefault(key, []).append(row)
    _join_unfingerprinted(groups)
    boards = []
    for (_, family, target), rows in groups.items():
        def rank(r):
            reached = r["reached"]
            seconds = r["seconds"] if r["seconds"] is not None else float("inf")
            if synthetic:
                return seconds, r["id"]
            return not reached, seconds if reached else -r["accuracy"], r["id"]
        ranked = sorted(rows, key=rank)
        newest = max(rows, key=lambda r: (r["date"], r["id"]))  # a copy may carry another folder's name
        fingerprint = next((r["fingerprint"] for r in rows if r["fingerprint"]), None)  # old rows have none
        boards.append({"dataset": clip_text(newest["dataset"], 300), "fingerprint": fingerprint,
                       "family": family, "target": target, "alpha": alpha, "rows": ranked})
    boards.sort(key=lambda b: (b["dataset"], b["family"], b["target"] or 0, b["fingerprint"] or ""))
    names = [(b["dataset"], b["family"]) for b in boards]
    for board, name in zip(boards, names):
        board["same_name"] = names.count(name) > 1  # board_name then tells them apart by fingerprint
    if len(boards) > MAX_BOARDS:
        boards = boards[:MAX_BOARDS]
        boards[-1]["more"] = len(groups) - MAX_BOARDS
    return boards


def has_reached(row: dict) -> bool:
    """A leaderboard row reaches its target by the records rule (leaderboards judged it)."""
    return row["reached"]


def record_p_cell(row: dict) -> str:
    """The records rule's p of a leaderboard row: "3.1e-04", "-" with one run or no target."""
    return record_p_text(row["p"])


def rule_text(alpha: float) -> str:
    """The records rule in words, for the notes under a leaderboard."""
    return (f"a result reaches its target only when a one-sided t-test of its runs' accuracies against the target "
            f"gives p < {alpha:g} (n >= 2 runs; the environment variable SPEEDRUN_RECORD_P sets the threshold), as "
            "modded-nanogpt's records require")


def pm_text(value, std, scale: float = 1.0, digits: int = 2) -> str:
    value, std = finite(value), finite(std)
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}" + ("" if std is None else f" ± {std * scale:.{digits}f}")


def hits_text(row: dict) -> str:
    return "-" if row["hit_rate"] is None else f"{round(row['hit_rate'] * row['n'])}/{row['n']}"


def fingerprint_text(row: dict) -> str:
    """What a result ran on, in a cell: the commit, torch, and on a GPU its CUDA and driver (a CPU run has neither:
    a CPU build of torch has no CUDA, and a CUDA build run on the CPU used none), the processes."""
    commit = "-" if not isinstance(row["commit"], str) else row["commit"][:10] + ("+dirty" if row["dirty"] else "")
    gpu = [] if row.get("device") == "cpu" else [f"CUDA {row['cuda'] or '-'}", f"driver {row['driver'] or '-'}"]
    processes = int(row["processes"] or 1)
    return " · ".join(clip_text(part, 60) for part in (
        f"commit {commit}", f"torch {row['torch'] or '-'}", *gpu,
        f"{processes} process{'' if processes == 1 else 'es'}"))


def newest_reports(conn: sqlite3.Connection, kinds: tuple[str, ...], left_out: list[str] | None = None) -> list[dict]:
    """The newest complete report of each kind per (recipe, dataset, device), or, where none is complete, the
    newest partial one; dicts with "_id", "_date" and "_partial"; at most MAX_REPORTS. Only reports that can be
    drawn (drawing_problem): each stored one that cannot, and the reports past MAX_REPORTS, get a sentence in
    `left_out` (at most MAX_LEFT_OUT, then one that counts the rest), so that a page never hides them."""
    chosen: dict[tuple, dict] = {}
    problems: list[str] = []
    sql = (f"SELECT id, kind, created_utc, CASE WHEN length(json) <= {MAX_REPORT_CHARS} THEN json END FROM reports "
           f"WHERE kind IN ({', '.join('?' * len(kinds))}) ORDER BY created_utc DESC, id DESC")
    for id_, kind, date, text in conn.execute(sql, kinds):
        try:
            report = json.loads(text) if text is not None else None
            problem = ("it is larger than a stored report may be" if text is None else
                       "it is not a JSON object" if not isinstance(report, dict) else drawing_problem(report, kind))
        except (ValueError, RecursionError, TypeError):  # the database stores strict JSON; this was edited by hand
            problem = "it is not valid JSON"
        if problem is not None:
            problems.append(f"report #{id_} ({clip_text(kind, 40)}, {clip_text(date, 40)[:10]}) could not be "
                            f"drawn: {problem}")
            continue
        key = tuple(clip_text(report.get(k), 200) for k in ("benchmark", "recipe", "dataset", "device"))
        if report.get("benchmark") == "bench":  # benches of different --vary are different questions: each shown
            key += (clip_text([clip_text(_dict(x).get("name"), 60) for x in _items(report.get("settings"))], 2000),)
        partial = report.get("complete") is not True or report.get("interrupted") is True
        if key not in chosen or (chosen[key]["_partial"] and not partial):
            chosen[key] = {**report, "_id": id_, "_date": clip_text(date, 40), "_partial": partial}
    note_left_out(left_out, problems, len(chosen), MAX_REPORTS, "report", ("could not be drawn", "not drawn"))
    return list(chosen.values())[:MAX_REPORTS]


def note_left_out(left_out: list[str] | None, problems: list[str], found: int, most: int, noun: str,
                  verbs: tuple[str, str]) -> None:
    """Add to `left_out` (None: nobody asks) the sentences on what a page leaves out: the first MAX_LEFT_OUT
    `problems` and a count of the rest (verbs[0]: "could not be drawn"), and, of `found` that can be drawn, how many
    are past the page's `most` (verbs[1]: "not drawn")."""
    if left_out is None:
        return
    left_out += problems[:MAX_LEFT_OUT]
    if len(problems) > MAX_LEFT_OUT:
        left_out.append(f"{counted(len(problems) - MAX_LEFT_OUT, f'more {noun}')} {verbs[0]}")
    if found > most:
        left_out.append(f"{counted(found - most, f'more {noun}')} {verbs[1]}: at most {most} are")


# The list each kind of report draws, and its rows: a report whose list holds no row that can be drawn is named.
REPORT_LISTS = {"bench": "settings", "ablate": "tricks", "waterfall": "waterfall", "to_target": "variants",
                "tune": "tune.rows"}


def report_rows(report: dict) -> list[dict]:
    """The rows a report of its "benchmark" kind draws (none for another kind)."""
    rows = {"bench": setting_rows, "ablate": ablation_rows, "waterfall": waterfall_rows, "to_target": target_rows,
            "tune": tune_rows}.get(report.get("benchmark"))
    return [] if rows is None else rows(report)


def drawing_problem(report: dict, kind: str) -> str | None:
    """Why a stored report (a dict) of `kind` (the reports table's) cannot be drawn, as "settings is not a list";
    None when it can."""
    if report.get("benchmark") != kind:
        return f"its benchmark field is {clip_text(json.dumps(report.get('benchmark')), 60)}, not \"{kind}\""
    field = REPORT_LISTS.get(kind)
    if field is None:
        return f"a page does not draw {kind} reports"
    value = report
    for part in field.split("."):
        value = _dict(value).get(part)
    if not isinstance(value, list):
        return f"{field} is {'missing' if value is None else 'not a list'}"
    if not report_rows(report):
        return f"no entry of {field} has the numbers to draw ({len(value)} listed)"
    return None


def accuracy_curves(conn: sqlite3.Connection, rows: list[dict]) -> list[dict]:
    """Per result: the mean test accuracy after each epoch over its finished runs (epochs that every run has)."""
    curves = []
    for row in rows[:CURVES_PER_CHART]:
        runs = []
        for (text,) in conn.execute("SELECT history FROM runs WHERE result_id = ? AND NOT diverged AND history IS "
                                    f"NOT NULL AND length(history) <= {MAX_HISTORY_CHARS} ORDER BY run_index LIMIT 100",
                                    (row["id"],)):
            try:
                history = json.loads(text)
            except (ValueError, RecursionError, TypeError):
                continue
            points = [(finite(h.get("epoch")), _within(h.get("val_acc"), 0.0, 1.0))
                      for h in _items(history, MAX_EPOCHS)]
            points = [(e, a) for e, a in points if e is not None and a is not None]
            if points:
                runs.append(points)
        length = min((len(points) for points in runs), default=0)
        if length:
            device = clip_text(row["device_name"] or row["device"], 30)
            curves.append({"label": f"#{row['id']} {clip_text(row['recipe'], 40)}, {device}, n={len(runs)}, "
                                    f"{row['date'][:10]}",
                           "epochs": [e for e, _ in runs[0][:length]],
                           "accuracy": [sum(points[i][1] for points in runs) / len(runs) for i in range(length)]})
    return curves


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _interval(value, ci) -> tuple:
    """(value, low, high) as checked numbers: low <= value <= high, all within ±1 (accuracy differences), or the
    interval dropped (None, None) when it is not one."""
    value = _within(value, -1.0, 1.0)
    low, high = (_within(ci[0], -1.0, 1.0), _within(ci[1], -1.0, 1.0)) if isinstance(ci, list) and len(ci) == 2 \
        else (None, None)
    if value is None or low is None or high is None or not low <= value <= high:
        return value, None, None
    return value, low, high


def ablation_rows(report: dict) -> list[dict]:
    rows = []
    for r in _items(report.get("tricks")):
        gain, low, high = _interval(r.get("gain_accuracy"), r.get("gain_ci95"))
        if r.get("measured") is True and gain is not None:
            rows.append({"trick": clip_text(r.get("trick"), 60), "off": clip_text(r.get("off"), 30), "gain": gain,
                         "low": low, "high": high, "p": _within(r.get("p"), 0.0, 1.0),
                         "ratio": _within(r.get("time_ratio_off"), 0.0, 1e6), "what": clip_text(r.get("what"), 120)})
    return rows


def waterfall_rows(report: dict) -> list[dict]:
    rows = []
    for r in _items(report.get("waterfall")):
        acc = _dict(r.get("accuracy"))
        if _within(acc.get("mean"), 0.0, 1.0) is None:
            continue
        d = _dict(_dict(r.get("bought")).get("accuracy"))
        gain, low, high = _interval(d.get("diff"), d.get("ci95"))
        rows.append({"label": clip_text(r.get("step"), 60), "accuracy": _within(acc["mean"], 0.0, 1.0),
                     "std": _within(acc.get("std"), 0.0, 1.0), "gain": gain, "low": low, "high": high,
                     "p": _within(d.get("p"), 0.0, 1.0),
                     "seconds": _within(_dict(r.get("train_seconds")).get("mean"), 0.0, 1e9)})
    return rows


def _ratio(test: dict) -> tuple:
    """(ratio, low, high) of a stored mean_diff_test: the ratio of means if plausible, and its 95% interval if that
    holds it (low <= ratio <= high; stats.ratio_ci95's, symmetric or not), else (ratio, None, None)."""
    ratio, ci = _within(test.get("ratio"), 0.0, 1e6), test.get("ratio_ci95")
    low, high = (_within(ci[0], 0.0, 1e6), _within(ci[1], 0.0, 1e6)) if isinstance(ci, list) and len(ci) == 2 \
        else (None, None)
    if ratio is None or low is None or high is None or not low <= ratio <= high:
        return ratio, None, None
    return ratio, low, high


def _summary(value, high: float) -> tuple | None:
    """A stored stats.Summary as (mean, low, high): the mean if within [0, high]; its 95% interval if that holds it
    and lies within [-high, 2 * high] (the t-interval of two or three runs may reach below 0 or past `high`), else
    (mean, None, None); None without a plausible mean."""
    value = _dict(value)
    mean = _within(value.get("mean"), 0.0, high)
    if mean is None:
        return None
    low, top = _within(value.get("ci95_low"), -high, 2 * high), _within(value.get("ci95_high"), -high, 2 * high)
    if low is None or top is None or not low <= mean <= top:
        return mean, None, None
    return mean, low, top


def setting_rows(report: dict) -> list[dict]:
    """A bench (or ablate) report's settings, the first its baseline (label: its name, the baseline's marked), each
    number checked: runs finished (n), accuracy and timed seconds as (mean, 95% low, 95% high) or None, and against
    the baseline the accuracy difference (gain, low, high: setting - baseline) with p, and the time ratio setting /
    baseline with its interval."""
    rows = []
    for i, s in enumerate(_items(report.get("settings"))):
        versus = _dict(s.get("versus_baseline"))
        acc, secs = _dict(versus.get("accuracy")), _dict(versus.get("train_seconds"))
        gain, low, high = _interval(acc.get("diff"), acc.get("ci95"))
        ratio, ratio_low, ratio_high = _ratio(secs)
        rows.append({"name": clip_text(s.get("name"), 60), "baseline": i == 0, "n": _within(s.get("n"), 0, 1e6),
                     "accuracy": _summary(s.get("accuracy"), 1.0), "seconds": _summary(s.get("train_seconds"), 1e9),
                     "gain": gain, "low": low, "high": high, "p": _within(acc.get("p"), 0.0, 1.0),
                     "ratio": ratio, "ratio_low": ratio_low, "ratio_high": ratio_high})
        rows[-1]["label"] = setting_label(rows[-1])
    return rows


def setting_label(row: dict) -> str:
    """A setting's name, the baseline's marked as such where its name does not say so."""
    return row["name"] if not row["baseline"] or "baseline" in row["name"] else f"{row['name']} (baseline)"


def summary_text(value: tuple | None, scale: float = 1.0) -> str:
    """"66.73 (65.10 .. 68.36)": a setting_rows mean with its 95% interval, times `scale`; the mean alone without
    one; "-" without a mean."""
    if value is None:
        return "-"
    mean, low, high = value
    return f"{scale * mean:.2f}" + ("" if low is None else f" ({scale * low:.2f} .. {scale * high:.2f})")


def tune_rows(report: dict) -> list[dict]:
    """The doctor's rows (instruments/tune.py), each number checked: setting, the guide's item, the time ratio with
    its interval, p, the accuracy difference where the setting changes the numbers, the verdict."""
    rows = []
    for r in _items(_dict(report.get("tune")).get("rows")):
        t = _dict(r.get("time"))
        ratio, low, high = _ratio(t)
        a = _dict(r.get("accuracy")) if r.get("changes_numbers") is True else {}
        gain, alow, ahigh = _interval(a.get("diff"), a.get("ci95"))
        rows.append({"setting": clip_text(r.get("setting"), 80), "guide": clip_text(r.get("guide"), 60),
                     "n": _within(r.get("n"), 0, 1e6), "ratio": ratio, "ratio_low": low,
                     "ratio_high": high, "p": _within(t.get("p"), 0.0, 1.0), "changes_numbers":
                     r.get("changes_numbers") is True, "gain": gain, "low": alow, "high": ahigh,
                     "recommended": r.get("recommended") is True, "verdict": clip_text(r.get("verdict"), 60)})
    return rows


def tune_recommended(report: dict) -> str:
    """The recommended settings as `key=value ...`, each clipped; "none" when nothing measured faster."""
    found = _dict(_dict(report.get("tune")).get("recommended"))
    return " ".join(f"{clip_text(k, 40)}={clip_text(v, 40)}" for k, v in list(found.items())[:20]) or "none"


def ratio_text(row: dict) -> str:
    if row["ratio"] is None:
        return "-"
    if row["ratio_low"] is None or row["ratio_high"] is None:
        return f"{row['ratio']:.3f}"
    return stats.ratio_text({"ratio": row["ratio"], "ratio_ci95": [row["ratio_low"], row["ratio_high"]]})


def target_rows(report: dict) -> list[dict]:
    """Per variant: the epochs it needed ("reached"), or the most it was tried at: "not reached" when its search
    ended there, "unfinished" when the search was cut short (an interrupted command)."""
    rows = []
    for v in _items(report.get("variants")):
        probes = [p for p in _items(v.get("probes")) if _within(p.get("epochs"), 0.0, 1e6) is not None]
        needed = _within(v.get("epochs_needed"), 0.0, 1e6)
        epochs = needed if needed is not None else max((p["epochs"] for p in probes), default=None)
        if epochs is not None:
            status = ("reached" if needed is not None else
                      "not reached" if v.get("search_complete") is True else "unfinished")
            rows.append({"name": clip_text(v.get("name"), 60), "epochs": epochs, "status": status,
                         "seconds": _within(v.get("seconds_needed"), 0.0, 1e9), "probes": len(probes)})
    return rows


def baseline_text(report: dict) -> str:
    """An ablation's baseline (the recipe itself, its first setting): "43.21 ± 2.95% in 87.5 s", or ""."""
    first = _items(report.get("settings"), 1)
    acc, secs = (_dict(first[0].get(k)) if first else {} for k in ("accuracy", "train_seconds"))
    mean = _within(acc.get("mean"), 0.0, 1.0)
    if mean is None:
        return ""
    return (f"{pm_text(mean, _within(acc.get('std'), 0.0, 1.0), 100)}% in "
            f"{pm_text(_within(secs.get('mean'), 0.0, 1e9), None)} s timed")


def report_title(report: dict, what: str) -> str:
    return (f"{clip_text(report.get('recipe'), 60)} on {clip_text(report.get('dataset'), 80)} "
            f"({clip_text(report.get('device'), 20)}): {what}")


def _runs(runs: object) -> str:
    """"1 run", "5 runs"; a stored value that is not a count, shown as it is (cut short)."""
    if isinstance(runs, int) and not isinstance(runs, bool):
        return counted(runs, "run")
    return f"{clip_text(runs, 10)} runs"


def provenance(report: dict) -> str:
    why = "was interrupted" if report.get("interrupted") is True else "failed part way"
    partial = f" (partial: the command {why})" if report["_partial"] else ""
    return (f"report #{report['_id']} of {report['_date'][:10]}{partial}, {_runs(report.get('runs'))} "
            f"per row: `{clip_text(report.get('command'), 600)}`")


def ci_text(row: dict, scale: float = 100) -> str:
    if row["gain"] is None or row["low"] is None or row["high"] is None:
        return "-"
    return interval_text(row["gain"], [row["low"], row["high"]], scale)


def p_text(value) -> str:
    return "-" if value is None else f"{value:.3g}"
