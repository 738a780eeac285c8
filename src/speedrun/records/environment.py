"""Where a result was measured: git commit and dirty flag, CPU or device name and driver, torch/CUDA/cuDNN versions,
threads. Every result file records it, so a number is never separated from the machine and code that made it."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from speedrun.records import debug_apis

_SUBPROCESS_TIMEOUT_S = 5.0  # a hung nvidia-smi or git (network filesystem, broken driver) must not stall a run


def _run(args: list[str]) -> str | None:
    """stdout of a command, or None if it is missing, fails or hangs: environment() only ever describes."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(directory: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git work tree holding `directory`, or (None, None) outside one. Dirty: a tracked file
    differs from the commit (staged or not). Untracked files (a report, a saved model, results written into the
    checkout) do not change the code that ran, so they leave it clean."""
    # An installed copy (pip install .) has no history of its own, but git would walk up from site-packages and
    # report whatever repository encloses the virtualenv, e.g. the user's project: that commit is not ours.
    if any(part in ("site-packages", "dist-packages") for part in directory.parts):
        return None, None
    head = _run(["git", "-C", str(directory), "rev-parse", "HEAD"])
    if head is None or not head.strip():
        return None, None
    status = _run(["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"])
    return head.strip(), (None if status is None else bool(status.strip()))


def _cpu_name() -> str | None:
    # platform.processor() is just "x86_64" on most Linux distributions; /proc/cpuinfo has the marketing name.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _device_name(device: torch.device) -> str | None:
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):  # CUDA not built in or no GPU visible: describe, do not fail
            return None
    if device.type == "mps":
        return "Apple MPS"
    if device.type == "cpu":
        return _cpu_name()
    return None


def _gpu_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    lines = [] if out is None else [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None  # one line per GPU; they share the driver


def _speedrun_version() -> str:
    try:
        return importlib.metadata.version("speedrun")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout with PYTHONPATH=src
        return "0+unknown"


def environment(device: torch.device | str) -> dict:
    """Facts that make a result reproducible and comparable. Never raises for a missing git or nvidia-smi."""
    device = torch.device(device)
    commit, dirty = git_state(Path(__file__).resolve().parent)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": cudnn,
        "device_type": device.type,
        "device_name": _device_name(device),
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "gpu_driver": _gpu_driver(),
        "git_commit": commit,
        "git_dirty": dirty,
        "speedrun_version": _speedrun_version(),
        "debug_apis": debug_apis.active(device),  # what slowed this run without saying so (records/debug_apis.py)
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def device_label(env: dict) -> str:
    """The device column of the BENCHMARKS.md tables: 'AMD EPYC (2 threads)' on a CPU, the device name elsewhere."""
    name = env["device_name"] or env["device_type"]
    return f"{name} ({env['cpu_threads']} threads)" if env["device_type"] == "cpu" else name


