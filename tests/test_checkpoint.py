import math
import os
import random
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from speedrun.engine import checkpoint as ck
from speedrun.engine.checkpoint import (CheckpointError, check_compatible, checkpoint_name, find_checkpoint,
    list_checkpoints, load_checkpoint, save_checkpoint)
from speedrun.data import limits


def assert_same(a, b, where="state"):
    """Bitwise equality, types included: a tuple is not a list, 1 is not 1.0, nan equals nan."""
    # A state_dict's OrderedDict comes back as a dict (load_state_dict takes either).
    kind = [dict if isinstance(x, dict) else type(x) for x in (a, b)]
    assert kind[0] is kind[1], f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device.type) == (b.dtype, b.shape, "cpu"), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), where
    else:
        assert a == b, where


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 3))


def train_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_round_trip_of_a_training_state_is_bitwise(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    train_step(model, opt, x, y)
    bf16 = torch.randn(5, dtype=torch.bfloat16)
    np_state = np.random.get_state()
    base = torch.arange(12.0).reshape(3, 4)
    state = {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])},
        "bf16": bf16, "loss": float("nan"), "best": float("-inf"), "zero": -0.0,
        "pair": (1, "a", None, True), "int_keys": {0: [1, [2.5, []]], 7: {"x": ()}},
        "views": [base, base[1:], base.t(), torch.tensor(3)],  # share one storage; one non-contiguous
    }
    expected = (random.random(), np.random.rand(), torch.rand(3))  # the draws that follow the saved RNG states
    meta = {"recipe": "r", "config": {"lr": 0.1, "shape": [3, 32, 32]}, "run": 0, "step": 1}
    path = save_checkpoint(tmp_path, 0, 1, state, meta, keep=3)
    assert path == tmp_path / "ckpt-00000-000000001.safetensors" == tmp_path / checkpoint_name(0, 1)
    loaded, loaded_meta = load_checkpoint(path)
    assert loaded_meta == meta
    assert_same(state, loaded)
    assert isinstance(loaded["optimizer"]["state"][0]["momentum_buffer"], torch.Tensor)  # int keys stay int

    # Tensors are independent of the file (not even mapped) and of each other.
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            assert path.name not in f.read()
    path.unlink()
    loaded["views"][0].add_(1)
    assert torch.equal(loaded["views"][1], base[1:])

    # A restored optimizer and model continue exactly as the originals do.
    model2 = make_model()
    model2[0].weight.data.zero_()
    model2.load_state_dict(loaded["model"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    opt2.load_state_dict(loaded["optimizer"])
    train_step(model, opt, x, y)
    train_step(model2, opt2, x, y)
    assert_same(model.state_dict(), model2.state_dict())

    # And so do the RNGs.
    name, keys, *rest = loaded["rng"]["numpy"]
    random.setstate(loaded["rng"]["python"])
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(loaded["rng"]["torch"])
    assert_same(expected, (random.random(), np.random.rand(), torch.rand(3)))


def test_keep_deletes_only_older_checkpoints(tmp_path):
    user = ["notes.txt", "ckpt-1-2.safetensors", "ckpt-000000-000000001.safetensors", "model.safetensors",
            ".tmp-ckpt-recent.part"]
    for name in user:
        (tmp_path / name).write_text("mine")
    for run, step in [(0, 5), (0, 10), (1, 1), (1, 2)]:
        save_checkpoint(tmp_path, run, step, {"step": step}, {"run": run}, keep=2)
    assert list_checkpoints(tmp_path) == [tmp_path / checkpoint_name(1, 2), tmp_path / checkpoint_name(1, 1)]
    assert all((tmp_path / name).read_text() == "mine" for name in user)
    # Re-saving a step replaces it; saving an older one never deletes what was just written.
    save_checkpoint(tmp_path, 1, 2, {"step": "again"}, {}, keep=2)
    assert load_checkpoint(tmp_path / checkpoint_name(1, 2))[0] == {"step": "again"}
    save_checkpoint(tmp_path, 0, 3, {}, {}, keep=1)
    assert list_checkpoints(tmp_path) == [tmp_path / checkpoint_name(0, 3)]
    assert sorted(os.listdir(tmp_path)) == sorted(user + [checkpoint_name(0, 3)])


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, error):
    first = save_checkpoint(tmp_path, 0, 1, {"w": torch.ones(3)}, {}, keep=1)

    def crash(*args):
        raise error

    monkeypatch.setattr(ck.os, "replace", crash)
    with pytest.raises(ValueError if isinstance(error, OSError) else KeyboardInterrupt) as e:
        save_checkpoint(tmp_path, 0, 2, {"w": torch.zeros(3)}, {}, keep=1)
    if isinstance(error, OSError):
        assert "No space left on device" in str(e.value) and "--checkpoint-dir" in str(e.value)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [first.name]
    assert torch.equal(load_checkpoint(first)[0]["w"], torch.ones(3))


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling this creates the marker file


def test_a_pickle_payload_is_refused_without_running_it(tmp_path):
    good = save_checkpoint(tmp_path, 0, 5, {"step": 5}, {}, keep=5)
    evil = tmp_path / checkpoint_name(0, 10)
    marker = tmp_path.parent / f"{tmp_path.name}-pwned"
    torch.save({"model": Payload(marker)}, evil)
    with pytest.raises(CheckpointError, match=f"{evil.name}.*not a safetensors file"):
        load_checkpoint(evil)
    assert not marker.exists()
    logs = []
    state, _, path = find_checkpoint(tmp_path, logs.append)
    assert (state, path) == ({"step": 5}, good)
    assert len(logs) == 1 and evil.name in logs[0] and "trying the previous one" in logs[0]
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        find_checkpoint(evil, logs.append)  # a file given by name is not fallen back from
    assert not marker.exists()
    # The payload is live: torch.load runs it (under a .pt name; it reads .safetensors names with safetensors).
    os.link(evil, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    save_checkpoint(tmp_path, 0, 1, {"w": torch.full((100,), 1.0)}, {"step": 1}, keep=5)
    newest = save_checkpoint(tmp_path, 0, 2, {"w": torch.full((100,), 2.0)}, {"step": 2}, keep=5)
    newest.write_bytes(newest.read_bytes()[:300])
    logs = []
    state, meta, path = find_checkpoint(tmp_path, logs.append)
    assert meta == {"step": 1} and torch.equal(state["w"], torch.ones(100)) and path.name == checkpoint_name(0, 1)
    assert len(logs) == 1 and newest.name in logs[0] and "unusable" in logs[0]
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"no usable checkpoint in .*newest {newest.name}: .*--checkpoint-dir"):
        find_checkpoint(tmp_path, logs.append)
    assert len(logs) == 2


def test_a_flipped_byte_in_tensor_data_fails_the_checksum(tmp_path):
    path = save_checkpoint(tmp_path, 0, 1, {"w": torch.zeros(1000)}, {}, keep=1)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path)


