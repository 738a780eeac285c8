"""`speedrun ablate RECIPE --to-target`: how many epochs (and seconds) does each variant need to reach the target?

The variants are the ones `speedrun ablate` measures: the recipe itself (baseline) and each registered trick that
is on in it, switched off alone. A variant reaches the target at E epochs when the mean test accuracy of its n runs
(seeds S..S+n-1), each trained for E epochs with the whole schedule compressed to fit as --epochs does, is at least
the config's target_accuracy (lower it with --set target_accuracy=0.5). A probe with a diverged run is a miss.
This is the search's criterion (airbench's budget search), not the records rule (records/stats.py: p < 0.01 in a
one-sided t-test), which would ask a 3-run probe for a mean some four standard deviations above the target and
so find the epochs a record needs rather than the epochs the mean needs.

The search is bounded (at most --max-probes probes per variant) and moves on the grid of whole optimizer steps:
--epochs E trains ceil(E * N / batch) steps (data/loader.py), so two epoch values with one step count would train
the same thing twice. It starts at the recipe's epochs E0; reached there, it halves until a probe misses or the
floor (E0 / 16, one step at least) is reached; missed there, it doubles until one reaches or the ceiling (4 * E0)
misses; then it bisects the bracket with the probes left, stopping when the bracket is one step wide. The answer is
the smallest probed epochs that reached, with the mean timed seconds there, and the largest that missed below it.

All variants advance in lockstep, as bench's settings do: each round trains every still-searching variant's next
probe, seed by seed, the variants of each seed in an order balanced as bench's rounds are (bench.round_orders,
seeded by --seed), so neither drift on a shared machine nor the place in a round falls on one variant; the order
is recorded, and an untimed warm-up of each variant on every device comes first (bench.warm_up). Every probe is
stored as a result of its own and the search as a report (bench.run_and_store); Ctrl-C keeps the finished runs as
a partial report.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator
from typing import Any

from speedrun import dist
from speedrun.config import check_int
from speedrun.errors import print_line
from speedrun.instruments.bench import PartialReport, measured_run, round_orders, stopped_by, warm_up
from speedrun.instruments.variants import set_text, split_tricks
from speedrun.records.environment import environment
from speedrun.run.prepared import MAX_EPOCHS, MAX_RUNS, PreparedRun, RunRequest, prepare

DEFAULT_PROBES = 5
# Two: the start and one step away from it. Twenty: more would bisect the 64x range [E0 / 16, 4 * E0] below a step.
MIN_PROBES, MAX_PROBES = 2, 20
FLOOR_DIVISOR, CEILING_FACTOR = 16, 4  # the search stays within [E0 / 16, 4 * E0]


def bounds(start: int, most: int) -> tuple[int, int]:
    """(floor, ceiling) in steps for a search starting at `start` steps; `most`: the largest count allowed."""
    return max(1, math.ceil(start / FLOOR_DIVISOR)), max(start, min(CEILING_FACTOR * start, most))


def probe_plan(start: int, floor: int, ceiling: int, max_probes: int) -> Generator[int, bool, None]:
    """The search as a generator of step counts: each value is the next probe; `send(reached)` answers it.

    A probe lies strictly between the largest count that missed and the smallest that reached, so no count is
    probed twice, and the answers stay consistent with an accuracy that grows with training."""
    assert 1 <= floor <= start <= ceiling and max_probes >= 1, (floor, start, ceiling, max_probes)
    reached_at: int | None = None  # the smallest count that reached
    missed_at: int | None = None  # the largest count that missed
    steps = start
    for used in range(1, max_probes + 1):
        if (yield steps):
            reached_at = steps
        else:
            missed_at = steps
        if used == max_probes:
            return
        if missed_at is None:  # every probe reached: shorter
            if reached_at <= floor:
                return
            steps = max(floor, reached_at // 2)
        elif reached_at is None:  # every probe missed: longer
            if missed_at >= ceiling:
                return
            steps = min(ceiling, 2 * missed_at)
        elif reached_at - missed_at > 1:
            steps = (missed_at + reached_at) // 2
        else:  # the bracket is one step wide: the answer is exact
            return


def search(measure: Callable[[int], tuple[bool, Any]], start: int, floor: int, ceiling: int,
           max_probes: int) -> list[tuple[int, bool, Any]]:
    """One variant's search with `measure(steps) -> (reached, info)`: the probes in order, (steps, reached, info).
    (The command drives probe_plan itself, to advance every variant's search in lockstep.)"""
    plan, probes = probe_plan(start, floor, ceiling, max_probes), []
    steps = next(plan)
    while True:
        reached, info = measure(steps)
        probes.append((steps, reached, info))
        try:
            steps = plan.send(reached)
        except StopIteration:
            return probes


def to_target(request: RunRequest, *, runs: int = 3, max_probes: int = DEFAULT_PROBES, seed: int = 0,
              log: Callable[[str], None] = print_line) -> dict:
    """Search the epochs each ablate variant needs to reach its target; return the report (see module), or raise
    PartialReport with the report of the finished runs where an interrupt or an error stopped the search."""
    runs = check_int("runs", "--runs", runs, 1, MAX_RUNS)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    max_probes = check_int("max_probes", "--max-probes", max_probes, MIN_PROBES, MAX_PROBES)
    run = prepare(request, join=False)
    family, base = run.family, run.cfg
    measured, already_off = split_tricks(family.TRICKS, base, run.device, family.idle_tricks(base))
    variants = [("baseline", {})] + [(f"{key}={set_text(off)}", {key: set_text(off)}) for key, off, _ in measured]
    configs = {name: run.config(changes) for name, changes in variants}
    run.join()  # under torchrun every probe run is one run of all K processes
    clean = False
    try:
        report, interrupt = _search(run, variants, configs, runs, seed, max_probes, log)
        clean = interrupt is None or getattr(interrupt, "in_step", False)
    finally:
        dist.shutdown(run.world, clean)  # the peers wait for each other only if they all got here alike
    report.update({"already_off": [{"trick": key, "off": off, "what": what} for key, off, what in already_off],
                   "target_accuracy": base.target_accuracy, "timed_region": family.timed_region(base)})
    if interrupt is not None:
        raise PartialReport(report, interrupt)
    return report


def _search(run: PreparedRun, variants: list[tuple[str, dict]], configs: dict[str, Any], runs: int, seed: int,
            max_probes: int, log: Callable[[str], None]) -> tuple[dict, BaseException | None]:
    """to_target's measuring, by every process of the run's world: data, checks, warm-ups, the lockstep rounds;
    (the report (without the already-off tricks, the target and the timed region, which to_target adds), what
    stopped the rounds part way or None)."""
    family, dev, world = run.family, run.device, run.world
    data = run.load(log)
    for i, cfg in enumerate(configs.values()):
        run.checked(cfg, quiet=i > 0)  # the baseline's notes, as train shows them
    n_train = data.num_train

    def at_steps(cfg, steps: int):
        """cfg trained for exactly `steps` steps: the recipe's own config at its own count, else the schedule
        compressed to the epochs that the family counts as `steps` (its epochs_for_steps and run_steps)."""
        if steps == family.run_steps(cfg, n_train):
            return cfg
        probe = family.with_epochs(cfg, family.epochs_for_steps(cfg, n_train, steps))
        probe.validate()
        assert family.run_steps(probe, n_train) == steps, (steps, probe.epochs)
        return probe

    state: dict[str, dict] = {}
    for name, _ in variants:
        cfg = configs[name]
        start = family.run_steps(cfg, n_train)
        floor, ceiling = bounds(start, family.run_steps(family.with_epochs(cfg, MAX_EPOCHS), n_train))
        plan = probe_plan(start, floor, ceiling, max_probes)
        state[name] = {"plan": plan, "next": next(plan), "probes": [], "floor": floor, "ceiling": ceiling}
    warmups = {}
    for name, _ in variants:
        log(f"warm-up (untimed): {name}")
        warmups[name] = warm_up(family, configs[name], data, dev, world, name, log)
    order: list[dict] = []
    interrupt: BaseException | None = None
    orders = random.Random(seed)  # each round's own seed for round_orders, drawn in turn: reruns repeat the order
    try:
        for rnd in range(max_probes):
            active = [name for name, _ in variants if state[name]["next"] is not None]
            if not active:
                break
            for name in active:
                steps = state[name]["next"]
                state[name]["probes"].append({"steps": steps, "cfg": at_steps(configs[name], steps), "runs": []})
            for r, places in enumerate(round_orders(len(active), runs, orders.randrange(2**62))):
                for name in (active[i] for i in places):
                    probe = state[name]["probes"][-1]
                    cfg = probe["cfg"]
                    log(f"round {rnd + 1}: {name}, {cfg.epochs:.4g} epochs ({probe['steps']} steps), seed {seed + r}")
                    probe["runs"].append(measured_run(family, cfg, data, dev, seed + r,
                                                      f"{name}, {cfg.epochs:.4g} epochs", log, world))
                    order.append({"round": rnd, "variant": name, "epochs": cfg.epochs, "steps": probe["steps"],
                                  "seed": seed + r})
            for name in active:
                s = state[name]
                try:
                    s["next"] = s["plan"].send(_reached(s["probes"][-1]["runs"], configs[name].target_accuracy))
                except StopIteration:
                    s["next"] = None
    except (KeyboardInterrupt, Exception) as e:  # Ctrl-C, SIGTERM, an error in a later run: the finished runs
        if not order:                               # make a partial report, marked as such (PartialReport)
            raise
        interrupt = e
    env, stop = environment(dev), stopped_by(interrupt)
    results: list[dict] = []
    rows = []
    for name, changes in variants:
        s, probes = state[name], []
        for p in (p for p in s["probes"] if p["runs"]):
            cfg, complete = p["cfg"], len(p["runs"]) == runs
            results.append(run.result(
                p["runs"], cfg, env=env, runs_requested=runs, complete=complete, interrupted=stop["interrupted"],
                command=f"bench {name}, {cfg.epochs:.6g} epochs ({p['steps']} steps)", kind="to-target").to_dict())
            probes.append(_probe_row(p, cfg.target_accuracy if complete else None, len(results) - 1))
        rows.append(_variant_row(name, changes, s, probes, warmups[name], n_train, configs[name]))
    return {"benchmark": "to_target", "recipe": run.recipe.name, "dataset": run.dataset, "device": dev.type,
            "runs": runs,
            "world": world.to_dict(), "seed": seed, "max_probes": max_probes,
            **stop,
            "order": order, "variants": rows, "environment": env, "results": results}, interrupt


def _reached(runs: list, target: float) -> bool:
    """The mean accuracy of a probe's runs is at least the target, and none of them diverged."""
    done = [r.accuracy for r in runs if r.diverged is None]
    return len(done) == len(runs) > 0 and sum(done) / len(done) >= target


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _probe_row(probe: dict, target: float | None, result: int) -> dict:
    """One probe for the report; target None: its runs were cut short (reached is then None: not answered)."""
    done = [r for r in probe["runs"] if r.diverged is None]
    return {"epochs": probe["cfg"].epochs, "steps": probe["steps"], "seeds": [r.seed for r in probe["runs"]],
            "accuracies": [r.accuracy for r in probe["runs"]], "seconds": [r.train_seconds for r in probe["runs"]],
            "mean_accuracy": _mean([r.accuracy for r in done]), "mean_seconds": _mean([r.train_seconds for r in done]),
            "diverged": len(probe["runs"]) - len(done),
            "reached": None if target is None else _reached(probe["runs"], target), "result": result}


def _variant_row(name: str, changes: dict, s: dict, probes: list[dict], warmup: float, n_train: int, cfg) -> dict:
    hit = [p for p in probes if p["reached"]]
    miss = [p for p in probes if p["reached"] is False]
    best = min(hit, key=lambda p: p["steps"]) if hit else None
    below = max((p for p in miss if best is None or p["steps"] < best["steps"]), key=lambda p: p["steps"],
                default=None)
    accuracies = [p["mean_accuracy"] for p in probes if p["mean_accuracy"] is not None]
    return {"name": name, "overrides": changes,
            "epochs_needed": best and best["epochs"], "steps_needed": best and best["steps"],
            "seconds_needed": best and best["mean_seconds"],
            # the bracket's lower end: the answer lies in (missed_epochs, epochs_needed]
            "missed_epochs": below and below["epochs"], "missed_steps": below and below["steps"],
            "exact": best is not None and (best["steps"] == s["floor"] if below is None
                                           else best["steps"] - below["steps"] == 1),
            "best_accuracy": max(accuracies) if accuracies else None,
            "searched_up_to_epochs": max((p["epochs"] for p in probes), default=None),
            "start_epochs": cfg.epochs, "floor_epochs": s["floor"] * cfg.batch_size / n_train,
            "ceiling_epochs": s["ceiling"] * cfg.batch_size / n_train, "search_complete": s["next"] is None,
            "warmup_seconds": warmup, "diverged": sum(p["diverged"] for p in probes), "probes": probes}
