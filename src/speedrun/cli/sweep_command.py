"""`speedrun sweep`: a hyperparameter search on Optuna (instruments/sweep.py), its table of trials and, with
--write-settings, the best trial's configuration as a settings file for `speedrun train --settings`. Loading this
module imports torch and the recipes, so program.py loads it only when the command runs."""

from __future__ import annotations

import shlex

from speedrun import dist
from speedrun.cli.output import err, out
from speedrun.cli.user_model import overrides_of, refuse_model_key
from speedrun.errors import counted
from speedrun.instruments.sweep import SweepSpec, best_settings, sweep
from speedrun.instruments.variants import set_text
from speedrun.records.result_file import check_result_path, claim_result_path, release_result_path
from speedrun.records.settings_file import write_settings
from speedrun.records.stats import record_p_text

# Trials the table shows (the newest); the report file and the study hold every one.
MAX_TABLE_TRIALS = 50


def _value_text(report: dict, trial: dict) -> str:
    """A trial's objective: its mean with the 95% interval of that mean ("n/a" without a finished run)."""
    mean, ci = trial.get("mean"), trial.get("ci95")
    if mean is None:
        return "n/a"
    scale, unit = (100, "%") if report["objective"] == "accuracy" else (1, " s")
    text = f"{scale * mean:.2f}{unit}"
    return text + ("" if ci is None else f" ({scale * ci[0]:.2f} .. {scale * ci[1]:.2f})")


def _params_text(trial: dict) -> str:
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={set_text(v)}"
                    for k, v in trial["params"].items())


def sweep_lines(report: dict) -> list[str]:
    """The study's trials (the newest MAX_TABLE_TRIALS), the best and the parameter importances."""
    what = ("mean test accuracy %, maximized" if report["objective"] == "accuracy" else
            f"mean timed seconds to the {100 * report['target']:g}% target, minimized")
    lines = [f"{report['recipe']} on {report['dataset']} ({report['device']}): study {report['study']}, "
             f"{counted(report['trials_total'], 'trial')} ({len(report['trials_this_process'])} by this command), "
             f"{counted(report['runs'], 'run')} per trial "
             f"(seeds {report['seed']}..{report['seed'] + report['runs'] - 1}; "
             f"n: the runs a trial finished); {what}; p: one-sided t-test of the accuracies against the target",
             f"{'trial':>5} {'state':9} {'objective (95% CI)':>26} {'n':>3} {'p':>8}  parameters"]
    shown = report["trials"][-MAX_TABLE_TRIALS:]
    if report["trials_total"] > len(shown):
        lines.append(f"... {counted(report['trials_total'] - len(shown), 'earlier trial')} in the report file")
    for t in shown:
        state = t["state"] + ("*" if t.get("penalized") else "")
        n = "-" if t.get("n") is None else str(t["n"])
        lines.append(f"{t['number']:>5} {state:9} {_value_text(report, t):>26} {n:>3} {record_p_text(t.get('p')):>8}"
                     f"  {_params_text(t)}")
    if any(t.get("penalized") for t in shown):
        lines.append("* did not reach the target by the records rule: its objective value is penalized")
    best = report["best"]
    if best is None:
        lines.append("best: none yet (no trial completed)")
    else:
        lines.append(f"best: trial {best['number']}, {_value_text(report, best)}, n {best['n']}: {_params_text(best)}"
                     + (" (no trial reached the target)" if best.get("penalized") else ""))
    if report["importances"] is not None:
        lines.append("parameter importances (Optuna, fANOVA): " + ", ".join(
            f"{k} {v:.2f}" for k, v in report["importances"].items()))
    else:
        lines.append(f"parameter importances: none ({report['importances_note']})")
    return lines


def sweep_command(args, argv: list[str]) -> int:
    overrides = overrides_of(args)
    refuse_model_key({str(text).partition("=")[0].strip() for text in args.space or []}, "--space")
    # an existing file, or one in a folder this process may not write, fails before any work; the file is claimed
    # once the sweep has checked everything else (claim), so that a refusal leaves no file or folder of it
    if args.write_settings is not None:
        check_result_path(args.write_settings, "--write-settings")
    settings_path = None
    written = False

    def claim() -> None:
        nonlocal settings_path
        if args.write_settings is not None:
            settings_path = claim_result_path(args.write_settings, "--write-settings")

    def on_report(report: dict, path, stored) -> None:
        """The table, the report's line and the settings file: on a finished sweep and on one stopped part way
        (Ctrl-C, an error after some runs), from the trials completed so far."""
        nonlocal written
        for line in sweep_lines(report):
            out(line)
        err(f"report: {path} ({'not stored in the results database' if stored is None else f'stored as #{stored}'});"
            f" study {report['study']} in {report['storage']} (--resume --study {shlex.quote(report['study'])} adds "
            "trials)")
        if settings_path is None:
            return
        stopped = not report["complete"]
        if stopped and report["best"] is None:
            err(f"settings: none written to {settings_path}: the sweep stopped before any trial completed")
            return
        values = best_settings(report)
        best = report["best"]
        write_settings(settings_path, recipe=report["recipe"], device=report["device"],
                       device_name=report["environment"]["device_name"], settings=values, written_by="sweep",
                       measured={"command": report["command"],
                                 "report": str(path), "stored_as": stored, "study": report["study"],
                                 "storage": report["storage"], "trial": best["number"],
                                 "objective": report["objective"], "mean": best["mean"], "ci95": best["ci95"],
                                 "n": best["n"], "p": best["p"], "utc": report["environment"]["timestamp_utc"],
                                 "epochs": report["epochs"], "dataset": report["dataset"], "complete": not stopped})
        written = True
        err(f"settings: {settings_path} (trial {best['number']}"
            + (", the best of the trials completed before the sweep stopped" if stopped else "")
            + f"; speedrun train {report['recipe']} --settings {settings_path} applies them)")

    spec = SweepSpec(args.recipe, space=tuple(args.space or ()), trials=args.trials, runs=args.runs,
                     objective=args.objective, sampler=args.sampler, prune=args.prune, seed=args.seed,
                     epochs=args.epochs, dataset=args.dataset, data_dir=args.data_dir, device=args.device,
                     overrides=overrides, storage_url=args.storage, study_name=args.study, resume=args.resume,
                     db_path=args.db, json_path=args.json, tensorboard_dir=args.tensorboard,
                     command=dist.command_line(argv))
    try:
        sweep(spec, on_report=on_report, on_checked=claim, log=(lambda line: None) if args.quiet else err)
    finally:
        if settings_path is not None and not written:
            release_result_path(settings_path)
    return 0
