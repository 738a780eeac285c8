"""A sweep's study storage as its URL names it (instruments/sweep.py): the default one beside the results database,
the SQLite file a URL names, how a URL is shown (its secrets masked), and which URLs are refused before any work.
No Optuna and no torch: the CLI checks with it that a sweep's outputs are distinct files (cli/program.py) before it
loads the command."""

from __future__ import annotations

import os
from pathlib import Path

from speedrun.paths import user_path
from speedrun.records import db


def results_path(db_path: str | os.PathLike | None) -> Path:
    """The results database's file: --db, else the default one (records/db.py)."""
    return db.default_db_path() if db_path is None else user_path(db_path, "--db")


def default_storage(db_path: str | os.PathLike | None) -> str:
    """The SQLite URL of the sweeps file beside the results database: results.db -> results.sweeps.db."""
    path = results_path(db_path)
    return f"sqlite:///{path.with_name(path.stem + '.sweeps.db').absolute()}"


def shown_url(url: str) -> str:
    """A storage URL as it may be printed and stored, as SQLAlchemy reads it (engine.make_url, what Optuna opens): its
    password masked by SQLAlchemy's own rendering, and every value of its query replaced by *** (a driver takes its
    password, a key or a token there too: ?password=, ?sslkey=...). A text with no "://" has no password to mask
    and is shown as given; one SQLAlchemy cannot read as a URL (postgres-ql://me:pw@host) is named, not shown."""
    if isinstance(url, str) and "://" not in url:
        return url
    try:
        from sqlalchemy.engine import URL, make_url  # Optuna's own dependency, there wherever a sweep gets this far

        parsed = make_url(url)
    except Exception:  # noqa: BLE001 -- SQLAlchemy's parse errors, or no SQLAlchemy: Optuna will refuse the URL
        return "the --storage URL"
    if "@" in (parsed.host or ""):  # an unescaped @ in a password (me:p@ss@host): the host SQLAlchemy reads shows "ss"
        return "the --storage URL"
    # The database as read, not percent-encoded as render_as_string writes it (a file's name as the user wrote it);
    # the query's keys alone, since render_as_string would write the mask itself percent-encoded (%2A%2A%2A).
    shown = URL.create(parsed.drivername, parsed.username, parsed.password, parsed.host,
                       parsed.port).render_as_string(hide_password=True)
    if parsed.database is not None:
        shown += "/" + parsed.database
    return shown + ("?" + "&".join(f"{key}=***" for key in parsed.query) if parsed.query else "")


def check_storage_url(url: str) -> None:
    """Refuse (one line) what is not a database URL; an SQLite database in memory (sqlite://, sqlite:///,
    sqlite:///:memory:, mode=memory), which ends with the process: a study must outlive it for --resume; and an
    SQLite URL's query arguments (?mode=ro, ?timeout=5): SQLAlchemy ignores most of them with a warning, and those it
    takes would undo what the sweep needs (a study it writes, its own wait for another process's lock)."""
    shown = shown_url(url)
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"--storage {shown}: not a database URL; give one such as sqlite:///study.db")
    from sqlalchemy.engine import make_url  # Optuna's own dependency: here only after sweep.optuna_module()

    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 -- SQLAlchemy's parse errors: the sweep names them when it opens the URL
        return
    if parsed.get_backend_name() != "sqlite":
        return
    database = parsed.database or ""
    if (database in ("", ":memory:") or database.startswith("file::memory:")
            or parsed.query.get("mode") == "memory"):
        raise ValueError(f"--storage {shown}: an in-memory database ends with this process, and a study must outlive "
                         "it (--resume); give a file, e.g. sqlite:///study.db")
    if parsed.query:
        raise ValueError(f"--storage {shown}: speedrun sweep takes no arguments on an SQLite URL "
                         f"(?{'&'.join(sorted(parsed.query))[:80]}): its study is written, and it waits for another "
                         f"process's lock itself; give the file alone, e.g. sqlite:///{database[:200]}")


def storage_file(url: str) -> Path | None:
    """The file an SQLite storage URL names (relative: to the working folder, as SQLite opens it); None for
    another database (PostgreSQL, MySQL ...), which has no file here to check, for one in memory, and where
    Optuna (with SQLAlchemy) is not installed, which the sweep refuses itself."""
    try:
        from sqlalchemy.engine import make_url
    except ImportError:
        return None
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 -- the sweep names the URL's fault when it opens it
        return None
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file::memory:"):
        return None
    return Path(database)


def storage_output(storage: str | None, db_path: str | os.PathLike | None) -> tuple[str, str, str] | None:
    """The study storage's file as the CLI's check that no two outputs of one command are one file takes it
    (paths.distinct_outputs): (what a message calls it, the URL as given, the file in full); None for a database
    server's. The file is made absolute here: SQLite takes its name as it is, with no ~ expanded."""
    url = storage if storage is not None else default_storage(db_path)
    file = storage_file(url)
    if file is None:
        return None
    what = "--storage" if storage is not None else \
        f"the study storage (beside {'--db' if db_path is not None else 'the results database'})"
    return what, shown_url(url), os.path.abspath(file)


