"""`speedrun compare A B`: is B's accuracy or time different from A's, or is it noise?

A and B are stored results: a number (`#ID` from `speedrun results`) or a result JSON file. A is the baseline.
For test accuracy and timed seconds, over the finished runs of each: mean ± std, B - A with its 95% Welch
interval, Welch's two-sided p (scipy.stats through stats.py), and B / A with its 95% interval (stats.ratio_ci95:
the delta method on the log of the ratio, so the interval stays above 0).
A claimed speedup needs its p: with fewer than two runs a side there is no spread, and the table says n/a rather
than a number. Settings that make the two incomparable (recipe, dataset, device, a smoke test) are named above the
table. The comparison is stored in the results database as a report (where this process may write it).
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime, timezone
from pathlib import Path

from speedrun.records import db
from speedrun.records.result_file import load_result, portable
from speedrun.records.stats import diff_ci95, mean_diff_test, summarize, welch_df, welch_t_test

METRICS = (("accuracy", "test acc %", 100.0), ("train_seconds", "timed s", 1.0))


def load_ref(ref: str, conn) -> tuple[str, dict]:
    """(label, result) for an id ("12" or "#12") or a JSON file."""

    if re.fullmatch(r"#?\d{1,18}", ref) and not Path(ref).exists():
        return f"#{ref.lstrip('#')}", db.get_result(conn, int(ref.lstrip("#")))
    if not Path(ref).is_file():
        raise ValueError(f"{ref!r} is neither a stored result's id (`speedrun results` lists them) nor a result "
                         "JSON file")
    return ref, load_result(ref)


# What a finished run's value may be: accuracy a fraction, timed seconds up to ten years.
_RANGES = {"accuracy": (0.0, 1.0), "train_seconds": (0.0, 3.2e8)}


def _values(result: dict, label: str, key: str) -> list[float]:
    """The finished runs' `key`, each checked: a file from elsewhere may hold anything."""
    runs = result.get("runs")
    if not isinstance(runs, list) or "benchmark" in result:
        raise ValueError(f"{label} is not a `speedrun train` result (no runs); compare two training results")
    low, high = _RANGES[key]
    values = []
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or not isinstance(r.get("diverged"), (dict, type(None))):
            raise ValueError(f"{label}: run {i + 1} is not a run record (a dict whose 'diverged' is null or a "
                             "dict); give a result JSON of speedrun train")
        if r.get("diverged") is not None:  # no key: a result from before divergence was recorded, none diverged
            continue
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
            raise ValueError(f"{label}: run {i + 1} has {key}={v!r:.40}, not a number in [{low:g}, {high:g}]; "
                             "give a result JSON of speedrun train")
        values.append(float(v))
    return values


def compare(a: dict, b: dict, labels: tuple[str, str] = ("A", "B")) -> dict:
    """B against baseline A: {"a", "b", "caveats", "metrics": {key: {"a": summary, "b": summary, "test": ...}}}."""
    caveats = [f"{key} differs: {a.get(key)!r} vs {b.get(key)!r}" for key in ("recipe", "dataset", "device")
               if a.get(key) != b.get(key)]
    caveats += [f"{label} is a smoke test, not a result" for label, r in zip(labels, (a, b)) if r.get("smoke_test")]
    if a == b:
        caveats.append("A and B are the same result: the test assumes two independent sets of runs")
    for label, r in zip(labels, (a, b)):
        if r.get("complete") is False or r.get("interrupted"):
            caveats.append(f"{label} is incomplete (interrupted or cut off): only its finished runs count")
        diverged = sum(1 for run in r["runs"] if isinstance(run, dict) and run.get("diverged") is not None) \
            if isinstance(r.get("runs"), list) else 0
        if diverged:
            caveats.append(f"{label}: {diverged} run(s) diverged and are left out")
    metrics = {}
    for key, _, _ in METRICS:
        xa, xb = _values(a, labels[0], key), _values(b, labels[1], key)
        entry = {"a": summarize(xa).to_dict() if xa else None, "b": summarize(xb).to_dict() if xb else None,
                 "test": None}
        if len(xa) >= 2 and len(xb) >= 2:
            try:
                entry["test"] = mean_diff_test(xb, xa)  # candidate B, baseline A
            except ValueError:  # a mean of 0 (accuracies of a net that learned nothing): no ratio, the rest stands
                diff, low, high = diff_ci95(xb, xa)
                entry["test"] = {"diff": diff, "ci95": [low, high], "p": welch_t_test(xb, xa)[1],
                                 "df": welch_df(xb, xa), "ratio": None, "ratio_ci95": None}
        metrics[key] = entry
    return {"benchmark": "compare", "a": labels[0], "b": labels[1], "caveats": caveats, "metrics": metrics,
            "environment": {"timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}}


def compare_stored(a: str, b: str, *, db_path: str | None = None, command: str) -> tuple[dict, int | None]:
    """B against baseline A, each a stored result's id or a result JSON (load_ref), and the comparison stored in
    the results database at `db_path` as a report that records `command`: (the comparison, its id). A database
    this process may not write (a read-only mount, another user's) is read all the same, and the id is None."""

    conn, writable = db.connect_to_read(db_path)
    with contextlib.closing(conn):
        (la, ra), (lb, rb) = load_ref(a, conn), load_ref(b, conn)
        report = compare(ra, rb, (la, lb))
        stored = db.insert_result(conn, portable({**report, "command": command})) if writable else None
    return report, stored
