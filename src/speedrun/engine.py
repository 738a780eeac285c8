"""The small shared pieces recipes call: device choice, seeding, the timer, evaluation.

No training loop lives here (STYLE.md habit 2): each recipe writes its own loop out.
"""

from __future__ import annotations

import math
import random
import re
import time

import numpy as np
import torch
from torch import nn

from speedrun.data.loader import normalize
from speedrun.tricks.tta import tta_logits

DEVICES = ("auto", "cpu", "cuda", "mps")


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
        raise ValueError(f"device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from "
                         "0; use --device cuda or cuda:0")
    if name == "mps" and not _mps_available():
        raise ValueError("device mps: Apple MPS is not available here; use device cpu or auto (--device cpu)")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Timer:
    """Accumulates the seconds spent in timed regions, with device synchronization.

    On CUDA each region is bracketed by CUDA events (the GPU's own clock, as airbench times) and synchronized
    at its end; elsewhere by synchronize + perf_counter. Work queued before `start` is drained first so it is
    not charged to the region.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self._start: float | torch.cuda.Event | None = None

    def start(self) -> None:
        assert self._start is None, "Timer.start called twice"
        synchronize(self.device)
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> float:
        """Ends the region; returns the total seconds so far."""
        assert self._start is not None, "Timer.stop without start"
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.seconds += self._start.elapsed_time(end) / 1000
        else:
            synchronize(self.device)
            self.seconds += time.perf_counter() - self._start
        self._start = None
        return self.seconds


class Diverged(RuntimeError):
    """A run's loss became NaN or inf: the run stops and is recorded as diverged, not as a result."""

    def __init__(self, step: int, total_steps: int, loss: float, lr: float, lr_name: str):
        self.step, self.total_steps, self.loss, self.lr = step, total_steps, loss, lr
        super().__init__(f"diverged: the training loss became {loss} at step {step} of {total_steps} "
                         f"({lr_name} {lr:.4g} at that step); lower {lr_name} (--set {lr_name}=...), train in fp32 "
                         "(--set precision=fp32) or check the data")

    def to_dict(self) -> dict:
        # Strings, not bare NaN: strict JSON has no NaN or Infinity.
        return {"step": self.step, "total_steps": self.total_steps, "loss": str(self.loss), "lr": self.lr,
                "message": str(self)}


class FiniteLossGuard:
    """Stops a run within one step of its loss turning NaN or inf (a diverged run would otherwise finish as a
    normal result near chance accuracy).

    On the CPU and MPS the check reads the loss at once. On CUDA reading it would drain the queue every step, so
    each step's loss is copied into pinned host memory behind a CUDA event, and the previous step's value is read
    after the current step has been queued: the GPU stays busy with step s while the CPU checks step s - 1, and a
    divergence at step s - 1 stops the run before step s + 1 is queued. `finish()` checks the last step.
    """

    def __init__(self, device: torch.device, total_steps: int, lr_name: str, enabled: bool = True):
        self.device, self.total_steps, self.lr_name, self.enabled = device, total_steps, lr_name, enabled
        self._pending: tuple[int, float, torch.Tensor, torch.cuda.Event] | None = None
        if enabled and device.type == "cuda":
            self._slots = [torch.empty((), dtype=torch.float32, pin_memory=True) for _ in range(2)]

    def _raise_if_bad(self, step: int, loss: float, lr: float) -> None:
        if not math.isfinite(loss):
            raise Diverged(step, self.total_steps, loss, lr, self.lr_name)

    def check(self, step: int, loss: torch.Tensor, lr: float) -> None:
        """`loss` is step `step`'s loss (a 0-d tensor, still on the device); `lr` the lr it was taken with."""
        if not self.enabled:
            return
        if self.device.type != "cuda":
            self._raise_if_bad(step, loss.item(), lr)
            return
        slot = self._slots[step % 2]
        slot.copy_(loss.detach().float(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._pending = self._pending, (step, lr, slot, event)
        if previous is not None:
            prev_step, prev_lr, prev_slot, prev_event = previous
            prev_event.synchronize()
            self._raise_if_bad(prev_step, prev_slot.item(), prev_lr)

    def finish(self) -> None:
        if self._pending is not None:
            step, lr, slot, event = self._pending
            self._pending = None
            event.synchronize()
            self._raise_if_bad(step, slot.item(), lr)


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, mean: torch.Tensor,
             std: torch.Tensor, dtype: torch.dtype, channels_last: bool, tta_level: int,
             batch_size: int = 2000, autocast=None) -> float:
    """Top-1 accuracy (fraction) of `model` in eval mode on uint8 images (N, C, H, W) already on the device."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=images.device)
    for start in range(0, len(images), batch_size):
        x = normalize(images[start:start + batch_size], mean, std, dtype, channels_last)
        if autocast is None:
            logits = tta_logits(model, x, tta_level)
        else:
            with autocast():
                logits = tta_logits(model, x, tta_level)
        correct += (logits.argmax(1) == labels[start:start + batch_size]).sum()
    model.train(was_training)
    return correct.item() / len(images)
