"""What slows a run without saying so: debugging and profiling switches left on in the process or its environment.

PyTorch's performance tuning guide ("Disable debugging APIs") names anomaly detection, the autograd profiler and
emit_nvtx; the rest below each force a slower path of their own: CUDA_LAUNCH_BLOCKING makes every kernel launch
synchronous, deterministic algorithms refuse the fastest cuDNN/cuBLAS kernels (and some ops run a slower
deterministic one), sync-debug mode checks every CUDA call for a hidden synchronization,
PYTORCH_NO_CUDA_MEMORY_CACHING sends every allocation to cudaMalloc, TORCH_COMPILE_DEBUG writes every graph to
disk, and a Python tracer or profiler (a debugger, coverage, cProfile) runs Python code at every line or call.

`active()` lists them, each as one line naming the switch and how to turn it off; `guard()` warns once per line or,
strict, refuses. Every result records the list (records/environment.py), so a slow number carries its cause.
"""

from __future__ import annotations

import os
import sys

import torch

from speedrun.errors import counted, warn

# Environment variables that select a slower path, each with the values that turn it on as the library reading it
# parses them: inductor's config reads TORCH_COMPILE_DEBUG == "1"; the CUDA runtime's CUDA_LAUNCH_BLOCKING and
# c10's PYTORCH_NO_CUDA_MEMORY_CACHING take "1" (c10 also "true"). The CUDA ones slow only a run on CUDA.
_ENV_SWITCHES = {
    "CUDA_LAUNCH_BLOCKING": (("1",), True, "every CUDA kernel launch waits for the kernel to finish"),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": (("1", "true"), True,
                                       "every CUDA allocation goes to cudaMalloc, not PyTorch's caching allocator"),
    "TORCH_COMPILE_DEBUG": (("1",), False, "torch.compile writes every graph and its generated code to disk"),
}


def _env_on(name: str, values: tuple[str, ...]) -> bool:
    return os.environ.get(name, "").strip().lower() in values


def profiler_on() -> bool:
    """torch.profiler, torch.autograd.profiler or emit_nvtx active in this process (each enables the autograd
    profiler, which records every op)."""
    autograd = getattr(torch._C, "_autograd", None)
    enabled = getattr(autograd, "_profiler_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def _sync_debug_on() -> bool:
    # Asking for the mode initializes CUDA; setting it did so already, so an uninitialized CUDA has no mode on.
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    return torch.cuda.get_sync_debug_mode() != 0


def active(device: torch.device | str | None = None) -> list[str]:
    """One line per debugging switch that is on now and slows a run on `device` (None: any device this machine
    has): what it is, and how to turn it off."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    found = []
    if torch.is_anomaly_enabled():
        found.append("autograd anomaly detection is on (torch.autograd.set_detect_anomaly(True)): every backward op "
                     "is checked and traced; turn it off")
    if profiler_on():
        found.append("a profiler is recording (torch.profiler, torch.autograd.profiler or emit_nvtx): every op is "
                     "recorded; end it before training (speedrun profile measures with one of its own)")
    if torch.are_deterministic_algorithms_enabled():
        found.append("deterministic algorithms are on (torch.use_deterministic_algorithms(True)), which the recipe "
                     "did not ask for: the fastest kernels are refused; turn them off")
    if cuda and torch.backends.cudnn.is_available() and torch.backends.cudnn.deterministic:
        found.append("torch.backends.cudnn.deterministic is True: cuDNN's fastest convolutions are refused; set it "
                     "False")
    if cuda and _sync_debug_on():
        found.append("CUDA sync-debug mode is on (torch.cuda.set_sync_debug_mode): every call is checked for a "
                     "synchronization; set it to 0")
    for name, (values, cuda_only, what) in _ENV_SWITCHES.items():
        if _env_on(name, values) and (cuda or not cuda_only):
            found.append(f"{name}={os.environ[name].strip()[:20]!r} in the environment: {what}; unset it")
    if sys.gettrace() is not None:
        found.append("a Python tracer is attached (a debugger or coverage: sys.gettrace()): Python code runs a "
                     "callback at every line; run without it")
    if sys.getprofile() is not None:
        found.append("a Python profiler is attached (cProfile or similar: sys.getprofile()): every call runs a "
                     "callback; run without it")
    return found


def guard(strict: bool, device: torch.device | str | None = None) -> list[str]:
    """The debugging switches on now that slow a run on `device` (None: any device here): each warned once, in one
    line, and returned (for the result); strict: refused instead (ValueError, one line naming them all)."""
    found = active(device)
    if found and strict:
        raise ValueError(f"--strict: {counted(len(found), 'debugging switch', 'debugging switches')} would slow this "
                         "run: " + "; ".join(found) + " (or run without --strict to train anyway, with a warning)")
    for line in found:
        warn(f"slower than it could be: {line}")
    return found
