"""The `speedrun` command: argument parsing only; each subcommand calls one function.

User errors (bad flags, unknown --set keys, wrong types, missing or corrupt data) print one line on stderr and
exit with code 2; an interrupt exits 130 after saving the finished runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + error; we print one line
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speedrun", description="Train neural networks as fast as the hardware allows.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a recipe for N seeds and report statistics")
    t.add_argument("recipe", nargs="?", default="cifar10-94", help="recipe name (default cifar10-94)")
    t.add_argument("--dataset", default=None,
                   help="cifar10, cifar100, mnist, fashion-mnist, kmnist, synthetic[:k=v,...], or a path "
                        "(image folder ROOT/{train,test}/<class>/, CIFAR batches or archive, IDX files)")
    t.add_argument("--data-dir", default=None, help="where a named dataset's archive or files already are")
    t.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")
    t.add_argument("--epochs", type=_float, default=None, help="override the epochs; the schedule is compressed")
    t.add_argument("--runs", type=int, default=1, help="number of seeds (default 1)")
    t.add_argument("--seed", type=int, default=0, help="first seed; run i uses seed + i")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set lookahead=false (repeatable)")
    t.add_argument("--json", default=None, help="result file (default: results/<time>-<recipe>-<dataset>.json)")
    t.add_argument("--quiet", action="store_true", help="print only the summary table")
    sub.add_parser("recipes", help="list the recipes")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from speedrun import runs  # deferred: `speedrun --help` should not import torch
    from speedrun.config import parse_set_args

    if args.command == "recipes":
        runs.print_recipes()
        return 0
    try:
        overrides = parse_set_args(args.overrides)
        runs.train(args.recipe, args.dataset, device=args.device, epochs=args.epochs, runs=args.runs,
                   seed=args.seed, data_dir=args.data_dir, json_path=args.json or "auto", verbose=not args.quiet,
                   command=shlex.join(["speedrun", *argv]), **overrides)
    except (ValueError, FileNotFoundError) as exc:
        # One line, always: some library messages (tarfile's, for one) carry newlines of their own.
        print(f"speedrun: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("speedrun: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
