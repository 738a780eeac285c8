"""The debug-API guard: each switch that slows a run without saying so is warned once, in one line, recorded in
the result, and refused by --strict (exit 2) before any work, for train, bench and ablate alike."""

from __future__ import annotations

import contextlib
import json
import sys

import pytest
import torch

from speedrun.cli.program import main
from speedrun.records import debug_apis

TINY = ["--dataset", "synthetic:train=64,test=16", "--device", "cpu", "--epochs", "0.5",
        "--set", "batch_size=32", "--set", "widths=8,8,8", "--set", "whiten_images=32", "--set", "tta_level=0"]


@contextlib.contextmanager
def _anomaly():
    with torch.autograd.set_detect_anomaly(True):
        yield


@contextlib.contextmanager
def _profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        yield


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def _cudnn_deterministic(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    yield


@contextlib.contextmanager
def _sync_debug(monkeypatch):
    # A CPU build has no sync-debug mode to enter: the CUDA calls the guard makes answer as a GPU in mode 1 would.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 1)
    yield


@contextlib.contextmanager
def _emit_nvtx(monkeypatch):
    # emit_nvtx needs CUDA (a CPU build raises on entry); it turns on the same autograd profiler state that the
    # guard reads, which is what this stands in for.
    monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: True)
    yield


@contextlib.contextmanager
def _env(monkeypatch, name, value="1"):
    monkeypatch.setenv(name, value)
    yield


@contextlib.contextmanager
def _tracer():
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: None)  # a tracer that asks for no line events: cheap, but attached
    try:
        yield
    finally:
        sys.settrace(previous)


@contextlib.contextmanager
def _python_profiler():
    previous = sys.getprofile()
    sys.setprofile(lambda frame, event, arg: None)
    try:
        yield
    finally:
        sys.setprofile(previous)


# name, a context with the switch on, a word the one line must hold: switches that slow a run on any device,
# tried end to end on this machine's CPU
SWITCHES = [
    ("anomaly", lambda mp: _anomaly(), "anomaly detection"),
    ("profiler", lambda mp: _profiler(), "profiler is recording"),
    ("emit_nvtx", _emit_nvtx, "emit_nvtx"),
    ("deterministic", lambda mp: _deterministic(), "deterministic algorithms"),
    ("TORCH_COMPILE_DEBUG", lambda mp: _env(mp, "TORCH_COMPILE_DEBUG"), "TORCH_COMPILE_DEBUG"),
    ("tracer", lambda mp: _tracer(), "Python tracer"),
    ("python_profiler", lambda mp: _python_profiler(), "Python profiler"),
]
# switches that slow only a run on CUDA: this machine has none, so each is checked for a CUDA run directly, and
# for not being flagged on a CPU run
CUDA_SWITCHES = [
    ("cudnn_deterministic", _cudnn_deterministic, "cudnn.deterministic"),
    ("sync_debug", _sync_debug, "sync-debug mode"),
    ("CUDA_LAUNCH_BLOCKING", lambda mp: _env(mp, "CUDA_LAUNCH_BLOCKING"), "CUDA_LAUNCH_BLOCKING"),
    ("PYTORCH_NO_CUDA_MEMORY_CACHING", lambda mp: _env(mp, "PYTORCH_NO_CUDA_MEMORY_CACHING"),
     "PYTORCH_NO_CUDA_MEMORY_CACHING"),
]


@pytest.mark.parametrize("name,switch,word", CUDA_SWITCHES, ids=[s[0] for s in CUDA_SWITCHES])
def test_a_cuda_switch_is_flagged_for_a_cuda_run_only(name, switch, word, monkeypatch):
    with switch(monkeypatch):
        assert len([line for line in debug_apis.active("cuda") if word in line]) == 1
        assert not [line for line in debug_apis.active("cpu") if word in line]
        with pytest.warns(Warning, match="slower than it could be") as caught:
            debug_apis.guard(False, "cuda")
        assert len([w for w in caught if word in str(w.message)]) == 1
        with pytest.raises(ValueError, match="--strict") as refused:
            debug_apis.guard(True, "cuda")
        assert word in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name,value,on", [("TORCH_COMPILE_DEBUG", "false", False), ("TORCH_COMPILE_DEBUG", "0", False),
                                           ("TORCH_COMPILE_DEBUG", "1", True), ("CUDA_LAUNCH_BLOCKING", "0", False),
                                           ("PYTORCH_NO_CUDA_MEMORY_CACHING", "true", True)])
def test_an_environment_switch_is_on_as_its_library_reads_it(name, value, on, monkeypatch):
    monkeypatch.setenv(name, value)
    assert any(name in line for line in debug_apis.active("cuda")) == on


def test_the_guard_does_not_initialize_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def init():
        raise AssertionError("the guard asked CUDA for its sync-debug mode before CUDA was initialized")

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", init)
    debug_apis.active("cuda")


def test_nothing_is_flagged_in_a_clean_process(monkeypatch):
    for name in ("CUDA_LAUNCH_BLOCKING", "PYTORCH_NO_CUDA_MEMORY_CACHING", "TORCH_COMPILE_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "0")  # set to 0 is off
    if sys.gettrace() is not None or sys.getprofile() is not None:
        pytest.skip("this test process runs under a tracer (coverage or a debugger)")
    assert debug_apis.active() == []


@pytest.mark.parametrize("name,switch,word", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_each_switch_is_warned_once_in_one_line_and_recorded(name, switch, word, monkeypatch, capsys, tmp_path):
    out = tmp_path / "r.json"
    with switch(monkeypatch):
        code = main(["train", *TINY, "--json", str(out), "--quiet", "--db", str(tmp_path / "db")])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = [line for line in err.splitlines() if word in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("speedrun: warning: slower than it could be: ")
    recorded = json.loads(out.read_text())["environment"]["debug_apis"]
    assert len([r for r in recorded if word in r]) == 1


@pytest.mark.parametrize("command", ["train", "bench", "ablate"])
@pytest.mark.parametrize("name,switch,word", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_strict_refuses_before_any_work(name, switch, word, command, monkeypatch, capsys, tmp_path):
    out = tmp_path / "r.json"
    extra = ["--vary", "lookahead=false"] if command == "bench" else []
    with switch(monkeypatch):
        code = main([command, *TINY, *extra, "--strict", "--json", str(out), "--db", str(tmp_path / "db")])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "--strict" in lines[0], captured.err
    assert not out.exists() and not (tmp_path / "db").exists()  # refused before the result or database
