"""The `speedrun` command: each subcommand calls one handler (the grammar is parser.py; the handlers are in
file_commands.py, train_commands.py and sweep_command.py).

Failure behaviour (README "Failure behaviour"):
- a user error (bad flag, config, data or path) prints one line on stderr and exits 2, before any training;
- Ctrl-C exits 130 and SIGTERM 143, each after saving the finished runs;
- a run whose loss becomes NaN/inf is recorded as diverged and the command exits 3 (its result is written);
- anything unexpected prints one line naming the error and exits 1 (SPEEDRUN_TRACEBACK=1 shows the traceback);
- when the reader of the output leaves (`speedrun results | head`), the command ends quietly with 141 (128 +
  SIGPIPE), as a Unix filter's writer does.
Warnings are one line each, `speedrun: warning: ...`, and are shown with --quiet too.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import select
import signal
import sys
import warnings
from pathlib import Path

from speedrun.cli.output import EXIT_INTERNAL, EXIT_USAGE, one_line, other_rank, prog_name, say, under_torchrun
from speedrun.cli.parser import build_parser
from speedrun.data.download import given_mirrors  # urllib only: no torch
from speedrun.errors import SpeedrunWarning, Terminated, clip, counted
from speedrun.paths import SECTIONS, distinct_outputs, tidy_folders, user_path
from speedrun.recipes import recipe_lines  # a table of names: no torch, no family imported


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if other_rank():
        return
    ours = issubclass(category, SpeedrunWarning)
    kind = "" if ours else f" ({category.__name__})"
    say(f"speedrun: warning: {one_line(message, prose=not ours)}{kind}")


@contextlib.contextmanager
def _cli_signals_and_warnings():
    """SIGTERM raises errors.Terminated (an interrupt) in the main thread; warnings print as one line."""
    def on_term(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    ending = False
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on exit
            warnings.simplefilter("default")
            # a library's deprecation notice (torch's own, on importing torch.compile's machinery) is for that
            # library's developers, not a user of speedrun: ours are still shown
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("default", category=DeprecationWarning, module=r"speedrun(\.|$)")
            # a file a library left open when a signal cut its import short is not the user's business
            warnings.simplefilter("ignore", ResourceWarning)
            warnings.showwarning = _show_warning
            yield
    except BaseException:
        # The command is ending (an interrupt or an error) and main() is about to write its one line: a second
        # Ctrl-C there would print a traceback, a second SIGTERM (the default action again) end the process without
        # a word. From here to main()'s return, signals change nothing; main() puts the caller's handlers back.
        ending = True
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _ignored)
        raise
    finally:
        if not ending:
            signal.signal(signal.SIGTERM, previous)


def _ignored(signum, frame) -> None:
    """A signal while a command writes its last line: the command is stopping already (a Python-level handler, not
    SIG_IGN, which the programs it starts would inherit)."""


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, CUDA's OutOfMemoryError, and the CPU allocator's RuntimeError ("can't allocate memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


# What to do when a command runs out of memory, in the flags that command has (a test holds each flag named here
# to the command's parser).
_SMALLER_BATCH = ("lower batch_size or eval_batch_size (--set batch_size=N, --set eval_batch_size=N), or use fewer "
                  "or smaller images")
_MEMORY_ADVICE = {
    "train": _SMALLER_BATCH, "bench": _SMALLER_BATCH, "ablate": _SMALLER_BATCH, "tune": _SMALLER_BATCH,
    "profile": _SMALLER_BATCH, "sweep": _SMALLER_BATCH,
    "eval": "evaluate on the CPU (--device cpu), whose memory is usually larger, or, for an image folder, at a "
            "smaller --image-size",
    "predict": "give fewer or smaller images per call, or predict on the CPU (--device cpu)",
    "bench-loader": "measure a smaller --batch or --res, or fewer --workers",
    "peak": "measure on the CPU (--device cpu), or free the device's memory (other programs on it)",
    "data": "use fewer --workers (each holds images being decoded) or a smaller --max-side-px",
    "results": "free memory (other programs), or give a smaller results database with --db PATH",
    "compare": "free memory (other programs), or compare two result files (compare A.json B.json)",
    "report": "free memory (other programs), or give a smaller results database with --db PATH",
}


def memory_advice(command: str) -> str:
    """The fix an out-of-memory line gives for `command` (a subcommand's name)."""
    return _MEMORY_ADVICE.get(command, "free memory (other programs) and run again")


def _stdout_reader_left() -> bool:
    """Whether stdout's reader has gone (a pipe whose reading end is closed: poll says POLLERR), so that a
    BrokenPipeError is the output's and not some other pipe's (a worker process's), which is an error to show.
    A stdout with no descriptor (an embedding program's stream) is taken at its word."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return True
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _quiet_stdout() -> None:
    """stdout onto /dev/null: the interpreter's flush at exit must not fail again on the broken pipe."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def _raised_in(exc: BaseException, function: str) -> bool:
    """Whether `exc` was raised in a function of that name (the innermost frame of its traceback)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name == function


def _recipes_command(args) -> int:
    for line in recipe_lines():
        print(line)
    return 0


# Each subcommand's handler: (its module in speedrun.cli, the function, whether it takes the command line too).
# The module is imported when its command runs: train_commands imports torch, which `speedrun --help`, `speedrun
# recipes` and the file commands do without.
_COMMANDS = {"train": ("train_commands", "train_command", True),
             "bench": ("train_commands", "bench_command", True),
             "ablate": ("train_commands", "ablate_command", True),
             "eval": ("train_commands", "eval_command", True),
             "predict": ("train_commands", "predict_command", False),
             "bench-loader": ("train_commands", "bench_loader_command", True),
             "profile": ("train_commands", "profile_command", True),
             "tune": ("train_commands", "tune_command", True),
             "sweep": ("sweep_command", "sweep_command", True),
             "peak": ("train_commands", "peak_command", False),
             "results": ("file_commands", "results_command", False),
             "compare": ("file_commands", "compare_command", True),
             "report": ("file_commands", "report_command", False),
             "data": ("file_commands", "prepare_command", False),
             "recipes": (None, _recipes_command, False)}


# The options that name what a command writes: (its attribute, the option, its kind as paths.distinct_outputs takes
# it: True for a folder, False for a file, SECTIONS for a file whose own sections it rewrites, as report's --readme
# and --benchmarks do, which may name one file). A command's own flag of the same name that is no path (results
# --json, a switch) holds a bool and is passed over.
_OUTPUTS = (("json", "--json", False), ("trace", "--trace", False), ("db", "--db", False), ("apply", "--apply", False),
            ("write_settings", "--write-settings", False), ("out", "--out", False), ("readme", "--readme", SECTIONS),
            ("benchmarks", "--benchmarks", SECTIONS), ("tensorboard", "--tensorboard", True),
            ("checkpoint_dir", "--checkpoint-dir", True))


def _check_outputs(args) -> None:
    """Before any work: each path the command writes within the bounds every path has (paths.user_path), and no
    two of them one file (paths.distinct_outputs; --save's two files included, and the databases no option of
    _OUTPUTS names: _databases)."""
    given = [(option, value, value, kind) for name, option, kind in _OUTPUTS
             if isinstance(value := getattr(args, name, None), str)]
    save = getattr(args, "save", None)
    if isinstance(save, str):
        user_path(save, "--save")  # its bounds, said of --save
        from speedrun.run.export import model_paths  # torch: train, the only command with --save, loads it anyway

        given += [("--save", save, os.fspath(p), False) for p in model_paths(save)]
    distinct_outputs(given + _databases(args))


def _databases(args) -> list[tuple[str, str, str, bool]]:
    """The database files a command writes without an option naming them, as distinct_outputs takes outputs: the
    default results database (of a command with --db, where none is given: $SPEEDRUN_DB or the default file) and
    sweep's study storage (--storage's SQLite file, or the default one beside the results database), which a
    --json or --write-settings of the same file would overwrite, and a study would fill with Optuna's tables."""
    found = []
    if hasattr(args, "db") and args.db is None:
        from speedrun.records import db  # numpy: the commands with --db load it anyway

        try:
            path = os.fspath(db.default_db_path())
        except RuntimeError:  # no home folder: the command's own connect refuses in its words
            path = None
        if path is not None:
            found.append(("the results database", path, path, False))
    if args.command == "sweep":
        from speedrun.instruments.study_url import storage_output  # no torch, no Optuna

        storage = storage_output(args.storage, args.db)
        if storage is not None:
            found.append((*storage, False))
    return found


