"""The engine under torchrun (gloo, CPU): one process's learning curve, exact resume after SIGINT and after a worker
is SIGKILLed under --max-restarts, and the summed-gradient contract of dist.py.

Each test starts real processes (`torchrun --standalone`, the `speedrun` module), one CPU thread each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import make_tiny, rest_of
from speedrun.engine.checkpoint import list_checkpoints

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SPEEDRUN = ["-m", "speedrun", "train"]
SMALL = ["--device", "cpu", "--set", "batch_size=64", "--set", "widths=16,32,32", "--set", "whiten_images=256",
         "--quiet"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """make_tiny's learnable images (each class its own colour) as an image folder, 1024 train / 256 test."""
    root = tmp_path_factory.mktemp("data")
    d = make_tiny(n_train=1024, n_test=256, shape=(3, 16, 16))
    for split, x, y in (("train", d.train_images, d.train_labels), ("test", d.test_images, d.test_labels)):
        for i, (img, label) in enumerate(zip(x, y)):
            where = root / split / f"c{int(label)}"
            where.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(where / f"{i}.png")
    return root


def _run(argv, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_DATA=str(cwd / "cache"), SPEEDRUN_RESULTS=str(cwd / "results"))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)


def _losses(path: Path) -> list[float]:
    return [row["train_loss"] for row in json.loads(path.read_text())["runs"][-1]["history"]]


@pytest.mark.slow
def test_two_processes_follow_one_processs_loss_curve(folder, tmp_path):
    """Same global batch (64), same seed: K=2 takes 32 examples each from the same permutation, gradients summed.

    Tolerance, and why: with BatchNorm statistics local (the default; SyncBatchNorm has no CPU implementation),
    each process normalizes its 32 examples by their own mean and variance, where one process uses all 64. That
    changes every step slightly (ghost batch norm), so the curves cannot be equal; everything else (data, order,
    augmentation, summed loss and gradient) is the same. Measured on this data: the per-epoch loss differs by at
    most 0.9% between K=1 and K=2, and by up to 2.6% between two seeds of K=1. The test asks for at most 2.5% at
    every epoch and a gap under half of the seed-to-seed gap: the change of K must be smaller than a change of seed.
    """
    common = ["--dataset", str(folder), "--epochs", "6", *SMALL]
    one = _run([sys.executable, *SPEEDRUN, *common, "--json", "one.json"], tmp_path)
    other_seed = _run([sys.executable, *SPEEDRUN, *common, "--seed", "1", "--json", "seed1.json"], tmp_path)
    two = _run([*TORCHRUN, *SPEEDRUN, *common, "--json", "two.json"], tmp_path)
    assert one.returncode == other_seed.returncode == two.returncode == 0, (one.stderr, two.stderr[-2000:])
    a, b, s = _losses(tmp_path / "one.json"), _losses(tmp_path / "two.json"), _losses(tmp_path / "seed1.json")
    assert len(a) == len(b) == 6
    assert a[-1] < a[0] - 0.3 and b[-1] < b[0] - 0.3  # both learn
    gap = max(abs(x - y) / x for x, y in zip(a, b))
    seed_gap = max(abs(x - y) for x, y in zip(a, s))
    assert gap < 0.025, (a, b)
    assert max(abs(x - y) for x, y in zip(a, b)) < seed_gap / 2, (a, b, s)
    result = json.loads((tmp_path / "two.json").read_text())
    assert result["world"] == {"processes": 2, "nodes": 1, "backend": "gloo", "restarts": 0}
    assert result["command"].startswith("torchrun --standalone --nproc_per_node=2 -m speedrun train --dataset")


_SUM_SCRIPT = """
import torch, torch.distributed as td
from speedrun import dist
world = dist.init(dist.from_env(), torch.device("cpu"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
full = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
expected = torch.autograd.grad(full, list(model.parameters()))
ddp = dist.wrap(model, world, torch.device("cpu"))
share = dist.share(8, world)
torch.nn.functional.cross_entropy(ddp(x[share]), y[share], reduction="sum").backward()
for p, g in zip(model.parameters(), expected):
    torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)
print("ok", world.rank, flush=True)
dist.shutdown(world, True)
dist.exit_process(0)  # as cli.entry: DDP's gloo threads must not see the interpreter's teardown
"""


