"""What every family's training loop shares: the timer, the run's result, stop-at-step-end, the finite-loss guard
and evaluation. A family's loop (recipes/imagenet/loop.py; the in-memory families' one, recipes/in_memory/loop.py)
is written out top to bottom and calls these pieces."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedrun import dist
from speedrun.data.loader import Normalization
from speedrun.engine.phases import phase
from speedrun.engine.system import rng_state, set_rng_state, synchronize
from speedrun.errors import Terminated, counted
from speedrun.tricks.tta import VIEWS, selective_tta_logits, tta_logits


@dataclass(frozen=True)
class RunHooks:
    """What a family's train_run tells its caller as a run goes, and keeps for it (the family contract's one
    per-run argument besides the world and the state to resume; recipes/family.py). Every field may be None.

    on_step(done, total): after each optimizer step (a progress bar). on_epoch(row): each row of the per-epoch
    table. on_scalars(step, loss, loss_scale, lr): each step's numbers (Steps.after says what each is; the
    TensorBoard log). checkpoints: run/resume.py's Checkpoints (a layer above this one: Any here), which save the
    training state every N steps, at the last step and on a signal. on_evaluation(done, total): after each batch of
    the final evaluation, in forward passes of one image (tricks/tta.py's passes) of this process's share: with TTA
    on a CPU it takes minutes, and is shown as it goes."""

    on_step: Callable[[int, int], None] | None = None
    on_evaluation: Callable[[int, int], None] | None = None
    on_epoch: Callable[[dict], None] | None = None
    on_scalars: Callable[[int, torch.Tensor, float, float | None], None] | None = None
    checkpoints: Any = None


@dataclass
class RunResult:
    """One training run, as every family's train_run returns it."""

    seed: int
    accuracy: float | None  # final test accuracy (with the recipe's TTA), fraction; None for a diverged run
    train_seconds: float | None  # the timed region; None for a diverged run
    epochs: float
    steps: int  # steps taken (for a diverged run: up to the step whose loss was not finite)
    history: list[dict] = field(default_factory=list)  # one row per epoch
    model: nn.Module | None = None  # the trained, unwrapped model (not serialized)
    diverged: dict | None = None  # Diverged.to_dict() when the loss became NaN/inf

    def to_dict(self) -> dict:
        """JSON-ready fields (the model is not serialized)."""
        return {"seed": self.seed, "accuracy": self.accuracy, "train_seconds": self.train_seconds,
                "epochs": self.epochs, "steps": self.steps, "diverged": self.diverged, "history": self.history}

    @classmethod
    def from_dict(cls, d: dict) -> RunResult:
        return cls(seed=d["seed"], accuracy=d["accuracy"], train_seconds=d["train_seconds"], epochs=d["epochs"],
                   steps=d["steps"], history=list(d["history"]), diverged=d["diverged"])


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

    def as_run(self, seed: int, epochs: float) -> RunResult:
        """The run this divergence ended, as results record it: its step, no accuracy."""
        return RunResult(seed=seed, accuracy=None, train_seconds=None, epochs=epochs, steps=self.step,
                         diverged=self.to_dict())

    def to_dict(self) -> dict:
        # Strings, not bare NaN: strict JSON has no NaN or Infinity.
        return {"step": self.step, "total_steps": self.total_steps, "loss": str(self.loss), "lr": self.lr,
                "message": str(self)}


class StopRequest:
    """A SIGINT or SIGTERM received during training, acted on at the next step boundary (see stop_at_step_end)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def interrupt(self, in_step: bool = True) -> KeyboardInterrupt:
        """The exception that ends the command: Terminated (exit 143) for SIGTERM, else KeyboardInterrupt (130).
        `in_step`: every process stops at this same step (FiniteLossGuard agrees on it), so they may wait for each
        other on the way out (dist.shutdown)."""
        exc = Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()
        exc.in_step = in_step
        return exc


@contextlib.contextmanager
def signals_handled_by(handler, acknowledge: Callable[[int], str] | None = None):
    """Inside the block, SIGINT and SIGTERM call `handler(signum, frame)` instead of interrupting; the previous
    handlers come back after it. Python-level handlers, not a signal mask: torch's threads would take a
    process-directed signal that the main thread blocks. Only the main thread may set handlers; elsewhere this
    changes nothing.

    acknowledge(signum) -> a line for stderr, written once, at the first SIGINT or SIGTERM, at once: Python runs a
    handler only between two lines of Python, and a CPU backward is one call of seconds. The interpreter's C-level
    handler writes each signal's number to a pipe (signal.set_wakeup_fd) that a thread waits on; torch releases
    the GIL inside its calls, so the thread writes the line while the call runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.nullcontext() if acknowledge is None else _acknowledged(acknowledge):
            yield
    finally:
        for s, old in previous.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)  # None: a handler set outside Python


