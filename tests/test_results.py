import json
import os
import shutil
import stat
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

from speedrun.records import result_file as results
from speedrun.records import environment as environment_mod
from speedrun.records.environment import environment
from speedrun.records.result_file import default_result_path, load_result, write_json
from speedrun.records.stats import summarize

ENV_KEYS = {"python", "platform", "hostname", "torch", "torch_cuda", "cudnn", "device_type", "device_name",
            "cpu_threads", "gpu_driver", "git_commit", "git_dirty", "speedrun_version", "timestamp_utc",
            "debug_apis"}


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_write_json_converts_and_round_trips(tmp_path):
    obj = {"path": Path("/data/cifar10"), "dtype": torch.bfloat16, "device": torch.device("cuda", 0),
           "acc": np.float32(0.5), "epochs": np.int64(9), "arr": np.arange(3), "loss": torch.tensor(1.25),
           "shape": (2, 3), "summary": summarize([1.0, 3.0]), "tags": {"b", "a"}}
    out = write_json(tmp_path / "deep" / "er" / "r.json", obj)
    assert out == tmp_path / "deep" / "er" / "r.json"
    assert load_result(out) == {"path": "/data/cifar10", "dtype": "torch.bfloat16", "device": "cuda:0", "acc": 0.5,
                                "epochs": 9, "arr": [0, 1, 2], "loss": 1.25, "shape": [2, 3],
                                "summary": summarize([1.0, 3.0]).to_dict(), "tags": ["a", "b"]}
    assert list(json.loads(out.read_text())) == list(obj)  # key order kept (sort_keys=False)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_write_json_failure_mid_dump_keeps_old_file(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"old": True})
    before = path.read_bytes()

    class Exploding:
        pass

    # The big list is streamed into the temp file before default= meets the object and raises.
    with pytest.raises(TypeError, match="cannot store Exploding"):
        write_json(path, {"big": list(range(20_000)), "bad": Exploding()})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["r.json"]


def test_write_json_failure_at_fsync_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json(path, {"old": True})

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"new": True})
    assert load_result(path) == {"old": True}
    assert os.listdir(tmp_path) == ["r.json"]


def test_default_result_path_names_and_never_overwrites(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "datetime", _FrozenDatetime)
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "db"))
    first = default_result_path("airbench94", "/data/CIFAR 10/")
    assert first == tmp_path / "db" / "20240102-030405-airbench94-CIFAR_10.json"
    write_json(first, {"run": 1})
    second = default_result_path("airbench94", "/data/CIFAR 10/")
    third = default_result_path("airbench94", "/data/CIFAR 10/")
    assert (second.name, third.name) == ("20240102-030405-airbench94-CIFAR_10-2.json",
                                         "20240102-030405-airbench94-CIFAR_10-3.json")
    assert load_result(first) == {"run": 1}
    explicit = default_result_path("r", "cifar10.npz", root=tmp_path / "other")
    assert explicit == tmp_path / "other" / "20240102-030405-r-cifar10.npz.json"


def test_default_result_path_default_root_and_validation(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)
    path = default_result_path("airbench94", "cifar10")
    assert path.parent == Path("results") and path.exists()
    with pytest.raises(ValueError, match="recipe '///'"):
        default_result_path("///", "cifar10")


def test_load_result_errors_name_the_file(tmp_path):
    good = write_json(tmp_path / "good.json", {"metrics": {"acc": 0.94}, "n": 3})
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good.read_text()[:-10])
    empty = tmp_path / "empty.json"
    empty.write_text("")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    for path, fragment in [(truncated, "truncated"), (empty, "never finished"), (listed, "JSON object"),
                           (binary, "UTF-8")]:
        with pytest.raises(ValueError, match=fragment) as info:
            load_result(path)
        assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError):
        load_result(tmp_path / "missing.json")


def test_environment_describes_cpu():
    env = environment("cpu")
    assert set(env) == ENV_KEYS
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert env["cpu_threads"] == torch.get_num_threads() and env["device_name"]
    assert datetime.fromisoformat(env["timestamp_utc"]).utcoffset().total_seconds() == 0
    assert isinstance(env["speedrun_version"], str) and env["speedrun_version"]
    json.dumps(env)  # plain JSON types only


def test_environment_without_git_or_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no git, no nvidia-smi
    env = environment(torch.device("cpu"))
    assert (env["git_commit"], env["git_dirty"], env["gpu_driver"]) == (None, None, None)

    def hung(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 5.0)

    monkeypatch.setattr(environment_mod.subprocess, "run", hung)
    monkeypatch.setattr(environment_mod.shutil, "which", lambda name: "/usr/bin/" + name)
    env = environment("cpu")
    assert (env["git_commit"], env["git_dirty"], env["gpu_driver"]) == (None, None, None)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_state_reads_commit_and_dirty_flag(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                               "-c", "commit.gpgsign=false", *args], check=True, capture_output=True, text=True)

    git("init", "-q")
    assert environment_mod.git_state(tmp_path) == (None, None)  # no commit yet
    (tmp_path / "f.py").write_text("x = 1\n")
    git("add", "f.py")
    git("commit", "-q", "-m", "init", "--no-verify")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert environment_mod.git_state(tmp_path) == (head, False)
    # what following the README writes into the checkout (a report, a saved model, a result) is untracked: clean
    (tmp_path / "speedrun-report.html").write_text("<html>")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.safetensors").write_bytes(b"\0")
    assert environment_mod.git_state(tmp_path) == (head, False)
    (tmp_path / "f.py").write_text("x = 2\n")  # a tracked file changed
    assert environment_mod.git_state(tmp_path) == (head, True)
    git("add", "f.py")  # staged counts too
    assert environment_mod.git_state(tmp_path) == (head, True)
    assert environment_mod.git_state(tmp_path / "venv" / "lib" / "site-packages" / "speedrun") == (None, None)