@pytest.mark.slow
def test_gradients_are_summed_over_the_global_batch(tmp_path):
    """dist.wrap's contract, exact without BatchNorm: each process's loss summed over its share, gradients summed,
    equals one process's gradient of the loss summed over the whole batch."""
    script = tmp_path / "sum.py"
    script.write_text(_SUM_SCRIPT)
    done = _run([*TORCHRUN, str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok") == 2  # one line per process (their output may interleave)


def _newest_step(directory: Path) -> int:
    found = list_checkpoints(directory)
    return int(found[0].name.split("-")[2].split(".")[0]) if found else -1


def _signal_when(proc: subprocess.Popen, directory: Path, step: int, send) -> None:
    """Wait until a checkpoint at or past `step` exists (the run is mid-way), then act."""
    deadline = time.monotonic() + 240
    while _newest_step(directory) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    send()


def _start(argv, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_DATA=str(cwd / "cache"), SPEEDRUN_RESULTS=str(cwd / "results"))
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _weights(stem: Path) -> dict[str, torch.Tensor]:
    return load_file(f"{stem}.safetensors")


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# 2048 synthetic images at batch 64: 32 steps an epoch, 96 in all, a checkpoint every 5 steps.
SYNTH = ["--dataset", "synthetic:train=2048,test=128", "--epochs", "3", *SMALL, "--checkpoint-every", "5"]


@pytest.mark.slow
def test_sigint_checkpoints_and_resume_auto_finishes_bitwise_equal(tmp_path):
    """Two runs; Ctrl-C in the second: exit 130, run 1's result and a checkpoint on disk, no traceback. `--resume
    auto` then finishes run 2, continues the same result file, and its weights equal an uninterrupted run's."""
    whole = _run([sys.executable, *SPEEDRUN, *SYNTH, "--runs", "2", "--checkpoint-dir", "a", "--json", "a.json",
                  "--save", "model_a"], tmp_path)
    assert whole.returncode == 0, whole.stderr
    proc = _start([sys.executable, *SPEEDRUN, *SYNTH, "--runs", "2", "--checkpoint-dir", "b", "--json", "b.json",
                   "--save", "model_b"], tmp_path)
    deadline = time.monotonic() + 240
    while not (list_checkpoints(tmp_path / "b") and list_checkpoints(tmp_path / "b")[0].name.startswith("ckpt-00001")
               and _newest_step(tmp_path / "b") >= 40):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("speedrun: interrupted; 1 finished run kept in b.json")
    partial = json.loads((tmp_path / "b.json").read_text())
    assert partial["interrupted"] is True and [r["seed"] for r in partial["runs"]] == [0]
    assert not (tmp_path / "model_b.safetensors").exists()  # no model from an unfinished command
    stopped_at = _newest_step(tmp_path / "b")
    assert 40 <= stopped_at < 96

    resumed = _run([sys.executable, *SPEEDRUN, *SYNTH, "--runs", "2", "--checkpoint-dir", "b", "--resume", "auto",
                    "--save", "model_b"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    final = json.loads((tmp_path / "b.json").read_text())  # the same file, continued
    assert final["complete"] is True and [r["seed"] for r in final["runs"]] == [0, 1]
    assert final["resumed_from"] == [str(Path("b") / f"ckpt-00001-{stopped_at:09d}.safetensors")]
    _assert_bitwise_equal(_weights(tmp_path / "model_a"), _weights(tmp_path / "model_b"))
    assert final["runs"][1]["accuracy"] == json.loads((tmp_path / "a.json").read_text())["runs"][1]["accuracy"]


def _worker_pids(launcher: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes (children of the launcher)."""
    pids = {}
    for child in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                pids[int(item[5:])] = int(child)
    return pids


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_job_resumes_bitwise_equal(tmp_path):
    """torchrun --max-restarts=1: rank 1 SIGKILLed mid-run; torchrun restarts the group, which resumes from the last
    checkpoint by itself; the final weights equal an uninterrupted two-process run's, and the result counts the
    restart."""
    elastic = [*TORCHRUN, "--max-restarts=1", *SPEEDRUN, *SYNTH]
    whole = _run([*elastic, "--checkpoint-dir", "a", "--json", "a.json", "--save", "model_a"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    proc = _start([*elastic, "--checkpoint-dir", "b", "--json", "b.json", "--save", "model_b"], tmp_path)
    _signal_when(proc, tmp_path / "b", 40, lambda: os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-20000:]  # whole: a rare failure needs every rank's lines
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["world"]["restarts"] == 1 and result["complete"] is True
    assert len(result["resumed_from"]) == 1
    _assert_bitwise_equal(_weights(tmp_path / "model_a"), _weights(tmp_path / "model_b"))


@pytest.mark.slow
def test_a_signal_stops_a_run_at_the_next_step_without_a_checkpoint_folder(tmp_path):
    """No --checkpoint-dir: SIGTERM still ends the run after its current step (not at the end of the run)."""
    argv = [sys.executable, *SPEEDRUN, "--dataset", "synthetic:train=2048,test=128", "--epochs", "200",
            *SMALL[:-1]]
    proc = _start(argv, tmp_path)
    for line in proc.stderr:  # the table's first row (epoch 1 at step 32): the run is under way, 6,368 steps left
        if line.split()[:2] == ["1", "32"]:
            break
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = rest_of(proc, timeout_s=60)
    assert proc.returncode == 143, err
    assert time.monotonic() - start < 10  # 6,368 steps were left; one step takes milliseconds
    assert err.strip().splitlines()[-1] == "speedrun: terminated (SIGTERM); no run had finished"


@pytest.mark.parametrize("n, size", [(10_000, 3), (7, 8), (0, 2), (5, 1)])
def test_the_parts_of_a_scored_set_cover_it_once(n, size):
    from speedrun import dist

    parts = [dist.part(n, dist.World(rank=r, size=size)) for r in range(size)]
    assert [i for p in parts for i in range(n)[p]] == list(range(n))
    assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) <= 1
