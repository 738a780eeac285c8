"""`speedrun profile` and `speedrun peak`: FLOPs against a hand count, the measured peak and its cache (a file from
elsewhere), MFU in every result, the phase marks, the profile's table and trace."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections import Counter

import pytest
import torch
from torch import nn

from speedrun.cli.program import main
from speedrun.data.loader import steps_for
from speedrun.engine import flops, peak
from speedrun.engine.phases import phase, phased
from speedrun.instruments.profile import group_of
from speedrun.recipes import get_recipe

TINY_SET = ["--set", "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=32"]
FAKE_PEAKS = {"fp32": 50e9, "bf16": 200e9}  # FLOP/s a test seeds the cache with


def _tiny_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


# By hand, per 3x8x8 image: the conv's forward is 2 x (4 x 8 x 8 outputs) x (3 x 3 x 3 inputs each) = 13,824 FLOPs,
# its backward only the weight gradient (its input needs none) = 13,824; the linear's forward 2 x 256 x 10 = 5,120,
# its backward the input and the weight gradients, 2 x 5,120.
CONV, LINEAR = 2 * 4 * 64 * 27, 2 * 256 * 10
HAND_TRAIN = 2 * CONV + 3 * LINEAR
HAND_FORWARD = CONV + LINEAR


def test_a_training_steps_flops_equal_the_hand_count():
    model = flops.on_meta(_tiny_net)
    counted = flops.train_step(model, (3, 8, 8), batch_size=5)
    assert abs(counted - 5 * HAND_TRAIN) <= 0.01 * 5 * HAND_TRAIN
    assert counted == 5 * HAND_TRAIN  # exact, in fact


@pytest.mark.parametrize("level,views", [(0, 1), (1, 2), (2, 6)])
def test_evaluation_flops_count_every_tta_view(level, views):
    model = flops.on_meta(_tiny_net)
    assert flops.evaluation(model, (3, 8, 8), images=7, tta_level=level) == 7 * views * HAND_FORWARD


def test_counting_draws_no_random_numbers_and_allocates_nothing():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model = flops.on_meta(_tiny_net)
    flops.train_step(model, (3, 8, 8), 512)
    assert torch.equal(torch.get_rng_state(), before) and model[0].weight.device.type == "meta"


@pytest.mark.parametrize("recipe", ["cifar10-94", "cifar10-resnet18"])
def test_an_in_memory_familys_run_is_its_steps_and_its_evaluation(recipe, tiny):
    rec = get_recipe(recipe)
    cfg = rec.make_config()
    run = rec.module().flops(cfg, tiny)
    assert run.steps == rec.module().run_steps(cfg, tiny.num_train)
    assert run.run == run.train_step * run.steps + run.evaluation
    model = flops.on_meta(lambda: rec.module().build_model(cfg, 3, 10))
    assert run.evaluation == flops.evaluation(model, (3, 32, 32), len(tiny.test_labels), cfg.tta_level)


@pytest.mark.slow
def test_the_imagenet_family_counts_each_resolution_of_its_ramp():
    from speedrun.recipes import imagenet

    cfg = dataclasses.replace(imagenet.debug(), min_res_px=16, max_res_px=32, res_step_px=8)  # 16, 24, 32 px
    cfg.validate()
    data = imagenet.ShardData("d", "/nonexistent", "train", "val", tuple("ab"), num_train=4096, num_eval=100,
                              mean_t=torch.zeros(3), std_t=torch.ones(3))
    run = imagenet.flops(cfg, data)
    model = flops.on_meta(lambda: imagenet.build_model(cfg, 3, 2))
    total = steps_for(cfg.epochs, 4096, cfg.batch_size)
    steps_at = Counter(imagenet.res_at(cfg, s, total) for s in range(total))  # {side px: steps at it}
    assert sorted(steps_at) == [16, 24, 32]
    expected = sum(n * flops.train_step(model, (3, side, side), cfg.batch_size) for side, n in steps_at.items())
    assert run.steps == total and run.train == expected


def test_phase_marks_are_nothing_without_a_profiler():
    assert isinstance(phase("forward"), contextlib.nullcontext)
    assert list(phased(iter([1, 2, 3]))) == [1, 2, 3]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("forward"):
            torch.ones(2).sum()
    assert any(e.name == "speedrun/forward" for e in prof.events())


@pytest.mark.parametrize("name,group", [("aten::mkldnn_convolution", "convolution"),
                                        ("aten::convolution_backward", "convolution"),
                                        ("aten::native_batch_norm", "batchnorm"), ("aten::max_pool2d", "pooling"),
                                        ("aten::gelu_backward", "activation"), ("aten::addmm", "linear"),
                                        ("aten::_foreach_add_", "optimizer"), ("aten::copy_", "copies/layout"),
                                        ("aten::argmax", "other")])
def test_operators_are_grouped_by_layer_type(name, group):
    assert group_of(name) == group


@pytest.mark.parametrize("name,dtype,expected", [("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
                                                 ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
                                                 ("NVIDIA H100 PCIe", "fp16", 756e12),
                                                 ("NVIDIA H200", "fp32", 67e12),
                                                 ("Tesla V100-SXM2-16GB", "bf16", None),  # V100 has no bf16
                                                 ("NVIDIA GeForce RTX 5090", "bf16", None),
                                                 ("NVIDIA H100 NVL", "bf16", None),  # not the SXM5 figure
                                                 ("NVIDIA GH200 480GB", "bf16", None),  # not the H200's
                                                 ("NVIDIA H200 NVL", "bf16", None),
                                                 ("Intel(R) Xeon(R) Processor", "fp32", None), (None, "fp32", None)])
def test_the_datasheet_never_gives_a_device_anothers_peak(name, dtype, expected):
    found = peak.datasheet(name, dtype)
    assert (found and found[0]) == expected or (found is None and expected is None)


def test_fp32_is_compared_with_the_tf32_figure_where_tf32_runs():
    assert peak.datasheet("NVIDIA A100-SXM4-80GB", "fp32", tf32=True)[0] == 156e12
    assert peak.datasheet("NVIDIA A100-SXM4-80GB", "fp32", tf32=False)[0] == 19.5e12
    assert peak.datasheet("Tesla V100-SXM2-16GB", "fp32", tf32=True)[0] == 15.7e12  # no TF32 on a V100


def _seed_cache(monkeypatch, tmp_path, rates=FAKE_PEAKS):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    dev = torch.device("cpu")
    from speedrun.records.environment import environment

    key = peak.fingerprint(dev, environment(dev)["device_name"])
    entry = {"fingerprint": key, "measured_utc": "2026-01-01T00:00:00Z",
             "dtypes": {d: {"flops_per_s": r, "kernel": "matmul", "kernels": {"matmul": r}} for d, r in rates.items()}}
    peak.cache_path().parent.mkdir(parents=True, exist_ok=True)
    peak.cache_path().write_text(json.dumps({key: entry}))
    return key


def _fake_measure(monkeypatch, calls):
    def measure(device, log=lambda line: None):
        calls.append(device)
        return {"fp32": {"flops_per_s": 1e9, "kernel": "matmul", "kernels": {"matmul": 1e9, "conv3x3": 5e8}}}
    monkeypatch.setattr(peak, "measure", measure)


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b"\xff\xfe", b"{" * 100_000, b" " * (2 << 20),
                                     b'{"KEY": {"dtypes": {"fp32": {"flops_per_s": NaN}}}}',
                                     b'{"KEY": {"dtypes": {"fp32": {"flops_per_s": -5}}}}',
                                     b'{"KEY": {"dtypes": {"fp32": {"flops_per_s": true}}}}',
                                     b'{"KEY": {"dtypes": {"fp32": "fast"}}}', b'{"KEY": "x"}',
                                     b'{"KEY": {"fingerprint": "KEY", "measured_utc": "t", "dtypes": {"fp32": '
                                     b'{"flops_per_s": 1e9, "kernels": {"matmul": 1e9}}}}}',  # no kernel name
                                     b'{"KEY": {"fingerprint": "KEY", "measured_utc": "t", "dtypes": {"fp32": '
                                     b'{"flops_per_s": 1e400, "kernel": "m", "kernels": {"m": 1e400}}}}}',
                                     b'{"KEY": {"fingerprint": "KEY", "measured_utc": "t", "dtypes": {"fp32": '
                                     b'{"flops_per_s": 1e-300, "kernel": "m", "kernels": {"m": 1e-300}}}}}',
                                     b'{"KEY": {"fingerprint": "KEY", "measured_utc": "t", "dtypes": {"fp32": '
                                     b'{"flops_per_s": 1e9, "kernel": "m", "kernels": "zz"}}}}'])
def test_a_damaged_peak_cache_is_measured_again_never_trusted(content, monkeypatch, tmp_path):
    key = _seed_cache(monkeypatch, tmp_path)
    peak.cache_path().write_bytes(content.replace(b"KEY", key.encode()))
    calls = []
    _fake_measure(monkeypatch, calls)
    with pytest.warns(Warning) if not content.startswith(b'{"KEY') else contextlib.nullcontext():
        found = peak.peak(torch.device("cpu"), key.split(": ", 1)[1].split(",")[0])
    assert calls and found["dtypes"]["fp32"]["flops_per_s"] == 1e9
    assert json.loads(peak.cache_path().read_text())[key]["dtypes"]["fp32"]["flops_per_s"] == 1e9


def test_a_peak_cache_that_is_a_fifo_is_measured_again_not_waited_on(monkeypatch, tmp_path):
    key = _seed_cache(monkeypatch, tmp_path)
    peak.cache_path().unlink()
    os.mkfifo(peak.cache_path())
    calls = []
    _fake_measure(monkeypatch, calls)
    with pytest.warns(Warning, match="not a regular file"):
        assert peak.cached(torch.device("cpu"), key.split(": ", 1)[1].rsplit(", ", 2)[0]) is None


def test_a_cached_peak_is_not_measured_again_unless_asked(monkeypatch, tmp_path):
    key = _seed_cache(monkeypatch, tmp_path)
    calls = []
    _fake_measure(monkeypatch, calls)
    name = key.split(": ", 1)[1].rsplit(", ", 2)[0]
    assert peak.peak(torch.device("cpu"), name)["dtypes"]["fp32"]["flops_per_s"] == FAKE_PEAKS["fp32"]
    assert not calls
    peak.peak(torch.device("cpu"), name, again=True)
    assert calls


def test_peak_measures_this_cpu_and_shows_no_datasheet(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path))
    monkeypatch.setattr(peak, "SECONDS_PER_KERNEL", 0.05)
    assert main(["peak", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "fp32  peak" in printed and "matmul" in printed and "conv3x3" in printed
    assert "datasheet: none for this device" in printed
    entry = next(iter(json.loads(peak.cache_path().read_text()).values()))
    assert all(math.isfinite(v["flops_per_s"]) and v["flops_per_s"] > 0 for v in entry["dtypes"].values())


def test_every_result_records_its_flops_and_mfu(monkeypatch, tmp_path):
    peaks = {"fp32": 1e12, "bf16": 4e12}  # above what a CPU reaches on a tiny net: an MFU under 100% is reported
    _seed_cache(monkeypatch, tmp_path, peaks)
    out = tmp_path / "r.json"
    assert main(["train", "--dataset", "synthetic:train=256,test=64", "--device", "cpu", "--epochs", "0.5",
                 *TINY_SET, "--set", "precision=fp32", "--json", str(out), "--quiet",
                 "--db", str(tmp_path / "db")]) == 0
    result = json.loads(out.read_text())
    f = result["flops"]
    assert f["steps"] == 2 and f["run"] == f["train_step"] * 2 + f["evaluation"] > 0
    m = result["mfu"]
    assert m["dtype"] == "fp32" and m["measured_peak_flops_per_s"] == peaks["fp32"]
    seconds = result["train_seconds"]["mean"]
    assert m["achieved_flops_per_s"] == pytest.approx(f["run"] / seconds)
    assert m["mfu_measured"] == pytest.approx(f["run"] / seconds / peaks["fp32"])
    assert m["mfu_datasheet"] is None


def test_profile_prints_the_table_writes_a_trace_and_names_the_measured_peak(monkeypatch, tmp_path, capsys):
    _seed_cache(monkeypatch, tmp_path, {"fp32": 1e12})  # above what this CPU reaches on a tiny net: MFU < 100%
    trace, report = tmp_path / "t.json", tmp_path / "p.json"
    code = main(["profile", "cifar10-94", "--dataset", "synthetic:train=512,test=64", "--device", "cpu",
                 *TINY_SET, "--set", "precision=fp32", "--steps", "2", "--trace", str(trace), "--json", str(report)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for text in ("time per step", "forward", "backward", "optimizer", "data", "host overhead and idle",
                 "final evaluation (once)", "convolution", "top operators", "peak memory",
                 "of the measured fp32 peak", "datasheet: none for this device"):
        assert text in captured.out, text
    events = json.loads(trace.read_text())["traceEvents"]
    assert isinstance(events, list) and any(e.get("name") == "speedrun/backward" for e in events)
    r = json.loads(report.read_text())
    assert 0 < r["mfu_train"]["mfu_measured"] < 1 and r["evaluation_seconds"] > 0
    assert r["schedule"] == {"wait": 1, "warmup": 1, "active": 2, "steps_run": 4}
    assert r["flops"]["train_step"] == get_recipe("cifar10-94").module().flops(
        get_recipe("cifar10-94").make_config().__class__(batch_size=64, widths=(8, 16, 16), whiten_images=32),
        _synthetic(512, 64)).train_step


def _synthetic(n_train, n_test):
    from speedrun.data.sources import load_dataset

    return load_dataset(f"synthetic:train={n_train},test={n_test}")


def test_profile_refuses_an_existing_trace_before_any_work(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text("mine")
    assert main(["profile", "--dataset", "synthetic", "--device", "cpu", "--trace", str(trace)]) == 2
    assert trace.read_text() == "mine" and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_profile_runs_a_loader_fed_family(monkeypatch, tmp_path, capsys):
    """imagenet-debug (synthetic shards, a warm-up fraction of its epochs): the short run is the recipe's schedule
    compressed, as --epochs does, so its warm-up still fits in it."""
    _seed_cache(monkeypatch, tmp_path, {"fp32": 1e12})
    trace = tmp_path / "t.json"
    code = main(["profile", "imagenet-debug", "--device", "cpu", "--steps", "1", "--trace", str(trace)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "time per step" in captured.out and "of the measured fp32 peak" in captured.out
    assert any(e.get("name") == "speedrun/forward" for e in json.loads(trace.read_text())["traceEvents"])


def test_profile_errors_name_the_flag_given(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text("mine")
    assert main(["profile", "--dataset", "synthetic", "--device", "cpu", "--trace", str(trace)]) == 2
    assert "(--trace)" in capsys.readouterr().err
    assert main(["profile", "--dataset", "synthetic:train=64,test=16", "--device", "cpu", "--steps", "1000",
                 "--set", "batch_size=1024", "--trace", str(tmp_path / "u.json")]) == 2
    line = capsys.readouterr().err.strip()
    assert "--steps 1000" in line and "--epochs" not in line and not (tmp_path / "u.json").exists()
    assert main(["profile", "--dataset", "synthetic", "--device", "cpu", "--seed", "9" * 25]) == 2
    assert "--seed" in capsys.readouterr().err


@pytest.mark.slow
def test_peak_measures_at_the_threads_asked_and_restores_them(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path))
    monkeypatch.setattr(peak, "SECONDS_PER_KERNEL", 0.05)
    before = torch.get_num_threads()
    assert main(["peak", "--device", "cpu", "--threads", "1"]) == 0
    assert ", 1 threads," in capsys.readouterr().out
    assert list(json.loads(peak.cache_path().read_text())) == [peak.fingerprint(torch.device("cpu"),
                                                                               _cpu_name(), 1)]
    assert torch.get_num_threads() == before


def _cpu_name():
    from speedrun.records.environment import environment

    return environment("cpu")["device_name"]
