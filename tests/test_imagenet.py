"""recipes/imagenet.py: the debug recipe learns from shards, the schedule and switches, exact resume mid-epoch,
and, under torchrun with two processes, every image once per epoch and a resumed loader's order."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from speedrun import dist
from speedrun.data.shards import write_split
from speedrun.engine.loop import RunHooks
from speedrun.recipes import RECIPES, imagenet
from speedrun.recipes.imagenet import loop as imagenet_loop
from speedrun.recipes.imagenet import data as imagenet_checks
from speedrun.run.runner import train

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return imagenet_checks.write_synthetic_shards(tmp_path_factory.mktemp("inet"), 320, 80)


def test_the_debug_recipe_learns_from_shards_well_above_chance(shards):
    result = train("imagenet-debug", str(shards), device="cpu", epochs=4, summary=False)
    run = result.runs[0]
    assert run.steps == 20  # ceil(4 epochs x 320 / 64)
    assert run.accuracy > 0.6  # 10 classes: chance is 0.1
    assert run.history[-1]["val_acc"] == run.accuracy


def test_resolution_ramps_late_in_steps_of_32_px_and_is_fixed_when_off():
    cfg = imagenet.resnet50(16)
    sizes = [imagenet.res_at(cfg, s, 1000) for s in range(1001)]
    assert sizes[0] == sizes[699] == 160 and sizes[850] == sizes[1000] == 192
    assert set(sizes) == {160, 192} and sizes == sorted(sizes)
    wide = dataclasses.replace(cfg, min_res_px=128, max_res_px=256)
    assert {imagenet.res_at(wide, s, 100) for s in range(101)} == {128, 160, 192, 224, 256}
    off = dataclasses.replace(cfg, progressive_resizing=False)
    assert {imagenet.res_at(off, s, 1000) for s in range(1001)} == {192}


def test_every_trick_is_a_config_field_and_its_off_value_is_valid():
    cfg = imagenet.resnet18()
    names = {f.name for f in dataclasses.fields(cfg)}
    for key, off, _ in imagenet_checks.TRICKS:
        assert key in names
        dataclasses.replace(cfg, **{key: off}).validate()


def test_no_decay_norm_bias_off_gives_every_group_the_weight_decay():
    cfg = imagenet.debug()
    model = imagenet.build_model(cfg, 3, 10)
    on = imagenet.build_optimizer(cfg, model).param_groups
    off = imagenet.build_optimizer(dataclasses.replace(cfg, no_decay_norm_bias=False), model).param_groups
    assert [g["weight_decay"] for g in on] == [cfg.weight_decay, 0.0]
    assert [g["weight_decay"] for g in off] == [cfg.weight_decay, cfg.weight_decay]
    assert [len(g["params"]) for g in on] == [len(g["params"]) for g in off]
    lars = imagenet.build_optimizer(dataclasses.replace(cfg, optimizer="lars"), model)
    assert [g["adapt"] for g in lars.param_groups] == [True, False]


def test_variants_carry_ffcvs_budgets_and_settings():
    for depth in (18, 50):
        for epochs, (top1, _) in imagenet.FFCV_REFERENCE[depth].items():
            name = f"imagenet-resnet{depth}" + ("" if epochs == 16 else f"-{epochs}")
            cfg = RECIPES[name].make_config()
            assert (cfg.depth, cfg.epochs, cfg.target_accuracy) == (depth, float(epochs), top1)
    r50 = imagenet.resnet50()
    assert r50.lr_per_256 * r50.batch_size / 256 == pytest.approx(1.7) and r50.weight_decay == 1e-4
    r18 = imagenet.resnet18()
    assert r18.lr_per_256 * r18.batch_size / 256 == pytest.approx(0.5) and r18.weight_decay == 5e-5


class _StopAt:
    """A checkpoints stand-in: saves a deep copy of the state at `step`, then stops the run."""

    class Stop(Exception):
        pass

    def __init__(self, step: int):
        self.step, self.state = step, None

    def due(self, step: int, total: int) -> bool:
        return step == self.step

    def save(self, step: int, state: dict) -> None:
        self.state = copy.deepcopy(state)
        raise self.Stop


def test_a_run_resumed_mid_epoch_ends_bitwise_equal_to_an_uninterrupted_one(shards):
    # 320 images at batch 64: 5 steps an epoch; stopping at step 7 is mid-way through epoch 2. EMA on, so its
    # averages are part of what must be restored.
    cfg = dataclasses.replace(imagenet.debug(), ema_decay=0.9, workers=1)
    data = imagenet_checks.load_data(str(shards))
    device = torch.device("cpu")
    whole = imagenet.train_run(cfg, data, device, seed=4)
    stop = _StopAt(7)
    with pytest.raises(_StopAt.Stop):
        imagenet.train_run(cfg, data, device, seed=4, hooks=RunHooks(checkpoints=stop))
    seen = []
    resumed = imagenet.train_run(cfg, data, device, seed=4, resume=stop.state,
                                 on_batch=lambda step, labels: seen.append(step))
    assert seen == [7, 8, 9]
    assert resumed.accuracy == whole.accuracy
    for (k, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_folder_that_is_not_prepared_shards_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="no classes.json"):
        imagenet_checks.load_data(str(tmp_path))
    with pytest.raises(ValueError, match="need --dataset"):
        imagenet_checks.load_data("")
    (tmp_path / "classes.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a list"):
        imagenet_checks.load_data(str(tmp_path))
    (tmp_path / "classes.json").write_text('["a", "b"]')
    with pytest.raises(ValueError, match="needs a train split"):
        imagenet_checks.load_data(str(tmp_path))


_ONCE_SCRIPT = """
import json, os, sys
import torch
from speedrun import dist
from speedrun.data.loader import Normalization
from speedrun.data.shard_loader import Decoding, ShardLoader

