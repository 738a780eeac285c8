"""Our cifar10-94 recipe against airbench94, side by side on one GPU, on the same data, n runs each.

Measures n runs of each system, interleaved (ours, airbench, ours, ...) so that clock and thermal drift hit both
alike, after one untimed full warm-up run of each: test accuracy with TTA and timed seconds as mean ± std and 95%
t-interval; the time ratio ours / airbench (95% CI, delta method); the accuracy difference ours - airbench (95% CI);
Welch p-values for both.

Timed region, the same for both: from the patch-whitening initialization through training to the end of the final
TTA evaluation, CUDA events, synchronized. Outside it: data loading, upload, model construction, the per-epoch
evaluations of the progress table. airbench's numbers are its own `tta_val_acc` and `total_time_seconds`, read
from the last row of the table train94(verbose=True) prints (4 decimals: exact for a 10,000-image test set).
Step counts: airbench drops each epoch's last partial batch (48 x 9.9 -> 476 steps on 50,000 images), and so does
ours by default (drop_last_batch); `--set drop_last_batch=false` counts examples instead (ceil(9.9 x 50000 / 1024)
= 484 steps).

Data: both get the same tensors. airbench's CifarLoader reads cifar10/{train,test}.pt relative to the working
directory (and downloads through torchvision if they are missing, which must never happen), so they are written
in its format into a temporary directory that is the working directory while airbench runs, and checked before
each call. The training split is put in one fixed random order first: an image folder lists images class by
class, and both systems whiten from the first 5000 training images, which would otherwise all be airplanes.

airbench's code: `python tools/fetch_airbench.py` unpacks its 0.1.8 sdist into third_party/ (git-ignored).
Run (GPU only: airbench94 needs CUDA and torchvision), from the repository root:
  PYTHONPATH=src:third_party/airbench-0.1.8 python benchmarks/vs_airbench.py \
      --data /path/to/cifar10-jpeg --runs 25 --out $OUT/vs_airbench.json
  Carry to the device: third_party/airbench-0.1.8 (git-ignored; the unpacked PyPI sdist of airbench 0.1.8) and the
  data, e.g. `cp -r ../shared/datasets/cifar10-jpeg third_party/` (~55 MB of files; a decoded cache is ~185 MB,
  over the 64 MiB carry limit). cuDNN autotuning: airbench turns it on at import; ours sets it from its config
  (cudnn_benchmark, default on), so each side runs as it would on its own.
Accuracy side by side on the CPU (no GPU needed; about an hour per run of each on 2 cores):
  PYTHONPATH=src:third_party/airbench-0.1.8 python benchmarks/vs_airbench.py --on-cpu \
      --data ../shared/datasets/cifar10-jpeg --runs 1 --out benchmarks/results/vs_airbench/<name>.json
  No warm-ups; airbench in fp32, ours at its `auto` precision (fp32 before bf16 became its choice on CPUs with
  native bf16 instructions; the report records it). airbench's own code runs unchanged; `airbench_on_cpu` maps its
  few CUDA and fp16 calls to CPU and fp32 while it runs (and stands in for torchvision.transforms.Normalize when
  torchvision is absent). This answers "does our recipe learn as well as airbench94 on this data?"; its times are
  CPU fp32 times and say nothing about the GPU race.
A reduced schedule, to race on the CPU in minutes (both at the same number of steps):
  PYTHONPATH=src:third_party/airbench-0.1.8 python benchmarks/vs_airbench.py --on-cpu --epochs 1 \
      --data ../shared/datasets/cifar10-jpeg --runs 3 --out benchmarks/results/vs_airbench/<name>.json
  airbench94 gets `epochs=E` through train94's own argument: ceil(E x 48) steps (it drops each epoch's last
  partial batch: 50,000 // 1024 = 48 steps an epoch). Ours gets --epochs E' = steps x 1024 / 50,000, the same
  step count, its whole schedule compressed to it (the family's with_epochs). airbench keeps its own fixed
  whiten_bias_epochs=3, as its epochs argument leaves it. Our side runs at the recipe's defaults (`auto`
  precision: bf16 autocast on a CPU with native bf16 instructions); airbench's fp16 casts are fp32 on the CPU.
Any of these with --db PATH also stores the report in that results database (as `speedrun results import` would
the JSON file), where `speedrun report` shows each finished race side by side; a database that refuses it is a
warning, and the JSON file holds the report all the same.
Plumbing check on CPU (ours only, tiny synthetic data; airbench is not imported):
  python benchmarks/vs_airbench.py --dry-run-cpu --data synthetic:train=256,test=64 --runs 2 \
      --set batch_size=64 --set widths=8,16,16 --set epochs=0.25 --out /tmp/vs_airbench.json

Facts: airbench94 reaches 94.01% mean accuracy (n=1000) in 3.83 s on an A100 (Jordan, arXiv 2404.00498). The JPEG
copy of CIFAR-10 is lossy (quality 75): accuracies on it run below the published ones for both systems, so compare
only numbers measured side by side by one invocation of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import math
import os
import shlex
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

import torch

from speedrun.config import parse_set_args
from speedrun.data.dataset import Dataset
from speedrun.data.sources import load_dataset
from speedrun.engine.system import resolve_system
from speedrun.errors import counted
from speedrun.records import db
from speedrun.records.environment import device_label, environment
from speedrun.records.result_file import default_result_path, portable, write_json
from speedrun.records.stats import diff_ci95, mean_std_text, ratio_ci95, summarize, welch_t_test
from speedrun.run.runner import get_recipe, make_config

AIRBENCH = "airbench94 0.1.8 (airbench.lib_airbench94.train94, defaults)"
TIMED_REGION = ("whitening init + training + final TTA evaluation, CUDA events, synchronized; excludes data "
                "loading, upload, model construction, per-epoch table evaluations and the warm-up run")
TRAIN_ORDER_SEED = 0
# utils.logging_columns_list: run, epoch, train_loss, train_acc, val_acc, tta_val_acc, total_time_seconds.
AIRBENCH_CELLS = 7
AIRBENCH_BATCH = 1024  # hyp['opt']['batch_size'] of lib_airbench94


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # stdout carries only the markdown block


def write_airbench_cache(dataset: Dataset, directory: str | os.PathLike) -> Path:
    """Write `dataset` as airbench's CifarLoader('cifar10') reads it: <directory>/cifar10/{train,test}.pt.

    Each file holds {'images': (N, 32, 32, 3) uint8 (HWC), 'labels': (N,) int64, 'classes': [str]}.
    Returns the cifar10 folder.
    """
    if dataset.image_shape != (3, 32, 32) or dataset.num_classes != 10:
        c, h, w = dataset.image_shape
        raise ValueError(f"airbench94's net takes 3x32x32 images in 10 classes; {dataset.name} has {c}x{h}x{w} "
                         f"images in {dataset.num_classes} classes; pass CIFAR-10")
    folder = Path(directory) / "cifar10"
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        images = getattr(dataset, f"{split}_images").permute(0, 2, 3, 1).contiguous()  # (N, C, H, W) -> (N, H, W, C)
        labels = getattr(dataset, f"{split}_labels").contiguous()
        torch.save({"images": images, "labels": labels, "classes": list(dataset.classes)}, folder / f"{split}.pt")
    return folder


def parse_airbench_table(text: str) -> tuple[float, float]:
    """(tta_val_acc, total_time_seconds) from the final row (epoch cell 'eval') of airbench's printed table."""
    final = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) == AIRBENCH_CELLS and cells[1] == "eval":
            final = cells  # the last one wins: a captured text may hold several runs
    if final is None:
        raise RuntimeError("airbench printed no final 'eval' row; its output ends with:\n" + text[-1500:])
    return float(final[5]), float(final[6])


