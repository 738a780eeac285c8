"""The commands that train or score a model: train, bench, ablate (--waterfall, --to-target), eval, predict and
bench-loader. Loading this module imports torch, the recipes and the data (a second or more), so program.py loads
it only when one of these commands runs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from speedrun import dist
from speedrun.cli.output import EXIT_DIVERGED, err, out
from speedrun.cli.user_model import given_builder, overrides_of, refuse_model_key
from speedrun.config import check_int
from speedrun.data.folder import IMAGE_EXTENSIONS
from speedrun.engine.peak import datasheet
from speedrun.engine.peak import mfu_text as peak_text
from speedrun.engine.peak import peak_kept
from speedrun.engine.system import resolve_device
from speedrun.errors import counted
from speedrun.instruments.ablate import ablate, waterfall
from speedrun.instruments.bench import bench, recipe_vary, run_and_store
from speedrun.instruments.bench_loader import TIMED_REGION, Rounds, bench_loader, int_list, rate_text, versus_text
from speedrun.instruments.profile import profile
from speedrun.instruments.to_target import DEFAULT_PROBES, MAX_PROBES, MIN_PROBES, to_target
from speedrun.instruments.tune import tune
from speedrun.instruments.variants import set_text
from speedrun.records.db import default_db_path
from speedrun.records.environment import environment
from speedrun.records.result_file import claim_result_path, release_result_path, write_json
from speedrun.records.settings_file import write_settings
from speedrun.records.stats import interval_text, mean_std_text, ratio_text
from speedrun.run import runner as runs
from speedrun.run.display import EvalProgress
from speedrun.run.ensemble import evaluate_ensemble, iter_ensemble_predictions
from speedrun.run.export import evaluate_saved, iter_predictions, model_paths
from speedrun.run.prepared import RunRequest
from speedrun.tricks.precision import set_cpu_threads


def _stored_text(stored: int | None) -> str:
    """Where a report went besides its file: its database id, or that storing it failed (a warning said why)."""
    return "not stored in the results database" if stored is None else f"stored as #{stored}"


def _log(line: str) -> None:
    """Progress lines go to stderr: stdout carries the command's table or answer alone."""
    err(line)


def _report_to(json_arg: str | None, make) -> tuple[dict, Path | None]:
    """make() the report and write it to the file `json_arg` names, if any: claimed first (an existing file fails
    before any work) and released if nothing was written (an error, Ctrl-C)."""
    path = claim_result_path(json_arg) if json_arg is not None else None  # "" is refused there, not ignored
    written = False
    try:
        report = make()
        if path is not None:
            write_json(path, report)
            written = True
    finally:
        if path is not None and not written:
            release_result_path(path)
    return report, path


def train_command(args, argv: list[str]) -> int:
    overrides = overrides_of(args)
    result = runs.train(args.recipe, args.dataset, device=args.device, epochs=args.epochs, runs=args.runs,
                        seed=args.seed, data_dir=args.data_dir, image_size=args.image_size,
                        json_path="auto" if args.json is None else args.json, verbose=not args.quiet,
                        summary="lines" if args.quiet else True,
                        smoke=args.smoke,
                        command=dist.command_line(argv), checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                        resume=args.resume, save=args.save, price_per_hour=args.price_per_hour,
                        db=args.db or default_db_path(), strict=args.strict, settings=args.settings,
                        tensorboard=args.tensorboard, overrides=overrides)
    return EXIT_DIVERGED if result.diverged_runs else 0


def _run_and_store(args, argv: list[str], kind: str, make) -> tuple[dict, Path | None, int | None]:
    """run_and_store with the flags that bench, ablate and ablate --to-target share."""
    return run_and_store(make, kind=kind, recipe=args.recipe, dataset=args.dataset, device=args.device,
                         db_path=args.db, json_path=args.json, command=dist.command_line(argv), log=_log,
                         strict=args.strict)


