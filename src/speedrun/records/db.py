"""The results database: every result JSON in one SQLite file, beside the columns queries filter on.

Writers lock first (BEGIN IMMEDIATE, WAL mode) and wait up to BUSY_TIMEOUT_S; PRAGMA user_version is the schema.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from speedrun.paths import user_path
from speedrun.records.result_file import load_result

BUSY_TIMEOUT_S = 30.0
_FIX = "give another file with --db PATH or SPEEDRUN_DB"
OPT_NUM, OPT_STR, OPT_INT, OPT_BOOL = (int, float, type(None)), (str, type(None)), (int, type(None)), (bool, type(None))

# Version 2's results columns: (column, path in the result JSON, allowed types). insert_result and migration 2's
# backfill both read them from here, so a migrated row equals a fresh one. Frozen: version 3 would add its own.
V2_FIELDS = [("std_accuracy", "std_accuracy", OPT_NUM), ("hit_rate", "hit_rate", OPT_NUM),
             ("git_commit", "environment.git_commit", OPT_STR), ("git_dirty", "environment.git_dirty", OPT_BOOL),
             ("device_name", "environment.device_name", OPT_STR), ("torch_version", "environment.torch", OPT_STR),
             ("mean_seconds", "train_seconds.mean", OPT_NUM), ("std_seconds", "train_seconds.std", OPT_NUM),
             ("wall_seconds", "wall_seconds", OPT_NUM), ("warmup_seconds", "warmup_seconds", OPT_NUM),
             ("data_seconds", "data_seconds", OPT_NUM), ("world_processes", "world.processes", OPT_INT),
             ("price_per_hour", "cost.price_per_hour", OPT_NUM)]
RUN_FIELDS = [("seed", OPT_INT), ("accuracy", OPT_NUM), ("train_seconds", OPT_NUM), ("steps", OPT_INT)]
_SQL_TYPE = {OPT_NUM: "REAL", OPT_STR: "TEXT", OPT_INT: "INTEGER", OPT_BOOL: "INTEGER"}
# For migration 2 and every insert: cost is US dollars per timed run (the result's own figure, cost.py: every
# process's device counts), price_per_hour per device (GPU or CPU machine).
_DERIVED = ("UPDATE results SET world_processes = coalesce(world_processes, 1), cost = coalesce("
            "json_extract(json, '$.cost.timed_usd_per_run'), "
            "price_per_hour * mean_seconds * coalesce(world_processes, 1) / 3600.0)")

MIGRATIONS = [
    # 1: one row per result; created_utc is its environment.timestamp_utc in _utc's form.
    """CREATE TABLE results (id INTEGER PRIMARY KEY, created_utc TEXT NOT NULL, recipe TEXT NOT NULL,
    dataset TEXT NOT NULL, device TEXT NOT NULL, command TEXT, mean_accuracy REAL, n INTEGER NOT NULL,
    json TEXT NOT NULL);
CREATE INDEX results_recipe ON results (recipe, dataset);
""",
    # 2: provenance, timings, cost, a row per run, reports; rows backfilled, exact duplicates dropped.
    "".join(f"ALTER TABLE results ADD COLUMN {column} {sql_type};\n" for column, sql_type in
            [("source", "TEXT"), ("sha256", "TEXT"), ("cost", "REAL")]
            + [(column, _SQL_TYPE[types]) for column, _, types in V2_FIELDS])
    + "UPDATE results SET sha256 = speedrun_sha256(json), "
    + ", ".join(f"{column} = json_extract(json, '$.{path}')" for column, path, _ in V2_FIELDS) + ";\n"
    + _DERIVED + """;
DELETE FROM results WHERE id NOT IN (SELECT min(id) FROM results GROUP BY sha256);
CREATE UNIQUE INDEX results_sha256 ON results (sha256);
CREATE INDEX results_created ON results (created_utc);
CREATE TABLE runs (result_id INTEGER NOT NULL REFERENCES results (id) ON DELETE CASCADE,
    run_index INTEGER NOT NULL, seed INTEGER, accuracy REAL, train_seconds REAL, steps INTEGER,
    diverged INTEGER NOT NULL, history TEXT, PRIMARY KEY (result_id, run_index));
INSERT INTO runs SELECT results.id, CAST(r.key AS INTEGER), """
    + "".join(f"json_extract(r.value, '$.{key}'), " for key, _ in RUN_FIELDS) + """
    json_extract(r.value, '$.diverged') IS NOT NULL, json_extract(r.value, '$.history')
    FROM results, json_each(results.json, '$.runs') AS r;
CREATE TABLE reports (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, created_utc TEXT, command TEXT, source TEXT,
    sha256 TEXT NOT NULL UNIQUE, json TEXT NOT NULL);
