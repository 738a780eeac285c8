"""Selective TTA against full TTA on saved models: test accuracy and evaluation seconds, side by side.

    python benchmarks/selective_tta.py --models m0 m1 m2 --dataset ../shared/datasets/cifar10-jpeg \
        --fractions 0.1,0.25,0.5 --repeats 3 --json benchmarks/results/selective_tta/<name>.json

Each model (`speedrun train --save`) is scored on the test split by its card's TTA level in full, by selective TTA
(the level's views only for the least confident `fraction` of the test set, tricks/tta.py) at each fraction, and
without TTA. Settings take turns inside each repeat, the order rotated between repeats, so drift and
background load hit them alike. The evaluation is speedrun eval's: fp32 (or bf16 autocast, --precision), batches
of 2000, on --device.

Reported per setting: the mean test accuracy over the models and the paired difference from full TTA (mean and
95% t-interval over the models: each model is scored by every setting, so the pairs share their network), and the
evaluation seconds as a ratio to full TTA's (95% CI, delta method on the log scale, over every model and repeat).
Accuracy is the same in every repeat (the evaluation is deterministic); only the seconds are repeated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from speedrun.engine.system import resolve_device, synchronize
from speedrun.errors import counted
from speedrun.records.environment import device_label, environment
from speedrun.records.result_file import write_json
from speedrun.records.stats import FRACTION, ratio_ci95, summarize
from speedrun.run.export import evaluation_data, load
from speedrun.tricks.tta import selective_tta_logits

BATCH = 2000  # speedrun eval's evaluation batch


def _fractions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or any(not 0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"each fraction must be in (0, 1), got {text!r}")
    return values


@torch.no_grad()
def score(net: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, level: int, fraction: float | None,
          device: torch.device, precision: str = "fp32") -> tuple[float, float]:
    """(accuracy, seconds) of one setting over the normalized test images x (N, C, H, W): fraction None is full
    TTA at `level`, 0.0 no TTA, else selective TTA."""
    synchronize(device)
    start = time.perf_counter()
    # full TTA: fraction 1; no TTA: level 0; selective: the least confident `fraction` of the whole test set
    fraction, level = (1.0, level) if fraction is None else (1.0, 0) if fraction == 0.0 else (fraction, level)
    with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
        logits = selective_tta_logits(net, lambda idx: x[idx.to(x.device)], len(x), level, fraction, BATCH)
    correct = int((logits.argmax(1) == labels).sum())
    synchronize(device)
    return correct / len(x), time.perf_counter() - start


def setting_name(fraction: float | None) -> str:
    return "full TTA" if fraction is None else "no TTA" if fraction == 0.0 else f"selective {fraction:g}"


def markdown(report: dict) -> str:
    """BENCHMARKS.md's table of one report (benchmarks/table.py renders it between the selective_tta markers)."""
    env = report["environment"]
    lines = [f"{env['timestamp_utc'][:10]}, {device_label(env)}, {report['models']} models (TTA level "
             f"{report['tta_level']}), {report.get('precision', 'fp32')}, "
             f"{counted(report['repeats'], 'timed repeat')} each, "
             f"interleaved: `{report['command']}`", "",
             "| setting | test acc % (mean over models) | − full TTA, points (95% CI, paired) | "
             "eval s (mean ± std) | "
             "time / full TTA (95% CI) |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        acc, d, s = row["accuracy"], row["accuracy_diff"], row["seconds"]
        diff = "reference" if d is None else (f"{100 * d['mean']:+.2f} ({100 * d['ci95_low']:+.2f} to "
                                              f"{100 * d['ci95_high']:+.2f})" if d["ci95_low"] is not None
                                              else f"{100 * d['mean']:+.2f}")
        ratio = "1 (reference)" if row["time_ratio"] is None else \
            f"{row['time_ratio'][0]:.3f} ({row['time_ratio'][1]:.3f} to {row['time_ratio'][2]:.3f})"
        lines.append(f"| {row['setting']} | {100 * acc['mean']:.2f} | {diff} | {s['mean']:.2f} ± {s['std'] or 0:.2f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, help="saved models (speedrun train --save PATH), 2 or more")
    p.add_argument("--dataset", required=True, help="the data they were trained for (a name or a folder)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--fractions", type=_fractions, default=[0.1, 0.25, 0.5],
                   help="selective TTA fractions, comma-separated (default 0.1,0.25,0.5)")
    p.add_argument("--no-plain", action="store_true", help="leave out the setting without TTA")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per model and setting (default 3)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 as speedrun eval scores (default), or bf16 autocast as a training run's final evaluation "
                        "does where the recipe trains in bf16")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    if len(args.models) < 2 or args.repeats < 1 or len(args.models) * args.repeats < 3:
        p.error("an interval needs 2 or more models and 3 or more timed evaluations of each setting")
    device = resolve_device(args.device)
    settings: list[float | None] = [None, *args.fractions, *([] if args.no_plain else [0.0])]
    accuracy = {s: [] for s in settings}
    seconds = {s: [] for s in settings}
    levels = set()
    for m, path in enumerate(args.models):
        model = load(path, device)
        levels.add(model.tta_level)
        data = evaluation_data(model, path, args.dataset, data_dir=args.data_dir)
        x = ((data.test_images.to(device).float() / 255 - model.mean.view(1, -1, 1, 1)) / model.std.view(1, -1, 1, 1))
        labels = data.test_labels.to(device)
        score(model.net, x[:BATCH], labels[:BATCH], model.tta_level, None, device, args.precision)  # untimed
        for r in range(args.repeats):
            order = settings[(m + r) % len(settings):] + settings[:(m + r) % len(settings)]
            for s in order:
                acc, secs = score(model.net, x, labels, model.tta_level, s, device, args.precision)
                if r == 0:
                    accuracy[s].append(acc)
                seconds[s].append(secs)
                print(f"{Path(path).name} repeat {r + 1}: {setting_name(s)} {100 * acc:.2f}% {secs:.2f} s",
                      file=sys.stderr)
    if len(levels) != 1:
        p.error(f"the models have different TTA levels {sorted(levels)}: compare models of one recipe")
    rows = []
    for s in settings:
        diffs = [a - f for a, f in zip(accuracy[s], accuracy[None])]
        rows.append({"setting": setting_name(s), "fraction": s,
                     "accuracy": summarize(accuracy[s], FRACTION).to_dict(), "accuracies": accuracy[s],
                     "accuracy_diff": None if s is None else summarize(diffs).to_dict(),
                     "seconds": summarize(seconds[s], (0.0, float("inf"))).to_dict(), "all_seconds": seconds[s],
                     "time_ratio": None if s is None else list(ratio_ci95(seconds[s], seconds[None]))})
    report = {"benchmark": "selective_tta", "command": " ".join(["python", *sys.argv]), "models": len(args.models),
              "precision": args.precision,
              "model_paths": args.models, "dataset": args.dataset, "tta_level": levels.pop(),
              "repeats": args.repeats, "rows": rows, "environment": environment(device)}
    print(markdown(report))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
