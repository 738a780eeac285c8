"""Timed seconds of one `speedrun train` command at two commits, run side by side in alternating processes.

    python benchmarks/ab_commits.py --base 6a8562f --runs 5 -- \
        --dataset synthetic:train=8192,test=256 --device cpu --epochs 1 --set batch_size=512 --set tta_level=0

The base commit is checked out into a temporary git worktree; each round runs the base and then the working
tree (this checkout), each a fresh process with PYTHONPATH on its own src/, after one untimed round of each. The
result JSON's `train_seconds` of each process (the recipe's timed region) is compared: mean ± std per side, the
difference with its 95% CI, Welch's p-value and the ratio of means (95% CI). What it answers: does a change cost
the single-process path anything?
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from speedrun.records.environment import device_label, environment
from speedrun.records.result_file import write_json
from speedrun.records.stats import mean_std_text
from speedrun.records.stats import diff_ci95, ratio_ci95, summarize, welch_t_test  # noqa: E402


def _train_run(src: Path, args: list[str], scratch: Path, tag: str) -> dict:
    out = scratch / f"{tag}.json"
    env = dict(os.environ, PYTHONPATH=str(src), SPEEDRUN_RESULTS=str(scratch))
    done = subprocess.run([sys.executable, "-m", "speedrun.cli.program", "train", *args, "--quiet", "--json", str(out)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tag}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    run = json.loads(out.read_text())["runs"][0]
    return {"seconds": run["train_seconds"], "accuracy": run["accuracy"], "steps": run["steps"]}


def markdown(report: dict) -> str:
    """BENCHMARKS.md rows (benchmarks/table.py): one per side, the working tree's with its ratio to the base, and
    each side's accuracy where the report has it."""
    env, cmd = report["environment"], report["command"].replace("|", "\\|")
    ratio = report["ratio"]
    accuracy = report.get("accuracy_summary")
    lines = ["| date | device | command | side | n | timed s (mean ± std) | new / base (95% CI), Welch p | "
             "accuracy % (mean ± std) |", "|---|---|---|---|---|---|---|---|"]
    for side in ("base", "new"):
        label = f"base {report['base']}" if side == "base" else f"new {env.get('git_commit', '')[:7]}"
        lo, hi = ratio["ci95"]
        versus = ("1 (reference)" if side == "base" else
                  f"{ratio['mean']:.3f} ({lo:.3f} to {hi:.3f}), p = {report['welch_p']:.2f}")
        acc = "-" if accuracy is None else mean_std_text(accuracy[side], 100, 2)
        lines.append(f"| {env['timestamp_utc'][:10]} | {device_label(env)} | `{cmd}` | {label} | {report['n']} | "
                     f"{mean_std_text(report['summary'][side], 1, 3)} | {versus} | {acc} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (e.g. the one before a change)")
    parser.add_argument("--runs", type=int, default=5, help="timed processes per side")
    parser.add_argument("--json", default=None, help="write the comparison here")
    parser.add_argument("--new-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a --set for the working tree's side only (a setting the base lacks, or one that gives "
                             "both sides the same steps: --new-set drop_last_batch=false); repeatable")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the `speedrun train` arguments")
    args = parser.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tmp / "base"), args.base],
                       check=True, capture_output=True)
        try:
            sides = {"base": tmp / "base" / "src", "new": ROOT / "src"}
            side_args = {"base": train_args, "new": [*train_args, *(a for s in args.new_set for a in ("--set", s))]}
            runs: dict[str, list[dict]] = {"base": [], "new": []}
            for name, src in sides.items():  # untimed: page cache, imports, first-use allocations
                _train_run(src, side_args[name], tmp, f"warm-{name}")
            for i in range(args.runs):
                for name, src in sides.items():
                    runs[name].append(_train_run(src, side_args[name], tmp, f"{name}-{i}"))
                    print(f"round {i + 1}/{args.runs} {name}: {runs[name][-1]}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "base")],
                           capture_output=True)
    seconds = {k: [r["seconds"] for r in v] for k, v in runs.items()}
    accuracy = {k: [r["accuracy"] for r in v] for k, v in runs.items()}
    base, new = seconds["base"], seconds["new"]
    adiff, alo, ahi = diff_ci95(accuracy["new"], accuracy["base"])
    diff, lo, hi = diff_ci95(new, base)
    ratio, rlo, rhi = ratio_ci95(new, base)
    _, p = welch_t_test(new, base)
    device = train_args[train_args.index("--device") + 1] if "--device" in train_args else "auto"
    from speedrun.engine.system import resolve_device

    report = {"benchmark": "ab_commits", "command": " ".join(["python", "benchmarks/ab_commits.py", *sys.argv[1:]]),
              "environment": environment(resolve_device(device)), "base": args.base,
              "train_args": train_args, "new_set": args.new_set, "n": args.runs, "runs": runs,
              "seconds": {"base": base, "new": new},
              "accuracy_diff": {"mean": adiff, "ci95": [alo, ahi]},
              "accuracy_summary": {k: summarize(v).to_dict() for k, v in accuracy.items()},
              "summary": {k: summarize(v).to_dict() for k, v in seconds.items()},
              "diff_seconds": {"mean": diff, "ci95": [lo, hi]}, "ratio": {"mean": ratio, "ci95": [rlo, rhi]},
              "welch_p": p}
    for k in ("base", "new"):
        s = summarize(seconds[k])
        print(f"{k}: {s.mean:.3f} ± {s.std:.3f} s (n={s.n})")
    print(f"new - base: {diff:+.3f} s (95% CI {lo:+.3f} .. {hi:+.3f}), Welch p = {p:.3f}; "
          f"ratio {ratio:.3f} ({rlo:.3f} .. {rhi:.3f}); accuracy new - base {100 * adiff:+.2f} points "
          f"(95% CI {100 * alo:+.2f} .. {100 * ahi:+.2f})")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
