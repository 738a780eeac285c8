"""`speedrun profile` shows its own lines on stderr, never Kineto's start/stop lines ("USDT:... profiler_start"),
which the profiler's C++ side writes to fd 2 (instruments/profile.py's _profiler_lines_dropped); Kineto's other
lines, and ours written meanwhile, pass."""

from __future__ import annotations

import json
import os

import pytest
import torch

from speedrun.cli.program import main
from speedrun.engine import peak
from speedrun.instruments.profile import _profiler_lines_dropped

START = b"USDT:2026-11-26 09:22:26 12699:12699 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
STOP = b"USDT:2026-11-26 09:22:26 12699:12699 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"


@pytest.mark.parametrize("written", [
    [START],
    [STOP, START, STOP],
    [b"ours before\n", START, b"ours after\n"],
    [START, b"WARNING:2026-11-26 1:1 CuptiActivityApi.cpp:1] a warning of Kineto's\n"],
    [b"a line without its newline"],
])
def test_only_kinetos_start_and_stop_lines_are_dropped(written, capfd):
    with _profiler_lines_dropped():
        for chunk in written:
            os.write(2, chunk)  # as Kineto writes, and sys.stderr (fd 2) outside pytest's capture
    assert capfd.readouterr().err == b"".join(c for c in written if c not in (START, STOP)).decode()


def test_a_real_profiler_session_writes_nothing_else(capfd):
    with _profiler_lines_dropped():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    torch.ones(3).add_(1)
    with _profiler_lines_dropped():
        prof.__exit__(None, None, None)
    assert capfd.readouterr().err == ""
    assert any(e.name == "aten::add_" for e in prof.events())


def test_the_profile_command_shows_its_lines_and_not_kinetos(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path))
    key = peak.fingerprint(torch.device("cpu"), _cpu_name())  # a measured peak, so that none is measured here
    entry = {"fingerprint": key, "measured_utc": "2026-01-01T00:00:00Z",
             "dtypes": {"fp32": {"flops_per_s": 1e12, "kernel": "matmul", "kernels": {"matmul": 1e12}}}}
    peak.cache_path().write_text(json.dumps({key: entry}))
    trace = tmp_path / "t.json"
    code = main(["profile", "cifar10-94", "--dataset", "synthetic:train=512,test=64", "--device", "cpu", "--set",
                 "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=32", "--set", "precision=fp32",
                 "--steps", "2", "--trace", str(trace)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert "USDT" not in captured.err and "profiler_start" not in captured.err, captured.err
    assert "profiling 2 steps of cifar10-94" in captured.err and "time per step" in captured.out
    assert any(e.get("name") == "speedrun/forward" for e in json.loads(trace.read_text())["traceEvents"])


def _cpu_name():
    from speedrun.records.environment import environment

    return environment("cpu")["device_name"]
