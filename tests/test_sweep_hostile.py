"""speedrun sweep against what a tester found: a study storage that fails part way (locked by another process,
failing) keeps every finished run; a --storage file that is not a study storage is refused and left as it was; a
storage URL's arguments are refused in one line; every refusal comes before any file is made; and what the sweep
says is true (examples it accepts, a resume hint a shell takes, sweep trials named as such, an imported report's
rows listed)."""

import hashlib
import json
import re
import shlex
import sqlite3

import pytest

optuna = pytest.importorskip("optuna")

from speedrun.cli.program import main  # noqa: E402
from speedrun.engine.loop import RunResult  # noqa: E402
from speedrun.instruments import sweep as sweeping  # noqa: E402
from speedrun.recipes import get_recipe  # noqa: E402
from speedrun.records import db  # noqa: E402
from speedrun.report import markdown  # noqa: E402
from speedrun.run import runner  # noqa: E402

TINY = ["--dataset", "synthetic:train=64,test=16", "--device", "cpu", "--epochs", "2", "--set", "batch_size=32",
        "--set", "widths=8,16,16", "--set", "whiten_images=32", "--set", "cpu_threads=1"]
REC = get_recipe("cifar10-94")


def _sweep(tmp_path, *extra):
    return main(["sweep", "cifar10-94", *TINY, "--db", str(tmp_path / "r.db"), "--space", "label_smoothing=0,0.1",
                 *extra])


@pytest.fixture
def fake_training(monkeypatch):
    """train_run replaced by one that reports each epoch's accuracy and returns at once; `on_run(n)` is called as
    the n-th run of a trial starts (the warm-up, which reports nothing, is not counted)."""
    calls = {"n": 0, "on_run": lambda n: None}

    def train_run(cfg, data, device, seed, *, world=None, hooks=None, resume=None):
        on_epoch = None if hooks is None else hooks.on_epoch
        if on_epoch is not None:
            calls["n"] += 1
            calls["on_run"](calls["n"])
            for epoch in (1.0, cfg.epochs):
                on_epoch({"train_loss": 1.0, "train_acc": 0.5, "val_acc": 0.5, "epoch": epoch, "step": 2,
                          "train_seconds": 0.5})
        return RunResult(seed=seed, accuracy=0.5 + cfg.label_smoothing, train_seconds=1.0 + 0.1 * seed,
                         epochs=cfg.epochs, steps=4, history=[])

    monkeypatch.setattr(REC.module(), "train_run", train_run)
    return calls


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines and "internal error" not in err and "Traceback" not in err, err
    return lines[-1]


