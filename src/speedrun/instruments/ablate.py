"""`speedrun ablate RECIPE`: which trick bought how much? Each trick the family registers (TRICKS: its config
switch and its "off" value, in one place per family) is switched off alone, n runs each, interleaved with the
baseline (bench.py does the measuring); the table is sorted by contribution: how much accuracy is lost without it
(baseline minus ablated, with the 95% Welch interval and p), and how the time changes. A trick already off in the
recipe (cutout in cifar10-94, compile on a CPU) is listed as such, not measured.

`--waterfall ORDER` tells the cumulative story instead, as Page's "How to train your ResNet" posts and the airbench
paper do: start from a plain baseline with every trick in ORDER off, then switch them on one at a time in that
order; each row shows what its trick bought over the row before (95% CI, p) and the time it changed. The last
row is the recipe itself.

`--to-target` asks how long each variant (the baseline and each trick off alone, as above) needs to train to reach
the recipe's target accuracy: a bounded search over epochs per variant, all variants in lockstep (to_target.py).

The variants (which tricks are on, which already off on the device that runs) are variants.py's, shared with
to_target.py.
"""

from __future__ import annotations

from speedrun.engine.system import resolve_device
from speedrun.instruments import bench as benching
from speedrun.instruments.variants import set_text, split_tricks
from speedrun.recipes import get_recipe
from speedrun.records.stats import mean_diff_test
from speedrun.run.prepared import RunRequest, make_config


def ablate(request: RunRequest, *, runs: int = 3, **bench_kwargs) -> dict:
    """The bench report of every registered trick switched off, with "tricks" rows sorted by contribution;
    bench_kwargs: bench()'s seed, log and tensorboard. Stopped part way: bench's PartialReport, its report given
    the rows of what finished."""
    rec = get_recipe(request.recipe)
    family = rec.module()
    base = make_config(rec, request.epochs, request.overrides)
    dev = resolve_device(request.device)
    idle = family.idle_tricks(base)
    measured, off = split_tricks(family.TRICKS, base, dev, idle)
    already_off = [{"trick": key, "off": value, "what": what, "measured": False, "idle": key in idle}
                   for key, value, what in off]

    def trick_rows(report: dict) -> None:
        report["benchmark"] = "ablate"
        by_name = {s["name"].split("=")[0]: s for s in report["settings"][1:]}
        rows = []
        for key, off, what in measured:
            s = by_name.get(key)
            v = (s or {}).get("versus_baseline") or {}
            acc, secs = v.get("accuracy"), v.get("train_seconds")
            rows.append({"trick": key, "off": off, "what": what, "measured": s is not None,
                         # contribution: what the trick adds = baseline - ablated (the negated difference)
                         "gain_accuracy": None if acc is None else -acc["diff"],
                         "gain_ci95": None if acc is None else [-acc["ci95"][1], -acc["ci95"][0]],
                         "p": None if acc is None else acc["p"],
                         "time_ratio_off": None if secs is None else secs["ratio"]})
        rows.sort(key=lambda r: -(r["gain_accuracy"] if r["gain_accuracy"] is not None else float("-inf")))
        report["tricks"] = rows + already_off

    return benching.bench_then(trick_rows, request, vary=[(key, [set_text(value)]) for key, value, _ in measured],
                               runs=runs, kind="ablate", **bench_kwargs)


def waterfall(request: RunRequest, order: list[str], *, runs: int = 3, **bench_kwargs) -> dict:
    """A plain start (every trick in `order` off), then the tricks switched on one at a time, cumulatively.
    Stopped part way: bench's PartialReport, its report given the rows of what finished."""
    recipe = request.recipe
    rec = get_recipe(recipe)
    family = rec.module()
    offs = {key: off for key, off, _ in family.TRICKS}
    unknown = [key for key in order if key not in offs]
    if unknown or len(set(order)) != len(order) or not order:
        raise ValueError(f"--waterfall takes distinct registered tricks, comma-separated; unknown or repeated: "
                         f"{', '.join(unknown) or ', '.join(order)}; registered: {', '.join(offs)}")
    base = make_config(rec, request.epochs, request.overrides)
    dev = resolve_device(request.device)
    _, off_in_base = split_tricks([t for t in family.TRICKS if t[0] in order], base, dev, family.idle_tricks(base))
    already = [key for key in order if key in {t[0] for t in off_in_base}]
    if already:
        idle = " or does nothing for the network " + base.model if family.idle_tricks(base) else ""
        raise ValueError(f"{', '.join(already)} is already off in {recipe} on {dev.type}{idle}: leave it out of "
                         "--waterfall")
    text = {key: set_text(off) for key, off in offs.items()}
    steps, off = [], {key: text[key] for key in order}
    steps.append(("plain (all off)", dict(off)))
    for key in order:
        off.pop(key)
        steps.append((f"+ {key}", dict(off)))

    def step_rows(report: dict) -> None:
        report["benchmark"] = "waterfall"
        report["tricks_added"], rows, previous = order, [], None
        for s in report["settings"]:
            done = [r for r in s["runs"] if r["diverged"] is None]
            bought = None
            if previous is not None and len(done) >= 2 and len(previous) >= 2:
                try:
                    bought = {key: mean_diff_test([r[key] for r in done], [r[key] for r in previous])
                              for key in ("accuracy", "train_seconds")}
                except ValueError:
                    bought = None
            rows.append({"step": s["name"], "accuracy": s["accuracy"], "train_seconds": s["train_seconds"],
                         "bought": bought})
            previous = done
        report["waterfall"] = rows

    return benching.bench_then(step_rows, request, steps=steps, runs=runs, kind="waterfall", **bench_kwargs)