def diverged_exit(report: dict, quiet: bool = False) -> int:
    """3 when a run diverged (as `speedrun train`), each setting's count on stderr unless quiet; else 0."""
    bad = [(s["name"], s["diverged"]) for s in report["settings"] if s["diverged"]]
    for name, count in [] if quiet else bad:
        are = "is" if count == 1 else "are"
        err(f"speedrun: warning: {name}: {counted(count, 'run')} diverged (NaN/inf loss) and {are} not in its "
            "statistics")
    return EXIT_DIVERGED if bad else 0


# How bench, ablate and tune order their runs (bench.round_orders), as their tables' first line says.
_BALANCED = "the order within rounds rotated from a shuffle seeded by --seed, so no setting always runs first"


def _bench_lines(report: dict) -> list[str]:
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}), {counted(report['runs'], 'round')} "
             f"after an untimed warm-up of each setting, {_BALANCED}; against the baseline: difference (95% CI), "
             "Welch p, time ratio (95% CI)",
             f"{'setting':28} {'n':>3} {'div':>3} {'test acc %':>14} {'timed s':>14} {'Δ acc points':>24} "
             f"{'p':>8} {'time ratio':>22}"]
    for s in report["settings"]:
        v = s["versus_baseline"]
        acc, secs = (v or {}).get("accuracy"), (v or {}).get("train_seconds")
        dacc = ("-" if s["name"] == "baseline" else "n/a" if acc is None
                else interval_text(acc["diff"], acc["ci95"], 100))
        p = "-" if acc is None else f"{acc['p']:.3g}"
        ratio = "-" if s["name"] == "baseline" else "n/a" if secs is None else ratio_text(secs)
        lines.append(f"{s['name'][:28]:28} {s['n']:>3} {s['diverged']:>3} {mean_std_text(s['accuracy'], 100):>14} "
                     f"{mean_std_text(s['train_seconds']):>14} "
                     f"{dacc:>24} {p:>8} {ratio:>22}")
    return lines


def _request(args, overrides: dict[str, Any]) -> RunRequest:
    """What a training command's flags ask for (recipe, --dataset, --device, --epochs, --set, --data-dir)."""
    return RunRequest(args.recipe, args.dataset, args.device, args.epochs, overrides, args.data_dir)


def bench_command(args, argv: list[str]) -> int:
    vary, overrides = recipe_vary(args.recipe, args.vary), overrides_of(args)
    refuse_model_key({key for key, _ in vary}, "--vary")
    report, path, stored = _run_and_store(args, argv, "bench", lambda log: bench(
        _request(args, overrides), vary=vary, runs=args.runs, seed=args.seed, log=log, tensorboard=args.tensorboard))
    if path is None:  # a torchrun process other than rank 0
        return diverged_exit(report, quiet=True)
    for line in _bench_lines(report):
        out(line)
    err(f"report: {path} ({_stored_text(stored)}); order: "
        + " ".join(o["setting"] for o in report["order"][:12]) + (" ..." if len(report["order"]) > 12 else ""))
    return diverged_exit(report)


def _waterfall_lines(report: dict) -> list[str]:
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): tricks added one at a time, "
             f"{counted(report['runs'], 'round')} per row after an untimed warm-up of each, {_BALANCED}",
             f"{'step':24} {'test acc %':>16} {'bought (points, 95% CI)':>28} {'p':>8} {'timed s':>14}"]
    for row in report["waterfall"]:
        b = row["bought"]
        if b is None:
            gain, p = ("-" if row is report["waterfall"][0] else "n/a"), ""
        else:
            d = b["accuracy"]
            gain, p = interval_text(d["diff"], d["ci95"], 100), f"{d['p']:.3g}"
        secs = "n/a" if row["train_seconds"] is None else f"{row['train_seconds']['mean']:.2f}"
        lines.append(f"{row['step'][:24]:24} {mean_std_text(row['accuracy'], 100):>16} {gain:>28} {p:>8} {secs:>14}")
    return lines


