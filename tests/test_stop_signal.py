"""A signal during training: acknowledged at once, and acted on as soon as the step allows.

A CPU step of cifar10-resnet18 takes seconds, most of it one torch call (the backward) during which Python runs no
signal handler: `timeout -k 5` used to kill such a run with nothing said."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import rest_of
from speedrun.engine.loop import stop_at_step_end
from speedrun.errors import Terminated

STOPPING = ("speedrun: SIGTERM received: stopping when the running torch call returns (a CPU backward may take "
            "seconds); the runs that finished are kept\n")


class _TimedStderr:
    """sys.stderr that notes when each line was written."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.append((time.monotonic(), text))
        return len(text)

    def flush(self) -> None:
        pass


def _long_call() -> float:
    """One torch call of half a second or more (a matmul of 128 GFLOP; torch releases the GIL inside it), with a
    SIGTERM sent 0.1 s into it. Returns when the call ended."""
    a = torch.randn(4000, 4000)
    torch.mm(a[:8], a)  # the first call's one-time costs
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
    torch.mm(a, a)
    return time.monotonic()


def test_with_nothing_to_keep_the_signal_is_acknowledged_during_the_call_and_ends_the_run_after_it(monkeypatch):
    err = _TimedStderr()
    monkeypatch.setattr(sys, "stderr", err)
    reached = []
    with pytest.raises(Terminated) as stopped:
        with stop_at_step_end(keep_state=False):
            _long_call()
            reached.append("after the call")  # the handler raises at the first line of Python after the call
    caught = time.monotonic()
    assert reached == [] and stopped.value.in_step is False
    (when, line), = err.lines
    assert line == STOPPING
    assert caught - when > 0.1  # written while the main thread was still inside the matmul


def test_with_a_state_to_keep_the_step_finishes_and_the_request_is_recorded(monkeypatch):
    err = _TimedStderr()
    monkeypatch.setattr(sys, "stderr", err)
    with stop_at_step_end(keep_state=True) as request:
        end = _long_call()
        os.kill(os.getpid(), signal.SIGINT)  # a second signal: recorded once, said once
        time.sleep(0.05)
    assert request.signum == signal.SIGTERM
    (when, line), = err.lines
    assert "finishing the current step, then stopping with its state kept" in line and when < end
    exc = request.interrupt()
    assert isinstance(exc, Terminated) and exc.in_step is True


def test_the_previous_handlers_and_wakeup_fd_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    wakeup = signal.set_wakeup_fd(-1)  # whatever was set before (none, or another library's): put back as it was
    signal.set_wakeup_fd(wakeup)
    threads = threading.active_count()
    with stop_at_step_end(keep_state=True):
        pass
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(wakeup) == wakeup  # ours is gone
    assert threading.active_count() == threads  # the watcher thread ended


@pytest.mark.slow
def test_sigterm_mid_step_of_a_slow_cpu_step_is_acknowledged_at_once_and_stops_the_run(tmp_path):
    """cifar10-resnet18's fp32 CPU step at batch 256: seconds, most of them in one backward call."""
    argv = [sys.executable, "-m", "speedrun.cli", "train", "cifar10-resnet18", "--dataset",
            "synthetic:train=2048,test=64", "--device", "cpu", "--epochs", "1", "--set", "batch_size=256",
            "--set", "eval_each_epoch=false"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the first step has ended: the second is running
            if line.startswith("run 1/1: step 1/"):
                break
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("speedrun: SIGTERM"):
                break
        acked = time.monotonic() - sent
        _, err = rest_of(proc, timeout_s=120)
        err = "".join(seen) + err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert seen[-1] == STOPPING, err
    assert proc.returncode == 143 and err.strip().splitlines()[-1].startswith("speedrun: terminated (SIGTERM)"), err
    assert acked < 2.0, acked
