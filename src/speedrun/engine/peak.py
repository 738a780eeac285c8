"""The device's peak FLOP/s per dtype, measured here (`speedrun peak`), and the datasheet's where one is known.

MFU figures elsewhere go wrong in three ways: a hard-coded peak table, an unknown device silently given an A100's
peak, and a peak for a dtype the run did not use. Here the denominator is measured on this device: a dense
square matmul and a 3x3 convolution (channels_last, 256 channels, the shape of the CIFAR recipes' middle layers)
per dtype, timed after warm-up, the faster of the two taken as the peak. It is cached per device fingerprint (the
device's name, torch's version, the CPU threads), so it is measured once. The datasheet figure (dense, no
sparsity) is shown beside it where the table below has the device; an unknown device has the measured peak only.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from speedrun.engine.flops import count as count_flops
from speedrun.engine.system import synchronize
from speedrun.errors import clip, counted, warn
from speedrun.paths import data_root
from speedrun.records import debug_apis
from speedrun.records.result_file import read_bounded, unencodable, write_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_CACHE_BYTES = 1 << 20  # the cache is a file from elsewhere too: a few KiB in use, read no further than this
SECONDS_PER_KERNEL = 0.5  # timed repetitions of each microbenchmark run for about this long

# Dense peaks in TFLOP/s (no sparsity), from NVIDIA's datasheets: A100 SXM/PCIe (Ampere datasheet, 2021: 19.5
# fp32, 156 tf32, 312 fp16/bf16), H100 SXM5 (H100 datasheet, 2023: 67 fp32, 494.7 tf32, 989.4 fp16/bf16), H100 PCIe
# (same: 51, 378, 756), H200 SXM (H200 datasheet, 2024: 67, 494.7, 989.4), V100 SXM2 (V100 datasheet, 2020: 15.7
# fp32, 125 fp16, no tf32 or bf16). Each pattern is anchored so that a variant the table lacks (H100 NVL, GH200,
# H200 NVL, A100X) matches none: an unknown device gets no datasheet figure, never another device's.
DATASHEETS = [
    (r"^NVIDIA A100[- ](SXM4|PCIE)", "NVIDIA A100 datasheet (2021)",
     {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"^NVIDIA H100 (80GB HBM3|SXM5?)", "NVIDIA H100 datasheet (2023), SXM5",
     {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"^NVIDIA H100 PCIe$", "NVIDIA H100 datasheet (2023), PCIe",
     {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"^NVIDIA H200$", "NVIDIA H200 datasheet (2024), SXM",
     {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"^Tesla V100-SXM2", "NVIDIA V100 datasheet (2020), SXM2", {"fp32": 15.7, "fp16": 125.0}),
]
# A measured rate outside this range (FLOP/s) is not a measurement of any device: a damaged cache. The floor bounds a
# peak from below as CPU_FLOPS_PER_THREAD bounds it from above: no device speedrun trains on does less than ~1
# GFLOP/s in a dense fp32 or bf16 matmul or convolution (one thread of a 2010 laptop CPU does several), and a peak
# below what a run achieves would report an MFU over 100% (a 2 MFLOP/s entry made a tiny CPU run "74,950%").
PLAUSIBLE_FLOPS = (1e9, 1e17)
# The most a device's hardware can do, so that a cached peak above it is refused: one that was not measured here (a
# file edited by hand, copied from another machine, written to mislead) would shrink every MFU computed against it.
# Generous on purpose, as a bound, not an estimate. A CPU thread (on its own core): the widest matrix units shipping
# do 1,024 dense bf16 multiply-adds a cycle per core (Intel AMX), 2,048 FLOP, at 6 GHz at most. A CUDA SM: Hopper
# does 4,096 dense bf16 FLOP a clock per SM (989 TFLOP/s over 132 SMs at 1.83 GHz), Blackwell about twice that;
# 16,384 at 3 GHz leaves twice that again. A 2-core CPU is thus held to 24.6 TFLOP/s (its real bf16 matmul: ~0.2).
CPU_FLOPS_PER_THREAD = 2048 * 6e9
CUDA_FLOPS_PER_SM = 16384 * 3e9


def tf32_on() -> bool:
    """fp32 convolutions or matmuls run in TF32 here (cuDNN's default allows it for convolutions)."""
    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def datasheet(device_name: str | None, dtype: str, tf32: bool = False) -> tuple[float, str] | None:
    """(FLOP/s, source) of the datasheet's dense peak for this device and dtype (fp32 as TF32 where `tf32`: the
    tensor cores' figure then bounds what fp32 work reaches), or None where the table has no entry."""
    key = "tf32" if dtype == "fp32" and tf32 else dtype
    for pattern, source, peaks in DATASHEETS:
        if device_name and re.search(pattern, device_name.strip()):
            if key in peaks:
                return peaks[key] * 1e12, source + (" (TF32)" if key == "tf32" else "")
            return (peaks[dtype] * 1e12, source) if dtype in peaks else None
    return None


def fingerprint(device: torch.device, device_name: str | None, threads: int | None = None) -> str:
    """The cache's key: the device, torch's version and, on a CPU, the threads (`threads`, default the current
    count): a peak measured with 16 threads is not the peak of a run on one."""
    threads = f", {threads or torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return f"{device.type}: {device_name or 'unknown'}{threads}, torch {torch.__version__}"


def cache_path() -> Path:
    return data_root() / "peak.json"


def _time(run: Callable[[], object], device: torch.device) -> float:
    """Seconds per call of `run`: one untimed call (allocation, autotuning), then repetitions for about
    SECONDS_PER_KERNEL, the median of them."""
    run()
    synchronize(device)
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - began < SECONDS_PER_KERNEL and len(times) < 200):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def kernels(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The microbenchmarks: a square matmul and a 3x3 convolution, sized to the device (a CPU's are smaller)."""
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    batch = 32 if device.type == "cpu" else 256
    conv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).to(device=device, dtype=dtype,
                                                                  memory_format=torch.channels_last)
    x = torch.randn(batch, 256, 32, 32, device=device, dtype=dtype).to(memory_format=torch.channels_last)

    def matmul():
        return a @ b

    def convolution():
        with torch.no_grad():
            return conv(x)

    return {"matmul": matmul, "conv3x3": convolution}


def measure(device: torch.device, log: Callable[[str], None] = lambda line: None) -> dict:
    """{dtype: {"flops_per_s": best, "kernel": its name, "kernels": {name: FLOP/s}}} for each dtype that runs here."""
    out = {}
    for name, dtype in DTYPES.items():
        if device.type == "cpu" and dtype == torch.float16 and not _fp16_native_cpu():
            continue  # emulated fp16 matmuls on a CPU run at a fraction of fp32: no run uses them
        try:
            rates = {}
            for kernel, run in kernels(device, dtype).items():
                rates[kernel] = count_flops(run) / _time(run, device)
        except (RuntimeError, NotImplementedError) as e:  # a dtype this device or build cannot run
            log(f"{name}: not measured ({type(e).__name__}: {clip(str(e), 120)})")
            continue
        best = max(rates, key=rates.get)
        log(f"{name}: " + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in rates.items()))
        if not _rate(rates[best]):  # what cached() refuses as no device's peak is never cached, nor an MFU's base
            log(f"{name}: not kept as a peak: below the {PLAUSIBLE_FLOPS[0] / 1e9:g} GFLOP/s any device speedrun "
                "trains on does")
            continue
        out[name] = {"flops_per_s": rates[best], "kernel": best, "kernels": rates}
    return out


