"""Stop signals that reach worker processes (DataLoader's, data prepare's): the parent alone acts on them
(src/speedrun/data/workers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import rest_of


def _start(argv: list[str], env: dict, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "speedrun", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)


def test_sigterm_to_the_group_during_shard_training_keeps_the_checkpoint(tmp_path):
    """`kill -TERM -PGID` (systemd, Slurm) while imagenet-debug trains with DataLoader workers: the run finishes its
    step and keeps its state, as it says. torch's own worker handler ends a worker by a SIGTERM its parent did not
    send, and torch's SIGCHLD handler then raises RuntimeError("DataLoader worker ... is killed by signal") in the
    parent wherever it is: `internal error`, exit 1, no checkpoint. The workers leave the signal to the parent."""
    env = {**os.environ, "SPEEDRUN_DATA": str(tmp_path / "data"), "SPEEDRUN_DB": str(tmp_path / "r.db"),
           "SPEEDRUN_RESULTS": str(tmp_path / "results")}
    env.pop("SPEEDRUN_TRACEBACK", None)
    proc = _start(["train", "imagenet-debug", "--device", "cpu", "--set", "workers=2", "--epochs", "20",
                   "--json", "r.json", "--checkpoint-dir", "ck"], env, tmp_path)
    deadline = time.monotonic() + 60
    for line in proc.stderr:  # the table's header: the loop has started its DataLoader workers
        if line.split()[:2] == ["epoch", "step"] or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = rest_of(proc, 60)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "internal error" not in err, err
    assert "Traceback (most recent call last)" not in err, err
    assert proc.returncode == 143, err
    assert lines[-1].startswith("speedrun: terminated (SIGTERM)") and "checkpoint in ck" in lines[-1], err
    assert list((tmp_path / "ck").glob("ckpt-*.safetensors")), err


_SLOW_PREPARE = r"""
import sys, time
import speedrun.data.prepare as prepare
from PIL import Image
from pathlib import Path

root = Path(sys.argv[1])
for c in ("a", "b"):
    (root / "train" / c).mkdir(parents=True)
    (root / "val" / c).mkdir(parents=True)
    for i in range(40):
        Image.new("RGB", (8, 8)).save(root / "train" / c / f"{i}.png")
    Image.new("RGB", (8, 8)).save(root / "val" / c / "0.png")
real = prepare.prepare_image

def slow(path, max_side_px, quality):  # a large photo: ~0.3 s to decode and shrink (16 of them per chunk)
    time.sleep(0.3)
    return real(path, max_side_px, quality)

prepare.prepare_image = slow  # the workers are forked: they see it too
from speedrun.cli.program import entry
sys.argv = ["speedrun", "data", "prepare", "--workers", "1", str(root), sys.argv[2]]
sys.exit(entry())
"""


def test_ctrl_c_during_data_prepare_does_not_wait_for_the_chunks_in_flight(tmp_path):
    """Ctrl-C (SIGINT to the foreground group) during `data prepare --workers 1`. The workers ignore SIGINT, the
    parent raises KeyboardInterrupt at once, then worker_pool's `pool.shutdown(wait=True)` waits for every chunk a
    worker holds (the running one and the one queued behind it: 2 x 16 images). With large source photos (2 s each
    measured for a 6800 px PNG on this machine) Ctrl-C took 13.6 s; SIGTERM, which kills the workers, 0.7 s."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PREPARE, str(tmp_path / "src"), str(tmp_path / "dst")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("train: preparing"):
            break
    time.sleep(1.5)  # inside the first chunk (4.8 s of work)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = rest_of(proc, 60)
    took = time.monotonic() - start
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "speedrun: interrupted; nothing was written", err
    assert took < 5, f"Ctrl-C took {took:.1f} s to end data prepare"  # 8.8 s when it waited for the chunks


_LOADER_ALIVE_AT_EXIT = r"""
import os, subprocess, sys, time
import torch
from speedrun.data.workers import dataloader_worker_init, started

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.01)
        return i

batches = started(torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=2,
                                               worker_init_fn=dataloader_worker_init()))
print(next(batches).tolist(), flush=True)
if sys.argv[1] == "group":  # `kill -TERM -PGID` from another process; this one's own SIGTERM handler just notes it
    import signal
    signal.signal(signal.SIGTERM, lambda *args: print("parent: SIGTERM", flush=True))
    subprocess.run(["sh", "-c", f"kill -TERM -{os.getpgid(0)}"], start_new_session=True, check=True)
    time.sleep(0.5)
print(next(batches).tolist(), flush=True)
# exits with the iterator alive: multiprocessing's exit terminate()s the workers and waits for them
"""


@pytest.mark.parametrize("how", ["plain", "group"])
def test_dataloader_workers_ignore_a_stop_from_elsewhere_and_end_on_their_parents(how):
    """A SIGTERM to the process group from another process leaves the workers serving batches (the parent decides);
    the parent's own terminate(), which multiprocessing's exit sends to a loader left alive, ends them: a worker
    ignoring every SIGTERM hung its parent's exit for good."""
    child = subprocess.run([sys.executable, "-c", _LOADER_ALIVE_AT_EXIT, how], capture_output=True, text=True,
                           timeout=60, start_new_session=True)
    expected = ["[0, 1, 2, 3]", *(["parent: SIGTERM"] if how == "group" else []), "[4, 5, 6, 7]"]
    assert child.returncode == 0 and child.stdout.splitlines() == expected, child.stderr[-3000:]
