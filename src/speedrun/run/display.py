"""What `speedrun train` shows: a progress bar per run, a per-epoch table, the multi-run summary; and the progress
of a long evaluation (`speedrun eval`, EvalProgress).

Everything goes to stderr except the summary, so `speedrun train ... > summary.txt` keeps the result.
verbose=False (the Python API's default) shows nothing; quiet (the CLI's --quiet, summary="lines") shows only the
result lines: the statistics in one line, the target's verdict in another.
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
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from speedrun.engine import peak
from speedrun.errors import printable
from speedrun.records.stats import FRACTION, NON_NEGATIVE, record_alpha, record_p_text, summarize

if TYPE_CHECKING:
    from rich.status import Status

_ROW = "{:>8} {:>6} {:>11} {:>12} {:>11} {:>9}"
_WIDE = 200  # columns for output that is not a terminal: long enough for any table, so nothing wraps


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def verdict_text(result) -> str:
    """One sentence on the target: how many runs reached it, and whether the result counts as reaching it by the
    records rule (session.Result.record(): at least 2 runs whose mean accuracy a one-sided t-test puts above the
    target with p below the threshold), said so that a first reader can tell the two apart."""
    target = f"the target {_pct(result.target_accuracy)}%"
    finished = len(result.finished)
    if not finished:
        return f"No run finished: nothing to judge against {target}."
    if result.smoke_test:
        return f"A smoke test checks that the pipeline runs: its accuracy is not judged against {target}."
    if not getattr(result, "target_applies", True):
        return (f"No record is judged against {target}: it was measured on the recipe's own data set, which this is "
                "not; give this data set a target with --set target_accuracy=FRACTION.")
    hits = sum(a >= result.target_accuracy for a in result.accuracies)
    reached = (f"{hits}/{finished} runs reached {target}" if finished > 1 else
               f"The run {'reached' if hits else 'did not reach'} {target}")
    record = result.record() if callable(getattr(result, "record", None)) else None
    if record is None:
        return f"{reached}."
    alpha = f"{record['threshold']:g}"
    if record["p"] is None:
        return (f"{reached}; a record needs at least 2 runs (--runs N) whose mean accuracy a one-sided t-test puts "
                f"above the target with p < {alpha}.")
    p, n = record_p_text(record["p"]), record["n"]
    if record["reached"]:
        return (f"{reached}, and a one-sided t-test puts their mean above it with p = {p} < {alpha} (n={n}): a "
                "record by the records rule.")
    mean = "their mean (a diverged run counted as 0)" if record["diverged"] else "their mean"
    if record["p"] >= 0.5:  # the t statistic is <= 0: the mean is at or below the target
        return (f"{reached}, but {mean} is not above it: not a record, which needs the mean above the target with "
                f"p < {alpha} in a one-sided t-test (here p = {p}, n={n}).")
    return (f"{reached} and {mean} is above it, but not surely enough for a record: a one-sided t-test gives p = {p}, "
            f"and a record needs p < {alpha} (n={n}); more runs would tell.")


def result_line(result) -> str:
    """The statistics of a result in one line (--quiet's): its runs' mean test accuracy and timed seconds."""
    head = printable(f"{result.recipe} on {result.dataset} ({result.device}), n={len(result.finished)}")
    if result.smoke_test:
        head = "SMOKE TEST (pipeline check, not a result): " + head
    if not result.finished:
        return f"{head}: no run finished"
    acc = summarize(result.accuracies, FRACTION)
    secs = summarize([r.train_seconds for r in result.finished], NON_NEGATIVE)
    if acc.n == 1:
        stats = f"test acc {_pct(acc.mean)}%, timed {_secs(secs.mean)} s"
    else:
        stats = (f"test acc {_pct(acc.mean)} ± {_pct(acc.std)}%, timed {_secs(secs.mean)} ± {_secs(secs.std)} s "
                 "(mean ± std)")
    diverged = (f"; {result.diverged_runs} of {len(result.runs)} runs diverged (NaN/inf loss)"
                if result.diverged_runs else "")
    stopped = f"; interrupted after {len(result.runs)} of {result.runs_requested} runs" if result.interrupted else ""
    return f"{head}: {stats}{diverged}{stopped}"


def _console(stream) -> Console:
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream) if tty else Console(file=stream, width=_WIDE, soft_wrap=True)


class Display:
    """Lines shown before `release()` (downloading, extracting, decoding ...) are held back: a refused input then
    costs exactly one line, the error, whatever was going on before it. On a terminal the latest held line shows
    meanwhile as a transient status line, erased when it ends; `release()` prints the held lines for good once every
    check has passed, and `close()` drops them."""

    def __init__(self, verbose: bool, summary: bool | str | None = None):
        """verbose: progress, tables and notes on stderr; summary: the final table on stdout (default: verbose), or
        "lines" for the result lines alone (result_line, verdict_text)."""
        self.verbose = verbose
        self.show_summary = verbose if summary is None else bool(summary)
        self.brief = summary == "lines"
        self.err = _console(sys.stderr)
        self.out = _console(sys.stdout)
        self._held: list[str] | None = []
        self._status: Status | None = None
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
        """Yields (on_step, on_epoch, on_evaluation) callbacks for one run. The per-epoch table streams: each row is
        printed as its epoch ends, above the progress bar, so a long (CPU) run shows its learning curve as it goes;
        the final evaluation (minutes with TTA on a CPU) has its progress too."""
        if not self.verbose:
            yield None, None, None
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
            scoring: list = []  # the final evaluation's task, once it starts

            def on_step(step: int, steps: int) -> None:
                progress.update(task, completed=step, total=steps)

            def on_evaluation(done: int, passes: int) -> None:
                if not scoring:
                    scoring.append(progress.add_task(final, total=passes))
                progress.update(scoring[0], completed=done, total=passes)

            with progress:
                yield on_step, on_epoch, on_evaluation
        else:
            start = time.perf_counter()
            shown = [0, 0]  # tenths of the run's steps, and of its final evaluation, already reported

            def on_step(step: int, steps: int) -> None:
                tenth = step * 10 // steps
                if tenth > shown[0]:
                    shown[0] = tenth
                    self.err.print(f"run {index + 1}/{total}: step {step}/{steps} ({100 * step // steps}%), "
                                   f"{time.perf_counter() - start:.1f} s", highlight=False)

            def on_evaluation(done: int, passes: int) -> None:
                tenth = done * 10 // max(1, passes)
                if done == 0 or tenth > shown[1]:
                    shown[1] = tenth
                    self.err.print(f"run {index + 1}/{total}: {final} {100 * done // max(1, passes)}%, "
                                   f"{time.perf_counter() - start:.1f} s", highlight=False)

            yield on_step, on_epoch, on_evaluation
        self.err.print(f"(last row: test accuracy of the {final}; timed s: the timed region so far)",
                       highlight=False)

    def summary(self, result) -> None:
        if not self.show_summary or not result.runs:
            return
        if self.brief:
            for text in (result_line(result), verdict_text(result)):
                self.out.print(printable(text), highlight=False, markup=False)
            return
        config = getattr(result, "config", None)
        network = config.get("model") if isinstance(config, dict) else None
        title = printable(f"{result.recipe}{f' with network {network}' if network else ''} on {result.dataset} "
                          f"({result.device}), n={len(result.finished)}")
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
        caption = [verdict_text(result)]
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


def duration_text(seconds: float) -> str:
    """A duration as a person reads it: "42 s", "3 min 5 s", "1 h 12 min"."""
    seconds = max(0, round(seconds))
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class EvalProgress:
    """How far an evaluation has got, and an estimate of the time left: a bar on a terminal, else a line at every
    tenth of the work (as a run's progress), nothing when not verbose (--quiet). It tracks either way: where() says
    how far it got, for the line an interrupt ends on.

    The work is counted in forward passes of one image (tricks/tta.py's passes: a TTA view is a pass), so the
    estimate holds across models of different TTA levels; each stage (one model's warm-up, its pass over the test
    images) is shown in images."""

    def __init__(self, verbose: bool, total: int, title: str = "eval"):
        self.total, self.done = max(1, total), 0
        self.title = printable(title)
        self.verbose = verbose
        self._stage = ("", 0, 1, 0)  # label, images, passes, passes done
        self._start = time.perf_counter()
        self._shown = 0  # tenths already written (not a terminal)
        self._bar: Progress | None = None
        self._err = _console(sys.stderr) if verbose else None
        if self._err is not None and self._err.is_terminal:
            self._bar = Progress(TextColumn(self.title + " {task.description}", markup=False), BarColumn(),
                                 TextColumn("{task.fields[images]}", markup=False), TimeElapsedColumn(),
                                 TextColumn("left"), TimeRemainingColumn(), console=self._err, transient=True)
            self._task = self._bar.add_task("", total=self.total, images="")
            self._bar.start()

    def stage(self, label: str, images: int, passes: int) -> None:
        """The next stage: `label` ("model 1/2 (m1)") over `images` images, `passes` forward passes of the work."""
        self._stage = (printable(label), images, max(1, passes), 0)
        if self.done == 0 and self._bar is None and self.verbose:  # a first line at once: the first tenth may be
            self._line()  # a minute away on a CPU (a 2,000-image TTA batch), the bar's own start is shown at once
        self._show()

    def advance(self, passes: int) -> None:
        label, images, total, done = self._stage
        self._stage = (label, images, total, min(total, done + passes))
        self.done = min(self.total, self.done + passes)
        self._show()

    def images_done(self) -> int:
        _, images, total, done = self._stage
        return images * done // total

    def where(self) -> str:
        """ "model 2/2 (m2) at 4,000/10,000 images" """
        label, images, _, _ = self._stage
        return f"{label} at {self.images_done():,}/{images:,} images"

    def left(self) -> float | None:
        """Seconds left at the rate so far; None before any work is done."""
        if not self.done:
            return None
        return (time.perf_counter() - self._start) * (self.total - self.done) / self.done

    def _show(self) -> None:
        if not self.verbose:
            return
        label, images, _, _ = self._stage
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=label,
                             images=f"{self.images_done():,}/{images:,} images")
            return
        tenth = self.done * 10 // self.total
        if tenth > self._shown:
            self._shown = tenth
            self._line()

    def _line(self) -> None:
        """ "eval: 41% (model 1/2 (m1) at 8,000/10,000 images), 2 min 13 s, about 3 min 7 s left" """
        assert self._err is not None  # a line is written only when verbose, which made the console
        left = self.left()
        estimate = "" if left is None or self.done == self.total else f", about {duration_text(left)} left"
        self._err.print(f"{self.title}: {100 * self.done // self.total}% ({self.where()}), "
                        f"{duration_text(time.perf_counter() - self._start)}{estimate}", highlight=False,
                        markup=False)

    def close(self) -> None:
        """The bar, if one is shown, erased."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
