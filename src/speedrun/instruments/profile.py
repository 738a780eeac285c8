"""`speedrun profile RECIPE`: where a training step's time goes, on this device, for this recipe.

torch.profiler records real training steps of the recipe's own loop (its train_run, cut to wait + warm-up +
active steps at the recipe's batch size): `wait` steps unrecorded, `warmup` recorded and thrown away (the
profiler's own start-up), then `active` steps and the final evaluation. Where compile is on, the family's untimed
warm-up run happens first, so compilation is not in the profile.

From the recorded events:
- each phase's time per step, by the ranges each family's loop marks (engine/phases.py): data (the loader making
  a batch: augmentation, copies), forward (with the loss), backward, optimizer; the rest of the step is host
  overhead and idle (the loop's bookkeeping, Python, waiting). The final evaluation is shown once, apart.
- the operators' self time grouped by layer type (convolution, batchnorm, pooling, activation, linear, optimizer,
  copies and layout changes, other), and the top operators;
- peak memory (CUDA: the caching allocator's peak; CPU: the process's peak resident set);
- what the loop asks of a device per step and per epoch, counted on the meta device as CUDA would be asked
  (instruments/launch_count.py): kernels, copies to the device, reads back (host syncs) and data-dependent syncs,
  each copy, read and sync with its line: the performance guide's "avoid unnecessary CPU-GPU synchronization",
  for this recipe with these settings;
- FLOPs (the family's flops(), torch.utils.flop_counter on the real shapes): a training step, the evaluation,
  the whole recipe's run; achieved FLOP/s of the profiled steps and MFU against this device's measured peak
  for the precision used (engine/peak.py, measured now if not cached), and the datasheet's where one is known.
The trace opens in Perfetto (ui.perfetto.dev) and chrome://tracing.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import re
import resource
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, schedule

from speedrun.config import check_int
from speedrun.data.dataset import Dataset
from speedrun.engine import peak
from speedrun.engine.loop import Diverged, RunHooks
from speedrun.engine.phases import PHASES, PREFIX
from speedrun.engine.system import resolve_system, setup_system
from speedrun.errors import print_line
from speedrun.instruments import launch_count
from speedrun.records import debug_apis
from speedrun.records.environment import environment
from speedrun.records.result_file import claim_result_path, default_result_path, release_result_path
from speedrun.run.prepared import MAX_EPOCHS, RunRequest, make_config, prepare

# Operator name -> layer type, first match wins (aten's names; mkldnn_/cudnn_ variants included).
GROUPS = [
    ("convolution", r"conv"),
    ("batchnorm", r"batch_norm|native_batch_norm|layer_norm|group_norm"),
    ("pooling", r"pool"),
    ("activation", r"relu|gelu|silu|sigmoid|tanh|elu|hardswish|softmax|threshold"),
    ("linear", r"addmm|\bmm\b|aten::mm|bmm|matmul|linear"),
    ("optimizer", r"_foreach|lerp|addcdiv|addcmul|sgd|adam|fused"),
    ("copies/layout", r"copy|to_copy|contiguous|clone|cat|stack|permute|flip|pad|index|gather|scatter|_to\b"
                      r"|aten::to$|empty_strided|as_strided|transpose|reshape|view|fill_|zero_"),
]
TOP_OPERATORS = 10


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


# Kineto (the profiler's C++ side) writes a line to the process's stderr, fd 2, as it starts and stops recording
# ("USDT:2026-01-01 12:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start"), at its log's highest level
# (USDT): KINETO_LOG_LEVEL hides it only with Kineto's errors and warnings too, and only when set before Kineto's
# first use in the process. So those two lines are dropped where they are written, and Kineto's others pass.
_PROFILER_CHATTER = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\s*")


@contextlib.contextmanager
def _profiler_lines_dropped():
    """Around a profiler call that may start or stop its recording: what it writes to fd 2 goes to a temporary
    file, then to stderr without Kineto's start/stop lines. Python's writes in between (a warning) pass too, in
    their order: sys.stderr is flushed on both sides of the switch."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
        captured = tempfile.TemporaryFile()
    except OSError:  # no descriptor to spare: the lines show, and the profile goes on
        yield
        return
    try:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            captured.seek(0)
            while line := captured.readline(1 << 16):  # a line at a time: what a call writes may be long
                if not _PROFILER_CHATTER.fullmatch(line):
                    os.write(2, line)
    finally:
        os.close(saved)
        captured.close()


@contextlib.contextmanager
def _recording(prof: torch.profiler.profile):
    """`with prof:`, its start and stop without Kineto's lines about them (_profiler_lines_dropped)."""
    with _profiler_lines_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _profiler_lines_dropped():
            prof.__exit__(None, None, None)


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"bytes": torch.cuda.max_memory_allocated(device), "what": "CUDA caching allocator's peak"}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"bytes": kib if sys.platform == "darwin" else kib * 1024,
            "what": "the process's peak resident memory (the dataset included)"}