def _ablate_lines(report: dict) -> list[str]:
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): each trick off alone, "
             f"{counted(report['runs'], 'round')} after an untimed warm-up of each, {_BALANCED}; gain = baseline - "
             "trick off",
             f"{'trick':20} {'off value':>10} {'gain (acc points, 95% CI)':>30} {'p':>8} {'time off/on':>12}  what"]
    for r in report["tricks"]:
        if not r["measured"]:
            gain, p, ratio = "not in this network" if r.get("idle") else "already off", "", ""
        elif r["gain_accuracy"] is None:
            gain, p, ratio = "n/a (needs 2+ runs)", "", ""
        else:
            gain = interval_text(r["gain_accuracy"], r["gain_ci95"], 100)
            p = f"{r['p']:.3g}"
            ratio = "-" if r["time_ratio_off"] is None else f"{r['time_ratio_off']:.3f}"
        lines.append(f"{r['trick']:20} {str(r['off']):>10} {gain:>30} {p:>8} {ratio:>12}  {r['what']}")
    return lines


def ablate_command(args, argv: list[str]) -> int:
    if args.to_target and args.waterfall is not None:
        raise ValueError("--to-target and --waterfall are two different questions: ask one per command")
    if args.max_probes is not None and not args.to_target:
        raise ValueError("--max-probes bounds the --to-target search: add --to-target")
    if args.to_target and args.tensorboard is not None:
        raise ValueError("--tensorboard logs the runs of ablate and --waterfall, not the --to-target search: leave "
                         "out one of them")
    if args.to_target:
        return to_target_command(args, argv)
    overrides = overrides_of(args)
    order = None if args.waterfall is None else [k.strip() for k in args.waterfall.split(",") if k.strip()]

    def make(log):
        request = _request(args, overrides)
        common = dict(runs=args.runs, seed=args.seed, log=log, tensorboard=args.tensorboard)
        return waterfall(request, order, **common) if order is not None else ablate(request, **common)

    report, path, stored = _run_and_store(args, argv, "waterfall" if order is not None else "ablate", make)
    if path is None:  # a torchrun process other than rank 0
        return diverged_exit(report, quiet=True)
    for line in _waterfall_lines(report) if order is not None else _ablate_lines(report):
        out(line)
    err(f"report: {path} ({_stored_text(stored)})")
    return diverged_exit(report)


def _target_lines(report: dict) -> list[str]:
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): epochs to reach "
             f"{report['target_accuracy'] * 100:.2f}% mean test accuracy over {counted(report['runs'], 'run')}, at "
             f"most {report['max_probes']} probes per variant, variants in lockstep",
             f"{'variant':28} {'epochs needed':>13} {'timed s':>9} {'vs baseline':>11} {'probes':>6}  search"]
    base = report["variants"][0]["epochs_needed"] if report["variants"] else None
    for v in report["variants"]:
        needed = v["epochs_needed"]
        ratio = ("-" if v["name"] == "baseline" else "n/a" if needed is None or base is None
                 else f"{needed / base:.3f}")
        if needed is None:
            best = "n/a" if v["best_accuracy"] is None else f"{v['best_accuracy'] * 100:.2f}%"
            up_to = "n/a" if v["searched_up_to_epochs"] is None else f"{v['searched_up_to_epochs']:.4g}"
            what = f"not reached at <= {up_to} epochs (best {best})"
        elif v["missed_epochs"] is not None:
            what = f"in ({v['missed_epochs']:.4g}, {needed:.4g}] epochs" + (
                ": one step wide" if v["exact"] else "; more --max-probes narrow it")
        else:
            what = ("reached at every probe, down to the search's floor" if v["exact"] else
                    "reached at every probe; more --max-probes go shorter")
        if not v["search_complete"]:
            what += "; cut short"
        secs = "n/a" if v["seconds_needed"] is None else f"{v['seconds_needed']:.2f}"
        shown = "n/a" if needed is None else f"{needed:.4g}"
        lines.append(f"{v['name'][:28]:28} {shown:>13} {secs:>9} {ratio:>11} {len(v['probes']):>6}  {what}")
    for off in report["already_off"]:
        name = f"{off['trick']}={set_text(off['off'])}"
        lines.append(f"{name:28} already off (recipe, --set or device): not searched")
    return lines