""",
]
VERSION = len(MIGRATIONS)
COLUMNS = ["id", "date", "recipe", "dataset", "device", "device_name", "n", "mean_accuracy", "std_accuracy",
           "mean_seconds", "std_seconds", "hit_rate", "cost", "command", "git_commit", "git_dirty"]
Imported = NamedTuple("Imported", [("path", Path), ("id", "int | None"), ("error", "str | None"), ("new", bool)])


def default_db_path() -> Path:
    """$SPEEDRUN_DB, else $XDG_DATA_HOME/speedrun/results.db, else ~/.local/share/speedrun/results.db."""
    if os.environ.get("SPEEDRUN_DB"):
        return user_path(os.environ["SPEEDRUN_DB"], "SPEEDRUN_DB")
    data = os.environ.get("XDG_DATA_HOME", "")
    base = Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share"  # XDG: ignore a relative one
    return base / "speedrun" / "results.db"


def _sha256(obj) -> str:  # of the canonical JSON: key order and spacing do not make a result new
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _utc(text: str, what: str) -> str:
    """An ISO date or time as 'YYYY-MM-DDTHH:MM:SS+00:00' (environment()'s form), so text order is time order."""
    try:
        moment = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {text!r:.80} is not an ISO date or time like 2026-11-22T16:34Z") from None
    moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)  # naive: UTC, as stored times are
    try:
        return moment.astimezone(timezone.utc).isoformat(timespec="seconds")
    except OverflowError:  # 9999-12-31T23:00-01:00 is past the last representable moment
        raise ValueError(f"{what} {text!r:.80} is out of range") from None


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection):
    """Locks first, so it never fails midway as a reader turned writer (SQLITE_BUSY_SNAPSHOT in WAL mode)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as e:  # another process held the lock over BUSY_TIMEOUT_S, or a read-only file
        if "locked" in str(e):
            raise ValueError(f"the results database stayed locked by another writer for {BUSY_TIMEOUT_S:.0f} s; "
                             "try again when it has finished") from None
        raise ValueError(f"cannot write to the results database ({e}); {_FIX}") from None
    try:
        yield
        conn.execute("COMMIT")
    finally:
        if conn.in_transaction:  # an exception: undo, unless SQLite has already (disk full)
            conn.execute("ROLLBACK")


def _shape(conn: sqlite3.Connection) -> dict[str, list[str]]:
    """{table: its column names} of a database (speedrun's tables only)."""
    return {table: [row[1] for row in conn.execute("SELECT * FROM pragma_table_info(?)", (table,))]
            for table in ("results", "runs", "reports")
            if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()}


@functools.cache
def _expected_shape(version: int) -> dict[str, list[str]]:
    """The tables and columns a speedrun database of `version` has: MIGRATIONS[:version] run on an empty one."""
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        conn.create_function("speedrun_sha256", 1, lambda text: None)
        for script in MIGRATIONS[:version]:
            conn.executescript(script)
        return _shape(conn)


def _text(data: bytes) -> str:
    """TEXT read from a database that may hold anything: bytes that are not UTF-8 become U+FFFD, not an error."""
    return data.decode("utf-8", "replace")


def connect(path: str | os.PathLike | None = None, *, readonly: bool = False) -> sqlite3.Connection:
    """The results database at `path` (default_db_path()), created if new, migrated; in autocommit mode.

    readonly: an existing database of the current version, opened for reading only (speedrun report): nothing is
    created, migrated or switched to WAL, so a read-only file or one another user owns can be read."""
    path = default_db_path() if path is None else user_path(path, "--db")
    name = str(path)
    if path.is_dir():
        raise ValueError(f"results database {name} is a directory; {_FIX}")
    try:
        if readonly:
            conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S,
                                   isolation_level=None)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except (OSError, sqlite3.Error) as e:
        verb = "open" if readonly else "create"
        raise ValueError(f"cannot {verb} results database {name} ({getattr(e, 'strerror', 0) or e}); {_FIX}") from None
    conn.text_factory = _text
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        # Whose file is it? Read-only questions first: a file speedrun refuses must leave exactly as it came (even
        # the switch to WAL below is written into the file's header).
        # One read transaction, one snapshot: separate reads could see another process's migration land in
        # between (the version of before, the tables of after: 1 in 10 CI runs of eight new writers, measured).
        conn.execute("BEGIN")
        try:
            version, names = conn.execute("SELECT (SELECT user_version FROM pragma_user_version), group_concat("
                                          "name, char(10)) FROM sqlite_master WHERE type = 'table'").fetchone()
            shape = _shape(conn) if version > 0 else {}
        finally:
            conn.execute("COMMIT")
        tables = set((names or "").split("\n")) - {""}
        if version > VERSION:
            raise ValueError(f"results database {name} has schema version {version}, from a newer speedrun or "
                             f"another program (this one reads up to {VERSION}); upgrade speedrun, or {_FIX}")
        if version < 0 or (version == 0 and tables) or (version > 0 and shape != _expected_shape(version)):
            raise ValueError(f"{name} is another program's SQLite database (or a damaged one), not speedrun's "
                             f"results; {_FIX}")
        if readonly:
            if version == 0:
                raise ValueError(f"{name} is an empty file, not a results database; {_FIX}")
            if version != VERSION:
                raise ValueError(f"results database {name} has schema version {version}; a writing command "
                                 f"migrates it to {VERSION} (e.g. speedrun results --db {name}), then run this again")
            return conn
        conn.create_function("speedrun_sha256", 1, lambda text: _sha256(json.loads(text)), deterministic=True)
        conn.execute("PRAGMA journal_mode = WAL")  # readers and the writer do not block each other
        conn.execute("PRAGMA foreign_keys = ON")
        while (version := conn.execute("PRAGMA user_version").fetchone()[0]) != VERSION:
            if not 0 <= version <= VERSION:
                raise ValueError(f"results database {name} changed to schema version {version} meanwhile, which this "
                                 f"speedrun does not read (it reads 0 to {VERSION}); {_FIX}")
            with _transaction(conn):
                if conn.execute("PRAGMA user_version").fetchone()[0] != version:
                    continue  # another process migrated it while this one waited for the lock
                if version == 0 and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                    raise ValueError(f"{name} is another program's SQLite database, not speedrun's results; {_FIX}")
                for statement in filter(str.strip, MIGRATIONS[version].split(";\n")):  # executescript() commits
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version + 1}")
    except BaseException as e:
        conn.close()
        if isinstance(e, sqlite3.DatabaseError):  # "file is not a database", a read-only file, a failed migration
            raise ValueError(f"cannot use {name} as the results database ({e}); {_FIX}") from None
        raise
    return conn