def test_a_file_larger_than_memory_is_refused_before_reading(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path, 0, 1, {"w": torch.zeros(1000)}, {}, keep=1)
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 1000)
    monkeypatch.setattr(ck.safetensors, "safe_open", None)  # never reached
    with pytest.raises(CheckpointError, match=f"{path.name} would take 4.* of memory, more than the 1.0 kB available"):
        load_checkpoint(path)


def forge(path, skeleton, tensors=None, **metadata):
    """A safetensors file whose checksum is right for what it holds, so the checks behind it are reached."""
    tensors = tensors or {}
    fields = {"format": ck.CHECKPOINT_FORMAT, "version": "1", "skeleton": skeleton, "meta": "{}"} | metadata
    fields["sha256"] = ck.checkpoint_digest(skeleton, fields["meta"], [tensors[k] for k in sorted(tensors, key=int)])
    safetensors.torch.save_file(tensors, path, metadata=fields)
    return path


@pytest.mark.parametrize("content, reason", [
    (struct.pack("<Q", 2**60) + b"{}" * 8, "header claims 1,152,921,504,606,846,976 bytes"),
    (b"\x05\x00", "header claims 5 bytes, the file has 2"),
    (struct.pack("<Q", 10) + b"not json!!", "not a valid safetensors file"),
])
def test_broken_headers_are_refused(tmp_path, content, reason):
    path = tmp_path / checkpoint_name(0, 1)
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(path)


@pytest.mark.parametrize("skeleton, extra, reason", ids=lambda v: str(v)[:24], argvalues=[
    ("[" * 10000 + "]" * 10000, {}, "not valid JSON"),
    ('{"tuple":[' * 200 + "]}" * 200, {}, "nested deeper than 64"),
    ('{"a": {"tensor": 1}}', {}, "unknown form"),
    ('{"dict": [["w", {"tensor": 1}]]}', {}, "refers to tensor 1, which the file does not hold"),
    ("{}", {"format": "other"}, "not a speedrun checkpoint"),
    ("{}", {"version": "2"}, "checkpoint version '2'; this speedrun reads version 1"),
    ("{}", {"meta": "[1]"}, "meta is not a JSON object"),
])
def test_hostile_metadata_is_refused(tmp_path, skeleton, extra, reason):
    path = forge(tmp_path / checkpoint_name(0, 1), skeleton, {"0": torch.ones(2)}, **extra)
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(path)