def _fp16_native_cpu() -> bool:
    probe = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(probe()) if callable(probe) else False


def _read_cache(path: Path, then: str | None) -> dict:
    """The cache's entries, or {} for a missing, oversized, unreadable or malformed file: a cache is never trusted
    over a measurement. Such a file is warned of, with `then` (what the caller does instead), unless `then` is None
    (read again to be written: the reader warned)."""
    try:
        raw = read_bounded(path, MAX_CACHE_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as e:
        if then is not None:
            warn(f"peak cache {path}: {e.strerror or e}; {then}")
        return {}
    try:
        if len(raw) > MAX_CACHE_BYTES:
            raise ValueError(f"over {MAX_CACHE_BYTES:,} bytes")
        entries = json.loads(raw.decode("utf-8"))
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        if then is not None:
            why = "JSON nested too deep to read" if isinstance(e, RecursionError) else clip(str(e), 160)
            warn(f"peak cache {path} is not usable ({why}); {then}")
        return {}
    return entries


def _rate(value: object, low: float = PLAUSIBLE_FLOPS[0]) -> bool:
    """Whether a cached `value` is a FLOP/s figure above 0, from `low` to PLAUSIBLE_FLOPS' top. Compared, never
    converted: JSON gives an int of any size (math.isfinite of a 401-digit int raises OverflowError), a string or a
    bool as readily, and NaN and inf fail the comparison."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value
            and low <= value <= PLAUSIBLE_FLOPS[1])


def ceiling(device: torch.device, threads: int | None = None) -> float | None:
    """The most FLOP/s `device` can do (CPU_FLOPS_PER_THREAD, CUDA_FLOPS_PER_SM), at `threads` CPU threads (default
    the current count; no more than the CPUs count); None where no bound is known (MPS)."""
    if device.type == "cpu":
        return min(threads or torch.get_num_threads(), os.cpu_count() or 1) * CPU_FLOPS_PER_THREAD
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * CUDA_FLOPS_PER_SM
    return None


def _problem(entry: object, key: str, most: float | None) -> str | None:
    """What makes a cached measurement unusable, or None: it must be exactly as measure() writes it for this
    fingerprint `key` (each dtype's peak the fastest of its kernels' rates, each rate a finite number in
    PLAUSIBLE_FLOPS) and claim no more than `most` FLOP/s (`ceiling`)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtypes"), dict) or not entry["dtypes"]:
        return "no dtypes"
    if entry.get("fingerprint") != key or not isinstance(entry.get("measured_utc"), str):
        return "its fingerprint or measured_utc is not what a measurement here writes"
    where = unencodable(entry)
    if where is not None:  # a result that records the peak (its kernel's name, profile's whole entry) would be lost
        return f"the string at {where} is no text UTF-8 can hold"
    for name, value in entry["dtypes"].items():
        if name not in DTYPES or not isinstance(value, dict):
            return f"dtype {clip(repr(name), 40)} is not one measured"
        rate, kernels = value.get("flops_per_s"), value.get("kernels")
        if not _rate(rate):
            return f"its {name} peak {clip(repr(rate), 40)} is not a rate in {PLAUSIBLE_FLOPS[0]:g} to " \
                   f"{PLAUSIBLE_FLOPS[1]:g} FLOP/s"
        if not isinstance(kernels, dict) or not kernels or \
                not all(isinstance(k, str) and len(k) <= 40 and _rate(v, 0.0) for k, v in kernels.items()):
            return f"its {name} kernels are not rates by kernel name"
        if value.get("kernel") not in kernels or rate != kernels[value["kernel"]] or rate != max(kernels.values()):
            rates = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in list(kernels.items())[:4])
            return f"its {name} peak {rate / 1e9:,.1f} GFLOP/s is not the fastest of its kernels' ({rates} GFLOP/s)"
        if most is not None and rate > most:
            return (f"its {name} peak {rate / 1e12:,.1f} TFLOP/s is more than this device can do, "
                    f"{most / 1e12:,.1f} TFLOP/s at most")
    return None