def _at(obj, path: str, types: tuple, where: str = ""):
    """obj["a"]["b"] for the path "a.b" ("": obj), of one of `types`; None where a level is missing (json_extract)."""
    value, where = obj, repr(where or path)
    for key in path.split(".") if path else ():
        value = None if value is None else _at(value, "", (dict,), f"{where[1:-1]} (a level of it)").get(key)
    if value is None and type(None) not in types:
        raise ValueError(f"result has no {where} (or it is null); is it a result JSON of `speedrun train`?")
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"result field {where} is {type(value).__name__}, expected {names}")
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63 \
            or isinstance(value, float) and not -1e300 <= value <= 1e300:  # SQLite's integers; no product overflows
        raise ValueError(f"result field {where} = {value!r:.40} is out of range")
    return value


def _store(conn: sqlite3.Connection, result: dict, source: str | None) -> tuple[int, bool]:
    """(id, True) for a result or report stored now, (its id, False) for one stored before."""
    _at(result, "", (dict,), "(the whole result)")
    try:
        text, digest = json.dumps(result, ensure_ascii=False, allow_nan=False), _sha256(result)
    except (TypeError, ValueError) as e:  # NaN or inf, or an object JSON cannot hold
        raise ValueError(f"result cannot be stored as strict JSON ({e})") from None
    if "benchmark" in result:  # a benchmark script's report: kept whole, listed by query_reports
        stamp = _at(result, "environment.timestamp_utc", OPT_STR)
        report = (_at(result, "benchmark", (str,)), stamp and _utc(stamp, "environment.timestamp_utc"),
                  _at(result, "command", OPT_STR), source, digest, text)
    else:  # a training result: the row and the runs rows, each value's type checked
        row = {key: _at(result, key, (str,)) for key in ("recipe", "dataset", "device")}
        row.update(created_utc=_utc(_at(result, "environment.timestamp_utc", (str,)), "environment.timestamp_utc"),
                   n=_at(result, "n", (int,)), mean_accuracy=_at(result, "mean_accuracy", OPT_NUM),
                   command=_at(result, "command", OPT_STR), source=source, sha256=digest, json=text)
        row.update({column: _at(result, path, types) for column, path, types in V2_FIELDS})
        _at(result, "cost.timed_usd_per_run", OPT_NUM)  # read by _DERIVED: a number or nothing
        runs = []
        for i, run in enumerate(_at(result, "runs", (list,))):
            history = _at(_at(run, "", (dict,), f"runs[{i}]"), "history", (list, type(None)), f"runs[{i}].history")
            runs.append((i, *(_at(run, key, types, f"runs[{i}].{key}") for key, types in RUN_FIELDS),
                         run.get("diverged") is not None,
                         None if history is None else json.dumps(history, separators=(",", ":"))))
    with _transaction(conn):
        # Results and reports share one id sequence (ids are never deleted, so max + 1 is new).
        found, new_id = conn.execute("SELECT (SELECT id FROM results WHERE sha256 = ?1 UNION ALL SELECT id FROM "
                                     "reports WHERE sha256 = ?1), max(coalesce((SELECT max(id) FROM results), 0), "
                                     "coalesce((SELECT max(id) FROM reports), 0)) + 1", (digest,)).fetchone()
        if found is not None:
            return found, False
        if "benchmark" in result:
            conn.execute("INSERT INTO reports (id, kind, created_utc, command, source, sha256, json) VALUES "
                         "(?, ?, ?, ?, ?, ?, ?)", (new_id, *report))
        else:
            conn.execute(f"INSERT INTO results (id, {', '.join(row)}) VALUES (?{', ?' * len(row)})",
                         [new_id, *row.values()])
            conn.execute(_DERIVED + " WHERE id = ?", (new_id,))
            conn.executemany("INSERT INTO runs (result_id, run_index, seed, accuracy, train_seconds, steps, "
                             "diverged, history) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(new_id, *run) for run in runs])
    return new_id, True


def insert_result(conn: sqlite3.Connection, result: dict, source: str | None = None) -> int:
    """Store a result dict (Result.to_dict(), or a benchmark report); its id, the first one if stored before."""
    return _store(conn, result, source)[0]


def query(conn: sqlite3.Connection, *, recipe=None, dataset=None, device=None, since=None, until=None, command=None,
          limit: int | None = None) -> list[dict]:
    """Stored results, newest first, as dicts with COLUMNS' keys. dataset: as stored or its last path component;
    device: the type or part of the name (any case); since/until: ISO dates/times, inclusive; command: a part."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10**9):
        raise ValueError(f"--limit must be an integer in [1, 1000000000], got {limit!r}")
    until = until + "T23:59:59" if until is not None and len(until) == 10 else until  # a date: to its last second
    filters = {"recipe = ?": [recipe], "(dataset = ? OR substr(dataset, -length(?) - 1) = '/' || ?)": [dataset] * 3,
               "(lower(device) = lower(?) OR instr(lower(device_name), lower(?)) > 0)": [device] * 2,
               "created_utc >= ?": [None if since is None else _utc(since, "--since")],
               "created_utc <= ?": [None if until is None else _utc(until, "--until")],
               "instr(command, ?) > 0": [command]}
    active = {clause: values for clause, values in filters.items() if values[0] is not None}
    sql = (f"SELECT {', '.join(COLUMNS).replace('date', 'created_utc')} FROM results"
           + "".join((" AND " if i else " WHERE ") + clause for i, clause in enumerate(active))
           + " ORDER BY created_utc DESC, id DESC" + ("" if limit is None else f" LIMIT {limit}"))
    return [dict(zip(COLUMNS, row), git_dirty=None if row[-1] is None else bool(row[-1]))
            for row in conn.execute(sql, [v for values in active.values() for v in values])]


def query_reports(conn: sqlite3.Connection, kind: str | None = None) -> list[dict]:
    """Stored benchmark reports (id, kind, date, command, source), newest first; `kind` e.g. "vs_airbench"."""
    rows = conn.execute("SELECT id, kind, created_utc, command, source FROM reports WHERE ? IS NULL OR kind = ? "
                        "ORDER BY created_utc DESC, id DESC", (kind, kind))
    return [dict(zip(["id", "kind", "date", "command", "source"], row)) for row in rows]


def get_result(conn: sqlite3.Connection, id: int) -> dict:
    """The JSON of stored result or report #id, as it was given."""
    sql = "SELECT json FROM results WHERE id = ?1 UNION ALL SELECT json FROM reports WHERE id = ?1"
    for (text,) in conn.execute(sql, (id,)):
        return json.loads(text)
    raise ValueError(f"no stored result #{id}; `speedrun results` lists them")


def import_files(conn: sqlite3.Connection, paths) -> list[Imported]:
    """Store each result file; a bad file gets id None and an error, and the others are stored all the same.
    new: False for a file stored before (as #id)."""

    done = []
    for path in map(Path, paths):
        try:
            new_id, new = _store(conn, load_result(path), os.path.abspath(path))
            done.append(Imported(path, new_id, None, new))
        except (ValueError, OSError, RecursionError, sqlite3.Error) as e:  # OSError: in the system's words
            done.append(Imported(path, None, (getattr(e, "strerror", 0) or str(e)).removeprefix(f"{path}: "), False))
    return done
