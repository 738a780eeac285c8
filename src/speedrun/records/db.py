"""The results database: every result JSON in one SQLite file, beside the columns queries filter on.

Writers lock first (BEGIN IMMEDIATE, WAL mode) and wait up to BUSY_TIMEOUT_S; PRAGMA user_version is the schema.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import sqlite3
import stat
from collections.abc import Callable
from datetime import date, datetime, time, timezone
from pathlib import Path
from typing import NamedTuple

from speedrun.errors import counted
from speedrun.paths import check_writable as _check_writable
from speedrun.paths import folder_trouble, make_dirs, symlink_loop, user_path
from speedrun.records.result_file import (MAX_RESULT_BYTES, UnreadableResult, check_sweep_report, load_result,
                                          parse_result, runs_summary)

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

# Version 3's results columns, in identity()'s order.
V3_COLUMNS = [("kind", "TEXT"), ("dataset_name", "TEXT"), ("dataset_fingerprint", "TEXT"), ("target", "REAL")]

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
    # 3: what stored a row (kind), what it was measured on (the data set's name and content fingerprint; `dataset`
    # keeps the path or name as typed, the row's source) and the target that applies there; rows backfilled by
    # identity(), as a new row is filled, so a migrated row equals a fresh one.
    "".join(f"ALTER TABLE results ADD COLUMN {column} {sql_type};\n" for column, sql_type in V3_COLUMNS)
    # As BLOBs: SQLite hands a function TEXT that is not UTF-8 as an error; _identity_column decodes as reads do.
    + "UPDATE results SET " + ", ".join(
        f"{column} = speedrun_identity(CAST(json AS BLOB), CAST(command AS BLOB), CAST(dataset AS BLOB), {i})"
        for i, (column, _) in enumerate(V3_COLUMNS)) + """;
