"""What `speedrun train` shows: a progress bar per run, a per-epoch table, the multi-run summary.

Everything goes to stderr except the summary table, so `speedrun train ... > summary.txt` keeps the result.
Silent when verbose is False (the Python API's default).
"""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from speedrun.stats import summarize


_ROW = "{:>8} {:>6} {:>11} {:>12} {:>11} {:>9}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.2f}"


class Display:
    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.err = Console(stderr=True)
        self.out = Console(file=sys.stdout)

    def line(self, text: str) -> None:
        if self.verbose:
            self.err.print(text, highlight=False, markup=False)

    @contextlib.contextmanager
    def run(self, index: int, total: int, seed: int):
        """Yields (on_step, on_epoch) callbacks for one run. The per-epoch table streams: each row is printed
        as its epoch ends, above the progress bar, so a long (CPU) run shows its learning curve as it goes."""
        if not self.verbose:
            yield None, None
            return
        progress = Progress(TextColumn(f"run {index + 1}/{total}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.err, transient=True)
        task = progress.add_task("train", total=None)
        self.err.print(f"\nrun {index + 1}/{total} (seed {seed})", highlight=False)
        self.err.print(_ROW.format("epoch", "step", "train loss", "train acc %", "test acc %", "timed s"),
                       highlight=False)

        def on_step(step: int, steps: int) -> None:
            progress.update(task, completed=step, total=steps)

        def on_epoch(row: dict) -> None:
            progress.console.print(_ROW.format(f"{row['epoch']:g}", row["step"], f"{row['train_loss']:.4f}",
                                               _pct(row["train_acc"]), _pct(row["val_acc"]),
                                               f"{row['train_seconds']:.2f}"), highlight=False)

        with progress:
            yield on_step, on_epoch
        self.err.print("(last row: final test accuracy with TTA; timed s: the timed region so far)",
                       highlight=False)

    def summary(self, result) -> None:
        if not self.verbose or not result.runs:
            return
        acc = summarize(result.accuracies)
        secs = summarize([r.train_seconds for r in result.runs])
        table = Table(title=f"{result.recipe} on {result.dataset} ({result.device}), n={acc.n}",
                      title_justify="left")
        for col in ("", "mean", "std", "95% CI of mean", "min", "max"):
            table.add_column(col, justify="right")
        table.add_row("test acc %", _pct(acc.mean), _pct(acc.std), f"{_pct(acc.ci95_low)} .. {_pct(acc.ci95_high)}",
                      _pct(acc.min), _pct(acc.max))
        table.add_row("timed s", f"{secs.mean:.2f}", f"{secs.std:.2f}",
                      f"{secs.ci95_low:.2f} .. {secs.ci95_high:.2f}", f"{secs.min:.2f}", f"{secs.max:.2f}")
        hits = sum(a >= result.target_accuracy for a in result.accuracies)
        table.caption = (f"{hits}/{acc.n} runs reached the target {_pct(result.target_accuracy)}%. Timed region: "
                         "whitening init + training + TTA eval; data loading "
                         f"({result.data_seconds:.1f} s) and warm-up ({result.warmup_seconds:.1f} s) excluded.")
        self.out.print(table)
