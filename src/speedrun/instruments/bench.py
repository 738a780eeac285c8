"""`speedrun bench RECIPE --runs N --vary KEY=V1,V2,...`: settings measured side by side, in interleaved order.

The baseline is the recipe's config (with any --set); each --vary value is one setting, that key changed alone.
Every setting first gets an untimed warm-up on every device (warm_up): the family's own (compile, autotune), or
where the family needs none for `speedrun train` (a CPU without compile), a short run of the setting itself, so
that what the first run in a process pays (the allocator's growth, oneDNN's kernel choice for each shape, lazy
imports: 2.7 s against 0.7 s measured on a CPU) is paid outside the timed runs. Then round r trains seed S + r of
every setting, in an order balanced across rounds (round_orders: over every k rounds of k settings each runs once
in each place, from a shuffle seeded by --seed), so neither drift on a shared machine (thermals, a neighbour's job)
nor a cost of running first or last in a round falls on one setting; the order is recorded. Per setting: mean ±
std of test accuracy and timed seconds, and against the baseline the difference with its 95% Welch interval,
Welch's p and the ratio of times with its interval (stats.mean_diff_test). Every setting's runs are also stored
in the results database as a training result of their own, and the bench itself as a report (`speedrun results`,
`speedrun compare`).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedrun import dist
from speedrun.config import check_int, field_types
from speedrun.engine.loop import Diverged, RunResult, signals_held
from speedrun.engine.system import resolve_device
from speedrun.errors import note_kept, print_line, warn
from speedrun.recipes import get_recipe
from speedrun.records import db, debug_apis
from speedrun.records.environment import environment
from speedrun.records.result_file import (check_result_path, claim_result_path, default_result_path, portable,
                                          release_result_path, write_json)
from speedrun.records.stats import FRACTION, NON_NEGATIVE, mean_diff_test, summarize
from speedrun.run import tensorboard as boards
from speedrun.run.prepared import MAX_RUNS, PreparedRun, RunRequest, prepare


class PartialReport(BaseException):
    """What an instrument raises where an interrupt (Ctrl-C, SIGTERM) or an error stopped it after some runs had
    finished: `report`, the report of those runs (marked incomplete, stopped_by), and `interrupt`, what stopped it,
    which run_and_store (a sweep: sweep()) raises as it was once the report and its runs are kept. A BaseException,
    as the KeyboardInterrupt it may carry: no `except Exception` between the two takes it for a failure of its own."""

    def __init__(self, report: dict, interrupt: BaseException):
        super().__init__(report, interrupt)
        self.report, self.interrupt = report, interrupt


def parse_vary(items: list[str], tuple_keys: frozenset[str] = frozenset()) -> list[tuple[str, list[str]]]:
    """["lookahead=true,false", "tta_level=0"] -> [("lookahead", ["true", "false"]), ("tta_level", ["0"])].

    A key whose value is itself comma-separated (widths=64,256,256: `tuple_keys`) takes ';' between values:
    "widths=64,256,256;32,64,64" is two settings, "widths=8,16,32" one."""
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        parts = [v.strip() for v in values.split(";" if key.strip() in tuple_keys else ",") if v.strip()]
        if not sep or not key.strip() or not parts:
            raise ValueError(f"--vary {item!r}: expected KEY=V1,V2,..., e.g. --vary lookahead=false")
        out.append((key.strip(), parts))
    return out


def recipe_vary(recipe: str, items: list[str]) -> list[tuple[str, list[str]]]:
    """parse_vary for `recipe`: its config's tuple-valued keys take ';' between values."""
    rec = get_recipe(recipe)
    tuple_keys = frozenset(k for k, t in field_types(type(rec.make_config())).items()
                           if getattr(t, "__origin__", None) is tuple)
    return parse_vary(items, tuple_keys)


def _stats(runs: list[RunResult]) -> dict:
    done = [r for r in runs if r.diverged is None]
    return {"n": len(done), "diverged": len(runs) - len(done),
            "accuracy": summarize([r.accuracy for r in done], FRACTION).to_dict() if done else None,
            "train_seconds": summarize([r.train_seconds for r in done], NON_NEGATIVE).to_dict() if done else None}


