"""The HTML page of `speedrun report` (report.py collects the data; report_charts.py draws).

One file that works offline: inline CSS, every chart a base64 PNG `<img data-chart="KIND">`, no script, no link
out. Every stored string is escaped (a recipe named `<script>` is text on the page), and every absolute path of the
machine that ran a command is shown portably (portable.portable_paths): in each text of the page's body, each
image's alt text and each chart's title.
"""

from __future__ import annotations

import base64
import re
import sqlite3
from datetime import datetime, timezone
from html import escape, unescape

from speedrun.errors import counted
from speedrun.report import charts
from speedrun.report import queries as rep
from speedrun.report import races as race
from speedrun.report import study
from speedrun.report.portable import portable_paths

_STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 12px}
h1{font-size:24px}h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:36px}h3{font-size:16px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:12.5px}td,th{border:1px solid #ddd;padding:3px 7px;
vertical-align:top}th{background:#f4f4f4;text-align:left}tr.reached td:first-child{border-left:4px solid #2ca02c}
td.num{text-align:right;white-space:nowrap}code{font-size:11.5px;word-break:break-all}.fp{color:#666;font-size:11px}
img.chart{display:block;max-width:100%;margin:8px 0 20px;border:1px solid #eee}.note{color:#555}"""


def _img(kind: str, png: bytes | None, alt: str) -> list[str]:
    """The chart as an <img>, or nothing where charts.py drew none (its data carry no information)."""
    if png is None:
        return []
    return [f'<img class="chart" data-chart="{escape(kind)}" alt="{escape(portable_paths(alt))}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">']


def _table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """Cells are HTML already (the callers escape; a cell that is a whole <td> is kept); header cells are ours."""
    body = "".join(f'<tr class="{cls}">' + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in cells)
                   + "</tr>" for cls, cells in zip(classes or [""] * len(rows), rows))
    return f"<table><thead><tr>{''.join(f'<th>{h}</th>' for h in header)}</tr></thead><tbody>{body}</tbody></table>"


def _num(text: str) -> str:
    return f'<td class="num">{escape(text)}</td>'


def _races(rows: list[dict], left_out: list[str]) -> list[str]:
    """The races against airbench94 (races.race_rows), each a row: what raced, the times and accuracies of both
    sides, the ratio and the difference with their 95% intervals and Welch's p; each race's command under the table
    by its number (in a column it would take more of the first screen than the numbers)."""
    out = ['<h2 id="races">Side by side with airbench94</h2>',
           '<p class="note">Each race is one invocation of benchmarks/vs_airbench.py: our recipe and airbench94 on one '
           'device and the same data, their runs interleaved after an untimed warm-up of each (none on a CPU), each '
           'timed from the whitening initialization to the end of the final TTA evaluation. Time: the ratio of the '
           'mean timed regions, ours / airbench94 (below 1: ours is faster); Δ accuracy: ours − airbench94, in '
           'points; 95% confidence intervals and Welch\'s p ("no CI" with one run a side). On a CPU, airbench94 runs '
           'in fp32 and the times say nothing about a GPU. Dry runs and races that did not finish are not shown.</p>']
    cells = [[_num(str(i + 1)), escape(r["device"]), escape(race.race_label(r)), escape(r["schedule"]),
              _num(f"{rep.pm_text(r['seconds_ours'], None, digits=3)} / "
                   f"{rep.pm_text(r['seconds_anchor'], None, digits=3)}"),
              _num(race.ratio_cell(r)), _num(rep.p_text(r["ratio_p"])),
              _num(f"{rep.pm_text(r['accuracy_ours'], None, 100)} / {rep.pm_text(r['accuracy_anchor'], None, 100)}"),
              _num(race.diff_cell(r)), _num(rep.p_text(r["diff_p"])), _num(race.runs_cell(r)), escape(r["date"]),
              escape(r["dataset"])] for i, r in enumerate(rows)]
    if cells:
        out += [_table(["#", "device", "race", "schedule", "timed s, ours / anchor", "time ratio (95% CI)", "p",
                        "test acc %, ours / anchor", "Δ acc, points (95% CI)", "p", "runs each", "date", "dataset"],
                       cells),
                '<p class="note">The commands, by the numbers above:</p>',
                "<ol>" + "".join(f"<li><code>{escape(r['command'])}</code></li>" for r in rows) + "</ol>"]
    if left_out:
        out += ['<p class="note">Stored, but not shown here:</p>',
                "<ul>" + "".join(f"<li>{escape(line)}</li>" for line in left_out) + "</ul>"]
    return out


def _leaderboards(conn: sqlite3.Connection, boards: list[dict]) -> list[str]:
    out = ['<h2 id="leaderboard">Leaderboards</h2>',
           '<p class="note">Per dataset, recipe family and target accuracy, complete results only: results that '
           'reach the target (marked green), fastest mean timed region first, then the rest, most accurate first; '
           f'{escape(rep.rule_text(boards[0]["alpha"]))}. p: that test\'s p-value, "-" for one run. Hit: the runs '
           'at or above the target. Results on synthetic data are not ranked here: they measure speed only (their '
           'own section). Cost: US dollars per timed run at the price the result carries (none for a device without '
           'a price).</p>']
    for board in boards:
        target = rep.NO_TARGET if board["target"] is None else f"target {100 * board['target']:g}%"
        rows = board["rows"][:rep.ROWS_PER_BOARD]
        out.append(f"<h3>{escape(rep.board_name(board))} · {escape(target)}</h3>")
        cells = []
        for i, r in enumerate(rows):
            cost = r["cost"]
            cells.append([_num(str(i + 1)), escape(rep.clip_text(r["recipe"], 60)),
                          escape(rep.clip_text(r["device_name"] or r["device"], 60)),
                          _num(rep.pm_text(r["accuracy"], r["std_accuracy"], 100)),
                          _num(rep.pm_text(r["seconds"], r["std_seconds"])),
                          _num("-" if cost is None else f"${cost:.4f}"), _num(str(r["n"])),
                          _num(rep.record_p_cell(r)), _num(rep.hits_text(r)), escape(r["date"][:10]),
                          f"<code>{escape(rep.clip_text(r['command'], 1000))}</code>",
                          f'<span class="fp">{escape(rep.fingerprint_text(r))}</span>'])
        out.append(_table(["#", "recipe", "device", "test acc %", "timed s", "cost/run", "n", "p", "hit", "date",
                           "command", "fingerprint"], cells, ["reached" if rep.has_reached(r) else "" for r in rows]))
        out += _not_shown(board, len(rows), "leaderboard")
    return out


def _not_shown(board: dict, shown: int, kind: str) -> list[str]:
    """The notes under a board: its rows past the `shown` ones, and the boards of this `kind` past the page's
    cap."""
    notes = []
    if len(board["rows"]) > shown:
        notes.append(f'<p class="note">{counted(len(board["rows"]) - shown, "more row")} not shown.</p>')
    if board.get("more"):
        notes.append(f'<p class="note">{counted(board["more"], "more " + kind)} not shown (`speedrun results` '
                     'lists every result).</p>')
    return notes


SYNTHETIC_NOTE = "synthetic data (random images and labels: nothing is learnable, accuracy is chance level)"
NO_CURVE_NOTE = ("a result evaluated only at the end of training has one point a run, no curve; train with "
                 "<code>--set eval_each_epoch=true</code> to evaluate after every epoch (untimed)")


def _speed_boards(boards: list[dict]) -> list[str]:
    """The results on synthetic data: their times, fastest first, and no accuracy (it is chance there)."""
    out = ['<h2 id="speed">Speed only (synthetic data)</h2>',
           f'<p class="note">Results on {SYNTHETIC_NOTE} measure speed only, so they are kept off the leaderboards '
           'and the accuracy charts: per dataset and recipe family, fastest mean timed region first.</p>']
    for board in boards:
        rows = board["rows"][:rep.ROWS_PER_BOARD]
        out.append(f"<h3>{escape(rep.board_name(board))}</h3>")
        cells = [[_num(str(i + 1)), escape(rep.clip_text(r["recipe"], 60)),
                  escape(rep.clip_text(r["device_name"] or r["device"], 60)),
                  _num(rep.pm_text(r["seconds"], r["std_seconds"])),
                  _num("-" if r["cost"] is None else f"${r['cost']:.4f}"), _num(str(r["n"])),
                  escape(r["date"][:10]), f"<code>{escape(rep.clip_text(r['command'], 1000))}</code>",
                  f'<span class="fp">{escape(rep.fingerprint_text(r))}</span>'] for i, r in enumerate(rows)]
        out.append(_table(["#", "recipe", "device", "timed s", "cost/run", "n", "date", "command", "fingerprint"],
                          cells))
        out += _not_shown(board, len(rows), "board")
    return out


def _charts_per_dataset(conn: sqlite3.Connection, boards: list[dict]) -> list[str]:
    out = ['<h2 id="accuracy-time">Accuracy against time</h2>']
    curves_html = ['<h2 id="curves">Learning curves</h2>',
                   '<p class="note">Test accuracy after each epoch, the mean over a result\'s runs (results that '
                   'evaluated every epoch; the first rows of each leaderboard).</p>']
    no_curve = []  # the datasets whose results have no curve to draw
    by_data: dict[str, list[dict]] = {}  # per dataset and family, as the leaderboards
    for board in boards:  # the name is a chart's title too: drawn into the image, never read by the page's pass
        by_data.setdefault(portable_paths(rep.board_name(board)), []).append(board)
    for name, group in by_data.items():
        rows = [r for board in group for r in board["rows"] if r["seconds"] is not None][:rep.POINTS_PER_CHART]
        points = [{"recipe": rep.clip_text(r["recipe"], 60), "seconds": r["seconds"], "std_seconds": r["std_seconds"],
                   "accuracy": r["accuracy"], "std_accuracy": r["std_accuracy"]} for r in rows]
        out += _img("accuracy-vs-time", charts.accuracy_vs_time(
            f"{name}: accuracy against timed seconds", points, [b["target"] for b in group if b["target"]]),
            f"accuracy against time on {name}")
        curves = rep.accuracy_curves(conn, [r for board in group for r in board["rows"][:rep.CURVES_PER_CHART]])
        drawn = _img("learning-curves", charts.learning_curves(f"{name}: test accuracy per epoch", curves),
                     f"learning curves on {name}")
        curves_html += drawn
        if not drawn:
            no_curve.append(name)
    if len(out) == 1:
        out.append('<p class="note">Nothing to draw: no result is ranked (see the leaderboards above).</p>')
    if no_curve:
        which = "No learning curve is shown" if len(no_curve) == len(by_data) else \
            f"No learning curve is shown for {escape(', '.join(no_curve))}"
        curves_html.append(f'<p class="note">{which}: {NO_CURVE_NOTE}.</p>')
    elif not by_data:
        curves_html.append('<p class="note">Nothing to draw: no result is ranked (see the leaderboards above).</p>')
    return out + curves_html


def _settings(report: dict, title: str, synthetic: bool) -> list[str]:
    """A bench or ablate report's settings side by side: the chart (accuracy and time, mean and 95% CI; time only
    on synthetic data) and the table against the baseline."""
    rows = rep.setting_rows(report)
    out = _img("settings", charts.settings(title, rows, accuracy=not synthetic), title)
    header = ["setting", "n", "timed s (95% CI)", "time ratio to baseline (95% CI)"]
    cells = [[escape(r["label"]),
              _num("-" if r["n"] is None else str(int(r["n"]))), _num(rep.summary_text(r["seconds"])),
              _num(rep.ratio_text(r))] for r in rows]
    if not synthetic:
        header[2:2] = ["test acc % (95% CI)", "Δ acc to baseline, points (95% CI)", "p"]
        for r, row_cells in zip(rows, cells):
            row_cells[2:2] = [_num(rep.summary_text(r["accuracy"], 100)), _num(rep.ci_text(r)),
                              _num(rep.p_text(r["p"]))]
    return out + [_table(header, cells)] if rows else out


def _title(report: dict, what: str) -> str:
    """A report's title, its paths shown portably: charts draw it into their images."""
    return portable_paths(rep.report_title(report, what))


def _ablations(conn: sqlite3.Connection) -> list[str]:
    out = ['<h2 id="ablation">Benchmarks: bench, ablations and waterfalls</h2>',
           '<p class="note">The newest report of each kind per recipe, dataset and device (of `speedrun bench`, per '
           'set of settings compared). Intervals are 95% confidence intervals of the mean; "-" where a side has '
           f'fewer than two runs. On {SYNTHETIC_NOTE}, only the times of the settings are charted.</p>']
    left_out: list[str] = []  # every stored report this section cannot draw, named on the page
    for report in rep.newest_reports(conn, ("bench", "ablate", "waterfall", "to_target", "tune"), left_out):
        kind = report.get("benchmark")
        synthetic = rep.is_synthetic(report.get("dataset"))
        prov = escape(rep.provenance(report)) + ("; synthetic data: accuracy is chance level here" if synthetic
                                                 else "")
        if kind == "bench" and rep.setting_rows(report):
            title = _title(report, "settings side by side")
            out += [f"<h3>{escape(title)}</h3>", f'<p class="note">{prov}</p>',
                    *_settings(report, title, synthetic)]
        elif kind == "ablate" and (rows := rep.ablation_rows(report)):
            title = _title(report, "what each trick buys")
            base = escape(rep.baseline_text(report) or "n/a")
            out += [f"<h3>{escape(title)}</h3>", f'<p class="note">{prov}; the baseline (the recipe): {base}</p>',
                    *_img("ablation", charts.ablation_bars(title, rows), title),
                    _table(["trick", "off value", "gain, points (95% CI)", "p", "time off/on", "what"],
                           [[escape(r["trick"]), escape(r["off"]), _num(rep.ci_text(r)), _num(rep.p_text(r["p"])),
                             _num("-" if r["ratio"] is None else f"{r['ratio']:.3f}"), escape(r["what"])]
                            for r in rows]),
                    *_settings(report, _title(report, "each trick off, side by side"), synthetic)]
        elif kind == "waterfall" and (rows := rep.waterfall_rows(report)):
            title = _title(report, "tricks added one at a time")
            out += [f"<h3>{escape(title)}</h3>", f'<p class="note">{prov}</p>',
                    *_img("waterfall", charts.waterfall(title, rows), title),
                    _table(["step", "test acc %", "bought, points (95% CI)", "p", "timed s"],
                           [[escape(r["label"]), _num(rep.pm_text(r["accuracy"], r["std"], 100)), _num(rep.ci_text(r)),
                             _num(rep.p_text(r["p"])), _num(rep.pm_text(r["seconds"], None))] for r in rows])]
        elif kind == "to_target" and (rows := rep.target_rows(report)):
            title = _title(report, "epochs to the target")
            out += [f"<h3>{escape(title)}</h3>", f'<p class="note">{prov}</p>',
                    *_img("to-target", charts.epochs_bars(title, rows), title),
                    _table(["variant", "epochs", "to the target", "timed s there", "probes"],
                           [[escape(r["name"]), _num(f"{r['epochs']:.3g}"), r["status"],
                             _num(rep.pm_text(r["seconds"], None)), _num(str(r["probes"]))] for r in rows])]
        elif kind == "tune" and (rows := rep.tune_rows(report)):
            title = rep.report_title(report, "the doctor: each setting against the current one")
            out += [f"<h3>{escape(title)}</h3>",
                    f'<p class="note">{prov}; recommended: {escape(rep.tune_recommended(report))}</p>',
                    _table(["setting", "guide", "n", "time ratio (95% CI)", "p", "Δ acc, points (95% CI)", "verdict"],
                           [[escape(r["setting"]), escape(r["guide"]),
                             _num("-" if r["n"] is None else str(int(r["n"]))), _num(rep.ratio_text(r)),
                             _num(rep.p_text(r["p"])), _num(rep.ci_text(r)) if r["changes_numbers"] else
                             "(same numbers)", escape(r["verdict"])] for r in rows])]
        else:  # newest_reports passes only reports that draw (queries.drawing_problem): a kind it draws, rows
            left_out.append(f"report #{report['_id']} could not be drawn")
    if left_out:
        out += ['<p class="note">Stored, but not drawn here:</p>',
                "<ul>" + "".join(f"<li>{escape(line)}</li>" for line in left_out) + "</ul>"]
    return out if len(out) > 2 else out[:1] + ['<p class="note">No bench or ablation report is stored yet '
                                               '(`speedrun bench`, `speedrun ablate`).</p>']


def _reports(conn: sqlite3.Connection) -> list[str]:
    rows = [[_num(str(id_)), escape(rep.clip_text(kind, 40)), escape(rep.clip_text(date, 20)[:16].replace("T", " ")),
             f"<code>{escape(rep.clip_text(command, 1000))}</code>"]
            for id_, kind, date, command in conn.execute(
                "SELECT id, kind, created_utc, command FROM reports ORDER BY created_utc DESC, id DESC LIMIT 200")]
    return ['<h2 id="reports">Stored benchmark reports</h2>',
            _table(["id", "kind", "date", "command"], rows) if rows else '<p class="note">None yet.</p>']


_TAG = re.compile(r"(<[^>]*>)")  # the page's own tags: stored text inside them is escaped, so never holds a "<"


def _portable_body(html: str) -> str:
    """`html` with each text between tags shown with portable paths (portable.portable_paths), read as the browser
    shows it (entities decoded) and escaped again where it changed."""
    parts = _TAG.split(html)
    for i in range(0, len(parts), 2):
        text = unescape(parts[i])
        shown = portable_paths(text)
        if shown != text:
            parts[i] = escape(shown)
    return "".join(parts)


def page(conn: sqlite3.Connection, alpha: float | None = None) -> str:
    """The whole page; leaderboards judged by the records rule at threshold `alpha` (None: the setting)."""
    left_out: list[str] = []  # the stored races that are not shown, named on the page
    races = race.race_rows(conn, left_out)
    boards, speed = rep.leaderboards(conn, alpha=alpha), rep.leaderboards(conn, synthetic=True)
    results, reports = (conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("results", "reports"))
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = ["<h1>speedrun results</h1>", f'<p class="note">Generated {now} by <code>speedrun report</code> from '
            f'{counted(results, "stored result")} and {counted(reports, "report")}. Nothing on this page loads '
            'from the network.</p>',
            '<p>' + ('<a href="#races">side by side with airbench94</a> · ' if races or left_out else '')
            + '<a href="#leaderboard">leaderboards</a> · '
            + ('<a href="#speed">speed only (synthetic data)</a> · ' if speed else '')
            + '<a href="#accuracy-time">accuracy against time</a> · <a href="#curves">learning curves</a> · '
            '<a href="#ablation">bench and ablations</a> · <a href="#sweeps">sweeps</a> · '
            '<a href="#reports">reports</a></p>']
    body += _races(races, left_out) if races or left_out else []
    body += _leaderboards(conn, boards) if boards else [
        '<h2 id="leaderboard">Leaderboards</h2>', '<p class="note">' + escape(
            "No result on real data is stored yet." if speed else rep.unranked_text(conn)) + '</p>']
    body += (_speed_boards(speed) if speed else []) + _charts_per_dataset(conn, boards) + _ablations(conn)
    body += study.section(conn, _img, _table, _num) + _reports(conn)
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">" + rep.GENERATOR +
            f"<title>speedrun results</title><style>{_STYLE}</style></head>\n<body>\n" +
            _portable_body("\n".join(body)) +
            "\n</body></html>\n")
