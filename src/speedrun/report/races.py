"""The races against airbench94 in the results database, as rows for the pages: each a report of
benchmarks/vs_airbench.py (kind "vs_airbench": our recipe and airbench94 on the same data, n runs each,
interleaved, in one invocation), stored with its --db or by `speedrun results import`.

A row: the device, our recipe and its precision against the anchor, the schedule, the time ratio ours / anchor and
the accuracy difference ours - anchor (points), each with its 95% interval and Welch's p, the runs of each side,
the date and the data set's name (its "name", never the path it was read from). Dry runs (--dry-run-cpu: ours alone,
on tiny data) and races that did not finish are no result and are left out. Everything read is hostile: each
number checked, each text clipped; a report that is not a race is named in `left_out`, never drawn.
"""

from __future__ import annotations

import json
import sqlite3

from speedrun.errors import counted
from speedrun.records.stats import interval_text, signed_text
from speedrun.report.charts import finite
from speedrun.report.portable import portable_paths
from speedrun.report.queries import MAX_REPORT_CHARS, clip_text, note_left_out, ratio_text

KIND = "vs_airbench"
ANCHOR = "airbench94"
MAX_RACES = 20  # rows on a page: a database holding anything draws a bounded one


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value, low: float, high: float) -> float | None:
    """A stored number if finite and in [low, high], else None (shown as "-", never trusted)."""
    value = finite(value)
    return value if value is not None and low <= value <= high else None