def _versus(runs: list[RunResult], base: list[RunResult]) -> dict | None:
    a = [r for r in runs if r.diverged is None]
    b = [r for r in base if r.diverged is None]
    if len(a) < 2 or len(b) < 2:
        return None  # no spread on a side: no interval, no p
    out = {}
    for key in ("accuracy", "train_seconds"):
        try:
            out[key] = mean_diff_test([getattr(r, key) for r in a], [getattr(r, key) for r in b])
        except ValueError:  # a zero baseline mean (no ratio)
            out[key] = None
    return out


def stopped_by(stop: BaseException | None) -> dict:
    """A report's account of what cut it short: an interrupt (Ctrl-C, SIGTERM) or an error in a later run."""
    failed = None if stop is None or isinstance(stop, KeyboardInterrupt) else f"{type(stop).__name__}: {stop}"
    return {"complete": stop is None, "interrupted": isinstance(stop, KeyboardInterrupt),
            "failed": None if failed is None else " ".join(failed.split())[:500]}


def measured_run(family, cfg, data, dev, seed: int, name: str, log, world=None, board=None,
                 dataset: str = "") -> RunResult:
    """One training run of a benchmark (by every process of `world` under torchrun): a divergence is a run too
    (its step, no accuracy), and the model is dropped (a benchmark keeps numbers, not weights). board: a
    tensorboard.Board (rank 0's, with --tensorboard) that gets the run as <setting>/seed-<n>."""
    with boards.run_log(board, cfg, seed=seed, dataset=dataset, steps=family.run_steps(cfg, data.num_train),
                         setting=name) as scalars:
        try:
            run = family.train_run(cfg, data, dev, seed, world=world, hooks=boards.run_hooks(scalars))
        except Diverged as e:
            log(f"warning: {name}, seed {seed}: {e}")
            run = e.as_run(seed, cfg.epochs)
    run.model = None
    return run


# The steps of a setting's short warm-up run, where the family has no warm-up of its own on this device: enough for
# the allocator to reach its working size and every kernel shape (a last partial batch aside) to be chosen once.
WARMUP_STEPS = 8


def warm_up(family, cfg, data, dev, world, name: str, log) -> float:
    """A setting's untimed warm-up before its timed runs, on every device; its seconds.

    The family's warm-up run (compile, autotune) where it has one; where it has none (family.warmup is 0.0: a CPU
    without compile, an ImageNet run, for which `speedrun train` needs none), a short run of `cfg` itself,
    WARMUP_STEPS steps at its batch size with its final evaluation, so that the costs of code run for the first
    time in a process fall here and not on whichever setting is timed first. A divergence here is a warning:
    compilation and autotuning happened before it, and the timed runs measure what the setting does."""
    start = time.perf_counter()
    try:
        seconds = family.warmup(cfg, data, dev, world)
        if seconds == 0.0:
            short = cfg
            if family.run_steps(cfg, data.num_train) > WARMUP_STEPS:
                short = family.with_epochs(cfg, family.epochs_for_steps(cfg, data.num_train, WARMUP_STEPS))
                try:
                    short.validate()
                except ValueError:  # a setting that cannot be cut this short (an epoch-long phase): the whole run
                    short = cfg
            family.train_run(short, data, dev, 0, world=world)
            seconds = time.perf_counter() - start
    except Diverged as e:
        log(f"warning: {name}: the warm-up run {e}")
        return time.perf_counter() - start
    return seconds


def round_orders(count: int, rounds: int, seed: int) -> list[list[int]]:
    """The order of `count` settings (0 .. count - 1) in each of `rounds` rounds, balanced: each block of `count`
    rounds is a Latin square, a seeded shuffle of the settings rotated by each of a seeded shuffle of the offsets,
    so over the block each setting runs once in each place (first, second, ... last), and no place twice in
    fewer rounds; a new shuffle per block changes which setting follows which. Seeded: the same --seed, the same
    order."""
    rng = random.Random(seed)
    orders: list[list[int]] = []
    while len(orders) < rounds:
        base, offsets = list(range(count)), list(range(count))
        rng.shuffle(base)
        rng.shuffle(offsets)
        orders += [base[k:] + base[:k] for k in offsets][:rounds - len(orders)]
    return orders