def test_nothing_to_resume_is_none(tmp_path):
    assert find_checkpoint(tmp_path, print) is None
    assert find_checkpoint(tmp_path / "not-made-yet", print) is None
    (tmp_path / "ckpt-latest.safetensors").write_bytes(b"user file")
    assert find_checkpoint(tmp_path, print) is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_checkpoint(tmp_path / checkpoint_name(0, 1), print)


def test_the_directory_being_a_file_is_a_value_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        save_checkpoint(tmp_path / "file", 0, 1, {}, {}, keep=1)
    with pytest.raises(ValueError, match="could not write .*under-a-file.*Not a directory"):
        save_checkpoint(tmp_path / "file" / "under-a-file", 0, 1, {}, {}, keep=1)
    with pytest.raises(ValueError, match="cannot hold; convert it"):
        save_checkpoint(tmp_path / "new" / "dir", 0, 1, {"a": {1, 2}}, {}, keep=1)
    with pytest.raises(ValueError, match="keep=0"):
        save_checkpoint(tmp_path, 0, 1, {}, {}, keep=0)


def test_check_compatible_names_the_first_difference(tmp_path):
    path = tmp_path / checkpoint_name(0, 1)
    meta = {"recipe": "a", "seed": 0, "run": 3, "config": {"lr_per_1024": 11.5, "epochs": 10, "ema": float("nan")},
            "data": {"name": "cifar10", "image_shape": [3, 32, 32], "num_classes": 10}}
    same = {"recipe": "a", "seed": 0, "config": {"lr_per_1024": 11.5, "epochs": 10, "ema": float("nan")},
            "data": {"name": "cifar10", "image_shape": (3, 32, 32), "num_classes": 10}}
    check_compatible(meta, same, path)
    cases = [({"config": {**same["config"], "lr_per_1024": 12.0}}, "lr_per_1024=11.5; this run has lr_per_1024=12.0"),
             ({"data": {**same["data"], "num_classes": 100}}, "data.num_classes=10; this run has data.num_classes=100"),
             ({"config": {**same["config"], "new": 1}}, "new=missing; this run has new=1"),
             ({"recipe": "b"}, "recipe='a'; this run has recipe='b'"),
             ({"extra": True}, "extra=missing; this run has extra=True"),
             ({"seed": 0.0}, "seed=0; this run has seed=0.0")]
    for change, message in cases:
        with pytest.raises(ValueError, match="checkpoint ckpt-00000-000000001.safetensors was made with") as e:
            check_compatible(meta, {**same, **change}, path)
        assert message in str(e.value) and "without --resume" in str(e.value) and "\n" not in str(e.value)
    del same["config"]["epochs"]  # the checkpoint has a field this run lacks
    with pytest.raises(ValueError, match="epochs=10; this run has epochs=missing"):
        check_compatible(meta, same, path)
    check_compatible(meta, same, path, may_differ=frozenset({"epochs"}))
    check_compatible(meta, {**same, "data": {**same["data"], "name": "x"}}, path, frozenset({"data.name", "epochs"}))


@pytest.mark.parametrize("saved,used_here,refused", [
    ({"precision_used": "bf16", "config": {"precision": "auto"}}, "bf16", False),
    ({"precision_used": "bf16", "config": {"precision": "auto"}}, "fp32", True),  # moved from a GPU to a CPU
    ({"precision_used": "fp32", "config": {"precision": "fp32"}}, "fp32", False),  # --set precision=fp32 resumes
    ({"config": {"precision": "auto"}}, "fp32", False),  # before the record: auto was fp32 on a CPU
    ({"config": {"precision": "fp16"}}, "fp16", False),
    ({"config": "garbage"}, "bf16", True),
])
def test_a_resumed_run_keeps_the_precision_its_checkpoint_ran_at(saved, used_here, refused):
    from pathlib import Path

    from speedrun.run.resume import check_precision

    meta = {"device_type": "cpu", "precision_used": used_here}
    try:
        check_precision(saved, meta, Path("ckpt-00000-000000001.safetensors"))
        outcome = False
    except ValueError as e:
        outcome = "--set precision=" in str(e)
    assert outcome == refused
