"""The `speedrun` command: argument parsing only; each subcommand calls one function.

Failure behaviour (README "Failure behaviour"):
- a user error (bad flag, config, data or path) prints one line on stderr and exits 2, before any training;
- Ctrl-C exits 130 and SIGTERM 143, each after saving the finished runs;
- a run whose loss becomes NaN/inf is recorded as diverged and the command exits 3 (its result is written);
- anything unexpected prints one line naming the error and exits 1 (SPEEDRUN_TRACEBACK=1 shows the traceback).
Warnings are one line each, `speedrun: warning: ...`, and are shown with --quiet too.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import warnings

EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_INTERNAL = 1


_MAX_LINE = 1000  # characters of one error or warning line


def _worker_message(text: str) -> str:
    """The message of an exception raised in a DataLoader worker process. torch re-raises it in the main process
    with the worker's whole traceback as its message ("Caught ValueError in DataLoader worker process 0.\nOriginal
    Traceback ..."): the one line is the original message, the last lines after the traceback's indented frames,
    without its "ValueError: " prefix."""
    if "\nOriginal Traceback (most recent call last):" not in text:
        return text
    lines = text.splitlines()
    last_frame = max(i for i, line in enumerate(lines) if line.startswith(" ") or i == 1)
    message = "\n".join(lines[last_frame + 1:]).strip()
    head, sep, rest = message.partition(": ")
    return (rest if sep and head.replace(".", "").replace("_", "").isalnum() else message) or lines[0]


def _one_line(text: object) -> str:
    """Newlines folded (tarfile's messages carry some), and cut in the middle past _MAX_LINE characters: a value
    echoed back (a 100,000-character --dataset, say) must not make the one line a screenful. An error from a
    DataLoader worker is its own message, not the worker's traceback."""
    text = " ".join(_worker_message(str(text)).split())
    if len(text) <= _MAX_LINE:
        return text
    return f"{text[:_MAX_LINE // 2]} ...[{len(text) - _MAX_LINE + 200} characters]... {text[-(_MAX_LINE // 2 - 200):]}"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # No prefixes: `--epoch` is a typo, not --epochs, and a new flag must not change what an old command means.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):  # argparse prints usage + error; we print one line
        _say(f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)")
        raise SystemExit(EXIT_USAGE)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _version() -> str:
    from speedrun import __version__

    return f"speedrun {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speedrun", description="Train neural networks as fast as the hardware allows.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from speedrun.recipes import recipe_lines  # a table of names: no torch, no family imported

    t = sub.add_parser("train", help="train a recipe for N seeds and report statistics",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="recipes:\n  " + "\n  ".join(recipe_lines()) +
                              "\n\nUnder torchrun (torchrun --nproc_per_node=K -m speedrun train ...) every process "
                              "takes 1/K of each batch; see the README.")
    t.add_argument("recipe", nargs="?", default="cifar10-94", help="recipe name (default cifar10-94; listed below)")
    t.add_argument("--dataset", default=None,
                   help="cifar10, cifar100, mnist, fashion-mnist, kmnist, synthetic[:k=v,...], or a path "
                        "(image folder ROOT/{train,test}/<class>/, CIFAR batches or archive, IDX files)")
    t.add_argument("--data-dir", default=None, help="where a named dataset's archive or files already are")
    t.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="image folders: resize the shorter side to PX and centre-crop PX x PX (mixed sizes)")
    t.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")
    t.add_argument("--epochs", type=_float, default=None, help="override the epochs; the schedule is compressed")
    t.add_argument("--runs", type=int, default=1, help="number of seeds (default 1)")
    t.add_argument("--seed", type=int, default=0, help="first seed; run i uses seed + i")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set lookahead=false (repeatable)")
    t.add_argument("--json", default=None,
                   help="result file, never replaced (default: a new results/<time>-<recipe>-<dataset>.json)")
    t.add_argument("--smoke", action="store_true",
                   help="pipeline check in seconds: a few steps, 1000 test images, no TTA; not a result")
    t.add_argument("--quiet", action="store_true", help="print only the summary table (and warnings)")
    t.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the training state in DIR (off by default; outside the timed region)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="checkpoint every STEPS steps (default: ten times a run), and always at a run's end")
    t.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="keep the newest K (default 2)")
    t.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint file, or 'auto': the newest usable one in --checkpoint-dir")
    t.add_argument("--price-per-hour", type=_float, default=None, metavar="USD",
                   help="dollars per device-hour for the result's cost (default: a table of GPU prices, cost.py)")
    t.add_argument("--save", default=None, metavar="PATH",
                   help="write the trained network: PATH.safetensors + PATH.json (for eval, predict, speedrun.load)")
    t.add_argument("--db", default=None, metavar="PATH",
                   help="results database (default: $SPEEDRUN_DB, else ~/.local/share/speedrun/results.db)")
    r = sub.add_parser("results", help="list stored results (filters, --json, --csv); `results import FILE...`")
    r.add_argument("--recipe", default=None)
    r.add_argument("--dataset", default=None, help="the dataset as given, or its last path part")
    r.add_argument("--device", default=None, help="a device type (cuda, cpu) or part of the device's name")
    r.add_argument("--since", default=None, metavar="DATE", help="ISO date or time (UTC), inclusive")
    r.add_argument("--until", default=None, metavar="DATE", help="ISO date or time (UTC), inclusive")
    r.add_argument("--command", dest="command_text", default=None, metavar="TEXT",
                   help="results whose command line contains TEXT")
    r.add_argument("--limit", type=int, default=None, metavar="N")
    r.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    r.add_argument("--csv", action="store_true", help="CSV instead of a table")
    r.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    rsub = r.add_subparsers(dest="results_action", parser_class=_Parser)
    ri = rsub.add_parser("import", help="store result JSON files (speedrun train --json, benchmarks/results/)")
    ri.add_argument("files", nargs="+", metavar="FILE")
    # SUPPRESS: `results --db X import F` keeps the X given before `import` (a default here would replace it).
    ri.add_argument("--db", default=argparse.SUPPRESS, metavar="PATH", help="results database (default as for train)")
    b = sub.add_parser("bench", help="settings side by side: --vary KEY=V1,V2 against the baseline, interleaved")
    b.add_argument("recipe", nargs="?", default="cifar10-94")
    b.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a config key and the values to try, each against the baseline (repeatable)")
    b.add_argument("--runs", type=int, default=3, help="runs per setting (default 3)")
    b.add_argument("--dataset", default=None)
    b.add_argument("--data-dir", default=None)
    b.add_argument("--device", default="auto")
    b.add_argument("--epochs", type=_float, default=None)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="the baseline's config overrides (repeatable)")
    b.add_argument("--json", default=None, help="report file, never replaced (default: results/<time>-bench-...)")
    b.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    a = sub.add_parser("ablate", help="each registered trick switched off alone, sorted by what it buys")
    a.add_argument("recipe", nargs="?", default="cifar10-94")
    a.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    for flag, kwargs in (("--dataset", {}), ("--data-dir", {}), ("--device", {"default": "auto"}),
                         ("--epochs", {"type": _float}), ("--seed", {"type": int, "default": 0}),
                         ("--json", {"help": "report file, never replaced"}),
                         ("--db", {"metavar": "PATH", "help": "results database (default as for train)"})):
        a.add_argument(flag, **{"default": None, **kwargs})
    a.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="the baseline's config overrides (repeatable)")
    a.add_argument("--waterfall", default=None, metavar="ORDER",
                   help="tricks (comma-separated) added one at a time to a plain start, cumulatively")
    a.add_argument("--to-target", action="store_true",
                   help="the epochs (and time) each variant needs to reach the target (target_accuracy), by a "
                        "bounded search")
    a.add_argument("--max-probes", type=int, default=None, metavar="K",
                   help="--to-target: epoch values tried per variant, 2 to 20 (default 5)")
    c = sub.add_parser("compare", help="B against baseline A: differences with 95%% CIs, Welch p, time ratio")
    c.add_argument("a", metavar="A", help="baseline: a stored result's id (`speedrun results`) or a result JSON")
    c.add_argument("b", metavar="B", help="candidate: an id or a result JSON")
    c.add_argument("--json", action="store_true", help="the comparison as JSON")
    c.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    e = sub.add_parser("eval", help="test accuracy of a saved model (--save) on a dataset")
    e.add_argument("model", help="a saved model (PATH, PATH.safetensors or PATH.json)")
    e.add_argument("--dataset", required=True, help="as for train: a name or a path")
    e.add_argument("--data-dir", default=None, help="where a named dataset's files already are")
    e.add_argument("--image-size", type=int, default=None, metavar="PX", help="image folders: resize as for train")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    e.add_argument("--json", default=None, help="also write the result to this new file")
    p = sub.add_parser("predict", help="top classes of image files under a saved model")
    p.add_argument("model", help="a saved model (PATH, PATH.safetensors or PATH.json)")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    p.add_argument("--top", type=int, default=5, help="classes shown per image (default 5)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    o = sub.add_parser("report", help="the results database as one HTML page; --readme/--benchmarks tables")
    o.add_argument("--out", default=None, metavar="FILE",
                   help="the HTML file (default speedrun-report.html; replaces only an earlier report)")
    o.add_argument("--readme", default=None, metavar="FILE",
                   help="rewrite the records table between <!-- records:begin/end --> lines in FILE (README.md)")
    o.add_argument("--benchmarks", default=None, metavar="FILE",
                   help="rewrite the ablation tables between <!-- ablation:begin/end --> lines in FILE (BENCHMARKS.md)")
    o.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    sub.add_parser("recipes", help="list the recipes")
    d = sub.add_parser("data", help="image data: `data prepare SRC DST` writes an image folder tree as shards")
    dp = d.add_subparsers(dest="data_action", metavar="ACTION", required=True, parser_class=_Parser).add_parser(
        "prepare", help="an image folder tree as shards; a second run redoes only the splits that changed",
        description="SRC: SRC/{train,val,test}/<class>/<image> (ImageNet's layout) or SRC/<class>/<image>. DST gets "
                    "SPLIT-NNNNN.tar shards (WebDataset's layout), SPLIT-index.npy, classes.json, manifest.json.")
    dp.add_argument("src", metavar="SRC", help="the image folder tree (read only)")
    dp.add_argument("dst", metavar="DST", help="the shards' folder, outside SRC (created if missing)")
    dp.add_argument("--max-side-px", type=int, default=256, metavar="PX",
                    help="shrink each image's longer side to PX (default 256: 256x192 for a 4:3 photo covers "
                         "training crops up to 192 px, with 2.4 to 3.8 times fewer pixels to decode than FFCV's "
                         "400-500 px; use 400-512 to evaluate at 224 px)")
    dp.add_argument("--quality", type=int, default=90, help="JPEG quality, 1 to 100 (default 90, FFCV's)")
    dp.add_argument("--workers", type=int, default=None, metavar="N",
                    help="processes that decode and encode (default min(8, CPUs)); 0: in this process")
    dp.add_argument("--on-error", choices=("skip", "stop"), default="skip",
                    help="a file that cannot be used: skip it with a warning (default), or stop, leaving DST as it was")
    bl = sub.add_parser("bench-loader", help="images/s of the input path alone: prepared shards, and a plain "
                        "Pillow + DataLoader baseline over the original JPEGs (--baseline)",
                        description="Times decode + augment + copy: from asking for a batch to holding it on the "
                                    "device, cropped, flipped and standardized, after untimed warm-up batches; "
                                    "worker start-up is reported apart. Settings are measured interleaved.")
    bl.add_argument("dir", metavar="DIR", help="the shards' folder (what `speedrun data prepare SRC DIR` wrote)")
    bl.add_argument("--split", default=None, help="the split to read (default train, or the only split in DIR)")
    bl.add_argument("--workers", default="1,2", metavar="N,N,...", help="DataLoader worker processes (default 1,2)")
    bl.add_argument("--res", default="160,224", metavar="PX,PX,...", help="training resolutions (default 160,224)")
    bl.add_argument("--batch", type=int, default=64, help="images per batch (default 64)")
    bl.add_argument("--batches", type=int, default=30, metavar="N",
                    help="timed batches per measurement (default 30: 4 to 6 s each on a 2-core CPU)")
    bl.add_argument("--runs", type=int, default=5, help="measurements per setting, interleaved (default 5)")
    bl.add_argument("--decode-px", type=int, default=256, metavar="PX",
                    help="ours: the square the workers decode to (default 256)")
    bl.add_argument("--device", default="auto", help="auto, cpu, cuda")
    bl.add_argument("--decoder", choices=("auto", "pillow", "nvjpeg"), default="auto",
                    help="ours: auto decodes with nvJPEG (TorchCodec, the [gpu] extra) on CUDA, else Pillow workers")
    bl.add_argument("--baseline", default=None, metavar="SRC",
                    help="the original JPEGs (class folders or a train/val tree): each setting is also measured "
                         "with Pillow + torch DataLoader over them, and the ratio shown")
    bl.add_argument("--json", default=None, metavar="FILE", help="also write the report here (never replaced)")
    return parser


def _say(line: str) -> None:
    """One line on stderr in one write: under torchrun every process shares the terminal, and print's two writes
    (text, then newline) let two processes' lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _prog() -> str:
    """'speedrun', or 'speedrun[rank R]' in a torchrun worker other than rank 0: a failure on any rank ends the
    job with that rank's one line, and the line says which."""
    rank, size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    return "speedrun" if rank == "0" or size == "1" else f"speedrun[rank {_one_line(rank)[:8]}]"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    from speedrun.errors import SpeedrunWarning

    kind = "" if issubclass(category, SpeedrunWarning) else f" ({category.__name__})"
    _say(f"{_prog()}: warning: {_one_line(message)}{kind}")


@contextlib.contextmanager
def _cli_signals_and_warnings():
    """SIGTERM raises errors.Terminated (an interrupt) in the main thread; warnings print as one line."""
    from speedrun.errors import Terminated

    def on_term(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on exit
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, CUDA's OutOfMemoryError, and the CPU allocator's RuntimeError ("can't allocate memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def _train(args, argv: list[str]) -> int:
    from speedrun import dist, runs  # deferred: `speedrun --help` should not import torch
    from speedrun.config import parse_set_args
    from speedrun.db import default_db_path

    overrides = parse_set_args(args.overrides)
    result = runs.train(args.recipe, args.dataset, device=args.device, epochs=args.epochs, runs=args.runs,
                        seed=args.seed, data_dir=args.data_dir, image_size=args.image_size,
                        json_path=args.json or "auto", verbose=not args.quiet, summary=True, smoke=args.smoke,
                        command=dist.command_line(argv), checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                        resume=args.resume, save=args.save, price_per_hour=args.price_per_hour,
                        db=args.db or default_db_path(), overrides=overrides)
    return EXIT_DIVERGED if result.diverged_runs else 0


# Each subcommand's function: (module, function, whether it takes the command line too).
_COMMANDS = {"eval": ("saved", "eval_command", False), "predict": ("saved", "predict_command", False),
             "bench": ("bench", "bench_command", True), "ablate": ("ablate", "ablate_command", True),
             "compare": ("compare", "compare_command", False), "results": ("db", "results_command", False),
             "report": ("report", "report_command", False),
             "data": ("data.prepare_tree", "prepare_command", False),
             "bench-loader": ("bench_loader", "bench_loader_command", True)}


# The commands that train, and so take part in a torchrun job (every process trains; rank 0 prints and writes).
DISTRIBUTED_COMMANDS = ("train", "bench", "ablate")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command not in DISTRIBUTED_COMMANDS and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        # K copies of a one-process command would each write the same report, file or table (or race on it)
        _say(f"{_prog()}: error: `speedrun {args.command}` runs in one process: start it without torchrun (the "
             f"commands that run under torchrun are {', '.join(DISTRIBUTED_COMMANDS)})")
        return EXIT_USAGE
    if args.command == "recipes":
        from speedrun import runs

        try:
            runs.print_recipes()
        except BrokenPipeError:  # `speedrun recipes | head -0`: the reader left; so do we, quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush must not fail again
            return 128 + signal.SIGPIPE
        except OSError as exc:  # a full disk under `> file`
            _say(f"speedrun: error: cannot write the list ({exc.strerror})")
            return EXIT_USAGE
        return 0
    from speedrun.errors import Terminated

    prog = _prog()
    # Everything from here on, the imports of torch and the data included (a second or more), is inside the
    # handlers: a Ctrl-C at any moment is one line and exit 130, never a traceback.
    try:
        with _cli_signals_and_warnings():
            if args.command in _COMMANDS:
                import importlib

                module, function, takes_argv = _COMMANDS[args.command]
                if args.command == "results" and args.results_action == "import":
                    function = "import_command"
                run = getattr(importlib.import_module(f"speedrun.{module}"), function)
                return run(args, argv) if takes_argv else run(args)
            return _train(args, argv)
    except ValueError as exc:
        _say(f"{prog}: error: {_one_line(exc)}")
        return EXIT_USAGE
    except OSError as exc:  # FileNotFoundError with our message, or the system's word on a path the user gave
        if exc.strerror is None:
            text = str(exc)
        else:  # a write to stdout or a full disk has no file name to show
            where = f": {exc.filename}" if exc.filename else " (writing the output or a result)"
            fix = "; free disk space and run again" if exc.errno == errno.ENOSPC else ""
            text = f"{exc.strerror}{where}{fix}"
        _say(f"{prog}: error: {_one_line(text)}")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM as errors.Terminated
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        kept, path = getattr(exc, "runs_kept", 0), getattr(exc, "result_path", None)
        where = (f"{kept} finished run(s) kept in {path}" if kept and path else
                 f"{kept} finished run(s), no result file asked for" if kept else
                 "nothing was written" if args.command in ("report", "results", "compare", "data") else
                 "no run had finished")
        if getattr(exc, "checkpoint_dir", None) is not None:
            where += f"; checkpoint in {exc.checkpoint_dir} (continue with --resume auto)"
        if prog != "speedrun":  # rank 0 reports the interrupt for the job
            return 143 if isinstance(exc, Terminated) else 130
        _say(f"{prog}: {what}; {_one_line(where)}")
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:  # noqa: BLE001 -- the promise is one line, never a traceback
        if _out_of_memory(exc):
            _say(f"{prog}: error: out of memory ({_one_line(exc)[:200]}); lower batch_size or eval_batch_size "
                  "(--set ...), or use fewer or smaller images")
            return EXIT_USAGE
        if os.environ.get("SPEEDRUN_TRACEBACK"):
            raise
        if _peer_lost(exc):
            _say(f"{prog}: error: lost contact with another process of the job: it failed or was stopped, and its "
                  f"own line (or torchrun's report) says why ({_one_line(exc)[:200]})")
            return EXIT_INTERNAL
        _say(f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)[:300]} (a bug: please report it; "
              "SPEEDRUN_TRACEBACK=1 shows the traceback)")
        return EXIT_INTERNAL


def _peer_lost(exc: BaseException) -> bool:
    """A collective failed because a peer process died (gloo's dropped connection, NCCL's DistBackendError)."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return False
    text = str(exc)
    return type(exc).__name__ == "DistBackendError" or (isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo")))


def entry() -> int:
    """The `speedrun` program (console script and `python -m speedrun.cli`): main(), then, after an interrupt, no
    more of them. The command is already ending: a second Ctrl-C (or a group signal arriving twice) would otherwise
    interrupt the interpreter's shutdown and print a traceback. Not in main(), which tests and embedding programs
    call in their own process, whose children would inherit the ignored signals."""
    code = main()
    if code in (130, 143):
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    if "torch.distributed" in sys.modules:  # under torchrun: the process group's threads must not see teardown
        from speedrun import dist

        dist.exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