root, start, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
world = dist.init(dist.from_env(), torch.device("cpu"))
# Labels are sample numbers here (one class per sample), so the targets a process receives name its images.
loader = ShardLoader(root, "train", batch_size=8, epochs=3, device=torch.device("cpu"), res_at=lambda s: 16,
                     normalization=Normalization(torch.zeros(3), torch.ones(3)),
                     decoding=Decoding(decode_px=16, workers=2), seed=11, share=dist.share(8, world))
seen = {step: y.tolist() for step, (_, y) in enumerate(loader.batches(start), start)}
with open(f"{out}.{world.rank}", "w") as f:
    json.dump(seen, f)
dist.shutdown(world, True)
dist.exit_process(0)
"""


@pytest.mark.slow
def test_under_torchrun_every_image_is_seen_once_per_epoch_and_a_resumed_loader_continues_in_order(tmp_path):
    """Two processes on CPU (gloo): 37 images, one class each, batch 8 (4 per process), 3 epochs = 14 steps. The
    union of both processes' images is each epoch's 37 images exactly once; started at step 6 (mid-epoch 2) they
    get the same images in the same order as the uninterrupted run from step 6 on."""
    root = tmp_path / "once"
    root.mkdir()
    rng = np.random.default_rng(2)
    samples = []
    for i in range(37):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(buf, "JPEG")
        samples.append((buf.getvalue(), i))
    write_split(samples, root, "train", shard_bytes=10_000)
    script = tmp_path / "once.py"
    script.write_text(_ONCE_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for start, out in ((0, "whole"), (6, "resumed")):
        done = subprocess.run([*TORCHRUN, str(script), str(root), str(start), str(tmp_path / out)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    ranks = [{int(k): v for k, v in json.loads((tmp_path / f"whole.{r}").read_text()).items()} for r in (0, 1)]
    assert sorted(ranks[0]) == sorted(ranks[1]) == list(range(14))
    stream = [i for step in range(14) for r in (0, 1) for i in ranks[r][step]]  # the global batches in order
    for epoch in range(3):
        assert sorted(stream[epoch * 37:(epoch + 1) * 37]) == list(range(37))
    assert not set(ranks[0][3]) & set(ranks[1][3])
    for r in (0, 1):
        resumed = {int(k): v for k, v in json.loads((tmp_path / f"resumed.{r}").read_text()).items()}
        assert resumed == {step: ranks[r][step] for step in range(6, 14)}


@pytest.mark.slow
def test_two_processes_train_the_debug_recipe_under_torchrun(shards, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_DATA=str(tmp_path / "cache"),
               SPEEDRUN_RESULTS=str(tmp_path / "results"))
    done = subprocess.run([*TORCHRUN, "-m", "speedrun", "train", "imagenet-debug", "--dataset", str(shards),
                           "--epochs", "4", "--device", "cpu", "--quiet", "--json", "two.json", "--db", "two.db"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "two.json").read_text())
    assert result["world"]["processes"] == 2 and result["runs"][0]["accuracy"] > 0.6
    from speedrun.records import db as db

    with db.connect(tmp_path / "two.db") as conn:  # rank 0 alone stores: one row, the job's
        [row] = db.query(conn)
        assert db.get_result(conn, row["id"])["world"]["processes"] == 2


def test_the_cli_refuses_what_is_not_prepared_shards_in_one_line(tmp_path, capsys, monkeypatch):
    from speedrun.cli.program import main

    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    for extra in (["--dataset", "synthetic:train=48"], ["--dataset", str(tmp_path / "missing")], [],
                  ["--dataset", str(tmp_path)], ["--dataset", str(tmp_path), "--image-size", "32"]):
        code = main(["train", "imagenet-resnet18", "--device", "cpu", "--quiet", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("speedrun"), (extra, err)


JPEG = Path(os.environ.get("SPEEDRUN_CIFAR10_JPEG", Path(__file__).resolve().parents[2] / "shared" / "datasets"
                           / "cifar10-jpeg"))


@pytest.mark.slow
def test_the_resnet18_recipe_learns_real_photographs_from_prepared_shards(tmp_path):
    """The real-photograph learning check at test size: the first 300 train / 100 test images of each class of the
    JPEG copy of CIFAR-10, through `data prepare`, then the ResNet-18 recipe at width 16 and 32 px for 6 epochs.
    Measured (BENCHMARKS.md): 41.03 +- 1.46% (n=3); chance is 10%."""
    if not JPEG.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"CI needs {JPEG} (shared/datasets/cifar10-jpeg beside the clone)")
        pytest.skip(f"{JPEG} not present")
    import shutil

    from speedrun.data.prepare_tree import prepare_tree

    for split, k in (("train", 300), ("test", 100)):
        for cls in sorted((JPEG / split).iterdir()):
            (tmp_path / "src" / split / cls.name).mkdir(parents=True)
            for f in sorted(cls.iterdir())[:k]:
                shutil.copyfile(f, tmp_path / "src" / split / cls.name / f.name)
    prepare_tree(tmp_path / "src", tmp_path / "shards", max_side_px=32, quality=95, workers=2)
    result = train("imagenet-resnet18", str(tmp_path / "shards"), device="cpu", epochs=6, summary=False,
                   width=16, batch_size=128, decode_px=32, min_res_px=32, max_res_px=32, eval_res_px=32,
                   eval_crop_ratio=1.0, crop_min_scale=0.35, workers=2, lr_per_256=0.4, warmup_epochs=0.5)
    assert result.runs[0].accuracy > 0.3


@pytest.mark.slow
def test_a_killed_worker_resumes_mid_epoch_under_torchrun_and_ends_bitwise_equal(shards, tmp_path):
    """Must-show 2 end to end: two processes, rank 1 SIGKILLed after a checkpoint in the middle of an epoch
    (batch 48 over 320 images: a step ends on an epoch boundary only every 20 steps; a checkpoint every 3 steps);
    torchrun restarts the group, which resumes from that step, and the trained weights equal an uninterrupted
    two-process run's bit for bit."""
    from test_dist import _assert_bitwise_equal, _run, _signal_when, _start, _weights, _worker_pids

    argv = [*TORCHRUN, "--max-restarts=1", "-m", "speedrun", "train", "imagenet-debug", "--dataset", str(shards),
            "--epochs", "12", "--device", "cpu", "--quiet", "--set", "batch_size=48", "--checkpoint-every", "3"]
    whole = _run([*argv, "--checkpoint-dir", "a", "--json", "a.json", "--save", "model_a"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    proc = _start([*argv, "--checkpoint-dir", "b", "--json", "b.json", "--save", "model_b"], tmp_path)
    _signal_when(proc, tmp_path / "b", 8, lambda: os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-20000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["world"]["restarts"] == 1 and result["complete"] is True
    step = int(Path(result["resumed_from"][0]).name.split("-")[2].split(".")[0])
    assert (step * 48) % 320 != 0 and 8 <= step < 80  # resumed in the middle of an epoch
    _assert_bitwise_equal(_weights(tmp_path / "model_a"), _weights(tmp_path / "model_b"))


def test_evaluation_decodes_at_least_the_centre_crops_full_size(shards, monkeypatch):
    """The evaluation images are decoded to a square no smaller than eval_res_px / eval_crop_ratio (a crop of
    an 8-px decode upsampled to 256 px would score a blur)."""
    assert imagenet.eval_decode_px(imagenet.resnet50()) == 293  # 256 / (224 / 256)
    assert imagenet.eval_decode_px(imagenet.debug()) == 32
    seen = []
    real = imagenet_loop.eval_batches

    def spy(dataset, **kw):
        seen.append(dataset.decode_px)
        return real(dataset, **kw)

    monkeypatch.setattr(imagenet_loop, "eval_batches", spy)
    cfg = imagenet_checks.with_epochs(dataclasses.replace(imagenet.debug(), eval_res_px=48, eval_crop_ratio=0.75), 0.2)
    imagenet.train_run(cfg, imagenet_checks.load_data(str(shards)), torch.device("cpu"), seed=0)
    assert seen == [64]


def test_a_saved_imagenet_model_predicts_and_eval_says_what_scores_it(shards, tmp_path, monkeypatch):
    """predict takes its images; eval refuses it in one line, before reading any data (its shards may be
    ImageNet's 150 GB)."""
    from speedrun.run.export import evaluate_saved, load

    train("imagenet-debug", str(shards), device="cpu", summary=False, save=str(tmp_path / "m"))
    model = load(tmp_path / "m", torch.device("cpu"))
    top = model.predict(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8), top=3)
    assert len(top) == 2 and all(len(t) == 3 and all(name.startswith("c") for name, _ in t) for t in top)
    def no_loading(*args, **kwargs):
        raise AssertionError("eval loaded the data before refusing the model")

    monkeypatch.setattr(imagenet, "load_data", no_loading)
    with pytest.raises(ValueError, match="speedrun eval scores data held in memory"):
        evaluate_saved(tmp_path / "m", str(shards), device="cpu")


def test_on_a_cpu_the_family_trains_contiguous_unless_asked_and_refuses_the_crashing_layout(shards):
    """torch 2.13's CPU backward crashes (SIGSEGV) on this ResNet at width 8, 224 px, in channels_last: auto is
    contiguous on a CPU here (a step at 224 px runs), and channels_last=on at width < 16 is refused in one line."""
    data = imagenet_checks.load_data(str(shards))
    cfg = imagenet_checks.with_epochs(dataclasses.replace(imagenet.debug(), min_res_px=224, max_res_px=224,
                                                          batch_size=8, eval_res_px=32), 0.025)
    run = imagenet.train_run(cfg, data, torch.device("cpu"), seed=0)
    stem = next(run.model.parameters())  # the 7x7 stem conv's weight, (8, 3, 7, 7)
    assert run.steps == 1 and stem.ndim == 4 and not stem.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="channels_last=on with width=8 crashes"):
        imagenet_checks.check(dataclasses.replace(cfg, channels_last="on"), data, torch.device("cpu"),
                              dist.World())