def _count(value) -> int | None:
    """A stored count of runs: an int in [1, 10**6], else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 10**6 else None


def _estimate(test, low: float, high: float) -> tuple:
    """(value, ci low, ci high, p) of a stored comparison entry ({value, ci95_low, ci95_high, welch_p}), each within
    [low, high]; the interval dropped (None, None) unless it holds the value."""
    test = _dict(test)
    value = _number(test.get("value"), low, high)
    ci = _number(test.get("ci95_low"), low, high), _number(test.get("ci95_high"), low, high)
    if value is None or None in ci or not ci[0] <= value <= ci[1]:
        ci = None, None
    return value, *ci, _number(test.get("welch_p"), 0.0, 1.0)


def _side(value) -> tuple[int | None, float | None, float | None]:
    """(runs, mean accuracy, mean timed seconds) of a stored side ("ours" or "airbench"), each checked."""
    side = _dict(value)
    accuracy, seconds = _dict(side.get("accuracy")), _dict(side.get("train_seconds"))
    return (_count(accuracy.get("n")), _number(accuracy.get("mean"), 0.0, 1.0),
            _number(seconds.get("mean"), 1e-9, 1e9))


def why_not_a_race(report) -> str | None:
    """Why a stored report is not a race a page shows (a dry run, unfinished, a side missing); None when it is."""
    if not isinstance(report, dict):
        return "it is not a JSON object"
    if report.get("benchmark") != KIND:
        return f"its benchmark field is {clip_text(json.dumps(report.get('benchmark')), 40)}, not \"{KIND}\""
    if report.get("dry_run_cpu") not in (False, None):
        return "a dry run (--dry-run-cpu: ours alone, a plumbing check)"
    if report.get("complete") is not True:
        return "it did not finish (complete is not true)"
    for key in ("ours", "airbench"):
        n, accuracy, seconds = _side(report.get(key))
        if n is None or accuracy is None or seconds is None:
            return f"its {key} side has no plausible runs, accuracy and time"
    return None


def race_row(report: dict, id_, date) -> dict:
    """A race (why_not_a_race said it is one) as a row of checked values and clipped texts. Without a stored
    comparison (one run a side: no interval) the ratio and difference of the means stand alone."""
    ours, anchor = _dict(report.get("ours")), _dict(report.get("airbench"))
    (n_ours, acc_ours, secs_ours), (n_anchor, acc_anchor, secs_anchor) = _side(ours), _side(anchor)
    comparison = _dict(report.get("comparison"))
    ratio = _estimate(comparison.get("time_ratio_ours_over_airbench"), 0.0, 1e6)
    diff = _estimate(comparison.get("accuracy_diff_ours_minus_airbench"), -1.0, 1.0)
    if ratio[0] is None:
        ratio = (_number(secs_ours / secs_anchor, 0.0, 1e6), None, None, None)
    if diff[0] is None:
        diff = (acc_ours - acc_anchor, None, None, None)
    env = _dict(report.get("environment"))
    on_cpu = report.get("on_cpu") is True
    device = clip_text(env.get("device_name") or env.get("device_type") or "-", 60)
    precision = ours.get("precision")
    # a report that does not say ran fp32 on the CPU, as vs_airbench.py's own markdown() reads it
    precision = clip_text(precision, 12) if isinstance(precision, str) else "fp32" if on_cpu else "-"
    steps = _count(_dict(report.get("schedule")).get("steps"))
    return {"id": id_, "date": clip_text(date, 40)[:10], "device": device + (" (CPU)" if on_cpu else ""),
            "on_cpu": on_cpu, "recipe": clip_text(ours.get("recipe"), 40), "precision": precision,
            # airbench94 runs its own fp16 on a GPU; on the CPU, vs_airbench.py maps its fp16 casts to fp32
            "anchor": ANCHOR + (" (fp32)" if on_cpu else ""),
            "schedule": "full" if steps is None else f"{counted(steps, 'step')} each",
            "ratio": ratio[0], "ratio_low": ratio[1], "ratio_high": ratio[2], "ratio_p": ratio[3],
            "diff": diff[0], "diff_low": diff[1], "diff_high": diff[2], "diff_p": diff[3],
            "n_ours": n_ours, "n_anchor": n_anchor, "accuracy_ours": acc_ours, "accuracy_anchor": acc_anchor,
            "seconds_ours": secs_ours, "seconds_anchor": secs_anchor,
            "dataset": clip_text(_dict(report.get("data")).get("name") or "-", 60),
            "command": clip_text(portable_paths(report.get("command")), 600)}


def race_rows(conn: sqlite3.Connection, left_out: list[str] | None = None) -> list[dict]:
    """The stored races (race_row), GPU races first, full schedules before reduced ones, more runs first, newest
    first; at most MAX_RACES. Each stored report that is no race gets a sentence in `left_out` (at most
    MAX_LEFT_OUT, then one that counts the rest), dry runs and unfinished ones among them."""
    rows, problems = [], []
    sql = (f"SELECT id, created_utc, CASE WHEN length(json) <= {MAX_REPORT_CHARS} THEN json END FROM reports "
           "WHERE kind = ? ORDER BY created_utc DESC, id DESC")
    for id_, date, text in conn.execute(sql, (KIND,)):
        try:
            report = json.loads(text) if isinstance(text, str) else None
            why = "it is larger than a stored report may be" if text is None else why_not_a_race(report)
        except (ValueError, RecursionError):  # the database stores strict JSON; this was edited by hand
            why = "it is not valid JSON"
        if why is None:
            rows.append(race_row(report, id_, date))
        else:
            problems.append(f"race #{id_} ({clip_text(date, 40)[:10]}) is not shown: {why}")
    # stable: within each group the order read, newest first
    rows.sort(key=lambda r: (r["on_cpu"], r["schedule"] != "full", -min(r["n_ours"], r["n_anchor"])))
    note_left_out(left_out, problems, len(rows), MAX_RACES, "race", ("not shown", "not shown"))
    return rows[:MAX_RACES]


def race_label(row: dict) -> str:
    """"cifar10-94 (bf16) vs airbench94": what raced what."""
    return f"{row['recipe']} ({row['precision']}) vs {row['anchor']}"


def ratio_cell(row: dict) -> str:
    """"1.326 (1.288 .. 1.364)"; "1.297 (no CI)" without an interval (one run a side); "-" without a ratio."""
    return ratio_text(row) + (" (no CI)" if row["ratio"] is not None and row["ratio_low"] is None else "")


def diff_cell(row: dict) -> str:
    """"+0.03 (-0.07 .. +0.13)": the accuracy difference in points with its interval, or alone "(no CI)"."""
    if row["diff"] is None:
        return "-"
    if row["diff_low"] is None:
        return f"{signed_text(100 * row['diff'])} (no CI)"
    return interval_text(row["diff"], [row["diff_low"], row["diff_high"]], 100)


def runs_cell(row: dict) -> str:
    """"25": the runs of each side; "3 / 2" where they differ."""
    n_ours, n_anchor = row["n_ours"], row["n_anchor"]
    return str(n_ours) if n_ours == n_anchor else f"{n_ours} / {n_anchor}"