def airbench_steps(num_train: int, epochs: float, batch_size: int = AIRBENCH_BATCH) -> int:
    """train94's step count at `epochs`: ceil(len(train_loader) * epochs), its loader dropping the last partial
    batch of each epoch."""
    return math.ceil(num_train // batch_size * epochs)


def ours_epochs_for(rec, cfg, steps: int, num_train: int) -> float:
    """The epochs that give our recipe exactly `steps` steps, as its family counts them (its run_steps)."""
    return rec.module().epochs_for_steps(cfg, num_train, steps)


def airbench_run(train94, seed: int, epochs: float | None = None) -> tuple[float, float]:
    """One airbench94 run in the current directory; (accuracy, timed seconds) from its own table."""
    missing = [f for f in ("cifar10/train.pt", "cifar10/test.pt") if not os.path.isfile(f)]
    if missing:  # CifarLoader would fall back to a torchvision download, which must never happen
        raise FileNotFoundError(f"{missing} not in {os.getcwd()}; airbench must run where write_airbench_cache wrote")
    torch.manual_seed(seed)  # airbench seeds nothing itself: init, shuffling and crops all draw from this
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # run only labels the row; -1 or "warmup" would stop after one step
        train94(run=seed, verbose=True, **({} if epochs is None else {"epochs": epochs}))
    return parse_airbench_table(out.getvalue())


class _HostEvent:
    """torch.cuda.Event's timing calls on the host clock, for airbench on the CPU (where work is synchronous)."""

    def __init__(self, enable_timing: bool = False, **_):
        self.seconds: float | None = None

    def record(self, stream=None) -> None:
        self.seconds = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 1e3 * (end.seconds - self.seconds)  # milliseconds, as CUDA events report


class _Normalize:
    """torchvision.transforms.Normalize on an (N, C, H, W) float tensor: (x - mean[c]) / std[c]."""

    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return (x - mean) / std


def _gpu_default_to_cpu(init) -> tuple:
    """CifarLoader.__init__'s defaults with gpu=0 replaced by 'cpu' (torch.device(0) raises without CUDA)."""
    code = init.__code__
    names = code.co_varnames[:code.co_argcount]
    defaults = list(init.__defaults__)
    defaults[names.index("gpu") - (len(names) - len(defaults))] = "cpu"
    return tuple(defaults)


@contextlib.contextmanager
def _torchvision_stand_in():
    """sys.modules['torchvision'(.transforms)] -> modules holding only Normalize, removed on exit.

    Only these two keys are touched: restoring all of sys.modules would also drop whatever was imported meanwhile
    (torch imports torch._dynamo lazily, and a second import of it fails).
    """
    transforms = types.ModuleType("torchvision.transforms")
    transforms.Normalize = _Normalize
    torchvision = types.ModuleType("torchvision")
    torchvision.transforms = transforms
    stubs = {"torchvision": torchvision, "torchvision.transforms": transforms}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name, module in stubs.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


@contextlib.contextmanager
def airbench_on_cpu(loader_class=None):
    """While inside, airbench 0.1.8's code runs on the CPU in fp32, its source untouched.

    airbench94 calls CUDA and fp16 in exactly these places (checked against the 0.1.8 sdist): make_net94 does
    net.half().cuda(); CifarLoader (`loader_class`, once imported) loads to its default gpu=0 and converts images
    with Tensor.half(); train times with torch.cuda.Event and torch.cuda.synchronize. Here .cuda() and
    Module.half() keep the module as it is, Tensor.half() gives fp32, the loader's default device is the CPU, and
    events read the host clock. utils.py imports torchvision for transforms.Normalize (and for a download that
    write_airbench_cache makes unnecessary); when torchvision is missing, a module holding only Normalize stands
    in for it. Everything is restored on exit.
    """
    with contextlib.ExitStack() as stack:
        def patch(obj, name: str, new) -> None:
            stack.enter_context(mock.patch.object(obj, name, new))

        patch(torch.nn.Module, "cuda", lambda self, device=None: self)
        patch(torch.nn.Module, "half", lambda self: self)
        patch(torch.Tensor, "half", lambda self, memory_format=torch.preserve_format: self.float())
        if loader_class is not None:
            patch(loader_class.__init__, "__defaults__", _gpu_default_to_cpu(loader_class.__init__))
        patch(torch.cuda, "Event", _HostEvent)
        patch(torch.cuda, "synchronize", lambda device=None: None)
        if importlib.util.find_spec("torchvision") is None:
            stack.enter_context(_torchvision_stand_in())
        yield


@contextlib.contextmanager
def airbench_cudnn():
    """airbench runs with cudnn.benchmark on (it sets it at import); ours may have set it off (--set)."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


def fixed_train_order(data: Dataset) -> Dataset:
    perm = torch.randperm(len(data.train_labels), generator=torch.Generator().manual_seed(TRAIN_ORDER_SEED))
    return Dataset(data.name, data.train_images[perm], data.train_labels[perm], data.test_images, data.test_labels,
                   list(data.classes))


def side(runs: list[dict]) -> dict:
    return {"accuracy": summarize([r["accuracy"] for r in runs]).to_dict(),
            "train_seconds": summarize([r["train_seconds"] for r in runs]).to_dict(), "runs": runs}


def compare(ours: list[dict], theirs: list[dict]) -> dict | None:
    """Ratio of mean times and difference of mean accuracies (ours vs airbench) with 95% CIs and Welch p."""
    if min(len(ours), len(theirs)) < 2:
        return None  # intervals and tests need two runs on each side
    out = {}
    for key, name, stat in [("train_seconds", "time_ratio_ours_over_airbench", ratio_ci95),
                            ("accuracy", "accuracy_diff_ours_minus_airbench", diff_ci95)]:
        a, b = [r[key] for r in ours], [r[key] for r in theirs]
        value, low, high = stat(a, b)
        t, p = welch_t_test(a, b)
        out[name] = {"value": value, "ci95_low": low, "ci95_high": high, "welch_t": t, "welch_p": p}
    return out


def markdown(report: dict) -> str:
    """Rows for BENCHMARKS.md: date, device, exact command, n, mean ± std, and the comparison line."""
    env, cmd = report["environment"], report["command"].replace("|", "\\|")
    date = env["timestamp_utc"][:10]
    lines = ["| date | device | command | system | n | accuracy % (mean ± std) | seconds (mean ± std) |",
             "|---|---|---|---|---|---|---|"]
    steps = f", {report['schedule']['steps']} steps" if report.get("schedule") else ""
    for key in ("ours", "airbench"):
        s = report[key]
        if s is None:
            continue
        # ours: the precision its config resolved to (reports before it was recorded ran fp32 on the CPU);
        # airbench on the CPU: fp32, its fp16 casts mapped by airbench_on_cpu
        precision = s.get("precision", "fp32") if key == "ours" else "fp32"
        mode = f" ({precision} on the CPU{steps})" if report.get("on_cpu") else (f" ({steps[2:]})" if steps else "")
        label = (f"speedrun {s['recipe']}" if key == "ours" else AIRBENCH) + mode
        acc, sec = s["accuracy"], s["train_seconds"]
        lines.append(f"| {date} | {device_label(env)} | `{cmd}` | {label} | {acc['n']} | "
                     f"{mean_std_text(acc, 100)} | {mean_std_text(sec, 1, 3)} |")
    if not report["complete"]:
        lines.append(f"\nIncomplete: stopped before all {counted(report['runs_planned'], 'planned run')} of each "
                     "finished.")
    c = report["comparison"]
    if c is not None:
        r, d = c["time_ratio_ours_over_airbench"], c["accuracy_diff_ours_minus_airbench"]
        lines.append(f"\nTime ours / airbench: {r['value']:.3f} (95% CI {r['ci95_low']:.3f} to "
                     f"{r['ci95_high']:.3f}, Welch p = {r['welch_p']:.2g}). Accuracy ours - airbench: "
                     f"{100 * d['value']:+.2f} pp (95% CI {100 * d['ci95_low']:+.2f} to {100 * d['ci95_high']:+.2f}, "
                     f"Welch p = {d['welch_p']:.2g}).")
    return "\n".join(lines)


def pick_device(on_cpu: bool) -> torch.device:
    if on_cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("no GPU is visible: the timing comparison needs CUDA; --on-cpu compares accuracy on the "
                         "CPU, --dry-run-cpu checks the plumbing")
    return torch.device("cuda")


def import_train94(on_cpu: bool):
    try:
        if on_cpu:
            with airbench_on_cpu():  # the torchvision stand-in must be in place while airbench imports
                from airbench.lib_airbench94 import train94
        else:
            from airbench.lib_airbench94 import train94
    except ImportError as e:
        raise ValueError(f"cannot import airbench ({e}); run with PYTHONPATH=src:third_party/airbench-0.1.8"
                         + ("" if on_cpu else " and torchvision installed")) from None
    return train94


def store(report: dict, db_path: str, out_path: Path) -> int | None:
    """`report` stored in the results database at `db_path`: its id there. A database that refuses it (damaged,
    full, locked, read-only) is a warning, not an error: the JSON file at `out_path` holds the report all the same."""
    try:
        with contextlib.closing(db.connect(db_path)) as conn:
            stored = db.insert_result(conn, portable(report), source=str(out_path))
    except ValueError as e:  # db.UnusableDatabase; or a report the database refuses
        later = (f"; `speedrun results import {shlex.quote(str(out_path))}` adds it later"
                 if isinstance(e, db.UnusableDatabase) else "")
        log(f"vs_airbench.py: warning: the report was not stored in the results database ({e}); it is in "
            f"{out_path}{later}")
        return None
    log(f"stored in the results database {db_path} as report #{stored}")
    return stored


def run(args: argparse.Namespace, command: str) -> dict:
    if args.db is not None:  # before any work: a database path that can never be written is refused now
        db.check_writable(args.db)
    rec = get_recipe(args.ours_recipe)
    overrides = parse_set_args(args.set)
    cfg = make_config(rec, None, overrides)
    device = pick_device(args.dry_run_cpu or args.on_cpu)
    start = time.perf_counter()
    # download=False: the GPU machine has no network, so a named dataset must already be in the cache.
    data = fixed_train_order(load_dataset(args.data, cache_dir=args.cache_dir, download=False, log=log))
    data_seconds = time.perf_counter() - start
    schedule = None
    if args.epochs is not None:  # the reduced schedule: both systems at airbench's step count for args.epochs
        steps = airbench_steps(len(data.train_labels), args.epochs)
        if steps < 1:
            n = len(data.train_labels)
            raise ValueError(f"--epochs {args.epochs:g} is no step of airbench94 on {n} training images "
                             f"({n // AIRBENCH_BATCH} steps an epoch); give more epochs or data")
        cfg = make_config(rec, ours_epochs_for(rec, cfg, steps, len(data.train_labels)), overrides)
        schedule = {"airbench_epochs": args.epochs, "ours_epochs": cfg.epochs, "steps": steps}
        log(f"reduced schedule: {steps} steps each (airbench epochs={args.epochs}, ours --epochs {cfg.epochs:.6g})")
    log(f"data: {data.name}: {len(data.train_labels)} train / {len(data.test_labels)} test ({data_seconds:.1f} s)")
    out_path = Path(args.out).resolve() if args.out else default_result_path("vs_airbench", data.name).resolve()
    report = {"benchmark": "vs_airbench", "command": command, "timed_region": TIMED_REGION,
              "runs_planned": args.runs, "complete": False, "dry_run_cpu": args.dry_run_cpu,
              "on_cpu": args.on_cpu, "schedule": schedule,
              "data": {"name": data.name, "spec": args.data,
                       "train": len(data.train_labels), "test": len(data.test_labels),
                       "train_order_seed": TRAIN_ORDER_SEED, "load_seconds": data_seconds},
              "ours": None, "airbench": None, "comparison": None, "environment": environment(device)}
    ours_meta = {"recipe": rec.name, "config": dataclasses.asdict(cfg),
                 "precision": resolve_system(cfg, device).precision}
    ab_meta = {"system": AIRBENCH, "cudnn_benchmark": True,  # what airbench sets at import
               "accuracy_note": "tta_val_acc as printed, 4 decimals"}
    if args.on_cpu:
        ab_meta["on_cpu"] = "fp32 on the CPU through airbench_on_cpu (its code unchanged)"
    # On the CPU nothing is compiled or autotuned, so a warm-up would only cost an hour per system.
    warm_up = not args.on_cpu
    ours: list[dict] = []
    theirs: list[dict] = []

    def save(done: int) -> None:
        # Written after every run: a benchmark cut off at the device's time limit keeps what finished.
        report.update(ours={**ours_meta, **side(ours)} if ours else None, comparison=compare(ours, theirs),
                      airbench={**ab_meta, **side(theirs)} if theirs else None, complete=done == args.runs)
        write_json(out_path, report)

    with tempfile.TemporaryDirectory(prefix="vs_airbench-") as work:
        write_airbench_cache(data, work)
        train94 = None if args.dry_run_cpu else import_train94(args.on_cpu)
        ab_context = (functools.partial(airbench_on_cpu, train94.__globals__["CifarLoader"]) if args.on_cpu
                      else airbench_cudnn)
        if warm_up:
            ours_meta["warmup_seconds"] = rec.module().warmup(cfg, data, device)
            if train94 is not None:
                start = time.perf_counter()
                with contextlib.chdir(work), ab_context():
                    ab_meta["warmup_accuracy"], ab_meta["warmup_timed_seconds"] = airbench_run(train94, seed=0)
                ab_meta["warmup_seconds"] = time.perf_counter() - start
        log(f"warm-up {'done (untimed)' if warm_up else 'skipped (CPU)'}; {counted(args.runs, 'interleaved run')} "
            "of each; "
            f"timed region: {TIMED_REGION}")
        for i in range(args.runs):
            msg, seed = f"run {i + 1}/{args.runs}", args.seed + i
            if train94 is not None:  # airbench first in each pair: the order within a pair is arbitrary
                with contextlib.chdir(work), ab_context():
                    acc, secs = airbench_run(train94, seed=seed, epochs=args.epochs)
                theirs.append({"seed": seed, "accuracy": acc, "train_seconds": secs})
                log(f"{msg}  airbench {100 * acc:.2f}% {secs:.3f} s")
                save(i)
            r = rec.module().train_run(cfg, data, device, seed)
            ours.append({"seed": seed, "accuracy": r.accuracy, "train_seconds": r.train_seconds, "steps": r.steps})
            log(f"{msg}  ours {100 * r.accuracy:.2f}% {r.train_seconds:.3f} s")
            save(i + 1)
    log(f"result: {out_path}")
    if args.db is not None:
        store(report, args.db, out_path)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True,
                   help="anything speedrun's load_dataset accepts: an image folder, synthetic:..., ...")
    p.add_argument("--cache-dir", help="speedrun's cache dir for --data (default $SPEEDRUN_DATA or ~/.cache/speedrun)")
    p.add_argument("--runs", type=int, default=25, help="runs of each system (default 25)")
    p.add_argument("--seed", type=int, default=0, help="the first run's seed, for both systems; run i has seed "
                   "SEED + i (default 0): a second invocation from --seed N adds runs the first did not make")
    p.add_argument("--out", help="result JSON (default results/<time>-vs_airbench-<data>.json)")
    p.add_argument("--db", metavar="PATH", help="also store the report in this results database, where `speedrun "
                   "report` shows the race (default: the JSON file only)")
    p.add_argument("--ours-recipe", default="cifar10-94", help="our recipe (default cifar10-94)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override our config; repeatable")
    p.add_argument("--epochs", type=float, default=None, metavar="E",
                   help="a reduced schedule: airbench94 at epochs=E (its own argument) and ours at the same number "
                        "of steps (default: each system's full schedule)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--on-cpu", action="store_true",
                      help="accuracy side by side on the CPU, both in fp32, no warm-ups (times are CPU times)")
    mode.add_argument("--dry-run-cpu", action="store_true", help="plumbing check: CPU, ours only, no airbench")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    if not 0 <= args.seed <= 2**31:
        p.error(f"--seed must be in [0, 2147483648], got {args.seed}")
    if args.epochs is not None and not (math.isfinite(args.epochs) and 0 < args.epochs <= 1000):
        p.error(f"--epochs must be a number in (0, 1000], got {args.epochs}")
    return args


def command_line(script: str, argv: list[str]) -> str:
    """How benchmarks/<script> was run, for its report: its PYTHONPATH (where airbench came from) and arguments."""
    pythonpath = os.environ.get("PYTHONPATH")
    return (f"PYTHONPATH={pythonpath} " if pythonpath else "") + f"python benchmarks/{script} " + shlex.join(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = command_line("vs_airbench.py", argv)
    try:
        report = run(args, command)
    except (ValueError, FileNotFoundError) as e:
        print(f"vs_airbench.py: error: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
