"""`speedrun tune RECIPE`: the performance guide's settings measured on this machine, for this recipe.

PyTorch's performance tuning guide is a checklist (its sections: DataLoader workers and pinned memory, the cuDNN
autotuner, mixed precision, channels_last, batch size, fused optimizers, torch.compile for fused pointwise ops,
threads on a CPU); which items pay depends on the device and the model. The doctor tries each setting that
applies here against the current configuration (the recipe with any --set), one change at a time, all of them
interleaved round by round with the current one, n runs each, at a short budget (bench.py: an untimed warm-up of
each first, then rounds in an order balanced across them, so neither drift nor a place in the round falls on one
setting):
- the time ratio (setting / current) of the timed region with its 95% interval and Welch's p;
- for settings that change the numbers (precision, batch size), the accuracy difference too, marked: at a short
  budget it says whether the setting breaks training, not what it does to a full run;
- a setting that cannot run here (a compile without a compiler, a fused kernel the device lacks) is reported as
  such, with the reason, found by a smoke run before any timing.
Recommended: each setting whose ratio's whole interval lies below 1 and, where it changes the numbers, whose
accuracy difference is not significantly negative (its interval reaches 0 or above); per key the fastest such
value. Each was measured alone against the current configuration; how they combine is not measured (`speedrun
bench` with --set of them all answers that).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from speedrun.config import ConfigError, check_int
from speedrun.engine.loop import Diverged
from speedrun.engine.system import resolve_system
from speedrun.errors import counted, print_line
from speedrun.instruments.bench import bench_then
from speedrun.run.prepared import MAX_RUNS, PreparedRun, RunRequest, prepare
from speedrun.tricks.precision import default_cpu_threads, native_bf16_cpu

# (key, what the guide calls it); the order of the table before ranking
GUIDE = {"precision": "mixed precision (autocast)", "channels_last": "channels_last memory format",
         "compile": "torch.compile", "cudnn_benchmark": "cuDNN autotuner", "cpu_threads": "intra-op threads (CPU)",
         "batch_size": "batch size", "optimizer_kernel": "foreach/fused optimizer", "eval_batch_size":
         "evaluation batch size", "workers": "DataLoader workers", "pin_memory": "pinned memory",
         "prefetch_factor": "DataLoader prefetch", "half_weights": "half weights (no autocast casts)",
         "check_finite_every_steps": "fewer host syncs (finite-loss reads)",
         "index_free_eval_pool": "pooling without indices (evaluation)", "muon_ns_compile": "compiled Newton-Schulz"}
CHANGES_NUMBERS = frozenset({"precision", "batch_size", "half_weights"})


def _precisions(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["fp32", "fp16"] + (["bf16"] if torch.cuda.is_bf16_supported() else [])
    if device.type == "cpu":
        return ["fp32"] + (["bf16"] if native_bf16_cpu() else [])  # emulated bf16/fp16 run slower than fp32
    return ["fp32"]


def candidates(cfg, device: torch.device) -> list[tuple[str, dict[str, Any]]]:
    """(name, overrides) of each setting to try against `cfg` on `device`: every value of the guide's keys that
    applies here and differs from what `cfg` resolves to."""
    system = resolve_system(cfg, device)
    fields = {f.name for f in dataclasses.fields(cfg)}
    out: list[tuple[str, dict[str, Any]]] = []

    def add(changes: dict[str, Any]) -> None:
        if all(k in fields for k in changes):
            out.append((",".join(f"{k}={v}" for k, v in changes.items()), changes))

    for p in _precisions(device):
        if p != system.precision:  # fp32 with half_weights=on would be refused: half weights go back to auto
            add({"precision": p, **({"half_weights": "auto"} if p == "fp32" and cfg.half_weights == "on" else {})})
    add({"channels_last": "off" if system.channels_last else "on"})
    if cfg.compile:
        add({"compile": False})
    else:
        modes = ["default", "max-autotune-no-cudagraphs"] + (["reduce-overhead"] if device.type == "cuda" else [])
        for mode in modes:
            add({"compile": True, "compile_mode": mode})
    if device.type == "cuda":
        add({"cudnn_benchmark": not cfg.cudnn_benchmark})
    if device.type == "cpu":
        current = cfg.cpu_threads or default_cpu_threads()
        for threads in sorted({1, max(1, (os.cpu_count() or 1) // 2), os.cpu_count() or 1} - {current}):
            add({"cpu_threads": threads})
    for factor in (0.5, 2):
        add({"batch_size": max(1, int(cfg.batch_size * factor))})
    # "auto" is torch's own choice: the for-loop on a CPU, foreach on CUDA (torch.optim's docs, "Algorithms")
    kernel_now = cfg.optimizer_kernel if cfg.optimizer_kernel != "auto" else (
        "foreach" if device.type == "cuda" else "for-loop")
    for kernel in ("foreach", "fused", "for-loop"):
        if kernel != kernel_now:
            add({"optimizer_kernel": kernel})
    for factor in (0.5, 2):
        add({"eval_batch_size": max(1, int(cfg.eval_batch_size * factor))})
    # The lean step's settings (the "avoid unnecessary CPU-GPU synchronization" measured here)
    if system.precision != "fp32" and device.type != "cpu":
        add({"half_weights": "off" if system.half_weights else "on"})
    if device.type != "cpu":  # a CPU reads every step at no cost
        for every in sorted({1, 32} - {cfg.check_finite_every_steps}):
            add({"check_finite_every_steps": every})
    if "index_free_eval_pool" in fields and device.type != "cpu":  # a CPU's pooling skips indices already
        add({"index_free_eval_pool": not cfg.index_free_eval_pool})
    if "muon_ns_compile" in fields and getattr(cfg, "optimizer", "") == "muon":
        add({"muon_ns_compile": not cfg.muon_ns_compile})
    if "workers" in fields:
        cores = os.cpu_count() or 1
        for workers in sorted({0, max(1, cores // 2), cores, 2 * cores} - {cfg.workers}):
            add({"workers": workers})
    if "pin_memory" in fields:
        add({"pin_memory": not cfg.pin_memory})
    if "prefetch_factor" in fields:
        for factor in (1, 4):
            if factor != cfg.prefetch_factor:
                add({"prefetch_factor": factor})
    return out


def _smoke_each(run: PreparedRun, make_cfg: Callable[[str], Any], names: list[str],
                log: Callable[[str], None]) -> dict[str, str]:
    """{name: why it cannot run} for each setting whose config is refused (a doubled batch past the family's
    limit, say) or whose smoke run (a few steps) fails here."""
    failed = {}
    family, dev = run.family, run.device
    for name in names:
        log(f"does {name} run here? (a few steps)")
        try:
            cfg, small = family.smoke(make_cfg(name), run.data)
            family.check(cfg, small, dev, run.world)
            family.train_run(cfg, small, dev, 0)
        except Diverged:
            pass  # a few steps on little data may diverge; the timed runs say what the setting does
        except (RuntimeError, ValueError, NotImplementedError, TypeError, OSError) as e:
            # a setting the config refuses is named as the ValueError it is: ConfigError's name would add nothing
            kind = "ValueError" if isinstance(e, ConfigError) else type(e).__name__
            failed[name] = f"{kind}: {' '.join(str(e).split())[:160]}"
            log(f"{name}: cannot run here ({failed[name]})")
    return failed


def _verdict(setting: dict, changes_numbers: bool) -> tuple[bool, str]:
    """(recommended, why): faster over its whole interval, no run diverged, and where the setting changes the
    numbers an accuracy difference that was measured and is not significantly negative."""
    v = setting.get("versus_baseline") or {}
    secs, acc = v.get("train_seconds"), v.get("accuracy")
    if setting.get("diverged"):
        return False, f"{counted(setting['diverged'], 'run')} diverged"
    if secs is None:
        return False, "n/a (needs 2+ runs a side)"
    low, high = secs["ratio_ci95"]
    if high < 1:
        if changes_numbers and acc is None:
            return False, "faster; its accuracy could not be compared"
        if changes_numbers and acc["ci95"][1] < 0:
            return False, "faster, but accuracy falls"
        return True, "faster"
    if low > 1:
        return False, "slower"
    return False, "no clear difference"


def tune(request: RunRequest, *, runs: int = 3, seed: int = 0, only: list[str] | None = None,
         log: Callable[[str], None] = print_line) -> dict:
    """Measure every applicable setting against the current configuration (see the module); the report has a
    bench report's fields plus "tune": the rows ranked by measured gain and the recommended settings. Stopped part
    way: bench's PartialReport, its report given the rows of what finished."""
    check_int("runs", "--runs", runs, 1, MAX_RUNS)  # before the smoke runs, not after
    check_int("seed", "--seed", seed, 0, 2**62)
    run = prepare(request, join=False)  # one process: the CLI refuses tune under torchrun
    cfg, dev = run.cfg, run.device
    found = candidates(cfg, dev)
    if only:
        unknown = sorted(set(only) - set(GUIDE))
        if unknown:
            raise ValueError(f"--only {','.join(unknown)}: not a setting the doctor measures; choose from "
                             f"{', '.join(GUIDE)}")
        found = [(n, c) for n, c in found if set(c) & set(only)]
    if not found:
        raise ValueError("no setting to try on this device for this recipe" + (" (--only)" if only else ""))
    run.load(log)  # for the smoke runs and, handed on to bench, the timed ones
    run.checked()  # what no setting can change (the user's network, the data) refused once, not once a setting
    changes = dict(found)
    failed = _smoke_each(run, lambda name: run.config(changes[name]), list(changes), log)
    steps = [("current", {})] + [(n, c) for n, c in found if n not in failed]
    if len(steps) == 1:
        raise ValueError("no setting to try runs here: " + "; ".join(f"{n} ({why})" for n, why in failed.items()))
    current = resolve_system(cfg, dev)

    def verdict_rows(report: dict) -> None:
        report["benchmark"] = "tune"
        rows = []
        for s in report["settings"][1:]:
            keys = [k for k in changes[s["name"]] if k != "compile_mode"]
            variant = run.config(changes[s["name"]])
            # a setting may change the precision "auto" resolves to; none of the guide's does today, but a family's
            # rule may
            numbers = (any(k in CHANGES_NUMBERS for k in keys)
                       or resolve_system(variant, dev).precision != current.precision)
            good, verdict = _verdict(s, numbers)
            v = s.get("versus_baseline") or {}
            rows.append({"setting": s["name"], "guide": GUIDE.get(keys[0], keys[0]), "changes_numbers": numbers,
                         "overrides": changes[s["name"]], "n": s["n"], "warmup_seconds": s["warmup_seconds"],
                         "time": v.get("train_seconds"), "accuracy": v.get("accuracy"), "recommended": good,
                         "verdict": verdict})
        rows.sort(key=lambda r: r["time"]["ratio"] if r["time"] else float("inf"))
        recommended: dict[str, Any] = {}
        for r in rows:  # fastest first: the first recommended value of a key wins
            if r["recommended"] and not any(k in recommended for k in r["overrides"]):
                recommended.update(r["overrides"])
        report["tune"] = {"rows": rows, "recommended": recommended,
                          "cannot_run": [{"setting": n, "why": why} for n, why in failed.items()],
                          "current": {"precision": current.precision, "channels_last": current.channels_last,
                                      "compile": cfg.compile, "batch_size": cfg.batch_size,
                                      "optimizer_kernel": cfg.optimizer_kernel,
                                      "cpu_threads": cfg.cpu_threads or default_cpu_threads()}}

    return bench_then(verdict_rows, run, steps=steps, runs=runs, seed=seed, log=log, kind="tune")