@contextlib.contextmanager
def _acknowledged(acknowledge: Callable[[int], str]):
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never wait on a full pipe
    try:
        old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # a wakeup fd that cannot be set (an embedding interpreter): no acknowledgement
        os.close(read_end)
        os.close(write_end)
        yield
        return

    def watch() -> None:
        said = False
        while chunk := os.read(read_end, 64):
            for signum in chunk:  # in the order they came: a signal just before the block ended is said too
                if signum == 0:  # our own end-of-block byte (a forked loader worker may hold the write end open)
                    return
                if not said and signum in (signal.SIGINT, signal.SIGTERM):
                    said = True
                    if os.environ.get("RANK", "0") != "0":  # torchrun signals every process; one line will do
                        continue
                    with contextlib.suppress(Exception):  # stderr closed: the signal still stops the run
                        sys.stderr.write(acknowledge(signum) + "\n")
                        sys.stderr.flush()

    watcher = threading.Thread(target=watch, name="speedrun-signal-ack", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        with contextlib.suppress(OSError):
            os.write(write_end, b"\0")
        watcher.join(timeout=1)
        os.close(write_end)
        if not watcher.is_alive():
            os.close(read_end)  # else the daemon thread still reads it; it ends with the process


def signals_held():
    """A Ctrl-C or SIGTERM during the block does not interrupt it; the command is stopping already, so it changes
    nothing after it either (signals_handled_by; off the main thread this does nothing)."""
    return signals_handled_by(lambda signum, frame: None)


@contextlib.contextmanager
def stop_at_step_end(keep_state: bool = True):
    """Inside the block, SIGINT and SIGTERM do not interrupt: they are recorded in the yielded StopRequest, and the
    loop stops after its current step, with a consistent state to checkpoint (an exception mid-step would leave the
    optimizers half-stepped). Later signals change nothing: the run is already stopping, and torchrun forwards the
    terminal's Ctrl-C to its workers a second time. Off the main thread signals keep their usual effect.

    keep_state=False (one process, no checkpoint folder: nothing will keep this run's state): the first signal
    ends the run at once instead, at the end of the torch call that is running; a CPU step of seconds is not
    finished for nothing (`timeout -k 5` would kill it silently). Either way the signal is acknowledged on stderr
    at once."""
    request = StopRequest()

    def record(signum, frame):
        if request.signum is None:
            request.signum = signum
            if not keep_state:
                raise request.interrupt(in_step=False)

    with signals_handled_by(record, acknowledge=lambda signum: stop_line(signum, keep_state)):
        yield request


def stop_line(signum: int, keep_state: bool) -> str:
    """What the user sees at once when a signal arrives during training (rank 0 speaks for a torchrun job)."""
    name = signal.Signals(signum).name
    then = ("finishing the current step, then stopping with its state kept" if keep_state else
            "stopping when the running torch call returns (a CPU backward may take seconds); the runs that "
            "finished are kept")
    return f"speedrun: {name} received: {then}"


class FiniteLossGuard:
    """Stops a run soon after its loss turns NaN or inf (a diverged run would otherwise finish as a normal result
    near chance accuracy), naming the step, and tells the loop when to stop for a signal.

    On the CPU the check reads the loss at once (reading costs nothing there). On an accelerator a read drains the
    device's queue, so the guard reads every `every_steps` steps: it keeps each step's loss (a reference: no
    kernel), and at the K-th stacks the K losses (one kernel) and copies them to the host in one transfer. On CUDA
    the copy goes to pinned memory behind an event and is read at the next K-th step, so the host waits only when the
    device is more than K steps behind; elsewhere (MPS, the meta device of the counts) it is read at once. A
    divergence is reported at its exact step, within 2K steps of it on CUDA. `finish()` checks what is left; the
    loops call it before each checkpoint too (Steps.after's settle), so no checkpoint holds a diverged step.

    Under torchrun every process must stop at the same step (a process that leaves the loop early would leave the
    others waiting in the next all-reduce): the loss and the stop flag travel together in one 2-element sum across
    processes each step, so a NaN or a signal on any process stops all of them at the same step.
    """

    def __init__(self, device: torch.device, total_steps: int, lr_name: str, enabled: bool = True,
                 world: dist.World | None = None, stop: StopRequest | None = None, every_steps: int = 8):
        self.device, self.total_steps, self.lr_name, self.enabled = device, total_steps, lr_name, enabled
        self.world, self.stop = world or dist.World(), stop or StopRequest()
        self.every_steps = max(1, every_steps)
        self._kept: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, loss) not yet copied
        self._in_flight: tuple[list[tuple[int, float]], torch.Tensor, torch.cuda.Event] | None = None
        self._many = self.world.size > 1
        if device.type == "cuda" and self._many:
            self._slots = [torch.empty(2, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        if self._many:  # the stop flag's two values on the device once: picking one each step copies nothing
            self._flags = torch.tensor([[0.0], [1.0]], device=device)
        self._pending: tuple[int, float, torch.Tensor, torch.cuda.Event] | None = None

    def _raise_if_bad(self, step: int, loss: float, lr: float) -> None:
        if self.enabled and not math.isfinite(loss):
            raise Diverged(step, self.total_steps, loss, lr, self.lr_name)

    def check(self, step: int, loss: torch.Tensor, lr: float) -> bool:
        """`loss` is step `step`'s loss (a 0-d tensor, still on the device); `lr` the lr it was taken with.

        Returns True when the loop should stop after this step for a signal (on any process)."""
        if not self._many:
            if self.enabled and self.device.type == "cpu":
                self._raise_if_bad(step, loss.item(), lr)
            elif self.enabled:
                self._kept.append((step, lr, loss.detach()))
                if len(self._kept) >= self.every_steps:
                    self._send()
            return self.stop.signum is not None
        flag = self._flags[0 if self.stop.signum is None else 1]  # (1,)
        packet = torch.cat([loss.detach().float().reshape(1) if self.enabled else torch.zeros_like(flag), flag])
        dist.sum_(packet, self.world)  # (2,): summed loss, number of processes asked to stop
        if self.device.type != "cuda":
            self._raise_if_bad(step, packet[0].item(), lr)
            return packet[1].item() > 0
        read = self._queue(step, packet, lr)
        return read is not None and read[1] > 0

    def _send(self) -> None:
        """The kept losses to the host in one copy; checked now, or on CUDA at the next send (or finish)."""
        steps = [(step, lr) for step, lr, _ in self._kept]
        losses = torch.stack([loss for _, _, loss in self._kept]).float()  # (K,)
        self._kept = []
        if self.device.type != "cuda":
            self._check_all(steps, losses.tolist())
            return
        host = torch.empty(len(steps), dtype=torch.float32, pin_memory=True)
        host.copy_(losses, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._in_flight = self._in_flight, (steps, host, event)
        if previous is not None:
            self._read(previous)

    def _read(self, sent: tuple[list[tuple[int, float]], torch.Tensor, torch.cuda.Event]) -> None:
        steps, host, event = sent
        event.synchronize()
        self._check_all(steps, host.tolist())

    def _check_all(self, steps: list[tuple[int, float]], losses: list[float]) -> None:
        for (step, lr), loss in zip(steps, losses):
            self._raise_if_bad(step, loss, lr)

    def _queue(self, step: int, values: torch.Tensor, lr: float) -> tuple[float, float] | None:
        """Under torchrun on CUDA: copy this step's values to pinned memory behind an event; read and check the
        previous step's."""
        slot = self._slots[step % 2]
        slot[:len(values)].copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._pending = self._pending, (step, lr, slot, event)
        if previous is None:
            return None
        prev_step, prev_lr, prev_slot, prev_event = previous
        prev_event.synchronize()
        loss, flag = prev_slot.tolist()
        self._raise_if_bad(prev_step, loss, prev_lr)
        return loss, flag

    def finish(self) -> None:
        if self._kept:  # on CUDA this reads the group in flight first
            self._send()
        if self._in_flight is not None:
            sent, self._in_flight = self._in_flight, None
            self._read(sent)
        if self._pending is not None:
            step, lr, slot, event = self._pending
            self._pending = None
            event.synchronize()
            self._raise_if_bad(step, slot[0].item(), lr)


@dataclass(kw_only=True)
class LoopState:
    """The bookkeeping every family's TrainState carries besides its model and optimizers (torchtitan's TrainState,
    nanoGPT's checkpoint dict): what a resumed run restores and the loop would otherwise keep in local variables.
    A family's TrainState inherits it and adds its own parts to state_dict / load_state_dict."""

    step: int = 0  # optimizer steps taken; a family's loader needs only this to continue
    seconds: float = 0.0  # timed seconds so far
    epochs_done: int = 0  # whole epochs in the per-epoch table
    history: list[dict] = field(default_factory=list)
    last_batch: dict | None = None  # the final row's train loss/accuracy, when the last step was checkpointed

    def loop_state(self) -> dict[str, Any]:
        return {"step": self.step, "seconds": self.seconds, "epochs_done": self.epochs_done,
                "history": self.history, "last_batch": self.last_batch, "rng": rng_state()}

    def load_loop_state(self, state: dict[str, Any], total_steps: int) -> None:
        """Restore the bookkeeping from a checkpoint's state. A checkpoint is a file from elsewhere: its checksum
        proves it whole, not well-formed, so each value is checked against this run (ValueError; the caller's
        checkpoint.restoring() turns it into one line naming the file)."""
        step, seconds, done, history = (state[k] for k in ("step", "seconds", "epochs_done", "history"))
        last = state.get("last_batch")  # absent in a checkpoint of an imagenet run that did not keep it
        # epochs_done may exceed step: a step of a batch larger than the data spans several epochs
        if not (type(step) is int and 0 <= step <= total_steps and type(done) is int and done >= 0
                and isinstance(seconds, float) and math.isfinite(seconds) and seconds >= 0
                and isinstance(history, list) and all(isinstance(row, dict) for row in history)
                and isinstance(last, (dict, type(None)))):
            raise ValueError("step, timed seconds or history out of range")
        self.step, self.seconds, self.epochs_done, self.history, self.last_batch = (
            step, seconds, done, list(history), last)
        set_rng_state(state["rng"])


class Steps:
    """What follows every optimizer step in every family's loop: the progress callback, a row of the per-epoch
    table at each whole epoch, a checkpoint when one is due or a signal asked to stop, the timer paused around
    both (the table's evaluation and checkpoint writes are not part of the timed region), and the final row.

    A row comes from the family: batch_row(seconds) is the last global batch's numbers (every process must call it
    alike: it sums over processes), table_row(seconds) the row shown at an epoch's end (batch_row plus what the
    family adds: a per-epoch evaluation, the resolution).

    on_scalars(step, loss, loss_scale, lr), when given, is called after every step inside the timed region with the
    step's loss (0-d, detached, still on the device: reading it there would wait for the step each time, so the
    callee keeps it and reads it later; run/tensorboard.py reads at the next row, where the timer is stopped),
    loss_scale (loss * loss_scale is the mean per example of this process's share) and the lr. Without it the
    loop does nothing more than it would."""

    def __init__(self, timer: Timer, total_steps: int, hooks: RunHooks | None = None):
        hooks = hooks or RunHooks()
        self.timer, self.total_steps, self.checkpoints = timer, total_steps, hooks.checkpoints
        self.on_step, self.on_epoch, self.on_scalars = hooks.on_step, hooks.on_epoch, hooks.on_scalars

    def after(self, state: LoopState, epoch: float, stopping: bool, *, batch_row: Callable[[float], dict],
              table_row: Callable[[float], dict] | None = None, loss: torch.Tensor | None = None,
              loss_scale: float = 1.0, lr: float | None = None, settle: Callable[[], None] | None = None) -> None:
        """After step `state.step` (already counted), at `epoch` epochs of data; stopping: a signal arrived.
        loss, loss_scale, lr: the step's, for on_scalars. settle: the finite-loss guard's check of every loss not
        yet read (FiniteLossGuard.finish), called before a checkpoint is written: a diverged step's weights are
        never saved (it raises Diverged)."""
        if self.on_scalars is not None and loss is not None:
            self.on_scalars(state.step, loss.detach(), loss_scale, lr)
        if self.on_step is not None:
            self.on_step(state.step, self.total_steps)
        at_row = int(epoch) > state.epochs_done and state.step < self.total_steps
        saving = self.checkpoints is not None and (stopping or self.checkpoints.due(state.step, self.total_steps))
        if not (at_row or saving):
            return
        self.timer.stop()
        if at_row:
            state.epochs_done = int(epoch)
            row = (table_row or batch_row)(self.timer.seconds)
            state.history.append(row)
            if self.on_epoch is not None:
                self.on_epoch(row)
        if saving:
            if settle is not None:
                settle()
            state.seconds = self.timer.seconds
            if state.step == self.total_steps:  # a run resumed from here takes only its final evaluation
                state.last_batch = batch_row(0.0)
            self.checkpoints.save(state.step, state.state_dict())
        self.timer.start()

    def final(self, state: LoopState, accuracy: float, train_seconds: float, batch_row: Callable[[float], dict]
              ) -> None:
        """The last row: the last batch's numbers (kept at the last step's checkpoint, else computed now, outside
        the timed region) with the final accuracy and the timed seconds."""
        row = dict(state.last_batch or batch_row(0.0))
        row["val_acc"], row["train_seconds"] = accuracy, train_seconds
        state.history.append(row)
        if self.on_epoch is not None:
            self.on_epoch(row)


def last_batch_row(epoch: float, step: int, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                   seconds: float, world: dist.World) -> dict:
    """A row of the per-epoch table for an in-memory family: train loss and accuracy are those of the last global
    batch, as airbench's table shows. loss is summed over this process's share; targets are labels (N,) or mixed
    soft targets (N, K), scored by their largest class. Every process must call it: the counts are summed."""
    labels = targets if targets.ndim == 1 else targets.argmax(1)
    counts = torch.stack([loss.detach().double(), (logits.argmax(1) == labels).sum().double(),
                          torch.tensor(float(len(labels)), dtype=torch.float64, device=loss.device)])
    dist.sum_(counts, world)  # (3,): summed loss, correct, examples over every process's share
    total_loss, correct, n = counts.tolist()
    return {"epoch": round(epoch, 4), "step": step, "train_loss": total_loss / n, "train_acc": correct / n,
            "val_acc": None, "train_seconds": seconds}


def untimed_warmup(device: torch.device, compile: bool, run: Callable[[], object]) -> float:
    """Wall-clock seconds of `run` (a family's training run on shuffled labels), so that torch.compile and cuDNN
    autotuning happen before the timed runs, as airbench does; skipped (0.0) on a CPU without compile, where there
    is nothing to warm."""
    if device.type == "cpu" and not compile:
        return 0.0
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, normalization: Normalization,
             tta_level: int, batch_size: int = 2000, autocast=None, world: dist.World | None = None,
             tta_select: float | None = 0.0, on_batch: Callable[[int], object] | None = None) -> float:
    """Top-1 accuracy (fraction) of `model` in eval mode on uint8 images (N, C, H, W) already on the device, each
    batch made by `normalization` (its statistics on that device).

    Under torchrun each process scores a contiguous 1/K of the images and the counts are summed. `model` must be
    the bare (or compiled) module, not DDP's wrapper, whose forward would synchronize buffers across processes
    that run different numbers of batches here. tta_select in (0, 1): selective TTA (tricks/tta.py), the views for
    that fraction of the images scored here (of each process's share under torchrun), least confident first.
    on_batch(p) after each batch: the forward passes of one image it made (tricks/tta.py's passes), for progress.
    """
    world = world or dist.World()
    n = len(images)
    mine = dist.part(n, world)
    lo, hi = mine.start, mine.stop
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=images.device)  # correct, seen
    amp = autocast if autocast is not None else contextlib.nullcontext
    with phase("evaluation"):
        if tta_level and tta_select and 0 < tta_select < 1:  # two passes: plain for all, views for the selected
            def inputs(idx: torch.Tensor) -> torch.Tensor:
                return normalization(images[lo + idx.to(images.device)])

            if hi > lo:  # under torchrun with fewer test images than processes, a share may hold none
                with amp():
                    logits = selective_tta_logits(model, inputs, hi - lo, tta_level, tta_select, batch_size,
                                                  on_batch)
                counts[0] += (logits.argmax(1) == labels[lo:hi]).sum()
                counts[1] += hi - lo
        else:
            for start in range(lo, hi, batch_size):
                stop = min(start + batch_size, hi)
                x = normalization(images[start:stop])
                with amp():
                    logits = tta_logits(model, x, tta_level)
                counts[0] += (logits.argmax(1) == labels[start:stop]).sum()
                counts[1] += stop - start
                if on_batch is not None:
                    on_batch((stop - start) * VIEWS[tta_level])
        model.train(was_training)
        dist.sum_(counts, world)
        correct, seen = counts.tolist()
    return correct / seen


def run_notes(*, smoke: bool, steps: int, batch_size: int, n_test: int, views: float,
              table_evaluations: int) -> list[str]:
    """The lines shown before an in-memory family's runs: what a smoke test is; else a line when scoring the test
    set (views forward passes per image, plus the per-epoch table's single-view evaluations) is more work than
    training, as it is in short CPU runs, with the quicker path."""
    if smoke:
        return [f"smoke test: {counted(steps, 'step')} of {batch_size}, {n_test} test images, no TTA: this checks "
                "that the pipeline runs; its accuracy is not a result"]
    eval_passes = n_test * views + n_test * table_evaluations
    train_passes = 3 * steps * batch_size  # a training step costs about three forward passes
    if eval_passes <= train_passes:
        return []
    return [f"note: scoring {n_test} test images x {counted(views, 'TTA view')} is more work than the training itself "
            f"({counted(steps, 'step')} of {batch_size}); for a quick check of the pipeline use smoke=True (--smoke)"]