def to_target_command(args, argv: list[str]) -> int:
    overrides = overrides_of(args)
    max_probes = DEFAULT_PROBES if args.max_probes is None else args.max_probes
    # checked before run_and_store opens the database and claims the report file
    check_int("max_probes", "--max-probes", max_probes, MIN_PROBES, MAX_PROBES)
    report, path, stored = _run_and_store(args, argv, "to-target", lambda log: to_target(
        _request(args, overrides), runs=args.runs, max_probes=max_probes, seed=args.seed, log=log))
    bad = [(v["name"], v["diverged"]) for v in report["variants"] if v["diverged"]]
    if path is None:  # a torchrun process other than rank 0
        return EXIT_DIVERGED if bad else 0
    for line in _target_lines(report):
        out(line)
    err(f"report: {path} ({_stored_text(stored)}); order: "
        + " ".join(f"{o['variant']}@{o['steps']}" for o in report["order"][:12])
        + (" ..." if len(report["order"]) > 12 else ""))
    for name, count in bad:
        err(f"speedrun: warning: {name}: {counted(count, 'run')} diverged (NaN/inf loss); each made its probe a miss")
    return EXIT_DIVERGED if bad else 0


def eval_command(args, argv: list[str] | None = None) -> int:
    """`speedrun eval MODEL --dataset D [--json FILE]`: one line on stdout; progress on stderr. With --ensemble
    M1 M2 ...: a table of each model's accuracy and the ensemble's (ensemble_eval)."""
    with given_builder(args):
        return _eval(args, argv)


def _eval(args, argv: list[str] | None) -> int:
    ensemble = getattr(args, "ensemble", None)
    if ensemble is not None and args.model is not None:
        raise ValueError(f"give either MODEL ({args.model}) or --ensemble MODEL MODEL ..., not both: with "
                         "--ensemble, name every model after it")
    if ensemble is not None:
        return ensemble_eval(args, argv)
    if args.model is None:
        raise ValueError("give a saved model: speedrun eval MODEL --dataset D (or --ensemble MODEL MODEL ...)")
    quiet = getattr(args, "quiet", False)
    result, _ = _report_to(getattr(args, "json", None), lambda: evaluate_saved(
        args.model, args.dataset, data_dir=args.data_dir, image_size=args.image_size, device=args.device,
        log=None if quiet else _log, progress=lambda total: EvalProgress(not quiet, total)))
    if result["smoke_test"]:
        err(_SMOKE_MODEL.format(model=args.model, what="accuracy means"))
    out(f"accuracy {100 * result['accuracy']:.2f}% on {result['dataset']} test ({result['n']} images, "
        f"TTA level {result['tta_level']})" + (" -- a smoke test's model" if result["smoke_test"] else ""))
    return 0


_SMOKE_MODEL = ("note: {model} was saved by a smoke test (speedrun train --smoke: a few steps), so its {what} "
                "nothing; train without --smoke for a real model")


def ensemble_eval(args, argv: list[str] | None = None) -> int:
    """`speedrun eval --ensemble M1 M2 ... --dataset D`: per model and for the ensemble, the accuracy and the
    evaluation seconds on stdout; what is timed on stderr."""
    quiet = getattr(args, "quiet", False)
    def make() -> dict:
        report = evaluate_ensemble(args.ensemble, args.dataset, data_dir=args.data_dir, image_size=args.image_size,
                                   device=args.device, log=None if quiet else _log,
                                   progress=lambda total: EvalProgress(not quiet, total))
        return {**report, "command": None if argv is None else shlex.join(["speedrun", *argv])}

    report, path = _report_to(getattr(args, "json", None), make)
    for row in report["models"]:
        if row["smoke_test"]:
            err(_SMOKE_MODEL.format(model=row["model"], what="accuracy means"))
    e = report["ensemble"]
    width = max(24, *(len(r["model"]) for r in report["models"]))
    out(f"ensemble of {e['n_models']} models on {report['dataset']} test ({report['n']} images, {report['device']})")
    out(f"{'model':{width}} {'TTA':>3} {'accuracy %':>10} {'eval s':>9}")
    for r in report["models"]:
        out(f"{r['model']:{width}} {r['tta_level']:>3} {100 * r['accuracy']:>10.2f} {r['seconds']:>9.3f}"
            + (" smoke test" if r["smoke_test"] else ""))
    ratio = "" if e["time_ratio"] is None else f", {e['time_ratio']:.2f}x"
    out(f"{'ensemble (mean softmax)':{width}} {'':>3} {100 * e['accuracy']:>10.2f} {e['seconds']:>9.3f} "
        f"(+{e['extra_seconds']:.3f} s over one model's mean{ratio})")
    if not quiet:
        err(f"timed: {report['timed']}" + (f"; report: {path}" if path else ""))
    return 0


