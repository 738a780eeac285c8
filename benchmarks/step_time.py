"""Seconds per training step of a recipe's network, for config variants measured side by side.

    python benchmarks/step_time.py --device cpu --threads 1 --batch-size 256 --steps 8 \
        --variant channels_last=off --variant channels_last=on

Each --variant is one set of config overrides (space-separated KEY=VALUE, as `speedrun train --set`). A step is
the recipe's own `train_step` (forward under the variant's autocast, label-smoothed loss, backward, optimizer
step), on random inputs in the variant's dtype and memory layout (speed only: nothing is learned). After one
untimed step of each variant, the variants take turns (A B A B ...) so drift and background load hit them alike.
Each step is timed alone with device synchronization (CUDA events on GPUs). Reported per variant: mean ± std of
the step seconds, the 95% t-interval, and the ratio of its mean to the first variant's (95% CI, delta method).

Not the recipe's timed region (no data loading, augmentation, Lookahead or evaluation): a microbenchmark for one
decision at a time, such as a default layout or precision on one machine.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from speedrun.config import parse_set_args
from speedrun.engine.loop import Timer
from speedrun.engine.system import resolve_device, seed_everything
from speedrun.recipes.cifar import build_model, build_optimizers, train_step
from speedrun.records.environment import device_label, environment
from speedrun.records.result_file import write_json
from speedrun.records.stats import mean_std_text
from speedrun.run.runner import get_recipe, make_config
from speedrun.records.stats import ratio_ci95, summarize
from speedrun.tricks.precision import (DTYPES, autocast, maybe_compile, resolve_channels_last, resolve_precision,
                                      to_channels_last)


class Variant:
    """One config's network, optimizers and a fixed random batch, ready to step."""

    def __init__(self, spec: str, recipe: str, device: torch.device, batch_size: int, image_shape: tuple[int, ...],
                 num_classes: int):
        self.spec = spec
        self.cfg = make_config(get_recipe(recipe), None, parse_set_args(shlex.split(spec)))
        self.device = device
        self.precision = resolve_precision(self.cfg.precision, device)
        self.channels_last = resolve_channels_last(self.cfg.channels_last, device)
        seed_everything(0)
        model = build_model(self.cfg, image_shape[0], num_classes).to(device)
        self.model = to_channels_last(model, self.channels_last)
        self.forward = maybe_compile(self.model, self.cfg.compile, self.cfg.compile_mode)
        self.optimizers = build_optimizers(self.cfg, self.model)
        x = torch.randn(batch_size, *image_shape, device=device).to(DTYPES[self.precision])
        self.inputs = x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
        self.targets = torch.randint(0, num_classes, (batch_size,), device=device)

    def step(self) -> float:
        timer = Timer(self.device)
        timer.start()
        train_step(self.forward, self.optimizers, self.inputs, self.targets, self.cfg.label_smoothing,
                   lambda: autocast(self.device, self.precision))
        return timer.stop()

    def describe(self) -> str:
        return f"{self.spec or '(recipe defaults)'} [{self.precision}, {'NHWC' if self.channels_last else 'NCHW'}]"


def measure(args: argparse.Namespace, command: str) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    try:
        shape = tuple(int(v) for v in args.image_shape.split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--image-shape must be CxHxW, e.g. 3x32x32, got {args.image_shape!r}")
    variants = [Variant(v, args.recipe, device, args.batch_size, shape, args.num_classes) for v in args.variant]
    for v in variants:
        v.step()  # untimed: first-call allocations, cuDNN autotuning, compilation
    seconds: list[list[float]] = [[] for _ in variants]
    for _ in range(args.steps):
        for v, out in zip(variants, seconds):
            out.append(v.step())
    rows = []
    for v, out in zip(variants, seconds):
        ratio = dict(zip(("value", "ci95_low", "ci95_high"), ratio_ci95(out, seconds[0])))  # first: 1 by definition
        rows.append({"variant": v.spec, "resolved": v.describe(), "seconds": out,
                     "summary": summarize(out).to_dict(), "ratio_to_first": ratio})
    return {"benchmark": "step_time", "command": command, "recipe": args.recipe, "batch_size": args.batch_size,
            "image_shape": list(shape), "steps_per_variant": args.steps, "threads": torch.get_num_threads(),
            "variants": rows, "environment": environment(device)}


def markdown(report: dict) -> str:
    env, cmd = report["environment"], report["command"].replace("|", "\\|")
    lines = ["| date | device | command | variant | n | step s (mean ± std) | ratio to first (95% CI) |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(report["variants"]):
        s, q = r["summary"], r["ratio_to_first"]
        ratio = "1 (reference)" if i == 0 else f"{q['value']:.3f} ({q['ci95_low']:.3f} to {q['ci95_high']:.3f})"
        lines.append(f"| {env['timestamp_utc'][:10]} | {device_label(env)} | `{cmd}` | {r['resolved']} | {s['n']} | "
                     f"{mean_std_text(s, 1, 4)} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="'KEY=VALUE ...'",
                   help="config overrides of one variant (repeat for each; the first is the reference)")
    p.add_argument("--recipe", default="cifar10-94")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--image-shape", default="3x32x32", help="CxHxW of the random inputs (default 3x32x32)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--out", help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.steps < 2 or args.batch_size < 1 or args.threads < 0:
        p.error("--steps must be >= 2, --batch-size >= 1 and --threads >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = "python benchmarks/step_time.py " + shlex.join(argv)
    try:
        report = measure(args, command)
    except ValueError as e:  # bad config keys or values, an unavailable device, a malformed --image-shape
        print(f"step_time.py: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_json(Path(args.out), report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