# The commands that train, and so take part in a torchrun job (every process trains; rank 0 prints and writes).
DISTRIBUTED_COMMANDS = ("train", "bench", "ablate")


def main(argv: list[str] | None = None) -> int:
    """`speedrun ARGV` in this process: its exit code. The caller's SIGINT and SIGTERM handlers are as they were
    when it returns (entry(), the program, keeps later signals ignored instead)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    finally:
        for s, handler in saved.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command not in DISTRIBUTED_COMMANDS and under_torchrun():
        # K copies of a one-process command would each write the same report, file or table (or race on it)
        if not other_rank():  # every process refuses alike: rank 0 says it
            say(f"speedrun: error: `speedrun {args.command}` runs in one process: start it without torchrun (the "
                 f"commands that run under torchrun are {', '.join(DISTRIBUTED_COMMANDS)})")
        return EXIT_USAGE
    prog = prog_name()
    # Everything from here on, the imports of torch and the data included (a second or more), is inside the
    # handlers: a Ctrl-C at any moment is one line and exit 130, never a traceback.
    try:
        # --mirror (the commands that may download a named dataset) reaches the downloader, whichever handler loads it
        # tidy_folders: a command that stops leaves none of the empty folders it made (--json's, --checkpoint-dir ...)
        with _cli_signals_and_warnings(), given_mirrors(getattr(args, "mirror", None) or ()), tidy_folders():
            _check_outputs(args)
            module, function, takes_argv = _COMMANDS[args.command]
            if args.command == "results" and args.results_action == "import":
                function = "import_command"
            run = function if module is None else getattr(importlib.import_module(f"speedrun.cli.{module}"), function)
            code = run(args, argv) if takes_argv else run(args)
            sys.stdout.flush()  # here, where a reader that left is caught, not at the interpreter's exit
            return code
    except BrokenPipeError as exc:  # `speedrun results | head`: the reader left, so do we, quietly (any command)
        if not _stdout_reader_left():
            return _error_line(prog, exc)
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except SystemExit as exc:
        # rich's Console (train's tables) meets a broken pipe by moving stdout onto /dev/null and raising
        # SystemExit(1) from its on_broken_pipe: the same event as above, told by where it was raised
        if _raised_in(exc, "on_broken_pipe"):
            return 128 + signal.SIGPIPE
        raise
    except ValueError as exc:
        say(f"{prog}: error: {one_line(exc)}{_kept(exc)}")
        return EXIT_USAGE
    except OSError as exc:  # FileNotFoundError with our message, or the system's word on a path the user gave
        return _error_line(prog, exc)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM as errors.Terminated
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        if isinstance(exc, Terminated) and under_torchrun():
            # torchrun stops every process with SIGTERM when one fails, as it forwards the user's or a scheduler's
            what = "terminated (SIGTERM: by the user or scheduler, or by torchrun after another process failed)"
        stopped = getattr(exc, "stopped_at", None)  # how far a command that keeps nothing part way got
        where = _where_kept(exc) or (f"{stopped}; nothing was written" if stopped else "nothing was written"
                                     if args.command in ("report", "results", "compare", "data", "eval")
                                     else "no run had finished")
        if getattr(exc, "checkpoint_dir", None) is not None:
            where += f"; checkpoint in {exc.checkpoint_dir} (continue with --resume auto)"
        if prog != "speedrun":  # rank 0 reports the interrupt for the job
            return 143 if isinstance(exc, Terminated) else 130
        say(f"{prog}: {what}; {one_line(where)}")
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:  # noqa: BLE001 -- the promise is one line, never a traceback
        if type(exc).__name__ == "PeerFailed":  # dist.main_first: rank 0 failed first and printed why
            return EXIT_USAGE
        if _out_of_memory(exc):
            say(f"{prog}: error: out of memory ({clip(one_line(exc, prose=True), 200)}); {memory_advice(args.command)}"
                f"{_kept(exc)}")
            return EXIT_USAGE
        if _database_error(exc):  # records/db.py makes SQLite's errors refusals; this catches one that got past
            from speedrun.records import db

            say(f"{prog}: error: {one_line(db.refusal(exc, _database_name(args)))}{_kept(exc)}")
            return EXIT_USAGE
        if os.environ.get("SPEEDRUN_TRACEBACK"):
            raise
        if _peer_lost(exc):
            say(f"{prog}: error: lost contact with another process of the job: it failed or was stopped, and its "
                  f"own line (or torchrun's report) says why ({clip(one_line(exc, prose=True), 200)}){_kept(exc)}")
            return EXIT_INTERNAL
        user = _users_code(exc)
        if user is not None:  # the user's network (--model) failed: theirs to mend, not a bug of speedrun's
            name, where = user
            say(f"{prog}: error: the network of --model {name} raised {type(exc).__name__} at {one_line(where)}: "
                f"{clip(one_line(exc, prose=True), 300)}; mend the network (SPEEDRUN_TRACEBACK=1 shows the "
                f"traceback){_kept(exc)}")
            return EXIT_USAGE
        say(f"{prog}: internal error: {type(exc).__name__}: {clip(one_line(exc, prose=True), 300)} (a bug: please "
              f"report it; SPEEDRUN_TRACEBACK=1 shows the traceback){_kept(exc)}")
        return EXIT_INTERNAL


def _users_code(exc: BaseException) -> tuple[str, str] | None:
    """models/custom.raised_in, where a --model builder was loaded (the module imports torch: never imported here)."""
    custom = sys.modules.get("speedrun.models.custom")
    return None if custom is None else custom.raised_in(exc)


def _error_line(prog: str, exc: OSError) -> int:
    """An OSError as the command's one line: ours (a message naming its file), or the system's word and file."""
    if exc.strerror is None:
        text = str(exc)
    else:  # a write to stdout or a full disk has no file name to show
        where = f": {exc.filename}" if exc.filename else " (writing the output or a result)"
        fix = "; free disk space and run again" if exc.errno == errno.ENOSPC else ""
        text = f"{exc.strerror}{where}{fix}"
    say(f"{prog}: error: {one_line(text)}{_kept(exc)}")
    return EXIT_USAGE


def _database_error(exc: BaseException) -> bool:
    """SQLite's own error about a file (damaged, full, locked), not a misuse of its API (a bug)."""
    sqlite3 = sys.modules.get("sqlite3")
    return sqlite3 is not None and isinstance(exc, sqlite3.DatabaseError) and not isinstance(
        exc, sqlite3.ProgrammingError)


