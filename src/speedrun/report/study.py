"""The report's sweeps section: each study that `speedrun sweep` stored (instruments/sweep.py's "sweep" reports),
as its newest report has it: the trials over time (objective against trial number), the best trial with the 95%
interval of its mean, and Optuna's parameter importances where the sweep could compute them.

Everything is read from the stored report, so the page needs neither Optuna nor the study's storage. A stored report
is a file from elsewhere: every field is checked for its type and range before it is drawn, and one that cannot be
drawn is named on the page.
"""

from __future__ import annotations

import json
import math
import sqlite3
from html import escape

from speedrun.errors import counted
from speedrun.report import charts
from speedrun.report import queries as rep

MAX_STUDIES = 20  # studies drawn, newest first
TABLE_TRIALS = 15  # trials listed per study, best first
MAX_SPACE = 50  # parameters listed per study


def _number(value) -> float | None:
    """A finite float, else None (a stored report may hold anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _interval(value) -> tuple[float, float] | None:
    if isinstance(value, list) and len(value) == 2:
        low, high = _number(value[0]), _number(value[1])
        if low is not None and high is not None and low <= high:
            return low, high
    return None


def _trial(raw) -> dict | None:
    """A stored trial with the fields the page reads, checked; None for one without a trial number."""
    if not isinstance(raw, dict) or isinstance(raw.get("number"), bool) or not isinstance(raw.get("number"), int):
        return None
    params = raw.get("params") if isinstance(raw.get("params"), dict) else {}
    n = raw.get("n")
    return {"number": raw["number"], "state": rep.clip_text(raw.get("state"), 20), "mean": _number(raw.get("mean")),
            "ci95": _interval(raw.get("ci95")), "value": _number(raw.get("value")),
            "n": n if isinstance(n, int) and not isinstance(n, bool) else None, "p": _number(raw.get("p")),
            "penalized": raw.get("penalized") is True,
            "params": {rep.clip_text(k, 60): rep.clip_text(v, 60) for k, v in list(params.items())[:MAX_SPACE]}}


def _study(report: dict) -> dict | None:
    """The fields of a stored sweep report the page draws; None where there is nothing to draw."""
    objective = report.get("objective")
    if objective not in ("accuracy", "time") or not isinstance(report.get("trials"), list):
        return None
    trials = [t for t in map(_trial, report["trials"][:100_000]) if t is not None]
    if not trials:
        return None
    importances = report.get("importances")
    importances = ({rep.clip_text(k, 60): v for k, v in importances.items() if _number(v) is not None}
                   if isinstance(importances, dict) else None)
    total = report.get("trials_total")
    return {"objective": objective, "trials": trials, "best": _trial(report.get("best")),
            "importances": importances, "importances_note": rep.clip_text(report.get("importances_note") or "", 300),
            "study": rep.clip_text(report.get("study"), 200), "storage": rep.clip_text(report.get("storage"), 300),
            "target": _number(report.get("target")),
            "total": total if isinstance(total, int) and not isinstance(total, bool) else len(trials)}


def stored_studies(conn: sqlite3.Connection, left_out: list[str]) -> list[tuple[dict, dict]]:
    """(report, what _study read of it) for the newest stored report of each study (by name and storage), newest
    first, at most MAX_STUDIES; each stored one that cannot be drawn is named in `left_out`."""
    chosen: dict[tuple, tuple[dict, dict]] = {}
    sql = (f"SELECT id, created_utc, CASE WHEN length(json) <= {rep.MAX_REPORT_CHARS} THEN json END FROM reports "
           "WHERE kind = 'sweep' ORDER BY created_utc DESC, id DESC")
    for id_, date, text in conn.execute(sql):
        try:
            report = json.loads(text) if text is not None else None
        except (ValueError, RecursionError, TypeError):
            report = None
        drawn = _study(report) if isinstance(report, dict) else None
        if drawn is None:
            left_out.append(f"sweep report #{id_} ({rep.clip_text(date, 40)[:10]}) could not be drawn: it holds no "
                            "trial with a number and a known objective")
            continue
        key = (drawn["study"], drawn["storage"])
        if key not in chosen:
            partial = report.get("complete") is not True or report.get("interrupted") is True
            chosen[key] = ({**report, "_id": id_, "_date": rep.clip_text(date, 40), "_partial": partial}, drawn)
    if len(chosen) > MAX_STUDIES:
        left_out.append(f"{len(chosen) - MAX_STUDIES} more stud(ies) not drawn: at most {MAX_STUDIES} are")
    return list(chosen.values())[:MAX_STUDIES]


def trials_chart(title: str, study: dict) -> bytes | None:
    """Each trial's mean (accuracy % or timed seconds) against its number, with the 95% interval of the mean as an
    error bar: completed trials that count in blue, pruned ones grey, time trials that missed the target red (drawn
    at their mean seconds, not at their penalized value); the best so far as a step line. None with fewer than two
    trials to draw."""
    accuracy = study["objective"] == "accuracy"
    scale = 100.0 if accuracy else 1.0
    drawn = [t for t in study["trials"] if t["mean"] is not None]
    if len(drawn) < 2:
        return None
    fig = charts.figure(3.8)  # charts.py's conventions: the object API, its width and resolution
    ax = fig.add_subplot()
    groups = [("completed", "#1f77b4", "o", lambda t: t["state"] == "complete" and not t["penalized"]),
              ("missed the target (penalized)", "#d62728", "o", lambda t: t["state"] == "complete" and t["penalized"]),
              ("pruned or failed (runs it finished)", "#999999", "x", lambda t: t["state"] != "complete")]
    for label, color, marker, member in groups:
        mine = [t for t in drawn if member(t)]
        if not mine:
            continue
        low = [scale * (t["mean"] - t["ci95"][0]) if t["ci95"] else 0.0 for t in mine]
        high = [scale * (t["ci95"][1] - t["mean"]) if t["ci95"] else 0.0 for t in mine]
        ax.errorbar([t["number"] for t in mine], [scale * t["mean"] for t in mine], yerr=[low, high], fmt=marker,
                    color=color, label=label, capsize=2, alpha=0.85)
    counted = sorted((t for t in drawn if t["state"] == "complete" and not t["penalized"]), key=lambda t: t["number"])
    if counted:
        best, xs, ys = None, [], []
        for t in counted:
            if best is None or (t["mean"] > best if accuracy else t["mean"] < best):
                best = t["mean"]
            xs.append(t["number"])
            ys.append(scale * best)
        ax.step(xs, ys, where="post", color="#2ca02c", linewidth=1.2, label="best so far")
    if accuracy and study["target"] is not None:
        ax.axhline(100 * study["target"], color="#555", linestyle="--", linewidth=1)
    ax.set_xlabel("trial number")
    ax.set_ylabel("mean test accuracy, %" if accuracy else "mean timed seconds per run")
    title = " ".join(title.split())
    title = title if len(title) <= charts.TITLE_CHARS else title[:charts.TITLE_CHARS - 1] + "…"
    ax.set_title(title.replace("$", r"\$"), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return charts.png(fig)


def _mean_text(study: dict, trial: dict) -> str:
    if trial["mean"] is None:
        return "n/a"
    scale, unit = (100.0, "%") if study["objective"] == "accuracy" else (1.0, " s")
    ci = trial["ci95"]
    return f"{scale * trial['mean']:.2f}{unit}" + ("" if ci is None else f" ({scale * ci[0]:.2f} .. "
                                                                          f"{scale * ci[1]:.2f})")


def _params_text(trial: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in trial["params"].items())


def section(conn: sqlite3.Connection, image, table, cell) -> list[str]:
    """The sweeps section of the page (html.py's helpers: image(kind, png, alt), table(header, rows), cell(text)
    for a number's cell)."""
    out = ['<h2 id="sweeps">Sweeps</h2>',
           '<p class="note">Each study of `speedrun sweep`, as its newest stored report has it: every trial\'s mean '
           'over its runs with the 95% confidence interval of that mean, the best trial, and Optuna\'s parameter '
           'importances (fANOVA) where they could be estimated. p: one-sided t-test of the trial\'s accuracies '
           'against the target (the records rule).</p>']
    left_out: list[str] = []
    for report, study in stored_studies(conn, left_out):
        title = f"{rep.clip_text(report.get('recipe'), 60)} on {rep.clip_text(report.get('dataset'), 80)}: study " \
                f"{study['study']}"
        what = ("mean test accuracy, maximized" if study["objective"] == "accuracy" else
                "mean timed seconds to the target, minimized (a trial that misses it is penalized)")
        out += [f"<h3>{escape(title)}</h3>",
                f'<p class="note">{escape(rep.provenance(report))}; {counted(study["total"], "trial")}; objective: '
                f'{escape(what)}; storage {escape(study["storage"])}</p>',
                *image("study-trials", trials_chart(f"{rep.clip_text(report.get('recipe'), 40)}: trials", study),
                       f"trials of study {study['study']}")]
        best = study["best"]
        out.append('<p>best: ' + ("none (no trial completed)" if best is None else
                                  escape(f"trial {best['number']}, {_mean_text(study, best)}, n {best['n']}, "
                                         f"p {rep.p_text(best['p'])}: {_params_text(best)}")
                                  + (" (no trial reached the target)" if best and best["penalized"] else "")) + '</p>')
        if study["importances"]:
            out.append(table(["parameter", "importance"], [[escape(k), cell(f"{v:.3f}")]
                                                          for k, v in study["importances"].items()]))
        else:
            out.append(f'<p class="note">Parameter importances: none ({escape(study["importances_note"] or "n/a")})'
                       '.</p>')
        ranked = sorted((t for t in study["trials"] if t["value"] is not None and t["state"] == "complete"),
                        key=lambda t: t["value"], reverse=study["objective"] == "accuracy")[:TABLE_TRIALS]
        if ranked:
            out.append(table(["trial", "objective (95% CI)", "n", "p", "parameters"],
                             [[cell(str(t["number"])), cell(_mean_text(study, t) + ("*" if t["penalized"] else "")),
                               cell("-" if t["n"] is None else str(t["n"])), cell(rep.p_text(t["p"])),
                               escape(_params_text(t))] for t in ranked]))
    if left_out:
        out += ['<p class="note">Stored, but not drawn here:</p>',
                "<ul>" + "".join(f"<li>{escape(line)}</li>" for line in left_out) + "</ul>"]
    return out if len(out) > 2 else out[:1] + ['<p class="note">No sweep is stored yet (`speedrun sweep`).</p>']
