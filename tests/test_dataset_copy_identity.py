"""A copy of a named dataset that is not its published files (a --data-dir folder of hand-made CIFAR batches) is
recorded under its path, never under the name (run/prepared.py): by every command, and before the data is read
where a command must decide something first (train's --resume auto of a finished job; the study a sweep names)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from speedrun.run.runner import TrainOptions

pytestmark = pytest.mark.usefixtures("in_tmp")
SMALL = ["--device", "cpu", "--epochs", "1", "--set", "widths=8,8,8", "--set", "batch_size=10", "--set",
         "whiten_images=10", "--set", "tta_level=0"]


def _copy(folder: Path, seed: int) -> Path:
    """A --data-dir holding CIFAR-10 batches that are not the published ones: 20 training and 4 test images."""
    d = folder / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)

    def batch(n):
        return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": [i % 10 for i in range(n)]}

    for i in (1, 2):
        (d / f"data_batch_{i}").write_bytes(pickle.dumps(batch(10), protocol=4))
    (d / "test_batch").write_bytes(pickle.dumps(batch(4), protocol=4))
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}))
    return folder


def test_resume_auto_of_a_finished_job_on_a_copy_returns_its_result(tmp_path, capsys):
    copy = _copy(tmp_path / "copy", 0)
    argv = ["train", "--dataset", "cifar10", "--data-dir", str(copy), *SMALL, "--runs", "2", "--checkpoint-dir",
            "ck", "--resume", "auto", "--json", "auto"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    (first,) = (tmp_path / "results").iterdir()
    assert json.loads(first.read_text())["dataset"] == str(copy)
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "finished" in err and "nothing was run again" in err, err
    assert list((tmp_path / "results").iterdir()) == [first]


def test_a_sweep_of_each_copy_is_its_own_study_recorded_under_its_path(tmp_path, capsys):
    pytest.importorskip("optuna")
    reports = []
    for i in (1, 2):
        copy = _copy(tmp_path / f"copy{i}", i)
        code, _, err = run_cli(["sweep", "--dataset", "cifar10", "--data-dir", str(copy), *SMALL, "--space",
                                "label_smoothing=0.1:0.3", "--trials", "1", "--runs", "1", "--json", f"s{i}.json"],
                               capsys)
        assert code == 0, err
        reports.append(json.loads((tmp_path / f"s{i}.json").read_text()))
    assert [r["dataset"] for r in reports] == [str(tmp_path / "copy1"), str(tmp_path / "copy2")]
    assert reports[0]["study"] != reports[1]["study"]


def test_options_and_keywords_together():
    opts, rest = TrainOptions.split(TrainOptions(json_path="o.json"), {"db": "x.db", "verbose": False, "lr": 1})
    assert (opts.json_path, opts.db, opts.verbose, rest) == ("o.json", "x.db", False, {"lr": 1})
    same, _ = TrainOptions.split(TrainOptions(save="m"), {"save": "m"})
    assert same.save == "m"
    with pytest.raises(ValueError, match="save given as a keyword and in options, with other values"):
        TrainOptions.split(TrainOptions(save="m"), {"save": "n"})
    with pytest.raises(ValueError, match="is not a TrainOptions"):
        TrainOptions.split({"save": "m"}, {})  # type: ignore[arg-type]