def _predict_inputs(args) -> tuple[list[str] | None, list[str]]:
    """(the ensemble's models or None, the image files) from `predict`'s words: with --ensemble, every
    positional word is an image (`predict IMAGE... --ensemble M M` or `predict --ensemble M M -- IMAGE...`)."""
    ensemble = getattr(args, "ensemble", None)
    positional = ([] if args.model is None else [args.model]) + list(args.images)
    if ensemble is None:
        if args.model is None or not args.images:
            raise ValueError("give a saved model and image files: speedrun predict MODEL IMAGE... (or --ensemble "
                             "MODEL MODEL ... -- IMAGE...)")
        return None, list(args.images)
    for word in ensemble:  # images swallowed by --ensemble, which takes every word up to the next flag
        if word.lower().endswith(IMAGE_EXTENSIONS) and not model_paths(word)[0].exists():
            raise ValueError(f"--ensemble took the image {word} as a model: give the images before --ensemble "
                             "(speedrun predict IMAGE... --ensemble MODEL MODEL) or after -- (speedrun predict "
                             "--ensemble MODEL MODEL -- IMAGE...)")
    if not positional:
        raise ValueError("give image files: speedrun predict IMAGE... --ensemble MODEL MODEL ...")
    return ensemble, positional


def predict_command(args) -> int:
    """`speedrun predict MODEL IMAGE... [--top K]`: `FILE: class p, class p, ...` per file on stdout, each batch
    as it is scored; a file that fails after some were printed says how many were. With --ensemble, the mean
    softmax of the models, noted on stderr."""
    with given_builder(args):
        return _predict(args)


def _predict(args) -> int:
    ensemble, images = _predict_inputs(args)

    def note_smoke(model) -> None:
        if model.smoke_test:
            err(_SMOKE_MODEL.format(model=args.model, what="predictions mean"))

    def note_ensemble(models) -> None:
        err(f"note: an ensemble of {len(models)} models ({', '.join(ensemble)}): each probability is the mean of "
            "their softmax")
        for path, model in zip(ensemble, models):
            if model.smoke_test:
                err(_SMOKE_MODEL.format(model=path, what="predictions mean"))

    if ensemble is None:
        predictions = iter_predictions(args.model, images, top=args.top, device=args.device, on_load=note_smoke)
    else:
        predictions = iter_ensemble_predictions(ensemble, images, top=args.top, device=args.device,
                                                on_load=note_ensemble)
    printed = 0
    try:
        for file, preds in predictions:
            out(f"{file}: " + ", ".join(f"{name} {p:.3f}" for name, p in preds), flush=True)
            printed += 1
    except ValueError as e:
        if printed:
            raise ValueError(f"{e} ({printed} of {counted(len(images), 'prediction')} printed above)") from None
        raise
    return 0


def bench_loader_command(args, argv: list[str] | None = None) -> int:
    workers = int_list(args.workers, "--workers", 0, 64)
    res = int_list(args.res, "--res", 8, 1024)

    def make() -> dict:
        rounds = Rounds(batch_size=args.batch, timed_batches=args.batches, runs=args.runs)
        report = bench_loader(args.dir, rounds, split=args.split, workers=workers, res=res, decode_px=args.decode_px,
                              device=args.device, baseline=args.baseline, decoder=args.decoder, log=_log)
        report["command"] = " ".join(["speedrun", *(sys.argv[1:] if argv is None else argv)])
        return report

    report, path = _report_to(args.json, make)
    out(f"{args.dir} ({report['split']}, {report['images']:,} images), batch {report['batch']}, "
        f"{report['batches']} timed batches, {counted(report['runs'], 'interleaved round')}, {report['device']}")
    out(f"{'pipeline':9} {'workers':>7} {'px':>5} {'n':>3} {'images/s':>14} {'start-up s':>10}  ours / baseline")
    for s in report["settings"]:
        out(f"{s['pipeline']:9} {s['workers']:>7} {s['res']:>5} {s['n']:>3} {rate_text(s['summary']):>14} "
            f"{np.mean(s['startup_s']):>10.2f}  {versus_text(s['versus_baseline'])}")
    err(f"timed: {TIMED_REGION}" + (f"; report: {path}" if path else ""))
    return 0


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.1f}"


