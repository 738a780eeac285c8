"""What `speedrun train` shows: a progress bar per run, a per-epoch table, the multi-run summary.

Everything goes to stderr except the summary table, so `speedrun train ... > summary.txt` keeps the result.
verbose=False (the Python API's default) shows nothing; quiet (the CLI's --quiet) shows only the summary table.
Warnings and errors are not this module's: they are printed whatever the verbosity (cli.py).

When stderr is not a terminal (piped to a file, a CI log, a batch job) a redrawn bar would be lost, so progress is
written as plain lines at every tenth of the run instead, and no line is wrapped at 80 columns.

Lines and names are escaped here, as they are shown (errors.printable): the messages carry a file or dataset name
as it is, and its newline or ESC must not break a line or reach the terminal. Nor is any of it read as rich's
markup ("[bold]" in a folder name is shown as it is).
"""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from speedrun.engine import peak
from speedrun.errors import printable
from speedrun.records.stats import FRACTION, NON_NEGATIVE, record_alpha, record_p_text, summarize

_ROW = "{:>8} {:>6} {:>11} {:>12} {:>11} {:>9}"
_WIDE = 200  # columns for output that is not a terminal: long enough for any table, so nothing wraps


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def record_text(record: dict | None, target: float) -> str:
    """The records rule's verdict on a result (session.Result.record()): "reached the target 94.00% (p = 0.003 <
    0.01, one-sided t-test, n=5)", or why it is not shown to."""
    if record is None:
        return f"Not shown to reach the target {_pct(target)}%: no run finished."
    n, alpha = record["n"], f"{record['threshold']:g}"
    if record["p"] is None:
        return (f"Not shown to reach the target {_pct(target)}%: the records rule's one-sided t-test needs n >= 2 "
                f"runs (n={n}).")
    p = record_p_text(record["p"])
    if record["reached"]:
        return f"Reached the target {_pct(target)}% (p = {p} < {alpha}, one-sided t-test, n={n})."
    return f"Not shown to reach the target {_pct(target)}% (p = {p}, not < {alpha}; one-sided t-test, n={n})."


def _console(stream) -> Console:
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream) if tty else Console(file=stream, width=_WIDE, soft_wrap=True)


