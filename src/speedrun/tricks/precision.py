"""Precision and memory-layout tricks for accelerators, each switched by config.

autocast (bf16/fp16): matmuls and convs run on tensor cores in 16-bit; BatchNorm and the loss stay fp32
  (autocast's op lists). airbench stores weights in fp16 with BN in fp32; autocast keeps fp32 master weights,
  which costs a cast per weight per step but needs no loss scaling with bf16. fp16 autocast runs without a
  GradScaler: the loss is summed over the batch (hundreds), far from fp16 gradient underflow.
channels_last: NHWC layout, the one cuDNN's tensor-core convolutions want (hlb-CIFAR10 v0.2: with amax pooling
  ~0.5 s of 18 s), and oneDNN's CPU convolutions too: a cifar10-94 training step on one CPU thread takes about
  three quarters of its NCHW time in NHWC (benchmarks/step_time.py; BENCHMARKS.md, "channels_last on the CPU").
compile: torch.compile of the model (airbench94: 3.83 s -> 3.29 s); its compilation happens in an untimed
  warm-up run.
cpu_threads: the CPU's intra-op threads while a run trains (torch.set_num_threads); 0 keeps torch's default.
cudnn_benchmark: cuDNN times the candidate algorithms for each new convolution shape once and keeps the
  fastest (PyTorch performance guide); the timing happens in the untimed warm-up run.
"auto" on CPU: fp32, channels_last, no compile; bf16 autocast instead of fp32 where the CPU has native bf16
  instructions (AVX-512 BF16 or AMX: oneDNN runs bf16 convolutions and matmuls on them at several times its fp32
  rate; `speedrun peak` measures it) and the family has measured its accuracy to hold
  (config.SystemConfig.BF16_AUTO_ON_CPU). Without those instructions oneDNN emulates bf16, slower than fp32.
  On Apple's MPS: fp32 and NCHW (NHWC not measured there).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a resolved precision's dtype
LAYOUTS = ("auto", "on", "off")


def native_bf16_cpu() -> bool:
    """This CPU executes bf16 dot products natively (AVX-512 BF16 or AMX tiles), as torch's CPU feature probes
    report them (torch.cpu's; False where this torch has no such probe)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(callable(probe) and bool(probe()) for probe in probes)


def resolve_precision(precision: str, device: torch.device, bf16_auto_on_cpu: bool = False) -> str:
    """bf16_auto_on_cpu: whether "auto" may mean bf16 on a CPU with native bf16 (a family's
    SystemConfig.BF16_AUTO_ON_CPU)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        if device.type == "cuda" or (device.type == "cpu" and bf16_auto_on_cpu and native_bf16_cpu()):
            return "bf16"
        return "fp32"
    return precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """A context running the forward pass in `precision` ("fp32" is a null context)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def resolve_channels_last(setting: str, device: torch.device, auto_on_cpu: bool = True) -> bool:
    """auto_on_cpu: what "auto" means on a CPU (a family's SystemConfig.CHANNELS_LAST_AUTO_ON_CPU)."""
    if setting not in LAYOUTS:
        raise ValueError(f"channels_last must be one of {LAYOUTS}, got {setting!r}")
    if setting == "auto":
        return device.type == "cuda" or (device.type == "cpu" and auto_on_cpu)
    return setting == "on"


def to_channels_last(model: nn.Module, enabled: bool) -> nn.Module:
    return model.to(memory_format=torch.channels_last) if enabled else model


def maybe_compile(model: nn.Module, enabled: bool, mode: str = "max-autotune-no-cudagraphs") -> nn.Module:
    """torch.compile(model) when enabled; the returned module shares parameters with `model`."""
    return torch.compile(model, mode=mode) if enabled else model


@functools.cache
def default_cpu_threads() -> int:
    """torch's intra-op thread count before any run set it (its default: the physical cores, or OMP_NUM_THREADS);
    read at the first run's setup, before set_cpu_threads changes it."""
    return torch.get_num_threads()


def set_cpu_threads(device: torch.device, threads: int) -> None:
    """CPU intra-op threads for the run (a process-wide setting; on a GPU run they serve its CPU-side work):
    `threads`, or torch's default for 0, so a run after a tuned one is back at the default whatever its device.
    PyTorch's tuning guide: on a CPU, the threads that pay are the physical cores the run has to itself."""
    default = default_cpu_threads()  # read first: the first run may be the one that sets another count
    torch.set_num_threads(threads or default)


def set_cudnn_benchmark(device: torch.device, enabled: bool) -> None:
    """Turn cuDNN's algorithm autotuner on or off (a process-wide setting; no effect off CUDA)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = enabled