@pytest.mark.parametrize("failure", ["locked", "failing"])
def test_a_storage_that_fails_part_way_keeps_every_finished_run(failure, tmp_path, capsys, monkeypatch,
                                                                fake_training):
    """Locked by another process past the wait (a backup tool's exclusive lock), or failing (Optuna's
    StorageInternalError) in trial 1's second run: the three runs that finished are in the report file and the
    results database, the last line names the storage and the fix, and the exit is a user error's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweeping, "SQLITE_TIMEOUT_S", 0.6)
    monkeypatch.setattr(sweeping, "LOCK_POLL_S", 0.1, raising=False)
    storage = tmp_path / "r.sweeps.db"
    held = []

    def on_run(n):
        if n != 4:
            return
        if failure == "locked":
            holder = sqlite3.connect(storage, isolation_level=None)
            holder.execute("BEGIN EXCLUSIVE")
            held.append(holder)
        else:
            def fail(*args, **kwargs):
                raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.")

            monkeypatch.setattr(optuna.trial.Trial, "report", fail)
            monkeypatch.setattr(optuna.trial.Trial, "set_user_attr", fail)

    fake_training["on_run"] = on_run
    try:
        code = _sweep(tmp_path, "--sampler", "grid", "--trials", "2", "--runs", "2", "--prune",
                      "--study", "a study")
    finally:
        for holder in held:
            holder.close()
    err = capsys.readouterr().err
    line = _error_line(err)
    kept = re.search(r"4 finished run(\(s\)|s) kept in", line)  # (the CLI's wording of a count)
    assert code == 2 and f"the study storage {storage}" in line and kept, err
    assert "--resume --study 'a study'" in line and "give another --storage" in line
    if failure == "locked":
        assert "stayed locked by another process" in line
        assert f"the study storage {storage} is locked by another process; waiting up to" in err
    (report_path,) = (tmp_path / "results").iterdir()
    report = json.loads(report_path.read_text())
    assert report["runs_finished"] == 4 and report["storage_failed"] and not report["complete"]
    assert [r["n"] for r in report["results"]] == [2, 2]
    assert [t["n"] for t in report["trials"]] == [2, 2] and report["best"]["number"] == 0
    conn = db.connect(tmp_path / "r.db")
    try:
        assert conn.execute("SELECT sum(n) FROM results").fetchone()[0] == 4
        assert conn.execute("SELECT count(*) FROM reports WHERE kind = 'sweep'").fetchone()[0] == 1
    finally:
        conn.close()
    # a storage locked when the sweep starts: said at once, then the lock and the fix, before any file is made
    held.append(sqlite3.connect(storage, isolation_level=None))
    held[-1].execute("BEGIN EXCLUSIVE")
    before = sorted(tmp_path.rglob("*"))
    try:
        assert _sweep(tmp_path, "--study", "a study", "--resume", "--trials", "1") == 2
    finally:
        held[-1].close()
    err = capsys.readouterr().err
    assert err.startswith(f"the study storage {storage} is locked by another process; waiting up to")
    assert "stayed locked" in _error_line(err) and "run this again" in _error_line(err)
    assert sorted(tmp_path.rglob("*")) == before


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_storage_file_must_be_new_or_a_study_storage_and_is_left_as_it_was(tmp_path, capsys, monkeypatch,
                                                                             fake_training):
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    named_like = tmp_path / "named.db"
    with sqlite3.connect(named_like) as conn:
        conn.execute("CREATE TABLE studies (mine TEXT)")
        conn.execute("CREATE TABLE version_info (mine TEXT)")
    db.connect(tmp_path / "results.db").close()  # speedrun's own, in WAL mode
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    files = {path: _digest(path) for path in (other, named_like, tmp_path / "results.db", text)}
    before = sorted(tmp_path.iterdir())
    for path, fragment in [(other, "another program's SQLite database"), (named_like, "another program's"),
                           (tmp_path / "results.db", "speedrun's results database"), (text, "not an SQLite database")]:
        assert _sweep(tmp_path, "--storage", f"sqlite:///{path}") == 2
        line = _error_line(capsys.readouterr().err)
        assert fragment in line and "it is left as it is" in line and "--storage" in line, line
    assert {path: _digest(path) for path in files} == files
    assert sorted(tmp_path.iterdir()) == before  # no -wal, -shm or -journal beside them, no results database
    # what is taken: an empty file, then the study storage it became
    empty = tmp_path / "empty.db"
    empty.touch()
    assert _sweep(tmp_path, "--storage", f"sqlite:///{empty}", "--trials", "1", "--runs", "1") == 0
    assert _sweep(tmp_path, "--storage", f"sqlite:///{empty}", "--trials", "1", "--runs", "1", "--resume") == 0
    assert len(optuna.get_all_study_names(f"sqlite:///{empty}")) == 1


@pytest.mark.parametrize("query", ["?mode=ro", "?timeout=5", "?mode=ro&uri=true", "?cache=shared"])
def test_a_storage_urls_arguments_are_refused_in_one_line(query, tmp_path, capsys, monkeypatch, fake_training):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--storage", f"sqlite:///{tmp_path / 's.db'}{query}") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "takes no arguments on an SQLite URL" in err, err
    assert "Warning" not in err and f"sqlite:///{tmp_path / 's.db'}" in err.split("give the file alone")[1]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [
    ["--tensorboard", "in-the-way.txt"],
    ["--sampler", "grid", "--space", "lookahead=true,false"],  # 4 points, over the MAX_GRID of 3 set below
    ["--resume"],  # a study in a storage that does not exist yet
    ["--resume", "--storage", "sqlite:///empty.db"],
    ["--dataset", "no-such-dataset"],
    ["--json", "taken.json"],
])
def test_every_refusal_comes_before_any_file_is_made(argv, tmp_path, capsys, monkeypatch, fake_training):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweeping, "MAX_GRID", 3)
    (tmp_path / "in-the-way.txt").write_text("a file\n")
    (tmp_path / "taken.json").write_text("{}\n")
    (tmp_path / "empty.db").touch()
    before = sorted(tmp_path.rglob("*"))
    assert _sweep(tmp_path, *argv, "--trials", "1", "--write-settings", "best.json") == 2
    capsys.readouterr()
    assert sorted(tmp_path.rglob("*")) == before and fake_training["n"] == 0


def _examples(message: str) -> list[str]:
    return re.findall(r"e\.g\. (?:--space )?(\S+?)[;)]?(?:\s|$)", message)


def test_what_a_sweep_says_is_true(tmp_path, capsys, monkeypatch, fake_training):
    """Every example a --space refusal gives is accepted for that key and recipe (label_smoothing lives in
    [0, 1): 8:14 is not one); the resume hint survives a shell; sweep trials are named as such by the README's
    table; a sweep's report imported into another database lists its trials' rows."""
    for recipe, item in [("cifar10-94", "label_smoothing=0.1"), ("cifar10-94", "label_smoothing=0:1:lin"),
                         ("cifar10-94", "label_smoothing=0.5:0.1"), ("cifar10-94", "lookahead"),
                         ("cifar10-94", "lr_per_1024=8"), ("imagenet-debug", "label_smoothing=0.1"),
                         ("imagenet-debug", "nokey"), ("cifar10-resnet18", "momentum=0.9")]:
        rec = get_recipe(recipe)
        with pytest.raises(ValueError) as refused:
            sweeping.parse_space([item], rec, None, {})
        message = str(refused.value)
        examples = _examples(message)
        assert examples and "8:14" not in message, message
        for example in examples:
            assert sweeping.parse_space([example], rec, None, {})[0].key == example.split("=")[0], message
        for setting in re.findall(r"--set (\S+?)[;)]", message):
            key, _, value = setting.partition("=")
            assert runner.make_config(rec, None, {key: value}) is not None

    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--trials", "2", "--runs", "2", "--study", "my study", "--json", "sweep.json") == 0
    hint = re.search(r"\((--resume --study .*) adds trials\)", capsys.readouterr().err).group(1)
    assert shlex.split(hint) == ["--resume", "--study", "my study"]

    conn = db.connect(tmp_path / "r.db")
    try:
        readme = "\n".join(markdown.readme_lines(conn))
    finally:
        conn.close()
    assert "2 sweep trials" in readme and "benches or ablations" not in readme, readme

    # the report file, imported elsewhere: its trials' rows are listed there, as the sweep listed them here
    assert main(["results", "import", "sweep.json", "--db", str(tmp_path / "elsewhere.db")]) == 0
    assert "with the 2 training results it carries" in capsys.readouterr().out
    assert main(["results", "--db", str(tmp_path / "elsewhere.db"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["kind"] for r in rows] == ["sweep", "sweep"] and sorted(r["n"] for r in rows) == [2, 2]
    assert main(["results", "import", "sweep.json", "--db", str(tmp_path / "r.db")]) == 0  # already there
    conn = db.connect(tmp_path / "r.db")
    try:
        assert conn.execute("SELECT count(*) FROM results").fetchone()[0] == 2
    finally:
        conn.close()


def test_the_default_storage_folder_is_speedruns_own_and_made_after_every_check(tmp_path, capsys, monkeypatch,
                                                                                fake_training):
    """With a fresh home and no --db, the default storage's folder (the results database's) is made, as train makes
    the database's, but only once every check has passed; a refusal of the default storage says what it is beside
    (no --db was given)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("SPEEDRUN_DB", "XDG_DATA_HOME", "SPEEDRUN_RESULTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    sweep = ["sweep", "cifar10-94", *TINY, "--space", "label_smoothing=0,0.1", "--trials", "1", "--runs", "1"]
    assert main([*sweep, "--dataset", "no-such-dataset"]) == 2
    capsys.readouterr()
    assert not list(home.iterdir()) and not (tmp_path / "results").exists() and fake_training["n"] == 0
    assert main(sweep) == 0, capsys.readouterr().err
    folder = home / ".local" / "share" / "speedrun"
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [
        "results.db", "results.sweeps.db"]
    capsys.readouterr()
    (folder / "results.sweeps.db").unlink()
    with sqlite3.connect(folder / "results.sweeps.db") as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    assert main(sweep) == 2
    line = _error_line(capsys.readouterr().err)
    assert "(beside the results database)" in line and "--db" not in line, line


@pytest.mark.parametrize("argv", [
    ["--storage", "sqlite:///s.db", "--json", "s.db"],
    ["--storage", "sqlite:///sub/../s.db", "--write-settings", "link.db"],  # link.db -> s.db, not yet made
    ["--storage", "sqlite:///r.db"],  # the --db file, not yet made
    ["--json", "r.sweeps.db"],  # the default storage beside --db
])
def test_a_study_storage_is_never_another_output_of_the_sweep(argv, tmp_path, capsys, monkeypatch, fake_training):
    """The JSON report or the settings file would overwrite the study; a study in the results database's file would
    fill it with Optuna's tables: refused before any work, naming both."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.db").symlink_to("s.db")
    before = sorted(tmp_path.rglob("*"))
    assert _sweep(tmp_path, "--trials", "1", "--runs", "1", *argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert "name the same file" in line and ("--storage" in line or "the study storage" in line), line
    assert sorted(tmp_path.rglob("*")) == before and fake_training["n"] == 0


@pytest.mark.parametrize("argv", [
    ["--storage", "sqlite:///locked/s.db"],
    ["--tensorboard", "locked/boards"],
    ["--db", "locked/r.db"],
    ["--json", "locked/new/report.json"],
    ["--write-settings", "locked/best.json"],
])
def test_an_output_in_a_folder_it_may_not_write_is_refused_before_any_file(argv, tmp_path, capsys, monkeypatch,
                                                                           fake_training):
    """A folder this process may not write (another user's, a read-only mount: faked here, as root writes any
    folder) is refused in one line before the results folder, the database or the study storage is made."""
    import os

    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and os.path.abspath(path) == str(locked):
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    before = sorted(tmp_path.rglob("*"))
    assert _sweep(tmp_path, "--trials", "1", "--runs", "1", *argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"may not write in {locked}" in line or f"may not create folders in {locked}" in line, line
    assert sorted(tmp_path.rglob("*")) == before and fake_training["n"] == 0


def test_the_settings_file_is_claimed_only_once_the_sweep_has_checked_everything(tmp_path, capsys, monkeypatch,
                                                                                  fake_training):
    """A refusal after the options (here the data) leaves no settings file and no folder made for it."""
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--trials", "1", "--dataset", "no-such-dataset", "--write-settings", "new/best.json") == 2
    capsys.readouterr()
    assert not list(tmp_path.iterdir()) and fake_training["n"] == 0


def test_a_sweeps_seeds_are_the_ones_its_libraries_take(tmp_path, capsys, monkeypatch, fake_training):
    """Optuna's samplers take a seed in [0, 2**32 - 1], and so do the runs' seeds --seed .. --seed + --runs - 1:
    a seed past that is refused in speedrun's words naming --seed and its range; the last one is taken."""
    monkeypatch.chdir(tmp_path)
    for seed, runs, last in [("5000000000", "1", 2**32 - 1), (str(2**32 - 1), "2", 2**32 - 2), ("-1", "1", 2**32 - 1)]:
        assert _sweep(tmp_path, "--trials", "1", "--runs", runs, "--seed", seed) == 2
        line = _error_line(capsys.readouterr().err)
        assert line.startswith(f"speedrun: error: --seed {seed}: ") and f"give --seed from 0 to {last}" in line, line
        assert "Seed must be" not in line and "2**62" not in line
    assert _sweep(tmp_path, "--trials", "1", "--runs", "2", "--seed", str(2**32 - 2)) == 0
    capsys.readouterr()


@pytest.mark.parametrize("url, shown", [
    ("sqlite:////tmp/my study/s.db", "sqlite:////tmp/my study/s.db"),  # a file's name as it was written
    ("sqlite:///caf\u00e9.db?mode=ro", "sqlite:///caf\u00e9.db?mode=***"),
    ("postgresql://me:hunter2@db.example:5432/studies?sslkey=/k.pem",
     "postgresql://me:***@db.example:5432/studies?sslkey=***"),
    ("postgresql://me:hun/ter2@host/studies", "postgresql://me:***@host/studies"),  # SQLAlchemy's password: hun/ter2
    ("postgresql://me:hun@ter2@host/studies", "the --storage URL"),  # an unescaped @: no host shows "ter2"
    ("postgres-ql://me:hunter2@host/studies", "the --storage URL"),  # not a URL SQLAlchemy reads
    ("nonsense", "nonsense"),  # no "://": nothing to mask
])
def test_a_storage_url_is_shown_as_sqlalchemy_reads_it_with_its_secrets_masked(url, shown):
    assert sweeping.shown_url(url) == shown


@pytest.mark.parametrize("argv, said, unsaid", [
    (["--study", "two\nlines"], "--study", None),
    (["--study", "red \x1b[31m"], "--study", None),
    (["--storage", "postgresql://me@127.0.0.1:1/studies?password=hunter2&sslmode=require"], "password=***",
     "hunter2"),
    (["--space", "epochs=1:2", "--objective", "time", "--runs", "2"], "--space epochs and --epochs", "--set"),
])
def test_what_a_sweep_refusal_says_is_true_and_safe(argv, said, unsaid, tmp_path, capsys, monkeypatch,
                                                    fake_training):
    """A study name a message cannot show as it is (a newline, ESC) is refused up front, not shown escaped in a
    resume hint that would name another study; a storage URL's query values are masked as its password is; a
    refusal names only the options given (no --set epochs= beside --space epochs and --epochs)."""
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, "--trials", "1", *argv) == 2
    err = capsys.readouterr().err
    line = _error_line(err)
    assert said in line and err.count("\n") == 1, err
    assert unsaid is None or unsaid not in err, err
    if argv[0] == "--study":
        assert "printable" in line and not list(tmp_path.iterdir())