UPDATE results SET hit_rate = NULL WHERE target IS NULL;
CREATE INDEX results_data ON results (dataset_fingerprint, dataset_name);
CREATE INDEX results_kind ON results (kind);
""",
]
VERSION = len(MIGRATIONS)
COLUMNS = ["id", "date", "kind", "recipe", "dataset", "device", "device_name", "n", "mean_accuracy", "std_accuracy",
           "mean_seconds", "std_seconds", "hit_rate", "cost", "command", "git_commit", "git_dirty", "dataset_name",
           "dataset_fingerprint", "target", "model"]


def json_at(path: str) -> str:
    """SQL for the value at `path` of a row's stored JSON, NULL where that text is not JSON (json_extract raises on
    it, and a row edited by hand must not stop a listing)."""
    return f"CASE WHEN json_valid(json) THEN json_extract(json, '{path}') END"


# query's SELECT: COLUMNS as stored, and `model` (the user's network, --model; "" or NULL: the recipe's own) read
# from the stored config
_QUERY_COLUMNS = ", ".join({"date": "created_utc", "model": json_at("$.config.model")}.get(c, c) for c in COLUMNS)
# What stored a result (its row's "kind"): `speedrun train`, its --smoke, or an instrument whose setting it is
# (Result.kind, set by the instrument; for a file from before, result_kind of its command).
KINDS = ("train", "smoke", "bench", "ablate", "waterfall", "to-target", "tune", "sweep")


class Imported(NamedTuple):
    path: Path
    id: int | None
    error: str | None
    new: bool
    results: int = 0  # the training results a report carries (its settings' or trials'), stored with it


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


def _utc(text: str, what: str, end_of_day: bool = False) -> str:
    """An ISO date or time as 'YYYY-MM-DDTHH:MM:SS+00:00' (environment()'s form), so text order is time order.
    end_of_day: a date alone (2026-11-22, 20261122) stands for its last second (--until's day is included)."""
    try:
        day = date.fromisoformat(text)
    except (TypeError, ValueError):
        day = None
    try:
        moment = datetime.combine(day, time(23, 59, 59) if end_of_day else time()) if day else \
            datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {text!r:.80} is not an ISO date or time like 2026-11-22T16:34Z") from None
    moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)  # naive: UTC, as stored times are
    try:
        return moment.astimezone(timezone.utc).isoformat(timespec="seconds")
    except OverflowError:  # 9999-12-31T23:00-01:00 is past the last representable moment
        raise ValueError(f"{what} {text!r:.80} is out of range") from None


class UnusableDatabase(ValueError):
    """The results database cannot be read or written (damaged, full, read-only, locked): one line naming the file
    and the fix. A ValueError, as every refusal is: the CLI prints it and exits 2, and a training run that meets it
    while storing its row keeps its result file."""


def refusal(e: sqlite3.Error, name: str) -> UnusableDatabase:
    """What SQLite's error `e` on the results database `name` means for the user, and what to do.

    The file is never changed or removed here: a damaged database may still hold rows `.recover` can save."""
    text = " ".join(str(e).split())
    code = getattr(e, "sqlite_errorname", None) or ""  # Python 3.11+; the message decides on 3.10
    if code.startswith("SQLITE_CORRUPT") or "malformed" in text:
        return UnusableDatabase(
            f"the results database {name} is damaged ({text}); it is left as it is: move it aside and run again "
            f"(a new one is started), recover its rows with `sqlite3 {shlex.quote(name)} .recover | sqlite3 NEW.db`, "
            f"or {_FIX}")
    if code.startswith("SQLITE_NOTADB") or "not a database" in text:
        return UnusableDatabase(f"{name} is not a SQLite database ({text}), so not a results database; it is left "
                                f"as it is; {_FIX}")
    # SQLite says I/O error, or cannot open, where a full disk stopped it creating the -wal beside the file
    full = code.startswith("SQLITE_FULL") or "disk is full" in text or disk_full(name) and (
        code.startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN")) or "I/O error" in text or "unable to open" in text)
    if full:
        return UnusableDatabase(f"the disk holding the results database {name} is full ({text}); free space and "
                                f"run again, or {_FIX}")
    if code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return UnusableDatabase(f"the results database {name} stayed locked by another writer for "
                                f"{BUSY_TIMEOUT_S:.0f} s; try again when it has finished")
    if code.startswith("SQLITE_READONLY") or "readonly" in text:
        return UnusableDatabase(f"cannot write to the results database {name} ({text}); {_FIX}, one this "
                                "process may write")
    if code.startswith("SQLITE_IOERR") or "I/O error" in text:
        return UnusableDatabase(f"cannot read or write the results database {name} ({text}); check the disk, or "
                                f"{_FIX}")
    return UnusableDatabase(f"cannot use {name} as the results database ({text}); {_FIX}")


# Free bytes below which a failure to open or write the database is taken as the disk being full: SQLite meets a
# full disk first when it creates the -wal and -shm files (tens of KiB), and reports that as an I/O error.
FULL_DISK_BYTES = 1 << 20


def disk_full(name: str | os.PathLike) -> bool:
    """Whether the file system that holds (or would hold) `name` has less than FULL_DISK_BYTES free for this
    user; False when that cannot be told (no such folder, no permission)."""
    folder = Path(os.path.abspath(name)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except (OSError, ValueError):
        return False


def _engine_error(e: BaseException) -> bool:
    """An error SQLite itself reported about the file (damaged, full, locked, read-only, I/O), not a misuse of the
    API by this code (ProgrammingError, InterfaceError: bugs, which stay internal errors)."""
    return isinstance(e, sqlite3.DatabaseError) and not isinstance(e, sqlite3.ProgrammingError)


@contextlib.contextmanager
def _refusals(name: str):
    try:
        yield
    except sqlite3.Error as e:
        if not _engine_error(e):
            raise
        raise refusal(e, name) from None


class _Cursor(sqlite3.Cursor):
    """A cursor whose SQLite errors are refusals (`refusal`): a damaged page is met while rows are fetched, not only
    when the statement starts, so every way to run a statement or take its rows is wrapped."""

    def execute(self, *args):
        with _refusals(self.connection.name):
            return super().execute(*args)

    def executemany(self, *args):
        with _refusals(self.connection.name):
            return super().executemany(*args)

    def executescript(self, *args):
        with _refusals(self.connection.name):
            return super().executescript(*args)

    def fetchone(self):
        with _refusals(self.connection.name):
            return super().fetchone()

    def fetchmany(self, *args):
        with _refusals(self.connection.name):
            return super().fetchmany(*args)

    def fetchall(self):
        with _refusals(self.connection.name):
            return super().fetchall()

    def __next__(self):
        with _refusals(self.connection.name):
            return super().__next__()


class Connection(sqlite3.Connection):
    """The results database's connection (`connect`): `name`, the file as the user gave it, and every statement
    run through _Cursor, so that whoever reads it (this module, the report's queries) meets a refusal naming the
    file, never SQLite's bare error. sqlite3.Connection.execute makes its cursor without calling cursor(): the
    three shortcuts are redone here."""

    name = "the results database"

    def cursor(self, factory=_Cursor):
        return super().cursor(factory)

    def execute(self, *args):
        return self.cursor().execute(*args)

    def executemany(self, *args):
        return self.cursor().executemany(*args)

    def executescript(self, *args):
        return self.cursor().executescript(*args)


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection):
    """Locks first, so it never fails midway as a reader turned writer (SQLITE_BUSY_SNAPSHOT in WAL mode). A lock
    held past BUSY_TIMEOUT_S, a read-only file or a full disk is a refusal (Connection)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    finally:
        if conn.in_transaction:  # an exception: undo, unless SQLite has already (disk full)
            with contextlib.suppress(ValueError):  # the first error is the one to report
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
        conn.create_function("speedrun_identity", 4, lambda *args: None)
        for script in MIGRATIONS[:version]:
            conn.executescript(script)
        return _shape(conn)


def _text(data: bytes) -> str:
    """TEXT read from a database that may hold anything: bytes that are not UTF-8 become U+FFFD, not an error."""
    return data.decode("utf-8", "replace")


# The file types a database path may not be, as a refusal names them (os.stat's mode bits).
_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def _database_path(path: str | os.PathLike | None) -> Path:
    """The file `path` names (default_db_path() for None), refused before SQLite sees it when it exists and is not a
    regular file: SQLite would create its journal beside a device (/dev/null-journal), block on a FIFO, or fail
    later with a message that names nothing. A symlink is judged by what it points at, as SQLite opens that."""
    path = default_db_path() if path is None else user_path(path, "--db")
    name = str(path)
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # new (connect creates it), or a parent that is a file (says so)
        return path
    except (OSError, ValueError) as e:  # a symlink loop, a name too long, a folder we may not search, a NUL byte
        loop = symlink_loop(path) if getattr(e, "errno", None) == errno.ELOOP else None
        why = loop or getattr(e, "strerror", None) or e
        raise ValueError(f"cannot use {name} as the results database ({why}); {_FIX}") from None
    if not stat.S_ISREG(info.st_mode):
        what = next((text for test, text in _NOT_FILES if test(info.st_mode)), "not a regular file")
        raise ValueError(f"results database {name} is {what}, not a file; {_FIX}")
    return path


def check_writable(path: str | os.PathLike | None = None) -> Path:
    """The results database's file (connect's `path`), refused in one line where this process could not make it
    (a folder it may not write, a file in the way) or write it: for a command to check before it makes its other
    files, which connect, called last, would otherwise refuse with those files made."""
    path = _database_path(path)
    if os.path.exists(path) and not _may_write(path):
        raise _unwritable(str(path))
    _check_writable(path, "the results database", f"{_FIX}, one this process may write")
    return path


def _unwritable(name: str) -> UnusableDatabase:
    return UnusableDatabase(f"cannot write to the results database {name}: this process may not write it or its "
                            f"folder (a read-only mount, another user's file); {_FIX}, one this process may write")


def _may_write(path: Path) -> bool:
    """Whether this process may change the database file and create its -wal and -shm files beside it. os.access
    asks the kernel, which counts a read-only mount (that stops root too) as well as the permissions."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def _immutable_is_safe(path: Path) -> bool:
    """Whether the database may be read with SQLite's immutable=1, when a read-only open could not start.

    immutable=1 reads the file without locks and without looking at a write-ahead log, so it is right only while
    nobody writes the database. A read-only open of a WAL database (speedrun's are) fails where the readers' shared
    -shm file cannot be created, that is where this process may not write the folder: a read-only mount, another
    user's folder. It is taken only there, and only with no -wal or -journal file beside the database: a writer
    keeps its -wal while it has the database open, so none is at work, and no committed change waits in a log that
    immutable would skip (showing old rows). What is left is a writer that starts during the read, possible only
    where someone else may write that folder; on a read-only mount nobody can."""
    return not os.access(path.parent, os.W_OK) and not any(
        os.path.lexists(f"{path}{suffix}") for suffix in ("-wal", "-journal"))


def _open_readonly(path: Path, name: str) -> Connection:
    uri = path.absolute().as_uri()
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           factory=Connection)
    try:  # the -shm a WAL database needs is opened at the first read: read once, with SQLite's own error
        sqlite3.Connection.execute(conn, "SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as e:
        conn.close()
        if not _engine_error(e):
            raise
        code = getattr(e, "sqlite_errorname", None) or ""
        if not (code.startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY")) or "unable to open" in str(e)):
            raise refusal(e, name) from None
        if not _immutable_is_safe(path):
            if os.access(path.parent, os.W_OK):
                raise refusal(e, name) from None
            raise ValueError(f"cannot read the results database {name} here: this process may not write its folder, "
                             f"and a -wal or -journal file beside it means a writer has it open or left changes in "
                             f"that log; copy the database and that file to a writable folder and pass "
                             f"--db COPY") from None
        conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=BUSY_TIMEOUT_S,
                               isolation_level=None, factory=Connection)
    return conn


def connect(path: str | os.PathLike | None = None, *, readonly: bool = False) -> Connection:
    """The results database at `path` (default_db_path()), created if new, migrated; in autocommit mode. Its
    SQLite errors, whenever met, are refusals naming the file and the fix (UnusableDatabase, a ValueError).

    readonly: an existing database of the current version, opened for reading only (speedrun report): nothing is
    created, migrated or switched to WAL, so a read-only file or one another user owns can be read, and one on a
    read-only mount or in a folder this process may not write (`_immutable_is_safe`)."""
    return _connect(_database_path(path), readonly)


def connect_to_read(path: str | os.PathLike | None = None) -> tuple[Connection, bool]:
    """For a command that reads and may also write (`results` migrates an older database, `compare` stores its
    report): connect() where this process may write the database and its folder (a new one is created), else a
    read-only connection (readonly=True), so that a read-only mount or another user's database is read too:
    (the connection, whether it may write)."""
    path = _database_path(path)
    if os.path.exists(path) and not _may_write(path):
        return _connect(path, True), False
    return _connect(path, False), True


def _connect(path: Path, readonly: bool) -> Connection:
    name = str(path)
    try:
        if readonly:
            conn = _open_readonly(path, name)
        else:
            if os.path.exists(path) and not _may_write(path):  # SQLite would open it read-only and fail later
                raise _unwritable(name)
            try:
                make_dirs(path.parent)
            except OSError as e:  # said as what is in the way (a file, a symlink loop), not "File exists"
                if e.errno == errno.ENOSPC:
                    raise
                raise ValueError(f"cannot create results database {name} ({folder_trouble(path.parent, e)}); "
                                 f"{_FIX}") from None
            conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, factory=Connection)
    except (OSError, sqlite3.Error) as e:
        verb = "open" if readonly else "create"
        if getattr(e, "errno", None) == errno.ENOSPC or not readonly and disk_full(name):
            raise UnusableDatabase(f"cannot {verb} results database {name}: the disk holding it is full "
                                   f"({getattr(e, 'strerror', 0) or e}); free space and run again, or {_FIX}") from None
        raise ValueError(f"cannot {verb} results database {name} ({getattr(e, 'strerror', 0) or e}); {_FIX}") from None
    conn.name = name
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
            if version != VERSION and not _may_write(path):
                raise ValueError(f"results database {name} has schema version {version}, which a writing "
                                 f"command migrates to {VERSION}, and this process may not write it; copy it to a "
                                 "writable folder, run `speedrun results --db COPY` once, and give the copy with "
                                 "--db COPY")
            if version != VERSION:
                raise ValueError(f"results database {name} has schema version {version}; a writing command "
                                 f"migrates it to {VERSION} (e.g. speedrun results --db {name}), then run this again")
            return conn
        conn.create_function("speedrun_sha256", 1, lambda text: _sha256(json.loads(text)), deterministic=True)
        conn.create_function("speedrun_identity", 4, _identity_column, deterministic=True)
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal" and tables:
            # The switch to WAL below writes the file's header. A damaged file must leave as it came, so one that
            # holds tables is checked whole first (once: the file stays in WAL mode, as speedrun makes its own).
            problem = conn.execute("PRAGMA quick_check(1)").fetchone()[0]
            if problem != "ok":
                raise refusal(sqlite3.DatabaseError(f"database disk image is malformed: {problem}"), name)
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
        if _engine_error(e):  # from a call that is not one of Connection's statements
            raise refusal(e, name) from None
        raise
    return conn


