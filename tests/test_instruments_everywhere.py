"""Issue 8's instruments for every recipe family and under torchrun: bench, ablate (its waterfall and --to-target)
on the imagenet family; under torchrun every process trains each run and rank 0 alone stores and writes; the
commands that do not train refuse to run as K copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun import db
from speedrun.cli import main
from speedrun.recipes import imagenet, imagenet_checks

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return imagenet_checks.write_synthetic_shards(tmp_path_factory.mktemp("inet"), 320, 80)


def test_bench_ablate_waterfall_and_to_target_run_on_the_imagenet_family(shards, tmp_path, capsys):
    tiny = ["imagenet-debug", "--dataset", str(shards), "--device", "cpu", "--epochs", "1", "--db",
            str(tmp_path / "r.db")]
    assert main(["bench", *tiny, "--runs", "2", "--vary", "label_smoothing=0.0", "--json", str(tmp_path / "b.json")]) == 0
    assert main(["ablate", *tiny, "--runs", "2", "--json", str(tmp_path / "a.json")]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert sorted(r["trick"] for r in report["tricks"]) == sorted(key for key, _, _ in imagenet.TRICKS)
    assert main(["ablate", *tiny, "--runs", "2", "--waterfall", "zero_init_residual,flip",
                 "--json", str(tmp_path / "w.json")]) == 0
    assert main(["ablate", *tiny, "--runs", "1", "--to-target", "--max-probes", "2",
                 "--json", str(tmp_path / "t.json")]) == 0
    searched = json.loads((tmp_path / "t.json").read_text())
    # 1 epoch of 320 images at batch 64: 5 steps; each variant's first probe is the recipe's own count
    assert all(v["probes"][0]["steps"] == 5 for v in searched["variants"])
    assert len(searched["variants"]) == 1 + sum(r["measured"] for r in report["tricks"])
    with db.connect(tmp_path / "r.db") as conn:
        assert [r["kind"] for r in db.query_reports(conn)] == ["to_target", "waterfall", "ablate", "bench"]
    assert "epochs needed" in capsys.readouterr().out


def _torchrun(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_DATA=str(cwd / "cache"), SPEEDRUN_RESULTS=str(cwd / "results"))
    return subprocess.run([*TORCHRUN, "-m", "speedrun", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_under_torchrun_each_run_is_the_jobs_and_rank_0_alone_stores_and_writes(shards, tmp_path):
    tiny = ["imagenet-debug", "--dataset", str(shards), "--device", "cpu", "--epochs", "1", "--db", "r.db"]
    done = _torchrun(["bench", *tiny, "--runs", "2", "--vary", "label_smoothing=0.0", "--json", "b.json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("against the baseline") == 1  # one table: rank 1 prints nothing
    assert "speedrun[rank 1]" not in done.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["world"]["processes"] == 2
    assert all(r["world"]["processes"] == 2 for r in report["results"])
    assert report["command"].startswith("torchrun --standalone --nproc_per_node=2 -m speedrun bench imagenet-debug")
    done = _torchrun(["ablate", *tiny, "--runs", "1", "--to-target", "--max-probes", "2", "--json", "t.json"],
                     tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    searched = json.loads((tmp_path / "t.json").read_text())
    with db.connect(tmp_path / "r.db") as conn:  # one copy of each result and each report, no second file
        assert [r["kind"] for r in db.query_reports(conn)] == ["to_target", "bench"]
        assert len(db.query(conn)) == len(report["results"]) + len(searched["results"])
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["b.json", "t.json"]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("argv", [["report", "--out", "{tmp}/r.html"], ["results"], ["recipes"],
                                  ["compare", "1", "2"], ["data", "prepare", "{tmp}/src", "{tmp}/dst"],
                                  ["bench-loader", "{tmp}/dst"], ["eval", "{tmp}/m", "--dataset", "x"],
                                  ["predict", "{tmp}/m", "{tmp}/a.png"]])
def test_commands_that_do_not_train_refuse_to_run_as_k_copies(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "r.db"))
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "start it without torchrun" in err and err.startswith("speedrun[rank 1]: error:")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the database
