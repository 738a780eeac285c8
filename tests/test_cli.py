"""The command line: one-line errors with exit code 2, and the JSON result contract."""

import json
import subprocess
import sys

import pytest

from speedrun.cli.program import main

TINY = ["--dataset", "synthetic:train=128,test=32", "--device", "cpu", "--epochs", "0.5",
        "--set", "batch_size=32", "--set", "widths=8,16,16", "--set", "whiten_images=32"]


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--epochs", "abc"], "expected a number"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--runs", "two"], "--runs"),
    (["train", "no-such-recipe", *TINY], "unknown recipe 'no-such-recipe'"),
    (["train", *TINY, "--set", "lr=1"], "unknown config key 'lr'"),
    (["train", *TINY, "--set", "batch_size=x"], "batch_size=x: expected int"),
    (["train", *TINY, "--set", "novalue"], "expected KEY=VALUE"),
    (["train", *TINY, "--runs", "0"], "runs (--runs) must be an integer in [1,"),
    (["train", *TINY, "--epochs", "-1"], "epochs (--epochs) must be a number in (0,"),
    (["train", "--dataset", "/nonexistent/data", "--device", "cpu"], "/nonexistent/data"),
    (["train", "--dataset", "synthetic:colour=red", "--device", "cpu"], "colour"),
    (["train", *TINY[:2], "--device", "tpu"], "device (--device) must be one of"),
])
def test_user_errors_are_one_line_and_exit_2(argv, fragment, capsys, tmp_path):
    try:
        code = main([*argv, "--json", str(tmp_path / "r.json")])
    except SystemExit as exc:  # argparse's own errors leave through SystemExit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err
    assert err.count("\n") == 1 and err.startswith("speedrun")


def test_corrupt_archive_in_data_dir_is_one_line(capsys, tmp_path, monkeypatch):
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(bytes(range(1, 256)) * 4)  # not a tar archive; tarfile's own message spans several lines
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    code = main(["train", "--dataset", "cifar10", "--data-dir", str(archive), "--device", "cpu",
                 "--json", str(tmp_path / "r.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "not a readable tar archive" in err
    assert archive.read_bytes() == bytes(range(1, 256)) * 4  # the user's file is left alone


def test_cuda_requested_without_cuda_is_one_line(capsys, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # the error path only exists without it
    assert main(["train", *TINY, "--device", "cuda", "--json", str(tmp_path / "r.json")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_train_writes_the_json_contract(tmp_path):
    out = tmp_path / "result.json"
    assert main(["train", *TINY, "--runs", "2", "--seed", "3", "--json", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    for key in ("recipe", "dataset", "device", "mean_accuracy", "std_accuracy", "runs", "config", "environment"):
        assert key in result
    assert result["recipe"] == "cifar10-94" and result["device"] == "cpu"
    assert [r["seed"] for r in result["runs"]] == [3, 4]
    for run in result["runs"]:
        assert 0 <= run["accuracy"] <= 1 and run["train_seconds"] > 0 and run["epochs"] == 0.5
    accs = [r["accuracy"] for r in result["runs"]]
    assert result["mean_accuracy"] == pytest.approx(sum(accs) / 2)
    assert result["config"]["widths"] == [8, 16, 16]
    assert result["environment"]["torch"]


@pytest.mark.slow
def test_console_script_runs_and_prints_tables(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "speedrun.cli", "train", *TINY, "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "device: cpu" in proc.stderr and "run 1/1" in proc.stderr and "test acc %" in proc.stdout


def test_python_api_returns_result_with_model():
    import speedrun
    result = speedrun.train("cifar10-94", "synthetic:train=64,test=16", device="cpu", epochs=0.5,
                            batch_size=32, widths=(8, 8, 8), whiten_images=32)
    assert result.recipe == "cifar10-94" and len(result.runs) == 1
    assert 0 <= result.mean_accuracy <= 1 and result.std_accuracy is None  # one run has no spread
    assert result.model is not None and result.runs[0].train_seconds > 0


def test_interrupt_keeps_the_finished_runs(tmp_path, monkeypatch, capsys):
    from speedrun.run import runner as runs
    from speedrun.recipes import cifar

    calls = []
    real_run = cifar.train_run

    def run_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    monkeypatch.setattr(cifar, "train_run", run_then_interrupt)
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--runs", "3", "--json", str(out), "--quiet"]) == 130
    result = json.loads(out.read_text())
    assert result["interrupted"] is True and len(result["runs"]) == 1 and result["runs"][0]["seed"] == 0
    # The last line says what was kept, and where.
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"speedrun: interrupted; 1 finished run kept in {out} and in the results database ")


def test_default_result_file_is_made_only_for_a_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    assert main(["train", "--dataset", "/nonexistent/data", "--device", "cpu"]) == 2
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())
    assert main(["train", *TINY, "--quiet"]) == 0
    (written,) = (tmp_path / "results").iterdir()
    assert json.loads(written.read_text())["recipe"] == "cifar10-94"