def _at(obj, path: str, types: tuple, where: str = ""):
    """obj["a"]["b"] for the path "a.b" ("": obj), of one of `types`; None where a level is missing (json_extract)."""
    value, where = obj, repr(where or path)
    for key in path.split(".") if path else ():
        value = None if value is None else _at(value, "", (dict,), f"{where[1:-1]} (a level of it)").get(key)
    if value is None and type(None) not in types:
        raise ValueError(f"result has no {where} (or it is null)")
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"result field {where} is {type(value).__name__}, expected {names}")
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63 \
            or isinstance(value, float) and not -1e300 <= value <= 1e300:  # SQLite's integers; no product overflows
        raise ValueError(f"result field {where} = {value!r:.40} is out of range")
    return value


class _Checked(NamedTuple):
    """A result or report checked whole and made into what its rows hold (_checked), before any is written."""

    digest: str
    report: tuple | None  # a report's row
    row: dict | None  # a training result's row
    runs: list  # and its runs' rows


def _store(conn: sqlite3.Connection, result: dict, source: str | None) -> tuple[int, bool]:
    """(id, True) for a result or report stored now, (its id, False) for one stored before."""
    return _write(conn, _checked(result, source))


def _checked(result: dict, source: str | None) -> _Checked:
    """`result` checked as the database takes it (a ValueError naming what is wrong), as rows; nothing touched."""
    _at(result, "", (dict,), "(the whole result)")
    try:
        text, digest = json.dumps(result, ensure_ascii=False, allow_nan=False), _sha256(result)
    except (TypeError, ValueError) as e:  # NaN or inf, or an object JSON cannot hold
        raise ValueError(f"result cannot be stored as strict JSON ({e})") from None
    report, row, runs = None, None, []
    if "benchmark" in result:  # a benchmark script's report: kept whole, listed by query_reports
        stamp = _at(result, "environment.timestamp_utc", OPT_STR)
        report = (_at(result, "benchmark", (str,)), stamp and _utc(stamp, "environment.timestamp_utc"),
                  _at(result, "command", OPT_STR), source, digest, text)
        _at(result, "results", (list, type(None)))  # the training results it carries (_carried), if any
        if report[0] == "sweep":  # the report's study section draws its trials
            check_sweep_report(result)
    else:  # a training result: its runs checked as compare reads them (the one check), then the row and the runs
        # The statistics the leaderboard ranks and judges, from the runs themselves: a result's stated summary is
        # its writer's word (a file edited to say n=50 beside one run), and the runs are checked as they are read
        # (runs_summary validates them: check_train_result's check, made once).
        summary = runs_summary(result)
        row = {key: _at(result, key, (str,)) for key in ("recipe", "dataset", "device")}
        row.update(created_utc=_utc(_at(result, "environment.timestamp_utc", (str,)), "environment.timestamp_utc"),
                   n=_at(result, "n", (int,)), mean_accuracy=_at(result, "mean_accuracy", OPT_NUM),
                   command=_at(result, "command", OPT_STR), source=source, sha256=digest, json=text)
        row.update({column: _at(result, path, types) for column, path, types in V2_FIELDS})
        row.update(zip([column for column, _ in V3_COLUMNS], identity(result, row["command"], row["dataset"])))
        row.update(n=summary["n"], mean_accuracy=summary["mean_accuracy"], std_accuracy=summary["std_accuracy"],
                   mean_seconds=summary["mean_seconds"], std_seconds=summary["std_seconds"],
                   # no target applies on this data: no run "reached" one (migration 3's rule for older rows too)
                   hit_rate=None if row["target"] is None else summary["hit_rate"])
        _at(result, "cost.timed_usd_per_run", OPT_NUM)  # read by _DERIVED: a number or nothing
        for i, run in enumerate(_at(result, "runs", (list,))):
            history = _at(_at(run, "", (dict,), f"runs[{i}]"), "history", (list, type(None)), f"runs[{i}].history")
            runs.append((i, *(_at(run, key, types, f"runs[{i}].{key}") for key, types in RUN_FIELDS),
                         run.get("diverged") is not None,
                         None if history is None else json.dumps(history, separators=(",", ":"))))
    return _Checked(digest, report, row, runs)


