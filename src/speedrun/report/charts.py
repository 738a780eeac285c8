"""The charts of `speedrun report` (report.py), drawn with matplotlib and returned as PNG bytes to embed.

matplotlib's object API (Figure + the Agg canvas), never pyplot: no global figure state, no GUI backend, nothing
left open between charts. Every label comes from a database that may hold anything, so each "$" is escaped (two of
them in a recipe name would otherwise be parsed as TeX, which can fail to draw) and labels are cut to a length.

Every chart carries information or is not drawn: each function returns None for data that would draw nothing worth
a look (a learning "curve" of one point, a comparison of one setting, empty axes), and the page leaves it out.
"""

from __future__ import annotations

import io
import math

LABEL_CHARS, TITLE_CHARS = 48, 100
WIDTH_IN, DPI = 7.5, 110  # a 825-pixel-wide image: readable at a laptop's width, small in base64
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


def _label(text: object, limit: int = LABEL_CHARS) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("$", r"\$")  # matplotlib's escape for a literal dollar


def figure(height_in: float):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("speedrun report draws its charts with matplotlib, a dependency of speedrun that is not "
                         "installed here; pip install matplotlib (or reinstall speedrun: pip install -e .)") from None
    return Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})  # no version stamp: same data, same bytes
    return buf.getvalue()


def accuracy_vs_time(title: str, points: list[dict], targets: list[float]) -> bytes | None:
    """One point per stored result: mean timed seconds (log x) against mean test accuracy (%), ± one std as
    error bars, a colour per recipe; a dashed line at each target. points: recipe, seconds, std_seconds,
    accuracy, std_accuracy (fractions). None without a point."""
    if not points:
        return None
    fig = figure(4.2)
    ax = fig.add_subplot()
    recipes = sorted({p["recipe"] for p in points})
    for i, recipe in enumerate(recipes):
        mine = [p for p in points if p["recipe"] == recipe]
        ax.errorbar([p["seconds"] for p in mine], [100 * p["accuracy"] for p in mine],
                    xerr=[p["std_seconds"] or 0 for p in mine], yerr=[100 * (p["std_accuracy"] or 0) for p in mine],
                    fmt="o", color=_COLORS[i % len(_COLORS)], label=_label(recipe), capsize=3, alpha=0.85)
    for target in targets:
        ax.axhline(100 * target, color="#555", linestyle="--", linewidth=1)
    seconds = [p["seconds"] for p in points]
    # log where the times span a factor of 3 or more (a record chart: 2 s next to 3,000 s); a narrower range reads
    # better on a linear axis, where a log axis labels its few ticks "3.95 x 10^0"
    log = bool(seconds) and min(seconds) > 0 and max(seconds) >= 3 * min(seconds)
    if log:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        narrow = max(seconds) < 10 * min(seconds)

        def minor(value, _):  # within a decade every tick is labelled; wider, the 2s and 5s (200, 500, 2000)
            lead = round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0
            return f"{value:g}" if narrow or lead in (2, 5) else ""

        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(minor))
    if len(set(seconds)) == 1:
        # One time (a single point, or several at one time): matplotlib would span 5% either side of it, a scale
        # that reads as a spread the data has not; from 0 to twice the time, the axis shows its size instead.
        widest = max(seconds[0] + (p["std_seconds"] or 0) for p in points)
        ax.set_xlim(0.0, max(2 * seconds[0], 1.2 * widest) if seconds[0] > 0 else 1.0)
    ax.set_xlabel("mean timed seconds per run" + (" (log scale)" if log else ""))
    ax.set_ylabel("mean test accuracy, %")
    ax.set_title(_label(title, TITLE_CHARS), fontsize=10)
    ax.grid(True, alpha=0.3)
    if recipes:
        ax.legend(fontsize=8, loc="lower right")
    return png(fig)