def _database_name(args) -> str:
    """The results database the command was given (--db), else the default one, for a refusal's line."""
    given = getattr(args, "db", None)
    if given:
        return str(given)
    from speedrun.records import db

    try:
        return str(db.default_db_path())
    except ValueError:  # SPEEDRUN_DB holds a ~user that does not exist
        return os.environ.get("SPEEDRUN_DB", "the results database")


def _kept(exc: BaseException) -> str:
    """"; 2 finished runs kept in PATH" when the command stopped part way after some runs had ended
    (errors.note_kept; `_where_kept`), else ""."""
    where = _where_kept(exc)
    return "" if where is None else one_line(f"; {where}")


def _where_kept(exc: BaseException) -> str | None:
    """Where the finished runs of a command that stopped part way are, as it is: None when none had ended.

    exc carries runs_kept and result_path (errors.note_kept), and stored_as = (database, id) where the runs' row
    went into the results database. A train result file is rewritten after every run, so a full disk can leave it
    a run or more behind: it is read back and its runs counted, and the line says how many it holds."""
    kept, path = getattr(exc, "runs_kept", 0), getattr(exc, "result_path", None)
    if not kept:
        return None
    stored = getattr(exc, "stored_as", None)
    in_database = None if stored is None else f"the results database {stored[0]} (#{stored[1]})"
    if path is None or (stored is not None and _same_file(path, stored[0])):
        return (f"{counted(kept, 'finished run')} in {in_database}" if in_database else
                f"{counted(kept, 'finished run')}, no result file asked for")
    in_file = _runs_in(path)
    if in_file is None or in_file == kept:
        return f"{counted(kept, 'finished run')} kept in {path}" + (f" and in {in_database}" if in_database else "")
    behind = f"{path} holds {in_file}{_why_behind(exc)}"
    return (f"{counted(kept, 'finished run')} in {in_database}; {behind}" if in_database else
            f"{counted(kept, 'run')} finished; {behind}")


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return Path(a) == Path(b)


