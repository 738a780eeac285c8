"""benchmarks/vs_airbench.py: the data handed to airbench, the parsing of its table, the statistics, and an
end-to-end CPU dry run (ours only; airbench needs CUDA and torchvision, which the test machine lacks)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from speedrun.data import sources
from speedrun.recipes import get_recipe
from speedrun.records import db
from speedrun.report import races

from conftest import load_benchmark, make_tiny

vs = load_benchmark("vs_airbench")

# What airbench 0.1.8's utils.print_training_details prints for a run: the header (run 0 only), one row per epoch
# (the run number only on the first), the final row with epoch 'eval', then a rule. Cells are right-justified to
# the width of the column names, floats as {:0.4f}, each cell framed by '|  ' and '  '.
RULE = "-" * 102
TABLE = f"""{RULE}
|  run     |  epoch  |  train_loss  |  train_acc  |  val_acc  |  tta_val_acc  |  total_time_seconds  |
{RULE}
|       0  |      0  |      1.8712  |     0.5342  |   0.6013  |               |                      |
|          |      9  |      1.0221  |     0.9541  |   0.9297  |               |                      |
|          |   eval  |      1.0221  |     0.9541  |   0.9297  |       0.9401  |              3.8312  |
{RULE}
"""
SECOND_RUN = """|       1  |      0  |      1.9012  |     0.5200  |   0.5990  |               |                      |
|          |   eval  |      1.0301  |     0.9500  |   0.9288  |       0.9389  |              3.7950  |
"""

TINY_ARGS = ["--dry-run-cpu", "--runs", "2", "--set", "batch_size=64", "--set", "widths=8,16,16",
             "--set", "epochs=0.25", "--set", "eval_each_epoch=false"]


def test_write_airbench_cache_layout_round_trips(tmp_path):
    data = make_tiny(n_train=20, n_test=8)
    folder = vs.write_airbench_cache(data, tmp_path)
    assert folder == tmp_path / "cifar10"
    for split in ("train", "test"):
        # airbench's CifarLoader torch.load()s with the default weights_only=True: plain tensors, lists, strings.
        saved = torch.load(folder / f"{split}.pt", weights_only=True)
        images, labels = getattr(data, f"{split}_images"), getattr(data, f"{split}_labels")
        assert set(saved) == {"images", "labels", "classes"}
        assert saved["images"].dtype == torch.uint8 and saved["images"].shape == (len(labels), 32, 32, 3)  # HWC
        # CifarLoader turns them back with .permute(0, 3, 1, 2): that must give our (N, C, H, W) images exactly.
        assert torch.equal(saved["images"].permute(0, 3, 1, 2), images)
        assert saved["labels"].dtype == torch.int64 and torch.equal(saved["labels"], labels)
        assert saved["classes"] == data.classes == [f"c{i}" for i in range(10)]


@pytest.mark.parametrize("shape, classes", [((1, 28, 28), 10), ((3, 32, 32), 5)])
def test_write_airbench_cache_rejects_what_airbench94_cannot_train(tmp_path, shape, classes):
    with pytest.raises(ValueError, match="3x32x32 images in 10 classes"):
        vs.write_airbench_cache(make_tiny(n_train=8, n_test=4, shape=shape, classes=classes), tmp_path)


def test_parse_airbench_table_reads_the_final_row():
    assert vs.parse_airbench_table(TABLE) == (0.9401, 3.8312)
    # Two runs captured together: the last final row is the one that counts.
    assert vs.parse_airbench_table(TABLE + SECOND_RUN) == (0.9389, 3.7950)


def test_parse_airbench_table_without_final_row_raises():
    truncated = TABLE.split("|          |   eval")[0]
    with pytest.raises(RuntimeError, match="no final 'eval' row"):
        vs.parse_airbench_table(truncated)
    # airbench's one-step warm-up (run=-1) prints a rule and one row with no epoch: not a result either.
    with pytest.raises(RuntimeError):
        vs.parse_airbench_table(RULE + "\n|  warmup  |         |      2.3026  |     0.1000  |           |"
                                       "               |                      |\n")


def test_fixed_train_order_permutes_pairs_and_keeps_test():
    data = make_tiny(n_train=50, n_test=8)
    shuffled = vs.fixed_train_order(data)
    assert not torch.equal(shuffled.train_labels, data.train_labels)
    assert torch.equal(shuffled.test_images, data.test_images)
    # Every (image, label) pair survives: match images by their bytes.
    before = {bytes(x.flatten().tolist()): int(y) for x, y in zip(data.train_images, data.train_labels)}
    after = {bytes(x.flatten().tolist()): int(y) for x, y in zip(shuffled.train_images, shuffled.train_labels)}
    assert before == after
    assert torch.equal(vs.fixed_train_order(data).train_labels, shuffled.train_labels)  # fixed, not random


def test_compare_ratio_and_difference():
    ours = [{"accuracy": a, "train_seconds": t} for a, t in [(0.940, 1.0), (0.942, 1.1), (0.938, 0.9)]]
    theirs = [{"accuracy": a, "train_seconds": t} for a, t in [(0.941, 2.0), (0.943, 2.2), (0.939, 1.8)]]
    c = vs.compare(ours, theirs)
    r, d = c["time_ratio_ours_over_airbench"], c["accuracy_diff_ours_minus_airbench"]
    assert r["value"] == pytest.approx(0.5) and r["ci95_low"] < 0.5 < r["ci95_high"]
    assert r["welch_p"] < 0.01  # 1.0 +- 0.1 against 2.0 +- 0.2 with n = 3
    assert d["value"] == pytest.approx(-0.001) and d["ci95_low"] < -0.001 < d["ci95_high"]
    assert d["welch_p"] > 0.5  # the same spread shifted by 0.001: no evidence of a difference
    assert vs.compare(ours[:1], theirs) is None and vs.compare(ours, []) is None


def test_dry_run_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "vs.json"
    rc = vs.main(["--data", "synthetic:train=256,test=64", "--out", str(out)] + TINY_ARGS)
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["dry_run_cpu"] and report["airbench"] is None
    assert report["comparison"] is None
    assert report["ours"]["recipe"] == "cifar10-94" and report["ours"]["config"]["widths"] == [8, 16, 16]
    assert [r["seed"] for r in report["ours"]["runs"]] == [0, 1]
    assert report["ours"]["accuracy"]["n"] == 2 and 0.0 <= report["ours"]["accuracy"]["mean"] <= 1.0
    assert all(r["train_seconds"] > 0 for r in report["ours"]["runs"])
    assert report["data"]["train"] == 256 and report["environment"]["device_type"] == "cpu"
    assert report["command"].endswith("python benchmarks/vs_airbench.py --data synthetic:train=256,test=64 --out "
                                      + str(out) + " " + " ".join(TINY_ARGS))
    printed = capsys.readouterr().out
    row = [line for line in printed.splitlines() if "speedrun cifar10-94" in line]
    assert len(row) == 1 and "| 2 |" in row[0] and "vs_airbench.py --data" in row[0]


@pytest.mark.parametrize("args, message", [
    (["--data", "synthetic:train=64,test=8", "--set", "no_such_key=1"], "unknown config key"),
    (["--data", "synthetic:train=64,test=8,classes=5"], "10 classes"),
    (["--data", "/no/such/dataset"], "unknown dataset"),
])
def test_bad_input_is_one_line_error(tmp_path, capsys, args, message):
    assert vs.main(args + ["--dry-run-cpu", "--runs", "1", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("vs_airbench.py: error:")


def test_bad_arguments_exit_through_argparse(capsys):
    for args in (["--data", "synthetic", "--runs", "0"], ["--runs", "2"]):
        with pytest.raises(SystemExit) as e:
            vs.main(args)
        assert e.value.code == 2


# A stand-in for airbench.lib_airbench94 with the same calling convention: it reads cifar10/{train,test}.pt from
# the working directory (so it fails unless the script chdir'ed to its data) and prints a final table row.
FAKE_AIRBENCH = '''
import os
import torch

calls = []

def train94(run=0, verbose=True):
    train = torch.load(os.path.join("cifar10", "train.pt"), weights_only=True)
    test = torch.load(os.path.join("cifar10", "test.pt"), weights_only=True)
    calls.append({"run": run, "seed": torch.initial_seed(), "cudnn_benchmark": torch.backends.cudnn.benchmark,
                  "train_shape": tuple(train["images"].shape), "test_n": len(test["labels"])})
    acc, secs = 0.9 + 0.001 * len(calls), 4.0 + 0.01 * len(calls) ** 2
    print("|          |   eval  |      1.0000  |     0.9000  |   0.9000  |  %11.4f  |  %18.4f  |" % (acc, secs))
'''


def test_airbench_side_with_a_stand_in(tmp_path, monkeypatch, capsys):
    (tmp_path / "fake" / "airbench").mkdir(parents=True)
    (tmp_path / "fake" / "airbench" / "__init__.py").write_text("")
    (tmp_path / "fake" / "airbench" / "lib_airbench94.py").write_text(FAKE_AIRBENCH)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setattr(vs, "pick_device", lambda dry_run_cpu: torch.device("cpu"))  # "GPU mode" on the CPU
    for name in ("airbench", "airbench.lib_airbench94"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # a real airbench imported earlier must not answer
    cwd = Path.cwd()
    out = tmp_path / "vs.json"
    try:
        rc = vs.main(["--data", "synthetic:train=256,test=64", "--out", str(out)] + TINY_ARGS[1:])
        import airbench.lib_airbench94 as fake
        calls = fake.calls
    finally:
        for name in ("airbench", "airbench.lib_airbench94"):
            sys.modules.pop(name, None)
    assert rc == 0 and Path.cwd() == cwd
    # One untimed warm-up, then one run per seed, each seeded, each with airbench's cuDNN setting.
    assert [(c["run"], c["seed"]) for c in calls] == [(0, 0), (0, 0), (1, 1)]
    assert all(c["cudnn_benchmark"] and c["train_shape"] == (256, 32, 32, 3) and c["test_n"] == 64 for c in calls)
    report = json.loads(out.read_text())
    assert report["airbench"]["warmup_accuracy"] == 0.901
    assert [r["accuracy"] for r in report["airbench"]["runs"]] == [0.902, 0.903]
    assert [r["train_seconds"] for r in report["airbench"]["runs"]] == [4.04, 4.09]
    assert report["ours"]["config"]["cudnn_benchmark"] is True and report["complete"]
    ratio = report["comparison"]["time_ratio_ours_over_airbench"]
    ours_mean = report["ours"]["train_seconds"]["mean"]
    assert ratio["value"] == pytest.approx(ours_mean / 4.065)
    printed = capsys.readouterr().out
    assert "| airbench94 0.1.8" in printed and "| 90.25 ± 0.07 | 4.065 ± 0.035 |" in printed
    assert "Time ours / airbench:" in printed


def test_seed_starts_both_systems_runs_there(tmp_path, monkeypatch):
    """--seed N: run i of each system has seed N + i (a second invocation adds runs the first did not make)."""
    (tmp_path / "fake" / "airbench").mkdir(parents=True)
    (tmp_path / "fake" / "airbench" / "__init__.py").write_text("")
    (tmp_path / "fake" / "airbench" / "lib_airbench94.py").write_text(FAKE_AIRBENCH)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setattr(vs, "pick_device", lambda dry_run_cpu: torch.device("cpu"))
    for name in ("airbench", "airbench.lib_airbench94"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    out = tmp_path / "vs.json"
    try:
        assert vs.main(["--data", "synthetic:train=256,test=64", "--out", str(out), "--seed", "5"]
                       + TINY_ARGS[1:]) == 0
        import airbench.lib_airbench94 as fake
        calls = fake.calls
    finally:
        for name in ("airbench", "airbench.lib_airbench94"):
            sys.modules.pop(name, None)
    assert [c["seed"] for c in calls[1:]] == [5, 6]  # after the warm-up
    report = json.loads(out.read_text())
    assert [r["seed"] for r in report["ours"]["runs"]] == [r["seed"] for r in report["airbench"]["runs"]] == [5, 6]


class _Loader:
    def __init__(self, path, train=True, batch_size=500, gpu=0):
        self.device = torch.device(gpu)  # raises on a machine without CUDA unless gpu is 'cpu'


def test_airbench_on_cpu_maps_cuda_and_fp16_calls_and_restores_them():
    had_torchvision = "torchvision" in sys.modules
    defaults = _Loader.__init__.__defaults__
    with vs.airbench_on_cpu(_Loader):
        net = torch.nn.Linear(2, 2).half().cuda()
        assert net.weight.dtype == torch.float32 and net.weight.device.type == "cpu"
        assert torch.ones(2, dtype=torch.uint8).half().dtype == torch.float32
        assert _Loader("cifar10").device == torch.device("cpu")
        assert _Loader("cifar10", gpu="cpu").device == torch.device("cpu")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda.synchronize()
        end.record()
        assert 0.0 <= start.elapsed_time(end) < 1e3  # milliseconds
        if not had_torchvision:
            import torchvision.transforms as T
            x = torch.tensor([[[[1.0]], [[2.0]]]]).to(memory_format=torch.channels_last)  # (1, 2, 1, 1)
            assert torch.equal(T.Normalize((1.0, 0.0), (2.0, 4.0))(x).flatten(), torch.tensor([0.0, 0.5]))
        import xml.dom.minidom  # noqa: F401  imported inside: must survive the exit
    assert torch.nn.Linear(2, 2).half().weight.dtype == torch.float16
    assert torch.ones(2).half().dtype == torch.float16
    assert _Loader.__init__.__defaults__ == defaults
    assert torch.cuda.Event is not vs._HostEvent
    assert ("torchvision" in sys.modules) == had_torchvision
    assert "xml.dom.minidom" in sys.modules


# airbench 0.1.8's CUDA and fp16 calls, in the places it makes them: torchvision at import, the loader's gpu=0
# default, Tensor.half() on the images, net.half().cuda(), CUDA events around the timed region.
FAKE_AIRBENCH_CUDA = '''
import os
import torch
import torchvision.transforms as T

calls = []

class CifarLoader:
    def __init__(self, path, train=True, batch_size=500, aug=None, drop_last=None, shuffle=None, altflip=False,
                 gpu=0):
        data = torch.load(os.path.join(path, "train.pt" if train else "test.pt"), map_location=torch.device(gpu))
        self.images = T.Normalize((0.5,) * 3, (0.25,) * 3)(data["images"].half().permute(0, 3, 1, 2) / 255)
        self.labels = data["labels"]

def train94(run=0, verbose=True, epochs=9.9):
    train, test = CifarLoader("cifar10"), CifarLoader("cifar10", train=False)
    net = torch.nn.Conv2d(3, 10, 32).half().cuda()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    acc = (net(test.images).flatten(1).argmax(1) == test.labels).float().mean().item()
    end.record()
    torch.cuda.synchronize()
    if epochs != 9.9:
        calls.append({"epochs": epochs})
    calls.append({"run": run, "seed": torch.initial_seed(), "dtype": str(net.weight.dtype),
                  "images": str(train.images.dtype), "n": len(train.labels)})
    print("|          |   eval  |      1.0000  |     0.9000  |   0.9000  |  %11.4f  |  %18.4f  |"
          % (acc, 1e-3 * start.elapsed_time(end)))
'''


def _fake_airbench(tmp_path, monkeypatch, argv: list[str]) -> tuple[int, list[dict]]:
    """vs.main(argv) with FAKE_AIRBENCH_CUDA importable as airbench.lib_airbench94; (exit code, its calls)."""
    (tmp_path / "fake" / "airbench").mkdir(parents=True)
    (tmp_path / "fake" / "airbench" / "__init__.py").write_text("")
    (tmp_path / "fake" / "airbench" / "lib_airbench94.py").write_text(FAKE_AIRBENCH_CUDA)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    for name in ("airbench", "airbench.lib_airbench94"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        rc = vs.main(argv)
        return rc, sys.modules["airbench.lib_airbench94"].calls
    finally:
        for name in ("airbench", "airbench.lib_airbench94"):
            sys.modules.pop(name, None)


def test_on_cpu_runs_a_cuda_only_airbench_stand_in(tmp_path, monkeypatch, capsys):
    out = tmp_path / "vs.json"
    rc, calls = _fake_airbench(tmp_path, monkeypatch, ["--on-cpu", "--data", "synthetic:train=256,test=64", "--out",
                                                       str(out)] + TINY_ARGS[1:])
    assert rc == 0
    # No warm-up on the CPU: one call per seed, all in fp32.
    assert calls == [{"run": i, "seed": i, "dtype": "torch.float32", "images": "torch.float32", "n": 256}
                     for i in range(2)]
    report = json.loads(out.read_text())
    assert report["on_cpu"] and not report["dry_run_cpu"] and report["complete"]
    assert "warmup_seconds" not in report["ours"] and "warmup_accuracy" not in report["airbench"]
    assert report["airbench"]["accuracy"]["n"] == 2 and report["comparison"] is not None
    assert torch.nn.Linear(1, 1).half().weight.dtype == torch.float16  # patches gone after the run
    printed = capsys.readouterr().out
    ours = report["ours"]["precision"]  # auto: bf16 on a CPU with native bf16, else fp32
    assert f"| speedrun cifar10-94 ({ours} on the CPU) | 2 |" in printed
    assert "(fp32 on the CPU) | 2 |" in printed.split("speedrun cifar10-94")[-1]  # airbench's


def test_on_cpu_and_dry_run_cpu_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        vs.main(["--data", "synthetic", "--on-cpu", "--dry-run-cpu"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("num_train,batch", [(50_000, 1024), (50_000, 512), (2048, 64), (1000, 7)])
def test_ours_epochs_give_exactly_airbenchs_step_count(num_train, batch, drop_last):
    rec = get_recipe("cifar10-94")
    cfg = dataclasses.replace(rec.make_config(), batch_size=batch, drop_last_batch=drop_last)
    for tenths in range(1, 120):
        steps = vs.airbench_steps(50_000, tenths / 10)
        epochs = vs.ours_epochs_for(rec, cfg, steps, num_train)
        assert rec.module().run_steps(dataclasses.replace(cfg, epochs=epochs), num_train) == steps and epochs > 0
    assert vs.airbench_steps(50_000, 9.9) == 476 and vs.airbench_steps(50_000, 1) == 48


def test_reduced_schedule_gives_both_systems_the_same_steps(tmp_path, monkeypatch, capsys):
    out = tmp_path / "vs.json"
    args = ["--runs", "2", "--set", "batch_size=64", "--set", "widths=8,16,16", "--set", "eval_each_epoch=false"]
    rc, calls = _fake_airbench(tmp_path, monkeypatch, ["--on-cpu", "--epochs", "1.5", "--data",
                                                       "synthetic:train=2048,test=64", "--out", str(out)] + args)
    assert rc == 0
    assert [c for c in calls if "epochs" in c] == [{"epochs": 1.5}] * 2  # airbench through its own argument
    report = json.loads(out.read_text())
    steps = 3  # 2048 // 1024 = 2 steps an epoch, x 1.5
    assert report["schedule"]["steps"] == steps
    assert [r["steps"] for r in report["ours"]["runs"]] == [steps, steps]
    assert report["ours"]["precision"] in ("fp32", "bf16")
    assert f"{steps} steps) | 2 |" in capsys.readouterr().out


def test_reduced_schedule_refuses_zero_steps(capsys):
    rc = vs.main(["--on-cpu", "--epochs", "0.5", "--data", "synthetic:train=256,test=64", "--runs", "1"])
    assert rc == 2 and "no step of airbench94" in capsys.readouterr().err


# ---- --db: a race is stored in the results database, where `speedrun report` shows it ---------------------------


def test_db_stores_the_race_as_the_json_file_holds_it(tmp_path, monkeypatch, capsys):
    out, database = tmp_path / "vs.json", tmp_path / "r.db"
    rc, _ = _fake_airbench(tmp_path, monkeypatch, ["--on-cpu", "--data", "synthetic:train=256,test=64", "--out",
                                                   str(out), "--db", str(database)] + TINY_ARGS[1:])
    assert rc == 0 and "stored in the results database" in capsys.readouterr().err
    conn = db.connect(database)
    try:
        (stored,) = db.query_reports(conn, "vs_airbench")
        assert db.get_result(conn, stored["id"]) == json.loads(out.read_text())  # the file, whole
        (row,) = races.race_rows(conn)  # a finished race: the pages show it
        assert row["n_ours"] == row["n_anchor"] == 2 and row["device"].endswith("(CPU)")
        (imported,) = db.import_files(conn, [out])  # importing the file later finds it stored
        assert imported.id == stored["id"] and not imported.new
    finally:
        conn.close()


def test_db_keeps_a_dry_run_that_the_pages_leave_out(tmp_path):
    database = tmp_path / "r.db"
    args = ["--data", "synthetic:train=256,test=64", "--out", str(tmp_path / "vs.json"), "--db", str(database)]
    assert vs.main(args + TINY_ARGS) == 0
    conn = db.connect(database)
    try:
        left_out: list[str] = []
        assert len(db.query_reports(conn, "vs_airbench")) == 1 and races.race_rows(conn, left_out) == []
        assert len(left_out) == 1 and "dry run" in left_out[0]
    finally:
        conn.close()


def test_db_that_cannot_be_used_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "folder.db").mkdir()
    out = tmp_path / "vs.json"
    args = ["--data", "synthetic:train=256,test=64", "--out", str(out), "--db", str(tmp_path / "folder.db")]
    assert vs.main(args + TINY_ARGS) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vs_airbench.py: error:") and "is a directory" in err[-1] and not out.exists()


def test_db_that_refuses_the_report_is_a_warning_and_the_file_is_kept(tmp_path, monkeypatch, capsys):
    def refuse(conn, result, source=None):
        raise db.UnusableDatabase("the results database r.db is locked by another process; try again later")

    monkeypatch.setattr(db, "insert_result", refuse)
    out = tmp_path / "vs.json"
    args = ["--data", "synthetic:train=256,test=64", "--out", str(out), "--db", str(tmp_path / "r.db")]
    assert vs.main(args + TINY_ARGS) == 0
    err = capsys.readouterr().err
    assert "warning: the report was not stored in the results database (the results database r.db is locked" in err
    assert f"speedrun results import {out}` adds it later" in err and json.loads(out.read_text())["complete"]
