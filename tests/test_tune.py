"""`speedrun tune` (the doctor), settings files (`--apply`, `train --settings`, $SPEEDRUN_SETTINGS) and the system
settings it measures (cpu_threads, optimizer_kernel), each an exact no-op at its default."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3

import pytest
import torch

from speedrun.cli.program import main
from speedrun.engine.system import resolve_system, setup_system
from speedrun.instruments import tune as doctor
from speedrun.recipes import get_recipe
from speedrun.records.settings_file import MAX_SETTINGS_BYTES, write_settings
from speedrun.report import html, markdown
from speedrun.run.prepared import RunRequest, prepare
from speedrun.tricks.optimizer_kernel import optimizer_kernel_kwargs
from speedrun.tricks.precision import default_cpu_threads, native_bf16_cpu

TINY = ["--dataset", "synthetic:train=256,test=64", "--device", "cpu", "--epochs", "0.5",
        "--set", "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=32", "--set", "tta_level=0"]
CPU = torch.device("cpu")


def test_the_doctor_tries_what_applies_on_a_cpu():
    cfg = get_recipe("cifar10-94").make_config()
    names = [name for name, _ in doctor.candidates(cfg, CPU)]
    current = resolve_system(cfg, CPU).precision
    other = {"bf16": "fp32", "fp32": "bf16" if native_bf16_cpu() else None}[current]
    assert (other is None or f"precision={other}" in names) and f"precision={current}" not in names
    assert "precision=fp16" not in names
    assert "channels_last=off" in names and not any(n.startswith("cudnn_benchmark") for n in names)
    assert "compile=True,compile_mode=default" in names and "compile=True,compile_mode=reduce-overhead" not in names
    assert {"batch_size=512", "batch_size=2048", "optimizer_kernel=foreach", "optimizer_kernel=fused",
            "eval_batch_size=1000", "eval_batch_size=4000"} <= set(names)
    assert "optimizer_kernel=for-loop" not in names  # what "auto" is on a CPU: not timed against itself
    assert not any(n.startswith("workers") for n in names)  # an in-memory family has no loader workers
    # the doctor's "current" is the run's default count, not torch's global setting, which an earlier test (a
    # run with cpu_threads=1) may have left changed
    assert all(not n.startswith(f"cpu_threads={default_cpu_threads()}") for n in names)


def test_the_doctor_tries_loader_workers_for_a_loader_fed_family():
    cfg = get_recipe("imagenet-debug").make_config()
    names = [name for name, _ in doctor.candidates(cfg, CPU)]
    assert any(n.startswith("workers=") for n in names)
    assert f"workers={cfg.workers}" not in names


def _setting(ratio, low, high, acc=None):
    return {"versus_baseline": {"train_seconds": {"ratio": ratio, "ratio_ci95": [low, high], "p": 0.01},
                                "accuracy": acc}}


@pytest.mark.parametrize("setting,numbers,expected", [
    (_setting(0.5, 0.4, 0.6), False, (True, "faster")),
    (_setting(0.5, 0.4, 1.1), False, (False, "no clear difference")),
    (_setting(1.5, 1.2, 1.8), False, (False, "slower")),
    (_setting(0.5, 0.4, 0.6, {"diff": -0.1, "ci95": [-0.2, -0.01]}), True, (False, "faster, but accuracy falls")),
    (_setting(0.5, 0.4, 0.6, {"diff": -0.01, "ci95": [-0.05, 0.03]}), True, (True, "faster")),
    ({"versus_baseline": None}, False, (False, "n/a (needs 2+ runs a side)")),
    ({**_setting(0.5, 0.4, 0.6), "diverged": 2}, False, (False, "2 runs diverged")),
    (_setting(0.5, 0.4, 0.6, None), True, (False, "faster; its accuracy could not be compared")),
])
def test_a_setting_is_recommended_only_when_its_whole_interval_is_faster(setting, numbers, expected):
    assert doctor._verdict(setting, numbers) == expected


def test_tune_measures_applies_and_stores(tmp_path, capsys):
    settings, report, db = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "db"
    code = main(["tune", *TINY, "--runs", "2", "--only", "channels_last,optimizer_kernel", "--apply", str(settings),
                 "--json", str(report), "--db", str(db)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for text in ("time ratio (95% CI)", "channels_last=off", "optimizer_kernel=fused", "recommended:"):
        assert text in captured.out
    r = json.loads(report.read_text())
    first_round = [o for o in r["order"] if o["round"] == 0]
    assert r["benchmark"] == "tune" and {o["setting"] for o in first_round} >= {"current", "channels_last=off"}
    assert all(o["seed"] == 0 for o in first_round) and len(first_round) == len(r["settings"])
    assert all(row["n"] == 2 and row["time"]["ratio_ci95"] for row in r["tune"]["rows"])
    assert {result["kind"] for result in r["results"]} == {"tune"}
    s = json.loads(settings.read_text())
    assert s["recipe"] == "cifar10-94" and s["device"] == "cpu" and s["measured"]["report"] == str(report)
    assert s["settings"] == {k: ("true" if v is True else "false" if v is False else str(v))
                             for k, v in r["tune"]["recommended"].items()}
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM reports WHERE kind = 'tune'").fetchone()[0] == 1
        stored = json.loads(conn.execute("SELECT json FROM reports WHERE kind = 'tune'").fetchone()[0])
    assert "The doctor" in "\n".join(markdown.benchmarks_lines(sqlite3.connect(db)))
    assert "the doctor" in html.page(sqlite3.connect(db))
    assert stored["tune"]["rows"] == r["tune"]["rows"]


def test_a_setting_that_cannot_run_here_is_reported_and_the_rest_measured(tmp_path, capsys, monkeypatch):
    family = get_recipe("cifar10-94").module()
    real = family.train_run

    def train_run(cfg, *args, **kwargs):
        if cfg.optimizer_kernel == "fused":
            raise RuntimeError("fused SGD is not built for this device")
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(family, "train_run", train_run)
    assert main(["tune", *TINY, "--runs", "2", "--only", "optimizer_kernel", "--json", str(tmp_path / "t.json"),
                 "--db", str(tmp_path / "db")]) == 0
    printed = capsys.readouterr().out
    assert "cannot run here: optimizer_kernel=fused (RuntimeError: fused SGD is not built" in printed
    assert "optimizer_kernel=foreach" in printed


def test_tune_refuses_an_unknown_only_and_an_existing_apply_file(tmp_path, capsys):
    assert main(["tune", *TINY, "--only", "warp_speed", "--db", str(tmp_path / "db")]) == 2
    assert "not a setting the doctor measures" in capsys.readouterr().err
    taken = tmp_path / "s.json"
    taken.write_text("mine")
    assert main(["tune", *TINY, "--apply", str(taken), "--db", str(tmp_path / "db")]) == 2
    assert taken.read_text() == "mine"


def _settings(path, recipe="cifar10-94", device="cpu", **values):
    return write_settings(path, recipe=recipe, device=device, device_name=None, settings=values,
                          measured={"command": "speedrun tune"})


def test_train_applies_a_settings_file_under_set_and_records_it(tmp_path):
    path = _settings(tmp_path / "s.json", eval_batch_size="100", optimizer_kernel="foreach", cpu_threads="1")
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--settings", str(path), "--set", "eval_batch_size=50", "--json", str(out),
                 "--quiet", "--db", str(tmp_path / "db")]) == 0
    r = json.loads(out.read_text())
    assert r["config"]["optimizer_kernel"] == "foreach" and r["config"]["cpu_threads"] == 1
    assert r["config"]["eval_batch_size"] == 50  # --set wins over the file
    assert r["settings"]["file"] == str(path) and r["settings"]["settings"]["optimizer_kernel"] == "foreach"
    assert torch.get_num_threads() >= 1


def test_the_settings_environment_variable_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_SETTINGS", str(_settings(tmp_path / "s.json", optimizer_kernel="foreach")))
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--json", str(out), "--quiet", "--db", str(tmp_path / "db")]) == 0
    assert json.loads(out.read_text())["config"]["optimizer_kernel"] == "foreach"


def test_a_settings_file_from_the_environment_for_another_recipe_is_skipped_with_a_warning(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.setenv("SPEEDRUN_SETTINGS", str(_settings(tmp_path / "s.json", recipe="cifar10-96",
                                                          lookahead="false")))
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--json", str(out), "--quiet", "--db", str(tmp_path / "db")]) == 0
    err = capsys.readouterr().err
    assert "($SPEEDRUN_SETTINGS) was measured for 'cifar10-96'" in err and "unset SPEEDRUN_SETTINGS" in err
    r = json.loads(out.read_text())
    assert r["config"]["lookahead"] is True and r["settings"] is None


def test_a_settings_file_from_another_device_of_the_type_is_applied_with_a_warning(tmp_path, capsys):
    path = write_settings(tmp_path / "s.json", recipe="cifar10-94", device="cpu", device_name="Some Other CPU",
                          settings={"optimizer_kernel": "foreach"}, measured={})
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--settings", str(path), "--json", str(out), "--quiet",
                 "--db", str(tmp_path / "db")]) == 0
    assert "was measured on 'Some Other CPU'" in capsys.readouterr().err
    assert json.loads(out.read_text())["config"]["optimizer_kernel"] == "foreach"


def test_settings_false_ignores_the_environment_and_errors_name_the_source(tmp_path, monkeypatch, capsys):
    import speedrun

    monkeypatch.setenv("SPEEDRUN_SETTINGS", str(tmp_path / "missing.json"))
    result = speedrun.train("cifar10-94", "synthetic:train=256,test=64", device="cpu", epochs=0.5, settings=False,
                            batch_size=64, widths=(8, 16, 16), whiten_images=32, tta_level=0)
    assert result.settings is None
    assert main(["train", *TINY, "--db", str(tmp_path / "db")]) == 2
    line = capsys.readouterr().err.strip()
    assert "($SPEEDRUN_SETTINGS)" in line and "unset SPEEDRUN_SETTINGS" in line
    monkeypatch.setenv("SPEEDRUN_SETTINGS", str(_settings(tmp_path / "s.json", bogus="1")))
    assert main(["train", *TINY, "--db", str(tmp_path / "db")]) == 2
    line = capsys.readouterr().err.strip()
    assert f"settings file {tmp_path / 's.json'} ($SPEEDRUN_SETTINGS): unknown config key 'bogus'" in line


def test_cpu_threads_after_a_tuned_run_are_back_at_the_default(tmp_path):
    import speedrun

    default = torch.get_num_threads()
    speedrun.train("cifar10-94", "synthetic:train=256,test=64", device="cpu", epochs=0.5, cpu_threads=1,
                   batch_size=64, widths=(8, 16, 16), whiten_images=32, tta_level=0)
    speedrun.train("cifar10-94", "synthetic:train=256,test=64", device="cpu", epochs=0.5,
                   batch_size=64, widths=(8, 16, 16), whiten_images=32, tta_level=0)
    assert torch.get_num_threads() == default


def test_compile_does_not_change_what_auto_precision_resolves_to():
    cfg = get_recipe("cifar10-94").make_config()
    assert resolve_system(dataclasses.replace(cfg, compile=True), CPU).precision == resolve_system(cfg, CPU).precision


def _fifo(path):
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make,words", [
    (lambda p: _settings(p, recipe="cifar10-96"), "measured for 'cifar10-96', not cifar10-94"),
    (lambda p: _settings(p, device="cuda"), "measured on 'cuda', not cpu"),
    (lambda p: _settings(p, warp="9"), "unknown config key 'warp'"),
    (lambda p: _settings(p, label_smoothing="2"), "label_smoothing"),
    (lambda p: p.write_text("{"), "not JSON"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "not JSON"),
    (lambda p: p.write_text("[" * 60_000), "JSON nested 60,000 levels deep"),
    (lambda p: p.write_text(" " * (MAX_SETTINGS_BYTES + 1)), "over"),
    (lambda p: p.write_text('{"speedrun_settings": 2}'), "not a speedrun settings file"),
    (lambda p: p.write_text('{"speedrun_settings": 1, "recipe": "cifar10-94", "device": "cpu", "settings": '
                            '{"lookahead": false}}'), "must map to a string"),
    (lambda p: p.write_text('{"speedrun_settings": 1, "recipe": 5, "device": "cpu", "settings": {}}'),
     "malformed"),
    (lambda p: p.mkdir(), "settings file"),
    (_fifo, "not a regular file"),
    (lambda p: None, "No such file"),
])
def test_a_bad_settings_file_is_one_line_before_any_work(make, words, tmp_path, capsys):
    path = tmp_path / "s.json"
    make(path)
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--settings", str(path), "--json", str(out), "--db", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_cpu_threads_zero_is_torchs_default_and_a_value_is_set(monkeypatch):
    cfg = get_recipe("cifar10-94").make_config()
    default = torch.get_num_threads()
    setup_system(dataclasses.replace(cfg, cpu_threads=1), CPU)
    assert torch.get_num_threads() == 1
    setup_system(cfg, CPU)
    assert torch.get_num_threads() == default
    with pytest.raises(ValueError, match="cpu_threads"):
        dataclasses.replace(cfg, cpu_threads=-1).validate()


def test_optimizer_kernel_auto_passes_nothing_and_each_kernel_gives_the_same_step():
    assert optimizer_kernel_kwargs("auto") == {}
    with pytest.raises(ValueError, match="optimizer_kernel"):
        optimizer_kernel_kwargs("turbo")
    results = {}
    for kernel in ("auto", "foreach", "fused", "for-loop"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(5, 3))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3,
                              **optimizer_kernel_kwargs(kernel))
        for _ in range(3):
            opt.zero_grad()
            (w ** 2).sum().backward()
            opt.step()
        results[kernel] = w.detach().clone()
    for kernel, value in results.items():
        torch.testing.assert_close(value, results["auto"], msg=kernel)


def test_a_candidate_the_config_refuses_is_reported_not_fatal(tiny):
    """A value the family's config refuses (a doubled batch past its limit, say) is a "cannot run" row with the
    reason, not the end of the tune."""
    rec = get_recipe("cifar10-94")
    base = dict(batch_size=64, widths=(8, 16, 16), whiten_images=32, tta_level=0)

    def make(name):
        changes = {"batch_size": 1 << 17} if name == "too big" else {}
        cfg = rec.make_config().__class__(**{**base, **changes})
        cfg.validate()
        return cfg

    run = prepare(RunRequest("cifar10-94", device="cpu"), join=False)
    run.data = tiny
    failed = doctor._smoke_each(run, make, ["too big", "fine"], lambda line: None)
    assert list(failed) == ["too big"] and failed["too big"].startswith("ValueError: ") and "batch_size" in failed[
        "too big"]


@pytest.mark.parametrize("hostile", ["`<!-- ablation:end -->`", "<script>x</script>", "|a|b|", None, 5, ["x"]])
def test_a_stored_tune_report_with_hostile_fields_renders(hostile, tmp_path):
    """A tune report in the database is a file from elsewhere: any field may be anything; the report and the
    generated Markdown still render, with the text escaped (a marker-like setting does not end a section)."""
    from speedrun.records import db

    report = {"benchmark": "tune", "recipe": "cifar10-94", "dataset": "d", "device": "cpu", "complete": True,
              "command": "speedrun tune", "environment": {"timestamp_utc": "2026-01-01T00:00:00+00:00"},
              "tune": {"rows": [{"setting": hostile, "guide": hostile, "n": hostile, "changes_numbers": True,
                                 "time": {"ratio": 0.5, "ratio_ci95": [0.4, hostile], "p": hostile},
                                 "accuracy": {"diff": hostile, "ci95": hostile}, "recommended": hostile,
                                 "verdict": hostile}],
                       "recommended": {"precision": hostile}}}
    conn = db.connect(tmp_path / "db")
    db.insert_result(conn, report)
    doc = tmp_path / "B.md"
    begin, end = markdown.markers("ablation")
    doc.write_text(f"x\n{begin}\n{end}\ny\n")
    markdown.rewrite_marked(doc, {"ablation": "\n".join(markdown.benchmarks_lines(conn))})
    text = doc.read_text()
    assert text.count(end) == 1 and "<script>" not in text
    assert "<script>" not in html.page(conn)


@pytest.mark.parametrize("family", ["cifar", "cifar_resnet"])
def test_the_warm_up_runs_to_its_end_whatever_its_loss(family, tiny, monkeypatch):
    """A warm-up whose loss turns NaN still runs through its final evaluation (no finite-loss guard), so the
    evaluation's compilation is not left to the first timed run."""
    import importlib

    loop = importlib.import_module(f"speedrun.recipes.{family}.loop")
    seen = []
    monkeypatch.setattr(loop, "train_run", lambda cfg, *a, **k: seen.append(cfg))
    cfg = dataclasses.replace(get_recipe("cifar10-94" if family == "cifar" else "cifar10-resnet18").make_config(),
                              compile=True)
    loop.warmup(cfg, tiny, CPU)
    assert [c.check_finite_loss for c in seen] == [False] and seen[0].compile