def _write(conn: sqlite3.Connection, checked: _Checked) -> tuple[int, bool]:
    """Store what _checked made of a result: (id, True) when new, (its id, False) for one stored before."""
    digest, report, row, runs = checked
    with _transaction(conn):
        # Results and reports share one id sequence (ids are never deleted, so max + 1 is new).
        found, new_id = conn.execute("SELECT (SELECT id FROM results WHERE sha256 = ?1 UNION ALL SELECT id FROM "
                                     "reports WHERE sha256 = ?1), max(coalesce((SELECT max(id) FROM results), 0), "
                                     "coalesce((SELECT max(id) FROM reports), 0)) + 1", (digest,)).fetchone()
        if found is not None:
            return found, False
        if report is not None:
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
    """Stored results, newest first, as dicts with COLUMNS' keys (model: the user's network's builder, None for the
    recipe's own network). dataset: as stored or its last path component;
    device: the type or part of the name (any case); since/until: ISO dates/times, inclusive; command: a part."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10**9):
        raise ValueError(f"--limit must be an integer in [1, 1000000000], got {limit!r}")
    # a date alone: --since from its first second, --until to its last (the day is included)
    start = None if since is None else _utc(since, "--since")
    end = None if until is None else _utc(until, "--until", end_of_day=True)
    if start is not None and end is not None and start > end:
        raise ValueError(f"--since {since!r:.80} is after --until {until!r:.80}, so no result can match; swap them")
    filters = {"recipe = ?": [recipe],
               "(dataset = ? OR substr(dataset, -length(?) - 1) = '/' || ? OR dataset_name = ?)": [dataset] * 4,
               "(lower(device) = lower(?) OR instr(lower(device_name), lower(?)) > 0)": [device] * 2,
               "created_utc >= ?": [start], "created_utc <= ?": [end],
               "instr(command, ?) > 0": [command]}
    active = {clause: values for clause, values in filters.items() if values[0] is not None}
    sql = (f"SELECT {_QUERY_COLUMNS} FROM results"
           + "".join((" AND " if i else " WHERE ") + clause for i, clause in enumerate(active))
           + " ORDER BY created_utc DESC, id DESC" + ("" if limit is None else f" LIMIT {limit}"))
    rows = []
    for values in conn.execute(sql, [v for values in active.values() for v in values]):
        row = dict(zip(COLUMNS, values))
        row.update(git_dirty=None if row["git_dirty"] is None else bool(row["git_dirty"]),
                   model=row["model"] if isinstance(row["model"], str) and row["model"] else None)
        rows.append(row)
    return rows


def result_kind(command: str | None, smoke: bool) -> str:
    """One of KINDS for a stored result: "smoke" for `train --smoke`, the instrument's name for the runs of one of
    its settings (its first word that names one: `speedrun bench ...  # setting x=1`, `torchrun ... -m speedrun
    ablate --to-target ...`), else "train" (a train command, the Python API's result with no command, a file from
    a script)."""
    if smoke:
        return "smoke"
    words = (command or "").split("  # setting ")[0].split()
    kind = next((word for word in words if word in ("train", "bench", "ablate", "tune", "sweep")), "train")
    if kind == "ablate":
        return "to-target" if "--to-target" in words else "waterfall" if any(
            w == "--waterfall" or w.startswith("--waterfall=") for w in words) else "ablate"
    return kind


# Dataset.fingerprint's form (data/dataset.py content_fingerprint; the imagenet family's shards alike).
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")


def identity(result, command: str | None, dataset: str | None) -> tuple:
    """(kind, dataset_name, dataset_fingerprint, target) of a training result: V3_COLUMNS as its row stores them.

    A result that records them (kind, data: {name, fingerprint}, target) is taken at its word where each is of its
    form. An older one is read by the rules it was written under: its kind from its command (result_kind), its
    data set's name from the path as typed (its last component; a name stays a name), no fingerprint (unknown:
    such rows share a leaderboard by name alone), and its config's target only where its data was the cifar
    recipes' published default, named `cifar10` (a copy that was not the published files was recorded under its
    path then): the rule's one trusted case. Lenient by design: a row edited by hand gets NULLs, never an error,
    so that a migration never stops on one."""
    result = result if isinstance(result, dict) else {}
    command = command if isinstance(command, str) else None
    kind, smoke = result.get("kind"), result.get("smoke_test")
    smoke = smoke is True or isinstance(smoke, (int, float)) and not isinstance(smoke, bool) and smoke != 0
    kind = "smoke" if smoke else kind if kind in KINDS else result_kind(command, False)
    data = result.get("data") if isinstance(result.get("data"), dict) else {}
    name = data.get("name")
    name = name if isinstance(name, str) and name.strip() else dataset_name(dataset)
    fingerprint = data.get("fingerprint")
    fingerprint = fingerprint if isinstance(fingerprint, str) and _FINGERPRINT.fullmatch(fingerprint) else None
    if "target" in result:
        target = result["target"]
    else:
        config = result.get("config") if isinstance(result.get("config"), dict) else {}
        target = config.get("target_accuracy", result.get("target_accuracy")) if dataset == "cifar10" else None
    fraction = isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target <= 1
    return kind, name, fingerprint, target if fraction else None


def dataset_name(typed) -> str | None:
    """A data set's name from the path or name a command was given: a path's last component (an archive's without
    .tar.gz), a name as it is ("cifar10", "synthetic:train=256")."""
    if not isinstance(typed, str):
        return None
    text = typed.strip()
    if "/" not in text and "\\" not in text and not text.startswith("~"):
        return text or None
    base = text.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".tar.gz", ".tgz", ".tar"):
        base = base.removesuffix(suffix)
    return base or text


@functools.lru_cache(maxsize=1)  # the migration asks four columns of each row in turn: parsed once
def _parsed(text) -> dict | None:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _identity_column(text, command, dataset, column: int):
    """speedrun_identity(json, command, dataset, i): migration 3's backfill, identity()'s column i, from BLOBs
    decoded as every read decodes them (_text: bytes that are not UTF-8 become U+FFFD). Never raises: SQLite would
    stop the upgrade on one row, and every command would refuse the database."""
    try:
        text, command, dataset = (_text(v) if isinstance(v, bytes) else v for v in (text, command, dataset))
        return identity(_parsed(text), command, dataset)[column]
    except Exception:  # noqa: BLE001  # a row edited by hand: its columns stay empty, as identity() leaves them
        return None


def query_reports(conn: sqlite3.Connection, kind: str | None = None) -> list[dict]:
    """Stored benchmark reports (id, kind, date, command, source), newest first; `kind` e.g. "vs_airbench"."""
    rows = conn.execute("SELECT id, kind, created_utc, command, source FROM reports WHERE ? IS NULL OR kind = ? "
                        "ORDER BY created_utc DESC, id DESC", (kind, kind))
    return [dict(zip(["id", "kind", "date", "command", "source"], row)) for row in rows]


def get_result(conn: sqlite3.Connection, id: int) -> dict:
    """The JSON of stored result or report #id, read as a result file is (result_file.parse_result: bounded,
    JSON, not nested past any result, an object): a row that is not is refused with one line naming the row, the
    database and the fix. The database is a file from elsewhere too; a row may have been edited, cut or replaced."""
    sql = (f"SELECT 'results', length(CAST(json AS BLOB)), CASE WHEN length(CAST(json AS BLOB)) <= {MAX_RESULT_BYTES} "
           "THEN json END FROM results WHERE id = ?1 UNION ALL SELECT 'reports', length(CAST(json AS BLOB)), CASE WHEN "
           f"length(CAST(json AS BLOB)) <= {MAX_RESULT_BYTES} THEN json END FROM reports WHERE id = ?1")
    for table, size, text in conn.execute(sql, (id,)):
        name = getattr(conn, "name", "the results database")
        where = f"row #{id} of the results database {name} is damaged"
        fix = (f"delete it (sqlite3 {shlex.quote(name)} 'DELETE FROM {table} WHERE id = {id}') and `speedrun results "
               "import` its result file again, or move the database aside")
        if isinstance(text, bytes):  # a BLOB: TEXT affinity keeps one as it is
            text = _text(text)
        if size is not None and size > MAX_RESULT_BYTES:
            raise UnreadableResult(where, f"{size} bytes, more than any result ({MAX_RESULT_BYTES} at most)", fix)
        if not isinstance(text, str):
            raise UnreadableResult(where, f"its JSON is {'NULL' if text is None else type(text).__name__}", fix)
        return parse_result(text, where, fix)
    raise ValueError(f"no stored result #{id}; `speedrun results` lists them")


def _carried(report: dict, source: str) -> list[_Checked]:
    """The training results a benchmark report carries in "results" (bench's, ablate's and to_target's settings,
    sweep's trials: the rows the command stored beside the report), each checked (_checked); a bad one is refused
    naming it, before any is stored."""
    carried = report.get("results") if "benchmark" in report else None
    if not isinstance(carried, list):  # absent or null (another type: _checked refuses the report)
        return []
    checked = []
    for i, result in enumerate(carried):
        try:
            if not isinstance(result, dict) or "benchmark" in result:
                raise ValueError("not a training result")
            checked.append(_checked(result, source))
        except ValueError as e:
            raise ValueError(f"results[{i}], a training result the report carries: {e}") from None
    return checked


Connector = Callable[[], sqlite3.Connection]


def import_files(conn: sqlite3.Connection | Connector, paths) -> list[Imported]:
    """Store each result file; a bad file gets id None and an error, and the others are stored all the same.
    new: False for a file stored before (as #id). Each file is read and checked whole (a report with the training
    results it carries) before anything of it is stored. `conn`: the database, or a function that opens it, called
    at the first file that passes (no database is made or changed for files that are all refused)."""

    done = []
    opened = conn if isinstance(conn, sqlite3.Connection) else None
    for path in map(Path, paths):
        source = os.path.abspath(path)
        try:
            result = load_result(path)
            carried, checked = _carried(result, source), _checked(result, source)
        except (ValueError, OSError, RecursionError) as e:  # OSError: in the system's words
            # what is wrong, without a fix: the command names one for every file it could not import
            error = e.reason if isinstance(e, UnreadableResult) else getattr(e, "strerror", 0) or str(e)
            done.append(Imported(path, None, error.removeprefix(f"{path}: "), False))
            continue
        if opened is None:  # the database's own refusal is the command's, not this file's
            opened = conn()
        try:
            for each in carried:  # first, as the command stored them, so that the rows list as its command's did
                _write(opened, each)
            new_id, new = _write(opened, checked)
            done.append(Imported(path, new_id, None, new, len(carried)))
        except UnusableDatabase as e:  # the database's fault, not the file's: every file after it would fail alike
            before = sum(entry.error is None for entry in done)
            raise UnusableDatabase(f"{e}; {path} and the files after it were not imported"
                                   + (f" (the {counted(before, 'file')} before it {'was' if before == 1 else 'were'})"
                                      if before else "")) from None
    return done