def cached(device: torch.device, device_name: str | None, threads: int | None = None, *,
           then: str = "not used; run speedrun peak to measure this device again") -> dict | None:
    """This device's cached measurement (at `threads` CPU threads; default the current count), or None. An entry
    for it that is not a measurement of it (_problem) is never used: a warning names the file, the reason and
    `then` (what the caller does instead)."""
    path, key = cache_path(), fingerprint(device, device_name, threads)
    entries = _read_cache(path, then)
    if key not in entries:
        return None
    why = _problem(entries[key], key, ceiling(device, threads))
    if why is not None:
        warn(f"peak cache {path}: the entry for {key} is not a measurement of this device ({why}); {then}")
        return None
    return entries[key]


def peak(device: torch.device, device_name: str | None, *, again: bool = False,
         log: Callable[[str], None] = lambda line: None) -> dict:
    """This device's peaks, measured now (and cached) unless the cache has them and not `again`:
    {"fingerprint", "measured_utc", "dtypes": {dtype: {...}}}."""
    return peak_kept(device, device_name, again=again, log=log)[0]


def peak_kept(device: torch.device, device_name: str | None, *, again: bool = False,
              log: Callable[[str], None] = lambda line: None) -> tuple[dict, Path | None]:
    """(peak()'s answer, the cache file that holds it), the file None where the answer is in none: a measurement
    that could not be cached (a warning said why). `speedrun peak` says where its figures are kept from this."""
    key = fingerprint(device, device_name)
    if not again:
        found = cached(device, device_name, then="measuring again")
        if found is not None:
            return found, cache_path()
    entry = {"fingerprint": key, "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "dtypes": measure(device, log)}
    slowed = debug_apis.active(device)
    if slowed:  # a peak measured slowed down would flatter every later MFU: used now, never cached
        warn(f"peak not cached: measured with {counted(len(slowed), 'debugging switch', 'debugging switches')} on "
             f"({clip(slowed[0], 120)})")
        return entry, None
    if not entry["dtypes"]:  # cached(), which refuses an entry of no dtypes, would warn of it on every read
        warn("peak not cached: no dtype could be measured on this device")
        return entry, None
    path = cache_path()
    entries = _read_cache(path, "writing a new one" if again else None)  # not again: cached() has said it
    entries[key] = entry
    try:
        write_json(path, entries)
    except OSError as e:
        warn(f"peak cache {path} not written ({e.strerror or e}); the measurement is used for this command only")
        return entry, None
    return entry, path


def mfu(flops_per_s: float, peaks: dict | None, dtype: str, device_name: str | None) -> dict:
    """Achieved FLOP/s against this device's measured peak for `dtype` (None where not measured) and the
    datasheet's (None where the table has no entry). A utilization over 1 is no utilization: the peak it divides
    by is not this device's (a cache edited or copied from elsewhere, a measurement slowed by other work), so it is
    None, with a warning (_impossible); the peak itself is kept in the record, as found."""
    measured = (peaks or {}).get("dtypes", {}).get(dtype)
    sheet = datasheet(device_name, dtype, tf32=tf32_on())
    of_measured = None if measured is None else flops_per_s / measured["flops_per_s"]
    if of_measured is not None and of_measured > 1:
        _impossible(f"the measured {dtype} peak, {measured['flops_per_s'] / 1e9:,.1f} GFLOP/s,",
                    f"run speedrun peak --again to measure this device again into the peak cache {cache_path()} (on "
                    "a CPU with --threads as the run's cpu_threads)")
        of_measured = None
    of_sheet = None if sheet is None else flops_per_s / sheet[0]
    if of_sheet is not None and of_sheet > 1:
        _impossible(f"the datasheet's {dtype} peak for {device_name}, {sheet[0] / 1e12:,.1f} TFLOP/s ({sheet[1]}),",
                    "the table in speedrun/engine/peak.py does not hold this device's figure")
        of_sheet = None
    return {"dtype": dtype, "achieved_flops_per_s": flops_per_s,
            "measured_peak_flops_per_s": None if measured is None else measured["flops_per_s"],
            "measured_peak_kernel": None if measured is None else measured["kernel"],
            "mfu_measured": of_measured,
            "datasheet_peak_flops_per_s": None if sheet is None else sheet[0],
            "datasheet_source": None if sheet is None else sheet[1],
            "mfu_datasheet": of_sheet}


def _impossible(peak_named: str, fix: str) -> None:
    # Called from mfu alone, so that each of its warnings comes from one place (errors.warn names the frame two up,
    # mfu's line that calls this): with the same text, Python's "default" warning filter, the CLI's, then shows it
    # once for a command that computes an MFU more than once (profile's training and evaluation steps, a result's
    # file after every run and its summary).
    warn(f"{peak_named} is below what this run achieved, so it is no peak of this device: no MFU against it is "
         f"reported (it would be over 100%); {fix}")


def mfu_text(m: dict) -> str:
    """One line: 'MFU 23.4% of the measured bf16 peak (214.0 GFLOP/s, matmul); datasheet: none for this device'."""
    achieved = f"achieved {m['achieved_flops_per_s'] / 1e9:,.1f} GFLOP/s"
    if m["mfu_measured"] is None and m.get("measured_peak_flops_per_s") is not None:  # mfu: below `achieved`
        head = (f"{achieved}; the measured {m['dtype']} peak, {m['measured_peak_flops_per_s'] / 1e9:,.1f} GFLOP/s, "
                "is below it: no peak of this device (speedrun peak --again measures again)")
    elif m["mfu_measured"] is None:
        head = (f"{achieved}; no measured {m['dtype']} peak for this device (run speedrun peak; on a CPU with "
                "--threads as the run's cpu_threads)")
    else:
        head = (f"{achieved} = MFU {100 * m['mfu_measured']:.1f}% of the measured {m['dtype']} peak "
                f"({m['measured_peak_flops_per_s'] / 1e9:,.1f} GFLOP/s, {m['measured_peak_kernel']})")
    if m["mfu_datasheet"] is None and m.get("datasheet_peak_flops_per_s") is not None:  # mfu: below `achieved`
        return head + (f"; the datasheet's {m['datasheet_peak_flops_per_s'] / 1e12:,.1f} TFLOP/s "
                       f"({m['datasheet_source']}) is below it: not this device's figure")
    if m["mfu_datasheet"] is None:
        return head + "; datasheet: none for this device"
    return (head + f"; {100 * m['mfu_datasheet']:.1f}% of the datasheet's "
            f"{m['datasheet_peak_flops_per_s'] / 1e12:,.1f} TFLOP/s ({m['datasheet_source']})")
