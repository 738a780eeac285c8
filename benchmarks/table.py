"""Turn stored result JSONs into the markdown tables of BENCHMARKS.md.

    python benchmarks/table.py benchmarks/results/*.json benchmarks/results/*/*.json          # print them
    python benchmarks/table.py --write BENCHMARKS.md benchmarks/results/*.json benchmarks/results/*/*.json

Each kind of result has its own table: `speedrun train --json` results go between `<!-- results:begin -->` and
`<!-- results:end -->`; the reports of benchmarks/vs_airbench.py and benchmarks/step_time.py (their "benchmark"
field) between `<!-- vs_airbench:begin -->` ... and `<!-- step_time:begin -->` ... markers, rendered by those
scripts' own markdown(); `speedrun bench-loader --json` reports between `<!-- bench_loader:begin -->` ...,
rendered by speedrun.instruments.bench_loader.markdown(). --write replaces the marked sections of the kinds
given, so the numbers in BENCHMARKS.md are generated from stored results, never typed by hand. A stored command's
absolute paths (the files of the machine it ran on) are shown portably: relative to this repository when they lie
in it, else as "…/" and their last component (speedrun.report.portable).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from speedrun.records import db
from speedrun.errors import counted
from speedrun.records.environment import device_label
from speedrun.records.result_file import load_result
from speedrun.records.stats import mean_std_text
from speedrun.report.markdown import markers, rewrite_marked
from speedrun.report.portable import portable_paths

REPO = Path(__file__).resolve().parents[1]
TRAIN = "results"  # the kind of `speedrun train` results, which carry no "benchmark" field
BEGIN, END = markers(TRAIN)  # "<!-- results:begin -->", "<!-- results:end -->": the convention of every section
# scripts beside this one, each with markdown(report) -> str
BENCHMARKS = ("vs_airbench", "step_time", "ab_commits", "shard_formats", "smoke_time", "selective_tta",
              "launch_counts", "step_parity")
# speedrun commands whose --json reports are rendered here, each by its module's markdown(report) -> str
COMMAND_REPORTS = {"bench_loader": "speedrun.instruments.bench_loader", "ensemble": "speedrun.run.ensemble"}
# speedrun's own commands' reports
SPEEDRUN_REPORTS = ("bench", "ablate", "waterfall", "to_target", "compare", "tune", "profile", "sweep")
HEADER = ("| date | device | command | n | test acc % (mean ± std) | 95% CI | timed s (mean ± std) | target hit |\n"
          "|---|---|---|---|---|---|---|---|")


def row(result: dict) -> str:
    env = result["environment"]
    acc, secs = result["accuracy"], result["train_seconds"]
    command = result.get("command") or "(not recorded)"
    diverged = result.get("diverged_runs", 0)
    if acc is None:  # every run diverged: there is nothing to average
        return (f"| {env['timestamp_utc'][:10]} | {env['device_type']}: {device_label(env)} | `{command}` | 0 "
                f"| all {counted(diverged, 'run')} diverged | n/a | n/a | n/a |")
    interval = (f"{100 * acc['ci95_low']:.2f} .. {100 * acc['ci95_high']:.2f}" if acc["n"] > 1
                else "n/a (n = 1)")  # one run has no interval
    # the target that applies on this data (the recipe's on its own data set, db.identity): a folder or shards
    # derived from CIFAR-10 are not it, so no run is counted against it
    target = db.identity(result, result.get("command"), result.get("dataset"))[3]
    hits = ("no target (not the recipe's data set)" if target is None else
            f"{round(result['hit_rate'] * acc['n'])}/{acc['n']} ≥ {100 * target:.0f}%")
    return (f"| {env['timestamp_utc'][:10]} | {env['device_type']}: {device_label(env)} | `{command}` | {acc['n']} "
            f"| {mean_std_text(acc, 100)} | {interval} | {mean_std_text(secs, 1, 1)} | {hits}"
            + (f"; {diverged} more diverged" if diverged else "") + " |")


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tables(paths: list[Path]) -> dict[str, str]:
    """{kind: markdown} for the kinds among `paths`, each kind's results in time order."""
    by_kind: dict[str, list[dict]] = {}
    for path in sorted(paths):
        result = load_result(path)
        if result.get("smoke_test"):
            raise ValueError(f"{path}: a smoke test (--smoke) checks the pipeline and is not a result; leave it out")
        kind = result.get("benchmark", TRAIN)
        if kind in SPEEDRUN_REPORTS:
            continue  # `speedrun report --benchmarks` renders these from the database
        if kind != TRAIN and kind not in BENCHMARKS and kind not in COMMAND_REPORTS:
            raise ValueError(f"{path}: unknown benchmark {kind!r}; this script renders "
                             f"{', '.join([*BENCHMARKS, *COMMAND_REPORTS])}")
        by_kind.setdefault(kind, []).append(result)
    out = {}
    for kind, results in by_kind.items():
        results.sort(key=lambda r: (r.get("environment") or {}).get("timestamp_utc", ""))  # none: first
        if kind == TRAIN:
            text = "\n".join([HEADER, *(row(r) for r in results)])
        else:
            render = (importlib.import_module(COMMAND_REPORTS[kind]) if kind in COMMAND_REPORTS
                      else _sibling(kind)).markdown
            text = "\n\n".join(render(r) for r in results)
        # each renderer shows commands as stored; their paths are made portable here, once for every kind
        out[kind] = portable_paths(text, REPO)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--write", type=Path, help="markdown file whose marked sections are replaced")
    args = parser.parse_args(argv)
    try:
        sections = tables(args.results)
        if args.write is None:
            print("\n\n".join(sections.values()))
            return 0
        rewrite_marked(args.write, sections)  # atomically, once every section is rendered and placed
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"table: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
