"""The device a run uses and how it is set up: device choice, precision and layout resolved for it, seeding and
the random-number state a checkpoint carries."""

from __future__ import annotations

import contextlib
import random
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from speedrun.errors import counted
from speedrun.tricks.precision import (DTYPES, autocast, maybe_compile, resolve_channels_last, resolve_half_weights,
                                       resolve_precision, set_cpu_threads, set_cudnn_benchmark, to_channels_last,
                                       to_half_weights)

DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass(frozen=True)
class System:
    """config.SystemConfig resolved for one device: what a loop uses."""

    device: torch.device
    precision: str  # "fp32", "bf16" or "fp16"
    channels_last: bool
    half_weights: bool = False  # weights in `dtype`, BatchNorm in fp32, no autocast

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def amp(self) -> contextlib.AbstractContextManager:
        """The forward pass's context: autocast at a 16-bit precision, nothing with half weights or fp32."""
        if self.half_weights:
            return contextlib.nullcontext()
        return autocast(self.device, self.precision)

    def prepare(self, model: nn.Module, cfg) -> tuple[nn.Module, nn.Module]:
        """The model in this layout on the device, and its forward (compiled when cfg.compile); cuDNN's autotuner
        set as cfg says. Both share parameters."""
        model = to_channels_last(model.to(self.device), self.channels_last)
        if self.half_weights:
            model = to_half_weights(model, self.dtype)
        set_cudnn_benchmark(self.device, cfg.cudnn_benchmark)
        return model, maybe_compile(model, cfg.compile, cfg.compile_mode)


def setup_system(cfg, device: torch.device) -> System:
    """Every family's shared settings (config.SystemConfig) resolved for a run about to train (resolve_system), and
    the process's CPU threads set for it."""
    set_cpu_threads(device, cfg.cpu_threads)
    return resolve_system(cfg, device)


def resolve_system(cfg, device: torch.device) -> System:
    """What cfg's device-side settings mean on `device` (precision=auto resolved, ...), changing nothing."""
    # auto on a CPU with native bf16: bf16 where the family measured it
    family = type(cfg)
    precision = resolve_precision(cfg.precision, device, family.BF16_AUTO_ON_CPU, family.CUDA_AUTO_PRECISION)
    return System(device, precision,
                  resolve_channels_last(cfg.channels_last, device, family.CHANNELS_LAST_AUTO_ON_CPU),
                  # auto: off for the user's network (models/custom.py), whose norms half weights would not keep
                  resolve_half_weights(cfg.half_weights, device, precision,
                                       family.HALF_WEIGHTS_AUTO_ON_CUDA and not getattr(cfg, "model", "")))


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA, then Apple's MPS, then the CPU. An unavailable explicit choice is a ValueError."""
    if name not in DEVICES and not re.fullmatch(r"cuda:\d{1,4}", name):
        raise ValueError(f"device (--device) must be one of {', '.join(DEVICES)} (or cuda:N), got {name!r}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name}: CUDA is not available to this torch ({torch.__version__}); "
                         "use device cpu or auto (--device cpu)")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ValueError(f"device {name}: this machine has {counted(torch.cuda.device_count(), 'CUDA device')}, "
                         "numbered from 0; use --device cuda or cuda:0")
    if name == "mps" and not _mps_available():
        raise ValueError("device mps: Apple MPS is not available here; use device cpu or auto (--device cpu)")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every global random generator (a checkpoint restores them all, though the recipes' loops draw from their
    own seeded generators). numpy's state becomes a tensor and ints, which a checkpoint stores without pickle."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


