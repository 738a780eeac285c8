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
cudnn_benchmark: cuDNN times the candidate algorithms for each new convolution shape once and keeps the
  fastest (PyTorch performance guide); the timing happens in the untimed warm-up run.
"auto" on CPU: fp32, channels_last, no compile; on Apple's MPS: fp32 and NCHW (NHWC not measured there).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a resolved precision's dtype
LAYOUTS = ("auto", "on", "off")


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
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


def set_cudnn_benchmark(device: torch.device, enabled: bool) -> None:
    """Turn cuDNN's algorithm autotuner on or off (a process-wide setting; no effect off CUDA)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = enabled
