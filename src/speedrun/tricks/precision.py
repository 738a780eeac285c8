"""Precision and memory-layout tricks for accelerators, each switched by config.

autocast (bf16/fp16): matmuls and convs run on tensor cores in 16-bit; BatchNorm and the loss stay fp32
  (autocast's op lists). airbench stores weights in fp16 with BN in fp32; autocast keeps fp32 master weights,
  which costs a cast per weight per step but needs no loss scaling with bf16. fp16 autocast runs without a
  GradScaler: the loss is summed over the batch (hundreds), far from fp16 gradient underflow.
half_weights: parameters and momentum in 16 bits, BatchNorm in fp32, no autocast (to_half_weights).
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
from torch.overrides import TorchFunctionMode

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a resolved precision's dtype
LAYOUTS = ("auto", "on", "off")


def native_bf16_cpu() -> bool:
    """This CPU executes bf16 dot products natively (AVX-512 BF16 or AMX tiles), as torch's CPU feature probes
    report them (torch.cpu's; False where this torch has no such probe)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(callable(probe) and bool(probe()) for probe in probes)


def resolve_precision(precision: str, device: torch.device, bf16_auto_on_cpu: bool = False,
                      cuda_auto: str = "bf16") -> str:
    """bf16_auto_on_cpu: whether "auto" may mean bf16 on a CPU with native bf16 (a family's
    SystemConfig.BF16_AUTO_ON_CPU); cuda_auto: what it means on CUDA (SystemConfig.CUDA_AUTO_PRECISION). The meta
    device, on which engine/launches.py counts what a CUDA run launches, resolves as CUDA."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        if device.type in ("cuda", "meta"):
            return cuda_auto
        if device.type == "cpu" and bf16_auto_on_cpu and native_bf16_cpu():
            return "bf16"
        return "fp32"
    return precision


def resolve_half_weights(setting: str, device: torch.device, precision: str, auto_on_cuda: bool = False) -> bool:
    """Whether a run keeps its weights in 16 bits (to_half_weights): "on" needs a 16-bit precision; "auto" is on
    for CUDA (and meta) at fp16 where the family says so (SystemConfig.HALF_WEIGHTS_AUTO_ON_CUDA)."""
    if setting not in LAYOUTS:
        raise ValueError(f"half_weights must be one of {LAYOUTS}, got {setting!r}")
    if setting == "on" and precision == "fp32":
        raise ValueError("half_weights=on needs a 16-bit precision: add --set precision=fp16 (or bf16), or leave "
                         "half_weights at auto")
    if setting == "auto":
        return auto_on_cuda and device.type in ("cuda", "meta") and precision == "fp16"
    return setting == "on"


def to_half_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Half weights (airbench94's make_net: net.half(), then BatchNorm back to float): every parameter and buffer
    in `dtype` except BatchNorm's, which stay fp32 (cuDNN takes 16-bit activations with fp32 BatchNorm parameters,
    and the running statistics keep their precision). The step then runs in `dtype` with no autocast: no cast
    kernels, and the optimizer's momentum lives in `dtype` too. fp16 keeps 10 mantissa bits, enough for SGD's small
    updates at airbench's scale; bf16's 7 are not recommended (half_weights=auto never chooses it).

    What: weights, gradients and momentum in 16 bits. Why: no per-step casts (autocast casts each weight every
    step, forward and backward), half the optimizer's memory traffic. Source: airbench94 (Jordan, arXiv 2404.00498).
    """
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.float()
    return model


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """A context running the forward pass in `precision` ("fp32" is a null context)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if device.type == "meta":  # the counting device stands for CUDA, whose casts it emulates (engine/launches.py)
        return emulated_autocast(DTYPES[precision])
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def resolve_channels_last(setting: str, device: torch.device, auto_on_cpu: bool = True) -> bool:
    """auto_on_cpu: what "auto" means on a CPU (a family's SystemConfig.CHANNELS_LAST_AUTO_ON_CPU)."""
    if setting not in LAYOUTS:
        raise ValueError(f"channels_last must be one of {LAYOUTS}, got {setting!r}")
    if setting == "auto":
        return device.type in ("cuda", "meta") or (device.type == "cpu" and auto_on_cpu)
    return setting == "on"


def to_channels_last(model: nn.Module, enabled: bool) -> nn.Module:
    return model.to(memory_format=torch.channels_last) if enabled else model


# Graphs a process may compile for one function (a network's forward, Newton-Schulz): dynamo keeps them per
# function, whatever module instance calls it, and past its limit (8 in torch 2.13) runs that function eagerly for
# good, with one warning. A run of cifar10-94 makes 3 (maybe_compile); runs of one configuration reuse them, but
# each configuration with other shapes or another compile mode adds its own. `speedrun tune` alone made 12 (two
# modes, each at its smoke run's shapes and the real ones): its later compiled runs measured eager code.
COMPILED_GRAPHS_PER_PROCESS = 256


def compile_static(fn, mode: str | None = None):
    """torch.compile(fn) with static shapes, the process's limit on a function's graphs raised (above) before its
    first call compiles anything."""
    compiled = torch.compile(fn, mode=mode, dynamic=False)  # loads torch._dynamo: a run without compile never does
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILED_GRAPHS_PER_PROCESS)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, COMPILED_GRAPHS_PER_PROCESS)
    return compiled


def maybe_compile(model: nn.Module, enabled: bool, mode: str = "max-autotune-no-cudagraphs") -> nn.Module:
    """torch.compile(model) when enabled, with static shapes (every batch of a run has one shape: no dynamic-shape
    graph is traced after a recompilation); the returned module shares parameters with `model`. A run's graphs:
    training with the whitening bias learning, training with it frozen (a parameter's requires_grad is guarded),
    and evaluation."""
    return compile_static(model, mode) if enabled else model


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


# CUDA autocast's policy (torch.amp, the CUDA op lists) for the operators these networks and losses use.
_LOWER = {torch.conv1d, torch.conv2d, torch.conv3d, torch.nn.functional.conv2d, torch.nn.functional.linear,
          torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.matmul, torch.Tensor.mm,
          torch.Tensor.__matmul__}
_FP32 = {torch.nn.functional.cross_entropy, torch.nn.functional.log_softmax, torch.nn.functional.softmax,
         torch.log_softmax, torch.softmax, torch.Tensor.log_softmax, torch.Tensor.softmax,
         torch.nn.functional.nll_loss, torch.nn.functional.layer_norm, torch.nn.functional.group_norm}


class emulated_autocast(TorchFunctionMode):
    """torch.autocast's casts for a device without an autocast implementation (meta): floating-point inputs of
    the lower-precision operators are cast to `dtype`, those of the fp32 operators to float32; a leaf parameter's
    cast is made once per region (autocast's weight cache). Nested operators (a linear inside cross-entropy) are
    not cast twice: the mode is off while one of its operators runs."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}

    def _cast(self, x, dtype: torch.dtype):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype):
            return x
        cacheable = x.is_leaf and x.requires_grad
        if cacheable and id(x) in self._cache:
            return self._cache[id(x)]
        y = x.to(dtype)
        if cacheable:
            self._cache[id(x)] = y
        return y

    def __exit__(self, *exc):
        self._cache.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.dtype if func in _LOWER else torch.float32 if func in _FP32 else None
        if dtype is None:
            return func(*args, **kwargs)
        args = tuple(self._cast(a, dtype) for a in args)
        kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)