def profile_lines(report: dict) -> list[str]:
    env = report["environment"]
    step = report["step_seconds"]
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}: {env['device_name']}), "
             f"{report['precision']}; {report['schedule']['active']} steps profiled after "
             f"{report['schedule']['wait'] + report['schedule']['warmup']} unrecorded",
             f"time per step: {_ms(step)} ms",
             f"  {'phase':24} {'ms/step':>10} {'share':>7}"]
    for name, seconds in report["phases_per_step_seconds"].items():
        lines.append(f"  {name:24} {_ms(seconds):>10} {100 * seconds / step if step else 0:>6.1f}%")
    lines.append(f"  {'final evaluation (once)':24} {_ms(report['evaluation_seconds']):>10}")
    total = sum(report["groups_self_seconds"].values()) or 1.0
    lines.append(f"operators' self time ({'the GPU kernels' if report['self_time_on'] == 'device' else 'CPU'}), by "
                 "layer type, over the profiled steps and the evaluation:")
    for group, seconds in report["groups_self_seconds"].items():
        lines.append(f"  {group:24} {_ms(seconds):>10} ms {100 * seconds / total:>6.1f}%")
    lines.append("top operators by self time:")
    for op in report["top_operators"]:
        lines.append(f"  {op['name'][:40]:40} {_ms(op['self_seconds']):>10} ms {op['calls']:>6} calls  {op['group']}")
    memory = report["peak_memory"]
    flops = report["flops"]
    lines += [f"peak memory: {memory['bytes'] / 2**30:.2f} GiB ({memory['what']})",
              f"FLOPs: a training step {flops['train_step'] / 1e9:,.1f} G, the final evaluation "
              f"{flops['evaluation'] / 1e9:,.1f} G; the recipe's whole run {flops['recipe_run'] / 1e12:,.2f} T "
              f"({flops['recipe_steps']} steps; convolutions and matmuls, torch.utils.flop_counter)",
              f"training steps: {peak_text(report['mfu_train'])}"]
    if report["mfu_evaluation"] is not None:
        lines.append(f"final evaluation: {peak_text(report['mfu_evaluation'])}")
    counted = report.get("launches") or {}
    if counted.get("counted"):
        step, epoch = counted["per_step"], counted["per_epoch"]
        lines.append(f"asked of a GPU (counted on the meta device): a step {step['kernels']} kernels, "
                     f"{step['host_to_device']} copies to it, {step['device_to_host']} host syncs (reads back), "
                     f"{step['data_dependent']} data-dependent syncs; an epoch of {counted['steps_per_epoch']} steps "
                     f"{epoch['host_to_device']} copies, {epoch['device_to_host']} host syncs, "
                     f"{epoch['data_dependent']} data-dependent")
        lines += [f"  {where}" for where in counted["where"]]
        lines += [f"  not lean: {problem}" for problem in counted["problems"]]
    elif counted:
        lines.append(f"asked of a GPU: {counted['why']}")
    return lines


def profile_command(args, argv: list[str]) -> int:

    def make() -> dict:
        request = RunRequest(args.recipe, args.dataset, args.device, None, overrides_of(args), args.data_dir,
                             args.image_size)
        report = profile(request, active=args.steps, seed=args.seed, trace="auto" if args.trace is None else args.trace,
                         strict=args.strict, log=_log)
        return {**report, "command": dist.command_line(argv)}

    report, json_path = _report_to(args.json, make)
    for line in profile_lines(report):
        out(line)
    err(f"trace: {report['trace']} (open it in https://ui.perfetto.dev or chrome://tracing)"
        + (f"; report: {json_path}" if json_path else ""))
    return 0


