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
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from speedrun.engine.flops import count as count_flops
from speedrun.engine.system import synchronize
from speedrun.errors import warn
from speedrun.paths import data_root
from speedrun.records import debug_apis
from speedrun.records.result_file import read_bounded, write_json

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
# A measured rate outside this range (FLOP/s) is not a measurement of any device: a damaged cache.
PLAUSIBLE_FLOPS = (1e6, 1e17)


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
            log(f"{name}: not measured ({type(e).__name__}: {str(e)[:80]})")
            continue
        best = max(rates, key=rates.get)
        out[name] = {"flops_per_s": rates[best], "kernel": best, "kernels": rates}
        log(f"{name}: " + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in rates.items()))
    return out


def _fp16_native_cpu() -> bool:
    probe = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(probe()) if callable(probe) else False


def _read_cache(path: Path) -> dict:
    """The cache's entries, or {} for a missing, oversized, unreadable or malformed file (warned, then measured
    again: a cache is never trusted over a measurement)."""
    try:
        raw = read_bounded(path, MAX_CACHE_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as e:
        warn(f"peak cache {path}: {e.strerror or e}; measuring again")
        return {}
    try:
        if len(raw) > MAX_CACHE_BYTES:
            raise ValueError(f"over {MAX_CACHE_BYTES:,} bytes")
        entries = json.loads(raw.decode("utf-8"))
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        warn(f"peak cache {path} is not usable ({str(e)[:80]}); measuring again")
        return {}
    return entries


def _rate(value: object) -> bool:
    low, high = PLAUSIBLE_FLOPS
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def _valid(entry: object) -> bool:
    """A cached measurement exactly as measure() writes it: each dtype's peak, its kernel's name and every kernel's
    rate, each rate a plausible finite number."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtypes"), dict) or not entry["dtypes"]:
        return False
    for name, value in entry["dtypes"].items():
        if name not in DTYPES or not isinstance(value, dict) or not _rate(value.get("flops_per_s")):
            return False
        kernels = value.get("kernels")
        if not isinstance(value.get("kernel"), str) or not isinstance(kernels, dict) or not kernels or \
                not all(isinstance(k, str) and len(k) <= 40 and _rate(v) for k, v in kernels.items()):
            return False
    return isinstance(entry.get("fingerprint"), str) and isinstance(entry.get("measured_utc"), str)


def cached(device: torch.device, device_name: str | None, threads: int | None = None) -> dict | None:
    """This device's cached measurement (at `threads` CPU threads; default the current count), or None."""
    entry = _read_cache(cache_path()).get(fingerprint(device, device_name, threads))
    return entry if _valid(entry) else None


def peak(device: torch.device, device_name: str | None, *, again: bool = False,
         log: Callable[[str], None] = lambda line: None) -> dict:
    """This device's peaks, measured now (and cached) unless the cache has them and not `again`:
    {"fingerprint", "measured_utc", "dtypes": {dtype: {...}}}."""
    key = fingerprint(device, device_name)
    if not again:
        found = cached(device, device_name)
        if found is not None:
            return found
    entry = {"fingerprint": key, "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "dtypes": measure(device, log)}
    slowed = debug_apis.active(device)
    if slowed:  # a peak measured slowed down would flatter every later MFU: used now, never cached
        warn(f"peak not cached: measured with {len(slowed)} debugging switch(es) on ({slowed[0][:80]})")
        return entry
    path = cache_path()
    entries = _read_cache(path)
    entries[key] = entry
    try:
        write_json(path, entries)
    except OSError as e:
        warn(f"peak cache {path} not written ({e.strerror or e}); the measurement is used for this command only")
    return entry


def mfu(flops_per_s: float, peaks: dict | None, dtype: str, device_name: str | None) -> dict:
    """Achieved FLOP/s against this device's measured peak for `dtype` (None where not measured) and the
    datasheet's (None where the table has no entry)."""
    measured = (peaks or {}).get("dtypes", {}).get(dtype)
    sheet = datasheet(device_name, dtype, tf32=tf32_on())
    return {"dtype": dtype, "achieved_flops_per_s": flops_per_s,
            "measured_peak_flops_per_s": None if measured is None else measured["flops_per_s"],
            "measured_peak_kernel": None if measured is None else measured["kernel"],
            "mfu_measured": None if measured is None else flops_per_s / measured["flops_per_s"],
            "datasheet_peak_flops_per_s": None if sheet is None else sheet[0],
            "datasheet_source": None if sheet is None else sheet[1],
            "mfu_datasheet": None if sheet is None else flops_per_s / sheet[0]}


def mfu_text(m: dict) -> str:
    """One line: 'MFU 23.4% of the measured bf16 peak (214.0 GFLOP/s, matmul); datasheet: none for this device'."""
    achieved = f"achieved {m['achieved_flops_per_s'] / 1e9:,.1f} GFLOP/s"
    if m["mfu_measured"] is None:
        head = (f"{achieved}; no measured {m['dtype']} peak for this device (run speedrun peak; on a CPU with "
                "--threads as the run's cpu_threads)")
    else:
        head = (f"{achieved} = MFU {100 * m['mfu_measured']:.1f}% of the measured {m['dtype']} peak "
                f"({m['measured_peak_flops_per_s'] / 1e9:,.1f} GFLOP/s, {m['measured_peak_kernel']})")
    if m["mfu_datasheet"] is None:
        return head + "; datasheet: none for this device"
    return (head + f"; {100 * m['mfu_datasheet']:.1f}% of the datasheet's "
            f"{m['datasheet_peak_flops_per_s'] / 1e12:,.1f} TFLOP/s ({m['datasheet_source']})")