def carries_curve(curve: dict) -> bool:
    """A curve has points at two epochs or more: a run evaluated only at its end (eval_each_epoch off) has one."""
    return len(set(curve["epochs"])) >= 2


def learning_curves(title: str, curves: list[dict]) -> bytes | None:
    """Test accuracy (%) after each epoch, the mean over a result's runs. curves: label, epochs, accuracy. The
    curves of one point are left out; None when none is left."""
    curves = [curve for curve in curves if carries_curve(curve)]
    if not curves:
        return None
    fig = figure(4.0)
    ax = fig.add_subplot()
    for i, curve in enumerate(curves):
        ax.plot(curve["epochs"], [100 * a for a in curve["accuracy"]], marker="o", markersize=3,
                color=_COLORS[i % len(_COLORS)], label=_label(curve["label"]))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy, %")
    ax.set_title(_label(title, TITLE_CHARS), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return png(fig)


def ablation_bars(title: str, rows: list[dict]) -> bytes | None:
    """What each trick buys: baseline minus trick-off, in accuracy points, with its 95% interval; dark bars have
    p < 0.05. rows: trick, gain, low, high (fractions; low <= gain <= high, or both None), p. None without a row."""
    if not rows:
        return None
    fig = figure(0.9 + 0.32 * max(len(rows), 1))
    ax = fig.add_subplot()
    y = list(range(len(rows)))[::-1]  # the first row (largest gain) on top
    gains = [100 * r["gain"] for r in rows]
    # a row without an interval (report.py drops one that does not hold its value) gets no error bar
    err = [[100 * (r["gain"] - r["low"]) if r["low"] is not None else 0.0 for r in rows],
           [100 * (r["high"] - r["gain"]) if r["high"] is not None else 0.0 for r in rows]]
    colors = ["#1f77b4" if r["p"] is not None and r["p"] < 0.05 else "#aec7e8" for r in rows]
    ax.barh(y, gains, xerr=err, color=colors, capsize=3)
    ax.set_yticks(y, [_label(r["trick"]) for r in rows], fontsize=8)
    ax.axvline(0, color="#333", linewidth=1)
    ax.set_xlabel("accuracy points bought (baseline - trick off), 95% CI; dark: p < 0.05")
    ax.set_title(_label(title, TITLE_CHARS), fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    return png(fig)


def waterfall(title: str, steps: list[dict]) -> bytes | None:
    """The cumulative story: each bar runs from the row before's mean accuracy to this row's (green up, red down);
    the first bar starts at zero. steps: label, accuracy (fraction), std (fraction or None). None for fewer than two
    steps (a start alone tells no story)."""
    if len(steps) < 2:
        return None
    fig = figure(4.0)
    ax = fig.add_subplot()
    previous = None
    for i, step in enumerate(steps):
        acc = 100 * step["accuracy"]
        low = 0.0 if previous is None else previous
        color = "#7f7f7f" if previous is None else ("#2ca02c" if acc >= previous else "#d62728")
        ax.bar(i, acc - low, bottom=low, color=color, width=0.7,
               yerr=None if step["std"] is None else 100 * step["std"], capsize=3)
        ax.text(i, acc, f"{acc:.1f}", ha="center", va="bottom", fontsize=7)
        previous = acc
    values = [100 * s["accuracy"] for s in steps]
    if values:
        span = max(values) - min(values)
        ax.set_ylim(max(0.0, min(values) - max(span, 2.0)), min(100.0, max(values) + max(span * 0.3, 1.0)))
    ax.set_xticks(range(len(steps)), [_label(s["label"]) for s in steps], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("mean test accuracy, %")
    ax.set_title(_label(title, TITLE_CHARS), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    return png(fig)


def epochs_bars(title: str, rows: list[dict]) -> bytes | None:
    """--to-target: the epochs each variant needed to reach the target (blue); grey bars did not reach it at the
    most epochs tried, white ones are searches cut short. rows: name, epochs, status. None without a row."""
    if not rows:
        return None
    fig = figure(0.9 + 0.32 * max(len(rows), 1))
    ax = fig.add_subplot()
    y = list(range(len(rows)))[::-1]
    colors = {"reached": "#1f77b4", "not reached": "#bbbbbb", "unfinished": "#ffffff"}
    ax.barh(y, [r["epochs"] for r in rows], color=[colors[r["status"]] for r in rows], edgecolor="#333")
    for yi, r in zip(y, rows):
        ax.text(r["epochs"], yi, f" {r['epochs']:.3g}" + ("" if r["status"] == "reached" else f" ({r['status']})"),
                va="center", fontsize=7)
    ax.set_yticks(y, [_label(r["name"]) for r in rows], fontsize=8)
    ax.set_xlabel("epochs to the target (grey: not reached at the most epochs tried; white: search cut short)")
    ax.set_title(_label(title, TITLE_CHARS), fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    return png(fig)


SETTING_PANELS = {"accuracy": ("test accuracy, %", 100.0), "seconds": ("timed seconds per run", 1.0)}


def settings_panels(rows: list[dict], accuracy: bool = True) -> list[str]:
    """The panels of settings() that compare something: a measure that two settings or more have. accuracy=False
    (synthetic data: random labels, chance accuracy) leaves accuracy out."""
    return [key for key in SETTING_PANELS if (accuracy or key != "accuracy")
            and sum(row[key] is not None for row in rows) >= 2]


def settings(title: str, rows: list[dict], accuracy: bool = True) -> bytes | None:
    """A bench (or ablate) report's settings side by side: per setting its mean test accuracy (%) and mean timed
    seconds, with the 95% interval of the mean as error bars (none for one run); the baseline red, with a dashed
    line at its mean. rows: label, baseline (bool), accuracy and seconds each (mean, low, high) or None (low and
    high None for one run). A panel only for a measure that two settings have (settings_panels); None without one."""
    panels = settings_panels(rows, accuracy)
    if not panels:
        return None
    from matplotlib.ticker import MaxNLocator

    fig = figure(1.1 + 0.32 * len(rows))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    y = list(range(len(rows)))[::-1]  # the baseline (the first row) on top
    for ax, key in zip(axes, panels):
        label, scale = SETTING_PANELS[key]
        shown = []
        for yi, row in zip(y, rows):
            if row[key] is None:
                continue
            mean, low, high = (None if v is None else scale * v for v in row[key])
            err = None if low is None else [[mean - low], [high - mean]]
            ax.errorbar([mean], [yi], xerr=err, fmt="o", capsize=3, color="#d62728" if row["baseline"] else "#1f77b4")
            shown += [mean] + ([low, high] if low is not None else [])
            if row["baseline"]:
                ax.axvline(mean, color="#d62728", linestyle="--", linewidth=1, alpha=0.6)
        # an interval of two runs can be far wider than the data: the axis keeps to what a value can be (accuracy
        # 0-100%, seconds from 0), and an error bar beyond it runs off the edge
        span = max(shown) - min(shown) or abs(max(shown)) or 1.0
        low_end, high_end = min(shown) - 0.08 * span, max(shown) + 0.08 * span
        ax.set_xlim(max(low_end, 0.0), min(high_end, 100.0) if key == "accuracy" else high_end)
        ax.xaxis.set_major_locator(MaxNLocator(6, steps=[1, 2, 2.5, 5, 10]))
        ax.set_xlabel(f"{label}, mean and 95% CI")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(y, [_label(r["label"]) for r in rows], fontsize=8)
    axes[0].set_ylim(-0.6, len(rows) - 0.4)
    fig.suptitle(_label(title, TITLE_CHARS), fontsize=10)
    return png(fig)


def finite(value) -> float | None:
    """A JSON number as a finite float; anything else (a string, a bool, null, a huge int) None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None
