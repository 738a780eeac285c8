"""Turn stored result JSONs (from `speedrun train --json`) into the markdown table of BENCHMARKS.md.

    python benchmarks/table.py benchmarks/results/*.json              # print the table
    python benchmarks/table.py --write BENCHMARKS.md benchmarks/results/*.json

--write replaces the text between the `<!-- results:begin -->` and `<!-- results:end -->` markers, so the
numbers in BENCHMARKS.md are generated from stored results, never typed by hand (STYLE.md habit 6).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speedrun.results import load_result

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADER = ("| date | device | command | n | test acc % (mean ± std) | 95% CI | timed s (mean ± std) | target hit |\n"
          "|---|---|---|---|---|---|---|---|")


def row(result: dict) -> str:
    env = result["environment"]
    acc, secs = result["accuracy"], result["train_seconds"]
    device = f"{env['device_type']}: {env['device_name']}" + (
        f" ({env['cpu_threads']} threads)" if env["device_type"] == "cpu" else "")
    command = result.get("command") or "(not recorded)"
    return (f"| {env['timestamp_utc'][:10]} | {device} | `{command}` | {acc['n']} "
            f"| {100 * acc['mean']:.2f} ± {100 * acc['std']:.2f} "
            f"| {100 * acc['ci95_low']:.2f} .. {100 * acc['ci95_high']:.2f} "
            f"| {secs['mean']:.1f} ± {secs['std']:.1f} "
            f"| {round(result['hit_rate'] * acc['n'])}/{acc['n']} ≥ {100 * result['target_accuracy']:.0f}% |")


def table(paths: list[Path]) -> str:
    rows = [load_result(p) for p in sorted(paths)]
    rows.sort(key=lambda r: r["environment"]["timestamp_utc"])
    return "\n".join([HEADER, *(row(r) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--write", type=Path, help="markdown file whose marked section is replaced")
    args = parser.parse_args(argv)
    try:
        text = table(args.results)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"table: error: {exc}", file=sys.stderr)
        return 2
    if args.write is None:
        print(text)
        return 0
    doc = args.write.read_text()
    if BEGIN not in doc or END not in doc:
        print(f"table: error: {args.write} has no {BEGIN} ... {END} markers; add them where the table goes",
              file=sys.stderr)
        return 2
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.write.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