def test_a_setting_that_changes_what_auto_resolves_to_is_marked_as_changing_the_numbers(monkeypatch):
    """A setting under which precision=auto resolves differently (a family's rule; here one made up: compile keeps
    auto at fp32) changes the numbers: its accuracy difference is shown and judged."""
    monkeypatch.setattr(doctor, "_smoke_each", lambda *a, **k: {})
    real_resolve = doctor.resolve_system

    def resolve(cfg, device):
        system = real_resolve(cfg, device)
        return dataclasses.replace(system, precision="fp32") if cfg.compile else system

    monkeypatch.setattr(doctor, "resolve_system", resolve)

    def fake_bench(recipe, *, steps, **kwargs):
        return {"settings": [{"name": name, "n": 2, "diverged": 0, "warmup_seconds": 0.0,
                              "versus_baseline": {"train_seconds": {"ratio": 0.5, "ratio_ci95": [0.4, 0.6], "p": 0.01},
                                                  "accuracy": {"diff": -0.2, "ci95": [-0.3, -0.1], "p": 0.01}}}
                             for name, _ in steps]}

    from speedrun.instruments import bench as benching

    monkeypatch.setattr(benching, "bench", fake_bench)  # what tune's bench_then calls
    report = doctor.tune(RunRequest("cifar10-94", "synthetic:train=64,test=16", "cpu"), runs=2,
                         only=["compile"], log=lambda line: None)
    row = next(r for r in report["tune"]["rows"] if r["setting"] == "compile=True,compile_mode=default")
    bf16_here = resolve_system(get_recipe("cifar10-94").make_config(), CPU).precision == "bf16"
    assert row["changes_numbers"] == bf16_here
    assert row["recommended"] == (not bf16_here)  # faster, but its accuracy falls where the precision changed