def _on_cpu(event) -> bool:
    """A host-side event (Kineto also copies ranges onto the GPU's timeline, under the same names)."""
    return getattr(getattr(event, "device_type", None), "name", "CPU") == "CPU"


def analyse(events, active: int) -> dict:
    """Per-step phase times, grouped operator self times and the top operators, from the profiler's events (the
    active steps and the final evaluation). Times in seconds; per step = over the `active` recorded steps.

    Phases are the host-side speedrun/<phase> ranges of the loop's thread; an operator belongs to the phase whose
    range holds its start, whatever thread ran it (on CUDA, backward's operators run on autograd's device thread).
    Self time is the host's (CPU) and, on CUDA, the kernels' (device) too."""
    ranges: list[tuple[float, float, str]] = []
    step_us = []
    for e in events:
        if not _on_cpu(e):
            continue
        if e.name.startswith("ProfilerStep"):
            step_us.append(e.time_range.elapsed_us())
        elif e.name.startswith(PREFIX):
            ranges.append((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]))
    ranges.sort()
    starts = [r[0] for r in ranges]

    def phase_at(t: float) -> str:
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0:  # the innermost range holding t (ranges nest: evaluation holds no other mark)
            start, end, name = ranges[i]
            if start <= t <= end:
                return name
            i -= 1
        return "host"

    phases: dict[str, float] = defaultdict(float)
    for start, end, name in ranges:
        phases[name] += end - start
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # group -> [cpu us, device us]
    by_phase_group: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # name -> [cpu us, device us, calls]
    for e in events:
        if not _on_cpu(e) or getattr(e, "is_user_annotation", False) or e.name.startswith(("ProfilerStep", PREFIX)):
            continue
        cpu_us, device_us = e.self_cpu_time_total, float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        group = group_of(e.name)
        groups[group][0] += cpu_us
        groups[group][1] += device_us
        by_phase_group[phase_at(e.time_range.start)][group] += cpu_us + device_us
        ops[e.name][0] += cpu_us
        ops[e.name][1] += device_us
        ops[e.name][2] += 1
    evaluation_s = phases.pop("evaluation", 0.0) / 1e6
    recorded_s = sum(step_us) / 1e6 - evaluation_s  # the last step's range runs on through the final evaluation
    step_s = max(0.0, recorded_s) / max(1, active)
    per_step = {name: phases.get(name, 0.0) / 1e6 / max(1, active) for name in PHASES if name != "evaluation"}
    per_step["host overhead and idle"] = max(0.0, step_s - sum(per_step.values()))
    on_device = any(device for _, device in groups.values())
    top = sorted(ops.items(), key=lambda kv: -(kv[1][1] if on_device else kv[1][0]))[:TOP_OPERATORS]
    return {"step_seconds": step_s, "phases_per_step_seconds": per_step, "evaluation_seconds": evaluation_s,
            "self_time_on": "device" if on_device else "cpu",
            "groups_self_seconds": {g: (device if on_device else cpu) / 1e6 for g, (cpu, device) in
                                    sorted(groups.items(), key=lambda kv: -(kv[1][1] if on_device else kv[1][0]))},
            "groups_cpu_seconds": {g: cpu / 1e6 for g, (cpu, _) in groups.items()},
            "phase_groups_self_seconds": {p: {g: us / 1e6 for g, us in gs.items()} for p, gs in by_phase_group.items()},
            "top_operators": [{"name": name, "self_seconds": (device if on_device else cpu) / 1e6,
                               "cpu_seconds": cpu / 1e6, "calls": int(calls), "group": group_of(name)}
                              for name, (cpu, device, calls) in top]}


def launches(family, cfg, data) -> dict:
    """What the recipe's loop asks of a device per steady-state step and per epoch (instruments/launch_count.py:
    its own loop on the meta device, as CUDA would be asked, whatever device is profiled): kernels, copies to the
    device, reads back (host syncs) and data-dependent syncs, with where each copy, read and sync is made. Counted
    for the families whose data lives in memory (Dataset); a streaming family's data path is not counted."""
    if not isinstance(data, Dataset):
        return {"counted": False, "why": "the loop's data path streams from workers: not counted on meta"}
    try:
        counts = launch_count.count_family(family, cfg, data.image_shape, data.num_classes)
    except Exception as e:  # noqa: BLE001 (an instrument's extra line: the profile stands without it, whatever failed)
        return {"counted": False, "why": f"not counted: the loop did not run on the meta device "
                                         f"({type(e).__name__}: {' '.join(str(e).split())[:160]})"}
    return {"counted": True, "per_step": counts.step.totals(), "per_epoch": counts.epoch.totals(),
            "steps_per_epoch": launch_count.STEPS_PER_EPOCH,
            "where": sorted(set(counts.step.host_to_device + counts.step.device_to_host + counts.step.data_dependent
                                + counts.epoch.host_to_device + counts.epoch.device_to_host
                                + counts.epoch.data_dependent)),
            "problems": launch_count.lean_problems(counts)}