class Display:
    """Lines shown before `release()` (downloading, extracting, decoding ...) are held back: a refused input then
    costs exactly one line, the error, whatever was going on before it. On a terminal the latest held line shows
    meanwhile as a transient status line, erased when it ends; `release()` prints the held lines for good once every
    check has passed, and `close()` drops them."""

    def __init__(self, verbose: bool, summary: bool | None = None):
        """verbose: progress, tables and notes on stderr; summary: the final table on stdout (default: verbose)."""
        self.verbose = verbose
        self.show_summary = verbose if summary is None else summary
        self.err = _console(sys.stderr)
        self.out = _console(sys.stdout)
        self._held: list[str] | None = []
        self._status = None
        # The records rule's threshold the summary judges at (stats.record_alpha: $SPEEDRUN_RECORD_P, else 0.01):
        # read here, with the command's other settings, so that a bad one is refused before any work
        self.record_p = record_alpha()

    def line(self, text: str) -> None:
        if not self.verbose:
            return
        text = printable(text)
        if self._held is None:
            self.err.print(text, highlight=False, markup=False)
            return
        self._held.append(text)
        if self.err.is_terminal:
            if self._status is None:
                self._status = self.err.status(Text(text), spinner="line")
                self._status.start()
            else:
                self._status.update(Text(text))

    def release(self) -> None:
        """Every check has passed: print the held lines, and print lines at once from now on."""
        held, self._held = self._held or [], None
        self._stop_status()
        for text in held:
            self.line(text)

    def close(self) -> None:
        """End of the command: a status line still shown is erased, held lines are dropped."""
        self._stop_status()
        self._held = None

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    @contextlib.contextmanager
    def run(self, index: int, total: int, seed: int, final: str = "final evaluation"):
        """Yields (on_step, on_epoch) callbacks for one run. The per-epoch table streams: each row is printed
        as its epoch ends, above the progress bar, so a long (CPU) run shows its learning curve as it goes."""
        if not self.verbose:
            yield None, None
            return
        self.err.print(f"\nrun {index + 1}/{total} (seed {seed})", highlight=False)
        self.err.print(_ROW.format("epoch", "step", "train loss", "train acc %", "test acc %", "timed s"),
                       highlight=False)

        def on_epoch(row: dict) -> None:
            self.err.print(_ROW.format(f"{row['epoch']:g}", row["step"], f"{row['train_loss']:.4f}",
                                       _pct(row["train_acc"]), _pct(row["val_acc"]), f"{row['train_seconds']:.2f}"),
                           highlight=False)

        if self.err.is_terminal:
            progress = Progress(TextColumn(f"run {index + 1}/{total}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.err, transient=True)
            task = progress.add_task("train", total=None)

            def on_step(step: int, steps: int) -> None:
                progress.update(task, completed=step, total=steps)

            with progress:
                yield on_step, on_epoch
        else:
            start = time.perf_counter()
            shown = [0]  # tenths of the run already reported

            def on_step(step: int, steps: int) -> None:
                tenth = step * 10 // steps
                if tenth > shown[0]:
                    shown[0] = tenth
                    self.err.print(f"run {index + 1}/{total}: step {step}/{steps} ({100 * step // steps}%), "
                                   f"{time.perf_counter() - start:.1f} s", highlight=False)

            yield on_step, on_epoch
        self.err.print(f"(last row: test accuracy of the {final}; timed s: the timed region so far)",
                       highlight=False)

    def summary(self, result) -> None:
        if not self.show_summary or not result.runs:
            return
        title = printable(f"{result.recipe} on {result.dataset} ({result.device}), n={len(result.finished)}")
        if result.smoke_test:
            title = "SMOKE TEST (pipeline check, not a result): " + title
        table = Table(title=Text(title, style="table.title"), title_justify="left")
        for col in ("", "mean", "std", "95% CI of mean", "min", "max"):
            table.add_column(col, justify="right")
        if result.finished:
            # intervals clipped to the quantities' ranges: at n = 2 a t-interval of seconds reaches far below 0
            acc = summarize(result.accuracies, FRACTION)
            secs = summarize([r.train_seconds for r in result.finished], NON_NEGATIVE)
            ci_acc = "n/a" if acc.ci95_low is None else f"{_pct(acc.ci95_low)} .. {_pct(acc.ci95_high)}"
            ci_secs = "n/a" if secs.ci95_low is None else f"{secs.ci95_low:.2f} .. {secs.ci95_high:.2f}"
            table.add_row("test acc %", _pct(acc.mean), _pct(acc.std), ci_acc, _pct(acc.min), _pct(acc.max))
            table.add_row("timed s", _secs(secs.mean), _secs(secs.std), ci_secs, _secs(secs.min), _secs(secs.max))
        hits = sum(a >= result.target_accuracy for a in result.accuracies)
        caption = [f"{hits}/{len(result.finished)} runs reached the target {_pct(result.target_accuracy)}%."]
        if callable(getattr(result, "record", None)):  # the records rule's verdict on the mean, before the runs'
            caption.insert(0, record_text(result.record(), result.target_accuracy))
        if result.diverged_runs:
            caption.append(f"{result.diverged_runs} of {len(result.runs)} runs diverged (NaN/inf loss): they are not "
                           "in the table's statistics; the records rule counts each as accuracy 0.")
        if result.interrupted:
            caption.append(f"Interrupted after {len(result.runs)} of {result.runs_requested} runs.")
        if len(result.finished) == 1:
            caption.append("One run has no spread: std and interval are n/a.")
        caption.append(f"Timed region: {result.timed_region}. Data loading ({result.data_seconds:.1f} s) and warm-up "
                       f"({result.warmup_seconds:.1f} s) are reported apart.")
        mfu = result.mfu() if callable(getattr(result, "mfu", None)) else None
        if mfu is not None:
            caption.append(f"{result.flops.run / 1e12:,.3g} TFLOP a run (convolutions and matmuls); "
                           f"{peak.mfu_text(mfu)}.")
        table.caption = Text(printable(" ".join(caption)), style="table.caption")  # text, never rich's markup
        self.out.print(table)
