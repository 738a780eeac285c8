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

from speedrun.errors import counted
from speedrun.records import db
from speedrun.records.result_file import check_train_result, load_result, portable
from speedrun.records.stats import FRACTION, NON_NEGATIVE, diff_ci95, mean_diff_test, summarize, welch_df, welch_t_test

METRICS = (("accuracy", "test acc %", 100.0), ("train_seconds", "timed s", 1.0))
BOUNDS = {"accuracy": FRACTION, "train_seconds": NON_NEGATIVE}  # the ranges their intervals are clipped to


def load_ref(ref: str, conn) -> tuple[str, dict]:
    """(label, result) for an id ("12" or "#12") or a JSON file, a training result whose runs can be compared
    (result_file.check_train_result, the check every stored result passed): a refusal names the stored id and its
    database, or the file, and says what to do about that one."""
    if re.fullmatch(r"#?\d{1,18}", ref) and not Path(ref).exists():
        id = int(ref.lstrip("#"))
        result = db.get_result(conn, id)
        where = f"stored result #{id} of the results database {getattr(conn, 'name', '')}".rstrip()
        fix = "compare two training results (`speedrun results` lists them)"
        return f"#{id}", _checked(result, where, fix)
    if not Path(ref).is_file():
        raise ValueError(f"{ref!r} is neither a stored result's id (`speedrun results` lists them) nor a result "
                         "JSON file")
    return ref, _checked(load_result(ref), ref, _FILE_FIX)


_FILE_FIX = "give a result JSON of speedrun train"


def _checked(result: dict, where: str, fix: str) -> dict:
    try:
        return check_train_result(result)
    except ValueError as e:
        raise ValueError(f"{where}: {e}; {fix}") from None


def _values(result: dict, key: str) -> list[float]:
    """The finished runs' `key` of a checked training result."""
    return [float(r[key]) for r in result["runs"] if r.get("diverged") is None]


def _test(xb: list[float], xa: list[float]) -> dict | None:
    """mean_diff_test of candidate B against baseline A, each part that cannot be had n/a (None): a mean of 0 has
    no ratio (accuracies of a net that learned nothing), values at the ends of the floating-point range (1e-300
    against 1e300) neither a ratio nor a difference."""
    try:
        return mean_diff_test(xb, xa)
    except ValueError:
        pass
    try:
        diff, low, high = diff_ci95(xb, xa)
        return {"diff": diff, "ci95": [low, high], "p": welch_t_test(xb, xa)[1], "df": welch_df(xb, xa),
                "ratio": None, "ratio_ci95": None}
    except ValueError:
        return None


def compare(a: dict, b: dict, labels: tuple[str, str] = ("A", "B")) -> dict:
    """B against baseline A: {"a", "b", "caveats", "metrics": {key: {"a": summary, "b": summary, "test": ...}}}."""
    for label, r in zip(labels, (a, b)):
        _checked(r, label, _FILE_FIX)
    caveats = [f"{key} differs: {a.get(key)!r} vs {b.get(key)!r}" for key in ("recipe", "dataset", "device")
               if a.get(key) != b.get(key)]
    caveats += [f"{label} is a smoke test, not a result" for label, r in zip(labels, (a, b)) if r.get("smoke_test")]
    if a == b:
        caveats.append("A and B are the same result: the test assumes two independent sets of runs")
    for label, r in zip(labels, (a, b)):
        if r.get("complete") is False or r.get("interrupted"):
            caveats.append(f"{label} is incomplete (interrupted or cut off): only its finished runs count")
        diverged = sum(1 for run in r["runs"] if run.get("diverged") is not None)
        if diverged:
            are = "is" if diverged == 1 else "are"
            caveats.append(f"{label}: {counted(diverged, 'run')} diverged and {are} left out")
    metrics = {}
    for key, _, _ in METRICS:
        xa, xb = _values(a, key), _values(b, key)
        entry = {"a": summarize(xa, BOUNDS[key]).to_dict() if xa else None,
                 "b": summarize(xb, BOUNDS[key]).to_dict() if xb else None,
                 "test": _test(xb, xa) if len(xa) >= 2 and len(xb) >= 2 else None}  # candidate B, baseline A
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