def profile(request: RunRequest, *, active: int = 5, wait: int = 1, warmup: int = 1, seed: int = 0,
            trace: str | Path | None = "auto", strict: bool = False, log: Callable[[str], None] = print_line) -> dict:
    """Profile `active` training steps of the request's recipe (see the module); returns the report, the trace
    written."""
    active = check_int("steps", "--steps", active, 1, 1000)
    seed = check_int("seed", "--seed", seed, 0, 2**62)
    prepared = prepare(request, join=False)
    rec, family, cfg, dev, dataset = prepared.recipe, prepared.family, prepared.cfg, prepared.device, prepared.dataset
    if prepared.world.size > 1:
        raise ValueError("profile runs in one process; run it without torchrun")
    debug_apis.guard(strict, dev)  # before this command's own profiler starts
    if trace is None:
        trace_path = None
    elif trace == "auto":  # results/<time>-profile-<recipe>-<dataset>.trace.json, claimed
        trace_path = default_result_path(f"profile-{rec.name}", dataset, extension=".trace.json")
    else:
        trace_path = claim_result_path(trace, "--trace")
    try:
        data = prepared.load(log)
        total = wait + warmup + active
        if family.epochs_for_steps(cfg, data.num_train, total) > MAX_EPOCHS:
            raise ValueError(f"--steps {active}: {total} steps of {cfg.batch_size} are more than "
                             f"{MAX_EPOCHS:g} epochs of {data.num_train} examples; profile fewer steps")
        # The recipe's schedule compressed to `total` steps, as --epochs does (the family's with_epochs); an epochs
        # the user set is the whole run's, for the FLOPs of the recipe's run below.
        short = make_config(rec, family.epochs_for_steps(cfg, data.num_train, total),
                            {k: v for k, v in request.overrides.items() if k != "epochs"})
        short = dataclasses.replace(short, eval_each_epoch=False) if hasattr(short, "eval_each_epoch") else short
        for message in prepared.checked(short, quiet=True):
            log(f"warning: {message}")
        env = environment(dev)
        setup_system(short, dev)  # the run's CPU threads, so that the peak it is measured against is theirs
        peaks = peak.peak(dev, env["device_name"], log=lambda line: log(f"peak: {line}"))
        try:
            warm_s = family.warmup(short, data, dev)
        except Diverged as e:  # compilation and autotuning happened before the bad step, as for train's warm-up
            log(f"warning: the warm-up run {e}")
            warm_s = 0.0
        if warm_s:
            log(f"untimed warm-up run (compile, autotune): {warm_s:.1f} s")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        log(f"profiling {active} steps of {rec.name} (after {wait} + {warmup} unrecorded) and the final evaluation")
        began = time.perf_counter()
        prof = torch.profiler.profile(activities=activities,
                                      schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1))

        def on_step(done: int, steps: int) -> None:
            # No step() after the last step: the final evaluation stays inside the last recorded step.
            if done >= steps:
                return
            if done <= wait + warmup:  # the schedule starts recording at one of these steps
                with _profiler_lines_dropped():
                    prof.step()
            else:
                prof.step()

        with _recording(prof):
            try:
                run = family.train_run(short, data, dev, seed, hooks=RunHooks(on_step=on_step))
            except Diverged as e:
                raise ValueError(f"the profiled run {e}; profile a setting that trains") from None
        wall_s = time.perf_counter() - began
        if trace_path is not None:
            prof.export_chrome_trace(str(trace_path))
        found = analyse(prof.events(), active)
    except BaseException:
        if trace_path is not None:
            release_result_path(Path(trace_path))
        raise
    precision = resolve_system(short, dev).precision
    counted = launches(family, cfg, data)
    step_flops = family.flops(short, data)
    whole = family.flops(cfg, data)
    achieved = step_flops.train_step / found["step_seconds"] if found["step_seconds"] > 0 else 0.0
    evaluation_rate = (step_flops.evaluation / found["evaluation_seconds"] if found["evaluation_seconds"] > 0
                       else None)
    return {"benchmark": "profile", "recipe": rec.name, "dataset": prepared.dataset, "device": dev.type,
            "environment": env, "precision": precision, "config": dataclasses.asdict(cfg),
            "schedule": {"wait": wait, "warmup": warmup, "active": active, "steps_run": run.steps},
            "wall_seconds": wall_s, **found, "peak_memory": _peak_memory(dev),
            "flops": {"train_step": step_flops.train_step, "evaluation": step_flops.evaluation,
                      "recipe_run": whole.run, "recipe_steps": whole.steps, "counted": whole.counted},
            "mfu_train": peak.mfu(achieved, peaks, precision, env["device_name"]),
            "mfu_evaluation": (None if evaluation_rate is None else
                               peak.mfu(evaluation_rate, peaks, precision, env["device_name"])),
            "peaks": peaks, "launches": counted, "trace": None if trace_path is None else str(trace_path)}