def peak_command(args) -> int:
    dev = resolve_device(args.device)
    if args.threads is not None:
        check_int("threads", "--threads", args.threads, 1, 1024)
    name = environment(dev)["device_name"]
    set_cpu_threads(dev, args.threads or 0)  # the fingerprint and the kernels see the count a run would use
    try:
        found, kept = peak_kept(dev, name, again=args.again, log=_log)
    finally:
        set_cpu_threads(dev, 0)
    out(f"{found['fingerprint']}: measured {found['measured_utc']}")
    for dtype, m in found["dtypes"].items():
        sheet = datasheet(name, dtype)
        kernels = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in m["kernels"].items())
        out(f"  {dtype:5} peak {m['flops_per_s'] / 1e9:>12,.1f} GFLOP/s ({kernels})  datasheet: "
            + ("none for this device" if sheet is None else f"{sheet[0] / 1e12:,.1f} TFLOP/s ({sheet[1]})"))
    if kept is not None:  # else a warning said why the figures are this command's only
        err(f"cached in {kept} (speedrun peak --again measures again)")
    return 0


def tune_lines(report: dict) -> list[str]:
    t = report["tune"]
    c = t["current"]
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): each setting against the current "
             f"one, {counted(report['runs'], 'round')} after an untimed warm-up of each, {_BALANCED}, ranked by "
             "measured gain",
             "current: " + ", ".join(f"{k} {v}" for k, v in c.items() if v is not None),
             f"{'setting':42} {'n':>3} {'time ratio (95% CI)':>26} {'p':>8} {'Δ acc points (95% CI)*':>26}  verdict"]
    for r in t["rows"]:
        time = r["time"]
        ratio = "n/a" if time is None else ratio_text(time)
        p = "-" if time is None else f"{time['p']:.3g}"
        acc = r["accuracy"]
        dacc = ("(same numbers)" if not r["changes_numbers"] else "n/a" if acc is None
                else interval_text(acc["diff"], acc["ci95"], 100))
        lines.append(f"{r['setting'][:42]:42} {r['n']:>3} {ratio:>26} {p:>8} {dacc:>26}  {r['verdict']}")
    lines.append("* only for settings that change the numbers, at this short budget: whether it breaks training")
    for f in t["cannot_run"]:
        lines.append(f"cannot run here: {f['setting']} ({f['why']})")
    rec = " ".join(f"{k}={set_text(v)}" for k, v in t["recommended"].items()) or "none measured faster"
    lines.append(f"recommended: {rec} (each measured alone against the current configuration)")
    return lines


def tune_command(args, argv: list[str]) -> int:
    overrides = overrides_of(args)
    only = None if args.only is None else [k.strip() for k in args.only.split(",") if k.strip()]
    # an existing file fails before any work
    apply_path = claim_result_path(args.apply, "--apply") if args.apply is not None else None
    written = False
    try:
        report, path, stored = _run_and_store(args, argv, "tune", lambda log: tune(
            _request(args, overrides), runs=args.runs, seed=args.seed, only=only, log=log))
        for line in tune_lines(report):
            out(line)
        err(f"report: {path} ({_stored_text(stored)})")
        if apply_path is not None:
            values = {k: set_text(v) for k, v in report["tune"]["recommended"].items()}
            write_settings(apply_path, recipe=report["recipe"], device=report["device"],
                           device_name=report["environment"]["device_name"], settings=values,
                           measured={"command": report["command"], "report": str(path), "stored_as": stored,
                                     "utc": report["environment"]["timestamp_utc"],
                                     # what each setting was measured against: the recipe with these
                                     "against": {"set": overrides, "epochs": args.epochs}})
            written = True
            err(f"settings: {apply_path} ({counted(len(values), 'setting')}; speedrun train {report['recipe']} "
                f"--settings {apply_path} applies them)")
    finally:
        if apply_path is not None and not written:
            release_result_path(apply_path)
    return diverged_exit(report)