def bench(request: RunRequest | PreparedRun, *, vary: list[tuple[str, list[str]]] | None = None,
          steps: list[tuple[str, dict[str, Any]]] | None = None, runs: int = 3, seed: int = 0,
          log: Callable[[str], None] = print_line, tensorboard: str | os.PathLike | None = None,
          kind: str = "bench") -> dict:
    """Train the baseline (the request's config) and every --vary setting `runs` times, interleaved; return the
    report (see module), or raise PartialReport with the report of the runs that finished where an interrupt or an
    error in a later run stopped it. request: what to prepare, or a run prepared already (its data read once).

    steps: instead of vary, the settings themselves as (name, overrides), the first being the baseline (the
    waterfall of ablate.py: cumulative configs).
    tensorboard: a folder for TensorBoard event files (run/tensorboard.py): a new <time>-<recipe> folder in it,
    made before any data is read, with a run <setting>/seed-<n> per timed run (the warm-ups are not logged).
    kind: the instrument whose settings' results these are (records/db.py KINDS): "bench", or the one that asks
    bench to measure them (ablate, waterfall, tune)."""
    runs = check_int("runs", "--runs", runs, 1, MAX_RUNS)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    run = request if isinstance(request, PreparedRun) else prepare(request, join=False)
    rec, family = run.recipe, run.family
    if steps is None:
        steps = [("baseline", {})] + [(f"{key}={value}", {key: value})
                                      for key, values in vary or [] for value in values]
    settings = []
    for name, changes in steps:
        cfg = run.config(changes)
        if all(cfg != c for _, _, c in settings):  # a value that changes nothing (the baseline's own) is left out
            settings.append((name, changes, cfg))
    base = settings[0][2]
    if len(settings) == 1:
        raise ValueError("every --vary value equals the baseline's; give values that change the config")
    world, dev = run.join(), run.device  # under torchrun every run is one run of all K processes (train's)
    results: dict[str, list[RunResult]] = {name: [] for name, _, _ in settings}
    order = []
    interrupt, clean, board = None, False, None
    try:
        if tensorboard is not None:  # rank 0 writes the event files; its refusal ends every process
            board = dist.main_first(world, lambda: boards.open_board(tensorboard, rec.name), everyone=False)
        data = run.load(log)
        for i, (_, _, cfg) in enumerate(settings):
            # the baseline's warnings, as train shows them (the settings' are alike, or their own)
            run.checked(cfg, quiet=i > 0)
        warmups = {}
        for name, _, cfg in settings:
            log(f"warm-up (untimed): {name}")
            warmups[name] = warm_up(family, cfg, data, dev, world, name, log)
        try:
            for r, places in enumerate(round_orders(len(settings), runs, seed)):
                for name, _, cfg in (settings[i] for i in places):
                    log(f"round {r + 1}/{runs}: {name} (seed {seed + r})")
                    results[name].append(measured_run(family, cfg, data, dev, seed + r, name, log, world, board,
                                                      run.dataset))
                    order.append({"round": r, "setting": name, "seed": seed + r})
        except (KeyboardInterrupt, Exception) as e:  # Ctrl-C, SIGTERM, an error in a later run: the finished runs
            if not order:                               # make a partial report, marked as such (PartialReport)
                raise
            interrupt = e
        clean = interrupt is None or getattr(interrupt, "in_step", False)
    finally:
        if board is not None:
            board.close()
        dist.shutdown(world, clean)  # the peers wait for each other only if they all got here alike
    env, stop = environment(dev), stopped_by(interrupt)
    base_name = settings[0][0]
    base_runs = results[base_name]
    report = {"benchmark": "bench", "recipe": rec.name, "dataset": run.dataset, "device": dev.type, "runs": runs,
              "world": world.to_dict(), **stop,
              "vary": [[k, v] for k, v in vary or []], "order": order, "environment": env,
              "timed_region": family.timed_region(base),
              "settings": [{"name": name, "overrides": changes, "warmup_seconds": warmups[name],
                            **_stats(results[name]),
                            "versus_baseline": None if name == base_name else _versus(results[name], base_runs),
                            "runs": [r.to_dict() for r in results[name]]}
                           for name, changes, _ in settings]}
    report["results"] = [run.result(results[name], cfg, env=env, runs_requested=runs, complete=interrupt is None,
                                    interrupted=stop["interrupted"], command=f"bench {name}", kind=kind).to_dict()
                         for name, _, cfg in settings]
    if interrupt is not None:
        raise PartialReport(report, interrupt)
    return report


