"""Wall seconds of `speedrun train --smoke` per recipe, as a user runs it: a new process each time, the decoded
data cache warm (the first, cold run of each dataset is shown apart and not counted).

    python benchmarks/smoke_time.py --cifar ../shared/datasets/cifar10-jpeg --shards /tmp/inshards \
        --runs 3 --json benchmarks/results/smoke/smoke-time.json

The smoke test's promise is "seconds on a laptop CPU" (README); the target is at most 15 s per recipe on a 2-core
CPU with a warm decode cache. Recipes take turns (round r runs every recipe once), so background load hits them
alike. Each run writes its result into a temporary folder and database, removed at the end. Reported per recipe:
mean ± std of the wall seconds (process start to exit), min, max, n.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from speedrun.records.environment import device_label, environment
from speedrun.records.result_file import write_json
from speedrun.records.stats import summarize

CIFAR_RECIPES = ["cifar10-94", "cifar10-94-muon", "cifar10-95", "cifar10-96", "cifar10-resnet18"]
SHARD_RECIPES = ["imagenet-resnet18", "imagenet-resnet50"]


def smoke_seconds(recipe: str, dataset: str, scratch: Path, device: str) -> float:
    """One `speedrun train RECIPE --smoke` in a new process: wall seconds; a failure ends the benchmark."""
    command = [sys.executable, "-m", "speedrun", "train", recipe, "--smoke", "--dataset", dataset, "--device", device,
               "--quiet", "--db", str(scratch / "results.db"), "--json", str(scratch / f"{time.time_ns()}.json")]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"smoke_time: {recipe} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return seconds


def markdown(report: dict) -> str:
    """BENCHMARKS.md's table of one report (benchmarks/table.py renders it between the smoke_time markers)."""
    env = report["environment"]
    lines = [f"{env['timestamp_utc'][:10]}, {device_label(env)}, n={report['runs']} per recipe, interleaved, warm "
             f"cache: `{report['command']}`", "", "| recipe | data | wall s (mean ± std) | min .. max |",
             "|---|---|---|---|"]
    for row in report["rows"]:
        s = row["summary"]
        lines.append(f"| {row['recipe']} | {Path(row['dataset']).name} | {s['mean']:.2f} ± {s['std'] or 0:.2f} | "
                     f"{s['min']:.2f} .. {s['max']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cifar", required=True, help="the dataset the cifar recipes take (a name or a folder)")
    parser.add_argument("--shards", default="synthetic",
                        help="a folder `speedrun data prepare` wrote, for the imagenet recipes (default synthetic)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    plan = [(r, args.cifar) for r in CIFAR_RECIPES] + [(r, args.shards) for r in SHARD_RECIPES]
    seconds: dict[str, list[float]] = {r: [] for r, _ in plan}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        first = {}  # dataset -> the first recipe that reads it
        for recipe, dataset in plan:
            first.setdefault(dataset, recipe)
        # One untimed run per dataset fills its decode cache (and the FLOP peak cache) as a user's first run does.
        cold = {dataset: smoke_seconds(recipe, dataset, scratch, args.device) for dataset, recipe in first.items()}
        for _ in range(args.runs):
            for recipe, dataset in plan:
                seconds[recipe].append(smoke_seconds(recipe, dataset, scratch, args.device))
    env = environment(torch.device(args.device))
    print(f"speedrun train RECIPE --smoke, wall seconds per process, warm decode cache, {device_label(env)}, "
          f"n={args.runs} each (interleaved)")
    print(f"{'recipe':20} {'dataset':28} {'mean':>6} {'std':>6} {'min':>6} {'max':>6}")
    rows = []
    for recipe, dataset in plan:
        s = summarize(seconds[recipe])
        rows.append({"recipe": recipe, "dataset": dataset, "seconds": seconds[recipe], "summary": s.to_dict()})
        print(f"{recipe:20} {Path(dataset).name[:28]:28} {s.mean:6.2f} {s.std or 0:6.2f} {s.min:6.2f} {s.max:6.2f}")
    print("first (cold cache) run per dataset, not counted: " +
          ", ".join(f"{Path(d).name} {v:.1f} s" for d, v in cold.items()))
    if args.json:
        write_json(args.json, {"benchmark": "smoke_time", "device": args.device, "environment": env, "runs": args.runs,
                               "rows": rows, "cold_seconds": cold,
                               "command": " ".join(["python", "benchmarks/smoke_time.py", *sys.argv[1:]])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
