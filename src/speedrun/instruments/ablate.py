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

"Already off" is judged on the device that runs: `precision=auto` is fp32 on a CPU, so switching bf16 off there
would train the baseline again under another name (three wasted runs per row on this machine's CPU).
"""

from __future__ import annotations

import sys


def effective(key: str, value, device, base):
    """What a switch's value means on `device` in `base`'s family: the shared "auto" settings resolved as the run
    resolves them (engine.setup_system: precision=auto is fp32 on a CPU; channels_last=auto is off on a CPU for
    a family that says so)."""
    import dataclasses

    from speedrun.engine.system import setup_system

    if key in ("precision", "channels_last"):
        system = setup_system(dataclasses.replace(base, **{key: value}), device)
        return system.dtype if key == "precision" else system.channels_last
    return value


def off_text(off) -> str:
    """A TRICKS "off" value as --set and --vary take it (False -> "false")."""
    return str(off).lower() if isinstance(off, bool) else str(off)


Trick = tuple[str, object, str]  # (config key, its "off" value, what it is): a family's TRICKS entry


def split_tricks(tricks: list[Trick], base, dev) -> tuple[list[Trick], list[Trick]]:
    """`tricks` as (on in `base`, already off in `base`), judged by what each value means on `dev`."""
    def is_off(key: str, off) -> bool:
        return effective(key, getattr(base, key), dev, base) == effective(key, off, dev, base)

    return [t for t in tricks if not is_off(t[0], t[1])], [t for t in tricks if is_off(t[0], t[1])]


def ablate(recipe: str, *, runs: int = 3, **bench_kwargs) -> dict:
    """The bench report of every registered trick switched off, with "tricks" rows sorted by contribution."""
    from speedrun.instruments import bench as benching
    from speedrun.run import runner as runner
    from speedrun.engine.system import resolve_device

    rec = runner.get_recipe(recipe)
    family = rec.module()
    base = runner.make_config(rec, bench_kwargs.get("epochs"), dict(bench_kwargs.get("overrides") or {}))
    dev = resolve_device(bench_kwargs.get("device", "auto"))
    measured, off = split_tricks(family.TRICKS, base, dev)
    already_off = [{"trick": key, "off": value, "what": what, "measured": False} for key, value, what in off]
    report = benching.bench(recipe, vary=[(key, [off_text(value)]) for key, value, _ in measured], runs=runs,
                            **bench_kwargs)
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
    return report


def waterfall(recipe: str, order: list[str], *, runs: int = 3, **bench_kwargs) -> dict:
    """A plain start (every trick in `order` off), then the tricks switched on one at a time, cumulatively."""
    from speedrun.instruments import bench as benching
    from speedrun.run import runner as runner
    from speedrun.engine.system import resolve_device
    from speedrun.records.stats import mean_diff_test

    rec = runner.get_recipe(recipe)
    family = rec.module()
    offs = {key: off for key, off, _ in family.TRICKS}
    unknown = [key for key in order if key not in offs]
    if unknown or len(set(order)) != len(order) or not order:
        raise ValueError(f"--waterfall takes distinct registered tricks, comma-separated; unknown or repeated: "
                         f"{', '.join(unknown) or ', '.join(order)}; registered: {', '.join(offs)}")
    base = runner.make_config(rec, bench_kwargs.get("epochs"), dict(bench_kwargs.get("overrides") or {}))
    dev = resolve_device(bench_kwargs.get("device", "auto"))
    _, off_in_base = split_tricks([t for t in family.TRICKS if t[0] in order], base, dev)
    already = [key for key in order if key in {t[0] for t in off_in_base}]
    if already:
        raise ValueError(f"{', '.join(already)} is already off in {recipe} on {dev.type}: leave it out of --waterfall")
    text = {key: off_text(off) for key, off in offs.items()}
    steps, off = [], {key: text[key] for key in order}
    steps.append(("plain (all off)", dict(off)))
    for key in order:
        off.pop(key)
        steps.append((f"+ {key}", dict(off)))
    report = benching.bench(recipe, steps=steps, runs=runs, **bench_kwargs)
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
    return report


def _waterfall_lines(report: dict) -> list[str]:
    from speedrun.instruments.bench import interval_text, mean_std

    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): tricks added one at a time, "
             f"{report['runs']} interleaved round(s) per row",
             f"{'step':24} {'test acc %':>16} {'bought (points, 95% CI)':>28} {'p':>8} {'timed s':>14}"]
    for row in report["waterfall"]:
        b = row["bought"]
        if b is None:
            gain, p = ("-" if row is report["waterfall"][0] else "n/a"), ""
        else:
            d = b["accuracy"]
            gain, p = interval_text(d["diff"], d["ci95"], 100), f"{d['p']:.3g}"
        secs = "n/a" if row["train_seconds"] is None else f"{row['train_seconds']['mean']:.2f}"
        lines.append(f"{row['step'][:24]:24} {mean_std(row['accuracy'], 100):>16} {gain:>28} {p:>8} {secs:>14}")
    return lines


def _lines(report: dict) -> list[str]:
    from speedrun.instruments.bench import interval_text

    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): each trick off alone, "
             f"{report['runs']} interleaved round(s); gain = baseline - trick off",
             f"{'trick':20} {'off value':>10} {'gain (acc points, 95% CI)':>30} {'p':>8} {'time off/on':>12}  what"]
    for r in report["tricks"]:
        if not r["measured"]:
            gain, p, ratio = "already off", "", ""
        elif r["gain_accuracy"] is None:
            gain, p, ratio = "n/a (needs 2+ runs)", "", ""
        else:
            gain = interval_text(r["gain_accuracy"], r["gain_ci95"], 100)
            p = f"{r['p']:.3g}"
            ratio = "-" if r["time_ratio_off"] is None else f"{r['time_ratio_off']:.3f}"
        lines.append(f"{r['trick']:20} {str(r['off']):>10} {gain:>30} {p:>8} {ratio:>12}  {r['what']}")
    return lines


def ablate_command(args, argv: list[str]) -> int:
    from speedrun.instruments.bench import run_and_store
    from speedrun.config import parse_set_args

    if args.to_target and args.waterfall is not None:
        raise ValueError("--to-target and --waterfall are two different questions: ask one per command")
    if args.max_probes is not None and not args.to_target:
        raise ValueError("--max-probes bounds the --to-target search: add --to-target")
    if args.to_target:
        from speedrun.instruments.to_target import to_target_command

        return to_target_command(args, argv)
    overrides = parse_set_args(args.overrides)
    order = None if args.waterfall is None else [k.strip() for k in args.waterfall.split(",") if k.strip()]

    def make(log):
        common = dict(runs=args.runs, dataset=args.dataset, device=args.device, seed=args.seed, epochs=args.epochs,
                      data_dir=args.data_dir, overrides=overrides, log=log)
        return waterfall(args.recipe, order, **common) if order is not None else ablate(args.recipe, **common)

    from speedrun.instruments.bench import diverged_exit

    report, path, stored = run_and_store(args, argv, "waterfall" if order is not None else "ablate", make)
    if path is None:  # a torchrun process other than rank 0
        return diverged_exit(report, quiet=True)
    print("\n".join(_waterfall_lines(report) if order is not None else _lines(report)))
    print(f"report: {path} (stored as #{stored})", file=sys.stderr)
    return diverged_exit(report)