def bench_then(finish: Callable[[dict], None], request: RunRequest | PreparedRun, **bench_kwargs) -> dict:
    """bench(request, **bench_kwargs), then finish(report) adds an instrument's own rows (ablate's tricks, the
    waterfall's steps, the doctor's verdicts). Stopped part way, the report of the runs that finished gets its
    rows alike and bench's PartialReport goes on up."""
    try:
        report = bench(request, **bench_kwargs)
    except PartialReport as stopped:
        finish(stopped.report)
        raise
    finish(report)
    return report


def run_and_store(make: Callable[[Callable[[str], None]], dict], *, kind: str, recipe: str, dataset: str | None,
                  device: str, db_path: str | None, json_path: str | None, command: str,
                  log: Callable[[str], None], strict: bool = False) -> tuple[dict, Path | None, int | None]:
    """What `bench`, `ablate` and `ablate --to-target` share: the database opened and the report file claimed
    first (a bad db_path or an existing json_path fails before any training; no json_path: a new file under
    results/ named after `kind`, the recipe and the dataset), then `make(log)` trains and returns the report (or
    raises PartialReport: its report is kept alike, then what stopped it raised); every setting's result and the
    report are stored with `command`, and the report written. Returns (report, path,
    stored id). strict: refuse (ValueError) while a debugging switch that slows training is on (records/debug_apis.py);
    else each is a warning, and every result lists them.

    Under torchrun every process trains (make) and rank 0 alone logs, stores and writes; the others return
    (report, None, None) and log nothing."""
    world = dist.from_env()
    debug_apis.guard(strict, dist.device_for(world, resolve_device(device)))  # before anything is opened or claimed
    # The group is joined now (bench and to_target find it joined), so that rank 0's opening of the database and
    # claiming of the report file can end every process at once when it fails (dist.main_first).
    world = dist.init(world, dist.device_for(world, resolve_device(device)))

    def claim():
        # The report file before the database (a path given claimed, the default's folder checked): a report path
        # that cannot be claimed must not leave a new database behind.
        path = None if json_path is None else claim_result_path(json_path)
        try:
            if path is None:
                check_result_path(None)
            conn = db.connect(db_path)
        except BaseException:
            if path is not None:
                release_result_path(path)
            raise
        try:
            return conn, path or default_result_path(f"{kind}-{recipe}", dataset or "default")
        except BaseException:
            conn.close()
            raise

    try:
        claimed = dist.main_first(world, claim, everyone=False)
        if not world.is_main:
            try:
                return make(lambda line: None), None, None
            except PartialReport as stopped:  # rank 0 keeps the finished runs
                cause = stopped.interrupt
            raise cause  # past the except clause, which would make the PartialReport its __context__
    except BaseException:
        dist.shutdown(world, False)  # make() left the group already when it got that far (then this does nothing)
        raise
    conn, path = claimed
    written, interrupt = False, None  # interrupt: what stopped make(), raised once the finished runs are kept
    try:
        try:
            report = make(log)
        except PartialReport as stopped:  # the finished runs are kept as a whole report's are
            report, interrupt = stopped.report, stopped.interrupt
        report["command"] = command
        with signals_held():  # what finished is kept whole, whatever signal comes now
            report = portable(report)
            for result in report["results"]:
                result["command"] = f"{report['command']}  # setting {result['command'][6:]}"
            write_json(path, report)  # first: a database that cannot take the rows must not cost the report
            written = True
            try:
                for result in report["results"]:
                    db.insert_result(conn, result)
                stored = db.insert_result(conn, report)
            except ValueError as e:  # db.UnusableDatabase: damaged, full, locked, read-only; or a row it refuses
                stored = None
                # an import adds it later only where the database failed, not where it refused what the report holds
                later = (f"; `speedrun results import {path}` adds it later" if isinstance(e, db.UnusableDatabase)
                         else "")
                warn(f"the report was not stored in the results database ({e}); it is in {path}{later}")
        if interrupt is not None:
            note_kept(interrupt, len(report["order"]), path)
            raise interrupt
    finally:
        conn.close()
        if not written:
            release_result_path(Path(path))
        dist.shutdown(world, False)  # make() left the group already when it got that far (then this does nothing)
    return report, path, stored
