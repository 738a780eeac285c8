"""The `speedrun` command: each subcommand calls one handler (the grammar is parser.py; the handlers are in
file_commands.py and train_commands.py).

Failure behaviour (README "Failure behaviour"):
- a user error (bad flag, config, data or path) prints one line on stderr and exits 2, before any training;
- Ctrl-C exits 130 and SIGTERM 143, each after saving the finished runs;
- a run whose loss becomes NaN/inf is recorded as diverged and the command exits 3 (its result is written);
- anything unexpected prints one line naming the error and exits 1 (SPEEDRUN_TRACEBACK=1 shows the traceback).
Warnings are one line each, `speedrun: warning: ...`, and are shown with --quiet too.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import signal
import sys
import warnings

from speedrun.cli.output import EXIT_INTERNAL, EXIT_USAGE, one_line, other_rank, prog_name, say, under_torchrun
from speedrun.cli.parser import build_parser
from speedrun.errors import SpeedrunWarning, Terminated
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
    finally:
        signal.signal(signal.SIGTERM, previous)


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, CUDA's OutOfMemoryError, and the CPU allocator's RuntimeError ("can't allocate memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


# Each subcommand's handler: (its module in speedrun.cli, the function, whether it takes the command line too).
# The module is imported when its command runs: train_commands imports torch, which `speedrun --help`, `speedrun
# recipes` and the file commands do without.
_COMMANDS = {"train": ("train_commands", "train_command", True),
             "bench": ("train_commands", "bench_command", True),
             "ablate": ("train_commands", "ablate_command", True),
             "eval": ("train_commands", "eval_command", False),
             "predict": ("train_commands", "predict_command", False),
             "bench-loader": ("train_commands", "bench_loader_command", True),
             "profile": ("train_commands", "profile_command", True),
             "tune": ("train_commands", "tune_command", True),
             "peak": ("train_commands", "peak_command", False),
             "results": ("file_commands", "results_command", False),
             "compare": ("file_commands", "compare_command", True),
             "report": ("file_commands", "report_command", False),
             "data": ("file_commands", "prepare_command", False)}


# The commands that train, and so take part in a torchrun job (every process trains; rank 0 prints and writes).
DISTRIBUTED_COMMANDS = ("train", "bench", "ablate")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command not in DISTRIBUTED_COMMANDS and under_torchrun():
        # K copies of a one-process command would each write the same report, file or table (or race on it)
        if not other_rank():  # every process refuses alike: rank 0 says it
            say(f"speedrun: error: `speedrun {args.command}` runs in one process: start it without torchrun (the "
                 f"commands that run under torchrun are {', '.join(DISTRIBUTED_COMMANDS)})")
        return EXIT_USAGE
    if args.command == "recipes":
        try:
            for line in recipe_lines():
                print(line)
        except BrokenPipeError:  # `speedrun recipes | head -0`: the reader left; so do we, quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush must not fail again
            return 128 + signal.SIGPIPE
        except OSError as exc:  # a full disk under `> file`
            say(f"speedrun: error: cannot write the list ({exc.strerror})")
            return EXIT_USAGE
        return 0
    prog = prog_name()
    # Everything from here on, the imports of torch and the data included (a second or more), is inside the
    # handlers: a Ctrl-C at any moment is one line and exit 130, never a traceback.
    try:
        with _cli_signals_and_warnings():
            module, function, takes_argv = _COMMANDS[args.command]
            if args.command == "results" and args.results_action == "import":
                function = "import_command"
            run = getattr(importlib.import_module(f"speedrun.cli.{module}"), function)
            return run(args, argv) if takes_argv else run(args)
    except ValueError as exc:
        say(f"{prog}: error: {one_line(exc)}{_kept(exc)}")
        return EXIT_USAGE
    except OSError as exc:  # FileNotFoundError with our message, or the system's word on a path the user gave
        if exc.strerror is None:
            text = str(exc)
        else:  # a write to stdout or a full disk has no file name to show
            where = f": {exc.filename}" if exc.filename else " (writing the output or a result)"
            fix = "; free disk space and run again" if exc.errno == errno.ENOSPC else ""
            text = f"{exc.strerror}{where}{fix}"
        say(f"{prog}: error: {one_line(text)}{_kept(exc)}")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM as errors.Terminated
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        if isinstance(exc, Terminated) and under_torchrun():
            # torchrun stops every process with SIGTERM when one fails, as it forwards the user's or a scheduler's
            what = "terminated (SIGTERM: by the user or scheduler, or by torchrun after another process failed)"
        kept, path = getattr(exc, "runs_kept", 0), getattr(exc, "result_path", None)
        where = (f"{kept} finished run(s) kept in {path}" if kept and path else
                 f"{kept} finished run(s), no result file asked for" if kept else
                 "nothing was written" if args.command in ("report", "results", "compare", "data") else
                 "no run had finished")
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
            say(f"{prog}: error: out of memory ({one_line(exc, prose=True)[:200]}); lower batch_size or "
                  f"eval_batch_size (--set ...), or use fewer or smaller images{_kept(exc)}")
            return EXIT_USAGE
        if os.environ.get("SPEEDRUN_TRACEBACK"):
            raise
        if _peer_lost(exc):
            say(f"{prog}: error: lost contact with another process of the job: it failed or was stopped, and its "
                  f"own line (or torchrun's report) says why ({one_line(exc, prose=True)[:200]}){_kept(exc)}")
            return EXIT_INTERNAL
        say(f"{prog}: internal error: {type(exc).__name__}: {one_line(exc, prose=True)[:300]} (a bug: please report "
              f"it; SPEEDRUN_TRACEBACK=1 shows the traceback){_kept(exc)}")
        return EXIT_INTERNAL


def _kept(exc: BaseException) -> str:
    """"; 2 finished run(s) kept in PATH" when the command stopped part way after some runs had ended
    (errors.note_kept), else ""."""
    kept, path = getattr(exc, "runs_kept", 0), getattr(exc, "result_path", None)
    if not kept:
        return ""
    return one_line(f"; {kept} finished run(s) kept in {path}" if path else
                     f"; {kept} finished run(s), no result file asked for")


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
    code = main()
    if code in (130, 143):
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    if "torch.distributed" in sys.modules:  # under torchrun: the process group's threads must not see teardown
        from speedrun import dist  # imports torch: here only when a command has loaded it already

        dist.exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
