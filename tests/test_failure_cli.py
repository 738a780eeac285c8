"""Failure behaviour of `speedrun train`: one line and exit 2 before any work, nothing lost, no silent NaN.

Each class of defect is tested with the issue's example and at least one variant.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speedrun.run import runner as runs
from speedrun.cli.program import main
from speedrun.engine.loop import signals_held
from speedrun.recipes import cifar
from speedrun.recipes.cifar import loop as cifar_loop

TINY = ["--dataset", "synthetic:train=128,test=32", "--device", "cpu", "--epochs", "0.5",
        "--set", "batch_size=32", "--set", "widths=8,16,16", "--set", "whiten_images=32"]


def _strict(text: str) -> dict:
    """json.loads that refuses NaN/Infinity, as strict parsers (JavaScript's JSON.parse, Go, jq) do."""
    def refuse(token):
        raise AssertionError(f"non-standard JSON constant {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def no_run(monkeypatch):
    """Replace every recipe's run and warm-up with a recorder, so a test sees whether training would have started."""
    started = []

    def run(*args, **kwargs):
        started.append(args)
        raise AssertionError("a run started for an input that must be refused")

    monkeypatch.setattr(cifar, "train_run", run)  # every recipe so far is of the cifar family
    monkeypatch.setattr(cifar, "warmup", lambda *a, **k: 0.0)
    return started


def _one_line_error(capsys, code, fragment):
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("speedrun: error: "), err
    assert fragment in err, err
    assert "Traceback" not in err
    return err


# ---- tracebacks instead of one line ------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, fragment", [
    (["--set", "seed=3"], "seed is not a config key: use --seed"),  # the class: keys that are train() args
    (["--set", "device=cpu"], "use --device"),
    (["--set", "runs=2"], "use --runs"),
    (["--set", "epochs=2"], "epochs is given twice"),  # with --epochs in TINY
    (["--epochs", "inf"], "(--epochs) must be a number in (0,"),  # the example
    (["--epochs", "nan"], "(--epochs) must be a number in (0,"),
    (["--epochs", "1e300"], "(--epochs) must be a number in (0,"),
    (["--set", "lr_per_1024=nan"], "lr_per_1024=nan: expected a finite number"),  # the example
    (["--set", "label_smoothing=-inf"], "expected a finite number"),
    (["--set", "compile_mode=bogus"], "compile_mode='bogus': expected one of default|"),  # the example
    (["--set", "batch_size=100000000"], "batch_size must be in [1,"),
    (["--set", "widths=8,16,1000000"], "widths must be 1 to 8 numbers"),
    (["--set", "bn_eps=0"], "bn_eps must be > 0"),
    (["--set", "lookahead_base=2"], "lookahead_base must be in [0, 1]"),
])
def test_bad_settings_are_one_line_before_any_run(extra, fragment, capsys, tmp_path, no_run):
    code = main(["train", *TINY, *extra, "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, fragment)
    assert not no_run and not (tmp_path / "r.json").exists()


def test_epochs_given_twice_names_every_place_it_can_come_from(capsys, tmp_path, no_run):
    """bench's --vary epochs= with --epochs: the refusal must not name a --set that was never given as the only
    source (sweep's --space has its own refusal)."""
    code = main(["bench", "--vary", "epochs=1,2", *TINY, "--db", str(tmp_path / "r.db")])
    err = _one_line_error(capsys, code, "epochs is given twice")
    assert "--vary" in err, err
    assert not no_run


def test_set_epochs_is_the_config_field(tmp_path):
    """`--set epochs=E` (a key that is also a train() argument) trains E epochs instead of a TypeError."""
    argv = [a for a in TINY if a not in ("--epochs", "0.5")]
    out = tmp_path / "r.json"
    assert main(["train", *argv, "--set", "epochs=0.25", "--json", str(out), "--quiet"]) == 0
    assert _strict(out.read_text())["runs"][0]["epochs"] == 0.25


@pytest.mark.parametrize("dataset, extra, fragment", [
    ("synthetic:train=64,test=16,shape=3x8x8", [], "8x8 images are too small for 3 groups"),  # the example
    ("synthetic:train=64,test=16,shape=1x4x4", [], "4x4 images are too small"),
    ("synthetic:train=64,test=16", ["--set", "widths=8,8,8,8,8"], "use at most 4 widths"),  # too deep
    ("synthetic:train=64,test=16,shape=3x12x12", ["--set", "translate_px=12"], "translate_px=12 does not fit"),
])
def test_data_that_does_not_fit_the_net_is_one_line(dataset, extra, fragment, capsys, tmp_path, no_run):
    code = main(["train", "--dataset", dataset, "--device", "cpu", "--set", "widths=8,8,8", *extra,
                 "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, fragment)
    assert not no_run


@pytest.mark.parametrize("dataset, extra, fragment", [
    ("synthetic:train=64,test=16", ["--set", "batch_size=65536"], "batch 65536"),  # activations alone: 51 GB
    ("synthetic:train=64,test=16", ["--set", "widths=8192,8192,8192"], "(8192, 8192, 8192)"),  # 36 GB of weights
    # Scoring 2,000 test images of 128 px in one batch: 11 GB, while training at batch 8 is small.
    ("synthetic:train=64,test=2000,shape=3x128x128", ["--set", "batch_size=8"], "eval batch 2000"),
])
def test_nets_that_cannot_fit_in_memory_are_refused_before_building(dataset, extra, fragment, capsys, tmp_path,
                                                                     no_run, monkeypatch):
    from speedrun.data import limits

    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 8 * 2**30)  # the same verdict on any machine
    code = main(["train", "--dataset", dataset, "--device", "cpu", *extra, "--json", str(tmp_path / "r.json")])
    err = _one_line_error(capsys, code, fragment)
    assert "more than the 8.6 GB available" in err
    assert not no_run


def test_too_many_classes_are_refused(capsys, tmp_path, no_run):
    code = main(["train", "--dataset", "synthetic:train=64,test=16,classes=100001", "--device", "cpu",
                 "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, "classes")


def test_the_cpu_allocators_error_is_out_of_memory_not_a_bug(monkeypatch, capsys, tmp_path):
    def cannot_allocate(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 2130739200 bytes")

    monkeypatch.setattr(cifar, "train_run", cannot_allocate)
    code = main(["train", *TINY, "--json", str(tmp_path / "r.json"), "--quiet"])
    _one_line_error(capsys, code, "out of memory (")


def test_an_interrupt_anywhere_in_the_command_is_one_line(monkeypatch, capsys):
    """Ctrl-C while torch and the data are imported (before any handler of the run) is exit 130, one line."""
    from speedrun.cli import train_commands

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_commands, "train_command", interrupted)
    assert main(["train", *TINY]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("speedrun: interrupted")


def test_unexpected_errors_are_one_line_too(monkeypatch, capsys, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(cifar, "train_run", broken)
    assert main(["train", *TINY, "--json", str(tmp_path / "r.json"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: RuntimeError: something broke" in err


def test_version():
    proc = subprocess.run([sys.executable, "-m", "speedrun.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("speedrun 0.")


# ---- lost or overwritten data ------------------------------------------------------------------------------------


def test_an_empty_result_file_left_by_a_killed_run_says_what_it_is(capsys, tmp_path, no_run):
    """A command claims its result file empty at the start; SIGKILL (`timeout -k`) leaves the claim behind, and the
    rerun was told only "already exists"."""
    out = tmp_path / "r.json"
    out.write_text("")
    code = main(["train", *TINY, "--json", str(out)])
    err = _one_line_error(capsys, code, "is empty: the claim of a command still running, or of one killed")
    assert "delete it if no command is writing it" in err
    assert out.read_text() == "" and not no_run


def test_json_never_replaces_an_existing_file(capsys, tmp_path, no_run):
    out = tmp_path / "r.json"
    out.write_text("precious")
    code = main(["train", *TINY, "--json", str(out)])
    _one_line_error(capsys, code, "already exists and is never replaced")
    assert out.read_text() == "precious" and not no_run


@pytest.mark.parametrize("make_path", [
    lambda tmp: tmp / "a-file" / "r.json",  # the parent is a file
    lambda tmp: tmp,  # a directory
    lambda tmp: tmp / ("x" * 300 + ".json"),  # a name longer than the filesystem allows
    lambda tmp: Path("/proc/speedrun-r.json"),  # not writable, even by root (tests run as root here)
])
def test_unwritable_json_fails_before_training(make_path, capsys, tmp_path, no_run):
    (tmp_path / "a-file").write_text("x")
    path = make_path(tmp_path)
    code = main(["train", *TINY, "--json", str(path)])
    _one_line_error(capsys, code, str(path))
    assert not no_run


def test_unwritable_results_dir_fails_before_training(capsys, tmp_path, monkeypatch, no_run):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "a-file" / "results"))
    _one_line_error(capsys, main(["train", *TINY]), "set SPEEDRUN_RESULTS to a writable directory")
    assert not no_run


def test_result_is_rewritten_after_every_run(tmp_path, monkeypatch):
    """A crash in run 3 keeps runs 1 and 2 in the file, marked incomplete."""
    calls = []
    real_run = cifar.train_run

    def run_then_crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(cifar, "train_run", run_then_crash)
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--runs", "4", "--json", str(out), "--quiet"]) == 1
    result = _strict(out.read_text())
    assert [r["seed"] for r in result["runs"]] == [0, 1] and result["complete"] is False
    assert result["runs_requested"] == 4


@pytest.mark.slow
def test_sigterm_keeps_finished_runs_and_exits_143(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--dataset", "synthetic:train=2048,test=256", "--device", "cpu", "--epochs", "2", "--runs", "50",
            "--set", "batch_size=64", "--set", "widths=16,32,32", "--json", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "speedrun.cli", "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until the file holds a finished run
        text = out.read_text() if out.exists() else ""
        if text.strip() and _strict(text)["runs"]:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("speedrun: terminated (SIGTERM)")
    result = _strict(out.read_text())
    assert result["interrupted"] is True and result["complete"] is False
    assert 1 <= len(result["runs"]) < 50 and all(r["accuracy"] is not None for r in result["runs"])


def test_interrupt_before_any_run_leaves_no_empty_claim(tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cifar, "train_run", interrupt)
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--json", str(out), "--quiet"]) == 130
    assert not out.exists()
    assert capsys.readouterr().err == "speedrun: interrupted; no run had finished\n"


# ---- silent wrong results ----------------------------------------------------------------------------------------


def test_nan_loss_stops_the_run_within_one_step(tmp_path, monkeypatch, capsys):
    """The step whose loss is NaN is the last step taken; the result records the run as diverged, in strict JSON."""
    steps_taken = []
    real_step = cifar.train_step

    def step_with_nan_at_3(*args, **kwargs):
        logits, loss = real_step(*args, **kwargs)
        steps_taken.append(1)
        return logits, loss * float("nan") if len(steps_taken) == 3 else loss

    monkeypatch.setattr(cifar_loop, "train_step", step_with_nan_at_3)
    out = tmp_path / "r.json"
    code = main(["train", *TINY, "--epochs", "2", "--json", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3
    assert len(steps_taken) == 3  # no step after the bad one
    assert "diverged: the training loss became nan at step 3 of 8 (lr_per_1024" in err
    result = _strict(out.read_text())
    (run,) = result["runs"]
    assert run["accuracy"] is None and run["diverged"]["step"] == 3 and run["diverged"]["loss"] == "nan"
    assert result["diverged_runs"] == 1 and result["mean_accuracy"] is None and result["n"] == 0


def test_a_real_divergence_is_caught_and_other_seeds_go_on(tmp_path, capsys):
    """fp16 logits scaled by 1e4 overflow (fp16 ends at 65504); every run is recorded as diverged, with its step."""
    out = tmp_path / "r.json"
    code = main(["train", *TINY, "--runs", "2", "--set", "precision=fp16", "--set", "logit_scale=10000",
                 "--json", str(out), "--quiet"])
    assert code == 3
    result = _strict(out.read_text())
    assert result["diverged_runs"] == 2 and [r["seed"] for r in result["runs"]] == [0, 1]
    for run in result["runs"]:
        assert 0 < run["diverged"]["lr"] <= 11.5 and 1 <= run["diverged"]["step"] <= run["diverged"]["total_steps"]
        assert run["diverged"]["loss"] in ("nan", "inf")
    assert capsys.readouterr().err.count("speedrun: warning: run ") == 2


def test_float_settings_beyond_float32_are_refused(capsys, tmp_path, no_run):
    """lr_per_1024=1e308 is finite in Python but not in the float32 step: refused before any run."""
    code = main(["train", *TINY, "--set", "lr_per_1024=1e308", "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, "lr_per_1024=1e+308 is outside [-10000, 10000]")


def test_finite_loss_check_off_is_a_no_op(tiny):
    """check_finite_loss=false trains bit-identically to true on a run that does not diverge."""
    cfg = cifar.CifarConfig(batch_size=64, epochs=1.0, widths=(8, 8, 8), whiten_images=64, eval_each_epoch=False)
    a = cifar.train_run(cfg, tiny, torch.device("cpu"), seed=0)
    b = cifar.train_run(runs.dataclasses.replace(cfg, check_finite_loss=False), tiny, torch.device("cpu"), seed=0)
    assert a.accuracy == b.accuracy
    for pa, pb in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(pa, pb)


def test_write_json_never_writes_bare_nan(tmp_path):
    from speedrun.records.result_file import write_json

    path = write_json(tmp_path / "x.json", {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -math.inf}})
    assert _strict(path.read_text()) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_api_rejects_nonfinite_and_wrong_types():
    import speedrun

    for kwargs, fragment in [({"lr_per_1024": float("nan")}, "finite"), ({"epochs": float("inf")}, "epochs"),
                             ({"runs": 1.5}, "runs (--runs)"), ({"lr_per_1024": 10**400}, "finite")]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            speedrun.train("cifar10-94", "synthetic:train=64,test=16", device="cpu", **kwargs)


# ---- rough edges -------------------------------------------------------------------------------------------------


def test_batch_larger_than_the_data_warns_even_when_quiet(capsys, tmp_path):
    code = main(["train", "--dataset", "synthetic:train=16,test=16", "--device", "cpu", "--set", "batch_size=32",
                 "--set", "widths=8,8,8", "--set", "whiten_images=16", "--quiet", "--json", str(tmp_path / "r.json")])
    assert code == 0
    err = capsys.readouterr().err
    assert "speedrun: warning: batch_size 32 is larger than the 16 training images" in err


def test_quiet_prints_the_result_lines_alone(capsys, tmp_path):
    """--quiet: the statistics and the target's verdict, a line each; no table, no caption, no progress."""
    assert main(["train", *TINY, "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    captured = capsys.readouterr()
    result = json.loads((tmp_path / "r.json").read_text())
    acc, secs = result["runs"][0]["accuracy"], result["runs"][0]["train_seconds"]
    lines = captured.out.splitlines()
    assert lines[0] == (f"cifar10-94 on {result['dataset']} (cpu), n=1: test acc {100 * acc:.2f}%, timed {secs:.2f} s")
    # synthetic data is not the recipe's own data set: its target is not this data's
    assert len(lines) == 2 and lines[1].startswith("No record is judged against the target 94.00%: it was measured")
    assert captured.err == ""  # no progress, no tables, no notes
    assert main(["train", *TINY, "--json", str(tmp_path / "full.json")]) == 0
    assert "n/a" in capsys.readouterr().out  # without --quiet, the table: one run has no spread


@pytest.mark.slow
def test_piped_output_keeps_progress_and_does_not_wrap(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "speedrun.cli", "train", *TINY, "--epochs", "2",
                           "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "run 1/1: step 8/8 (100%)" in proc.stderr  # plain progress lines instead of a lost bar
    caption = [line for line in proc.stdout.splitlines() if "the target 94.00%" in line]
    assert len(caption) == 1 and len(caption[0].strip()) > 80  # one line, not wrapped at 80 columns


def test_smoke_test_is_quick_and_says_what_it_is(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["train", "--dataset", "synthetic:train=4096,test=2000", "--device", "cpu", "--smoke",
                 "--set", "widths=8,8,8", "--json", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "SMOKE TEST (pipeline check, not a result)" in captured.out and "smoke test: 4 steps" in captured.err
    result = _strict(out.read_text())
    assert result["smoke_test"] is True and result["runs"][0]["steps"] == 4
    assert result["config"]["tta_level"] == 0


def test_short_runs_say_that_evaluation_dominates(capsys, tmp_path):
    assert main(["train", "--dataset", "synthetic:train=256,test=2000", "--device", "cpu", "--epochs", "0.1",
                 "--set", "widths=8,8,8", "--set", "batch_size=64", "--json", str(tmp_path / "r.json")]) == 0
    assert "is more work than the training itself" in capsys.readouterr().err


@pytest.mark.parametrize("name, fragment", [("a\x00b.json", "embedded null byte"), ("", "is a directory")])
def test_odd_result_names_are_one_line(name, fragment, capsys, tmp_path, no_run):
    code = main(["train", *TINY, "--json", str(tmp_path / name) if name else str(tmp_path)])
    _one_line_error(capsys, code, fragment)


def test_a_class_folder_without_training_images_is_refused(capsys, tmp_path, no_run):
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("a", "b"):
            (tmp_path / "pics" / split / cls).mkdir(parents=True)
            if (split, cls) != ("train", "b"):
                Image.new("RGB", (16, 16)).save(tmp_path / "pics" / split / cls / "1.png")
    (tmp_path / "pics" / "train" / "b" / "notes").mkdir()  # a folder, no image: class b would never be trained
    code = main(["train", "--dataset", str(tmp_path / "pics"), "--device", "cpu", "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, "class folder b holds no .jpg/.jpeg/.png images")


def test_a_data_dir_that_is_neither_folder_nor_file(capsys, tmp_path, no_run):
    os.symlink("loop", tmp_path / "loop")
    code = main(["train", "--dataset", "cifar10", "--data-dir", str(tmp_path / "loop"), "--device", "cpu",
                 "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, "is neither a folder nor an archive file")


def test_the_data_limit_holds_for_every_source(capsys, tmp_path, monkeypatch, no_run):
    """SPEEDRUN_MAX_DATA_BYTES bounds CIFAR batches (by their files' sizes, before reading) and the sum of IDX files
    that are each under it, as it bounds synthetic data."""
    import numpy as np
    from test_data_sources import _write_cifar10
    from test_hostile_cli import _idx_folder

    _write_cifar10(tmp_path / "cifar", np.random.default_rng(0))  # 9 images: 27.6 kB of pixels
    _idx_folder(tmp_path / "idx")  # 4 + 2 images of 28x28: 3,136 + 1,568 bytes
    for dataset, limit, fragment in [(tmp_path / "cifar", 20_000, "the CIFAR batches in"),
                                     (tmp_path / "idx", 4_000, "would take 4.7 kB")]:
        monkeypatch.setenv("SPEEDRUN_MAX_DATA_BYTES", str(limit))
        code = main(["train", "--dataset", str(dataset), "--device", "cpu", "--json", str(tmp_path / "r.json")])
        _one_line_error(capsys, code, fragment)
    assert not no_run


def test_after_the_first_interrupt_further_signals_are_ignored(monkeypatch, capsys):
    """A double Ctrl-C used to interrupt the interpreter's shutdown and print a traceback."""
    from speedrun.cli import program as cli
    from speedrun.cli import train_commands

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_commands, "train_command", interrupted)
    monkeypatch.setattr(sys, "argv", ["speedrun", "train", *TINY])
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["train", *TINY]) == 130  # main() leaves the caller's handlers alone
        assert all(signal.getsignal(s) == handler for s, handler in saved.items())
        assert cli.entry() == 130  # the program ignores what follows
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in saved)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_while_the_last_line_is_written_changes_nothing(second, monkeypatch, capsys):
    """A second Ctrl-C while main() wrote its interrupt line printed a traceback; a second SIGTERM there met the
    default action again and ended the process without a word."""
    from speedrun.cli import program as cli
    from speedrun.cli import train_commands

    def interrupted(*args):
        raise KeyboardInterrupt

    said = []

    def say_with_a_signal(text):
        os.kill(os.getpid(), second)  # Python runs the handler before the next line: within this call
        said.append(text)

    monkeypatch.setattr(train_commands, "train_command", interrupted)
    monkeypatch.setattr(cli, "say", say_with_a_signal)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main(["train", *TINY]) == 130
    assert said == ["speedrun: interrupted; no run had finished"]
    assert {s: signal.getsignal(s) for s in before} == before  # the caller's handlers, as they were


def test_a_bad_data_limit_is_one_line_even_with_a_warm_cache(capsys, tmp_path, monkeypatch, no_run):
    from test_hostile_folder import _folder

    root = _folder(tmp_path / "pics", size=(16, 16))
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    from speedrun.data.sources import load_dataset

    load_dataset(str(root))  # the cache is warm
    monkeypatch.setenv("SPEEDRUN_MAX_DATA_BYTES", "abc")
    code = main(["train", "--dataset", str(root), "--device", "cpu", "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, "SPEEDRUN_MAX_DATA_BYTES='abc' is not an integer")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"json_path": 123}, "json_path=123 is not"), ({"dataset": 123}, "dataset=123 is not"),
    ({"device": None}, "device=None is not"), ({"data_dir": 1.5}, "data_dir=1.5 is not"),
    ({"overrides": [("lookahead", False)]}, "overrides=[('lookahead', False)] is not"),
    ({"smoke": "yes"}, "smoke='yes' is not"), ({"command": 123}, "command=123 is not"),
    ({"dataset": ""}, "unknown dataset ''"),  # an empty name (an unset shell variable) is not the default
])
def test_the_python_api_refuses_wrong_types_with_value_errors(kwargs, fragment, no_run):
    import speedrun

    with pytest.raises(ValueError) as err:
        speedrun.train(**{"device": "cpu", "dataset": "synthetic:train=64,test=16", **kwargs})
    assert fragment in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="recipe"):
        speedrun.train(["cifar10-94"])
    from speedrun.data.sources import load_dataset

    with pytest.raises(ValueError, match="dataset=123 is not a path or name"):
        load_dataset(123)


def test_a_result_path_under_a_file_says_so(capsys, tmp_path, no_run):
    (tmp_path / "afile").write_text("x")
    code = main(["train", *TINY, "--json", str(tmp_path / "afile" / "r.json")])
    err = _one_line_error(capsys, code, "is a file, not a folder")
    assert "already exists" not in err and "PosixPath" not in err


def test_a_second_signal_waits_until_the_interrupted_result_is_written():
    """The runner writes the interrupted result with SIGINT and SIGTERM held: a second Ctrl-C must not cut that
    write short, which would leave the previous file ("interrupted": false)."""
    steps = []
    handler = signal.getsignal(signal.SIGINT)
    with signals_held():
        torch.ones(1000, 1000) @ torch.ones(1000, 1000)  # torch's worker threads exist, as in a real run
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        steps.append("written")  # reached: the signal did not interrupt the block
    assert steps == ["written"] and signal.getsignal(signal.SIGINT) is handler


@pytest.mark.parametrize("key", ["lr_per_1024", "bias_lr_mult", "muon_bias_lr", "muon_head_lr"])
def test_learning_rates_that_weight_decay_divides_by_cannot_be_zero(key, capsys, tmp_path, no_run):
    """Decoupled weight decay is wd / lr: lr 0 passed the old >= 0 check and divided by zero mid-setup."""
    code = main(["train", *TINY, "--set", "optimizer=muon", "--set", f"{key}=0", "--json", str(tmp_path / "r.json")])
    _one_line_error(capsys, code, "must be in [")


def test_a_result_name_near_the_length_limit_is_written(tmp_path):
    """The temporary file write_json renames from is named apart from the result: a 240-character result name
    used to claim fine, train, and then fail on its 255+-character temporary file, losing the run."""
    out = tmp_path / ("k" * 240 + ".json")
    assert main(["train", *TINY, "--json", str(out), "--quiet"]) == 0
    assert _strict(out.read_text())["complete"] is True


def test_results_dir_with_a_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPEEDRUN_RESULTS", "~/res")
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--quiet"]) == 0
    assert len(list((tmp_path / "home" / "res").glob("*.json"))) == 1 and not (tmp_path / "~").exists()


def test_recipes_into_a_closed_pipe_or_a_full_disk():
    closed = subprocess.run(f"{sys.executable} -m speedrun recipes | head -c 0", shell=True, capture_output=True,
                            text=True, timeout=60)
    assert "Traceback" not in closed.stderr
    full = subprocess.run([sys.executable, "-m", "speedrun", "recipes"], stdout=open("/dev/full", "w"),
                          stderr=subprocess.PIPE, text=True, timeout=60)
    assert full.returncode == 2 and full.stderr == ("speedrun: error: No space left on device (writing the output or a "
                                                    "result); free disk space and run again\n")


def test_message_details(capsys, tmp_path, monkeypatch, no_run):
    """Lines stay short whatever is echoed; sizes are exact where rounding would print one number for both; a net
    too deep for any width count says the image size it needs."""
    from speedrun.data import limits

    code = main(["train", "--dataset", "x" * 100_000, "--device", "cpu", "--json", str(tmp_path / "a.json")])
    err = _one_line_error(capsys, code, "(100,000 characters)")
    assert len(err) < 300
    monkeypatch.setenv("SPEEDRUN_MAX_DATA_BYTES", "62720")
    with pytest.raises(ValueError, match=r"62,721 bytes of memory as decoded images, over the limit of 62,720 bytes"):
        limits.check_dataset_bytes(62_721, "x")
    code = main(["train", "--dataset", "synthetic:train=64,test=16,shape=3x1x1", "--device", "cpu",
                 "--json", str(tmp_path / "b.json")])
    _one_line_error(capsys, code, "use images of at least 9 px")


@pytest.mark.slow
def test_a_full_disk_under_the_output_names_the_fix(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "speedrun", "train", *TINY, "--json", str(tmp_path / "r.json")],
                          stdout=open("/dev/full", "w"), stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == ("speedrun: error: No space left on device (writing the output or a "
                                            "result); free disk space and run again")
    assert _strict((tmp_path / "r.json").read_text())["complete"] is True  # the result was written before


def test_the_smoke_summary_says_no_tta(capsys, tmp_path):
    assert main(["train", *TINY, "--smoke", "--json", str(tmp_path / "r.json")]) == 0
    assert "final evaluation without TTA" in capsys.readouterr().out  # the table's caption