def _runs_in(path) -> int | None:
    """The runs a `speedrun train` result file at `path` holds (0: the empty file a command claims first); None
    for another file (a benchmark report is written once, whole, with the database row; the database itself) or
    one that cannot be read."""
    from speedrun.records.result_file import load_result  # numpy: only on this path

    try:
        if os.path.getsize(path) == 0:
            return 0
        result = load_result(path)
    except (OSError, ValueError, RecursionError):
        return None
    runs = result.get("runs")
    return len(runs) if isinstance(runs, list) and "benchmark" not in result else None


def _why_behind(exc: BaseException) -> str:
    """Why a result file holds fewer runs than ended, when the error that stopped the command says."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return ": the disk is full"
    if isinstance(exc, OSError) and exc.strerror:
        return f": writing it failed ({exc.strerror})"
    return ""


def _peer_lost(exc: BaseException) -> bool:
    """A collective failed because a peer process died (gloo's dropped connection, NCCL's DistBackendError)."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return False
    text = str(exc)
    return type(exc).__name__ == "DistBackendError" or (isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo")))


def entry() -> int:
    """The `speedrun` program (console script and `python -m speedrun.cli`): main(), then, after an
    interrupt, no more of them. The command is already ending: a second Ctrl-C (or a group signal arriving twice)
    would otherwise interrupt the interpreter's shutdown and print a traceback. Not in main(), which tests and
    embedding programs call in their own process, whose children would inherit the ignored signals."""
    code = _main(None)  # not main(): after it the process only exits, so what it ignored stays ignored
    if code in (130, 143):
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    if "torch.distributed" in sys.modules:  # under torchrun: the process group's threads must not see teardown
        from speedrun import dist  # imports torch: here only when a command has loaded it already

        dist.exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
