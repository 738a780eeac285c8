"""`--tensorboard DIR` (run/tensorboard.py): event files that TensorBoard's own reader reads back, one run per seed
(and setting), the per-step hook an exact no-op when off and lazy when on, and one-line refusals before training."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

import speedrun
from speedrun.cli.program import main
from speedrun.engine.loop import RunHooks
from speedrun.instruments.bench import bench
from speedrun.recipes import RECIPES, cifar
from speedrun.recipes.imagenet import data as imagenet_data
from speedrun.run import runner
from speedrun.run import tensorboard as boards
from speedrun.run.prepared import RunRequest
from speedrun.tricks.schedule import triangle

DATA = "synthetic:train=64,test=16"
# 64 images at batch 16: 4 steps an epoch; width 8 keeps a step a few milliseconds on one CPU thread.
SMALL = {"batch_size": 16, "widths": (8, 8, 8), "whiten_images": 32}
TINY = ["--dataset", DATA, "--device", "cpu", "--set", "batch_size=16", "--set", "widths=8,8,8",
        "--set", "whiten_images=32"]


pytestmark = pytest.mark.usefixtures("in_tmp")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: at these widths two threads contending with a shared machine are slower, not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _read(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return events


def _scalars(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in events.Scalars(tag)}


def _hparams(events: EventAccumulator) -> dict:
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: (v.string_value if v.HasField("string_value") else v.number_value) for k, v in start.hparams.items()}


def _metrics(events: EventAccumulator) -> list[str]:
    content = events.PluginTagToContent("hparams")["_hparams_/experiment"]
    return [m.name.tag for m in plugin_data_pb2.HParamsPluginData.FromString(content).experiment.metric_infos]


def test_a_two_run_train_writes_one_run_per_seed_that_tensorboard_reads_back(tmp_path):
    result = speedrun.train("cifar10-94", DATA, device="cpu", epochs=2, runs=2, seed=5, tensorboard=tmp_path / "tb",
                            **SMALL)
    (command,) = (tmp_path / "tb").iterdir()
    assert command.name.endswith("-cifar10-94")
    assert sorted(p.name for p in command.iterdir()) == ["seed-5", "seed-6"]
    cfg = cifar.cifar10_94()
    for run in result.runs:
        events = _read(command / f"seed-{run.seed}")
        loss, lr = _scalars(events, "train/loss"), _scalars(events, "train/lr")
        assert sorted(loss) == sorted(lr) == list(range(1, 9))  # 2 epochs x 4 steps, step = steps taken
        # the lr step s was taken with: the schedule at s - 1 steps done, in lr_per_1024's units
        assert lr == pytest.approx({s: cfg.lr_per_1024 * triangle(s - 1, 8, cfg.lr_start_mult, cfg.lr_peak_frac,
                                                                  cfg.lr_end_mult) for s in range(1, 9)})
        rows = {row["step"]: row for row in run.history}
        assert sorted(rows) == [4, 8]  # the epoch row and the final one
        # the per-step loss is the mean per example, as the row's train loss of that (last) batch
        assert loss[4] == pytest.approx(rows[4]["train_loss"], rel=1e-5)
        assert loss[8] == pytest.approx(rows[8]["train_loss"], rel=1e-5)
        assert _scalars(events, "epoch/val_acc") == pytest.approx({4: rows[4]["val_acc"]})  # not the final TTA one
        assert _scalars(events, "epoch/train_loss") == pytest.approx({s: rows[s]["train_loss"] for s in (4, 8)})
        assert _scalars(events, "epoch/train_acc") == pytest.approx({s: rows[s]["train_acc"] for s in (4, 8)})
        rate = _scalars(events, "train/images_per_second")
        assert rate == pytest.approx({4: 4 * 16 / rows[4]["train_seconds"]})  # the timed seconds up to the row
        assert _scalars(events, "final/accuracy") == pytest.approx({8: run.accuracy})
        assert _scalars(events, "final/train_seconds") == pytest.approx({8: run.train_seconds})
        assert _scalars(events, "final/images_per_second") == pytest.approx({8: 8 * 16 / run.train_seconds})
        hparams = _hparams(events)
        assert hparams["recipe"] == "cifar10-94" and hparams["dataset"] == DATA and hparams["seed"] == run.seed
        assert hparams["batch_size"] == 16 and hparams["widths"] == "(8, 8, 8)" and hparams["lookahead"] == 1
        assert _metrics(events) == ["final/accuracy", "final/train_seconds", "final/images_per_second"]


def test_bench_writes_a_run_per_setting_and_seed(tmp_path):
    report = bench(RunRequest("cifar10-94", DATA, "cpu", 1, SMALL), vary=[("lookahead", ["false"])], runs=2,
                   log=lambda line: None, tensorboard=tmp_path / "tb")
    (command,) = (tmp_path / "tb").iterdir()
    assert sorted(p.name for p in command.iterdir()) == ["baseline", "lookahead=false"]
    for setting in report["settings"]:
        folder = command / setting["name"]
        assert sorted(p.name for p in folder.iterdir()) == ["seed-0", "seed-1"]  # the timed runs, no warm-up
        for run in setting["runs"]:
            events = _read(folder / f"seed-{run['seed']}")
            assert sorted(_scalars(events, "train/loss")) == [1, 2, 3, 4]
            assert _scalars(events, "final/accuracy") == pytest.approx({4: run["accuracy"]})
            hparams = _hparams(events)
            assert hparams["setting"] == setting["name"] and hparams["seed"] == run["seed"]
            assert hparams["lookahead"] == (setting["name"] == "baseline")


def test_ablate_on_the_command_line_writes_its_runs_too(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar, "TRICKS", [t for t in cifar.TRICKS if t[0] in ("lookahead", "label_smoothing")])
    argv = ["ablate", *TINY, "--epochs", "1", "--runs", "1", "--db", str(tmp_path / "r.db"),
            "--json", str(tmp_path / "a.json"), "--tensorboard", str(tmp_path / "tb")]
    assert main(argv) == 0
    (command,) = (tmp_path / "tb").iterdir()
    settings = sorted(p.name for p in command.iterdir())
    assert settings == ["baseline", "label_smoothing=0.0", "lookahead=false"]
    for name in settings:
        assert [p.name for p in (command / name).iterdir()] == ["seed-0"]
        assert sorted(_scalars(_read(command / name / "seed-0"), "train/loss")) == [1, 2, 3, 4]


def _cifar(recipe: str, tmp_path: Path):
    rec = RECIPES[recipe]
    widths = (8, 8, 8) if recipe == "cifar10-94" else (8, 8, 16, 16)
    cfg = runner.make_config(rec, 2, {**SMALL, "widths": widths})
    return rec.module(), cfg, rec.module().load_data(DATA, data_dir=None, image_size=None, log=lambda line: None)


def _imagenet(recipe: str, tmp_path: Path):
    rec = RECIPES[recipe]
    (tmp_path / "shards").mkdir()
    shards = imagenet_data.write_synthetic_shards(tmp_path / "shards", 128, 32)
    cfg = dataclasses.replace(rec.make_config(), workers=1, epochs=1.0)
    return rec.module(), cfg, rec.module().load_data(str(shards), data_dir=None, image_size=None,
                                                     log=lambda line: None)


@pytest.mark.parametrize("recipe, make", [("cifar10-94", _cifar), ("cifar10-resnet18", _cifar),
                                          ("imagenet-debug", _imagenet)])
def test_the_per_step_hook_changes_nothing_and_gets_every_steps_detached_loss(recipe, make, tmp_path):
    family, cfg, data = make(recipe, tmp_path)
    device = torch.device("cpu")
    plain = family.train_run(cfg, data, device, seed=3)
    seen = []
    hooked = family.train_run(cfg, data, device, seed=3, hooks=RunHooks(on_scalars=lambda *a: seen.append(a)))
    assert hooked.accuracy == plain.accuracy
    assert [{k: v for k, v in row.items() if k != "train_seconds"} for row in hooked.history] == \
        [{k: v for k, v in row.items() if k != "train_seconds"} for row in plain.history]
    for (name, a), b in zip(plain.model.state_dict().items(), hooked.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert [step for step, *_ in seen] == list(range(1, plain.steps + 1))
    for step, loss, scale, lr in seen:
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and not loss.requires_grad
        assert scale > 0 and isinstance(lr, float)
    last = {row["step"]: row for row in plain.history}[plain.steps]
    _, loss, scale, _ = seen[-1]
    assert loss.item() * scale == pytest.approx(last["train_loss"], rel=1e-5)


def test_the_log_reads_a_steps_loss_only_at_the_next_row(tmp_path):
    """The hook keeps the tensor, not its value: a value read at once would cost a device sync every step."""
    board = boards.open_board(tmp_path / "tb", "cifar10-94")
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=16, epochs=2.0)
    with boards.run_log(board, cfg, seed=0, dataset=DATA, steps=8) as log:
        loss = torch.tensor(1.0)
        log.scalars(1, loss, 0.5, 0.1)
        loss.fill_(3.0)  # changed after the hook: the row must see this value
        log.row({"step": 2, "train_seconds": 0.5, "train_loss": 1.5, "train_acc": 0.25, "val_acc": None})
    events = _read(board.folder / "seed-0")
    assert _scalars(events, "train/loss") == {1: 1.5}
    assert _scalars(events, "train/images_per_second") == pytest.approx({2: 2 * 16 / 0.5})
    assert "epoch/val_acc" not in events.Tags()["scalars"]  # the row had none


def test_a_failing_write_is_a_warning_and_the_run_goes_on(tmp_path):
    board = boards.open_board(tmp_path / "tb", "cifar10-94")
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=16, epochs=2.0)
    with boards.run_log(board, cfg, seed=0, dataset=DATA, steps=8) as log:
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        log._writer.add_scalar = full
        log.scalars(1, torch.tensor(1.0), 1.0, 0.1)
        with pytest.warns(UserWarning, match="stopped writing .*No space left on device.*the run goes on"):
            log.row({"step": 1, "train_seconds": 0.5, "train_loss": 1.0, "train_acc": 0.0, "val_acc": None})
        log.row({"step": 2, "train_seconds": 1.0, "train_loss": 1.0, "train_acc": 0.0, "val_acc": None})


def test_a_log_that_cannot_start_or_finish_is_a_warning_and_the_runs_error_still_shows(tmp_path, monkeypatch):
    board = boards.open_board(tmp_path / "tb", "cifar10-94")
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=16)
    real = boards.writer_module()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(boards, "writer_module", lambda: SimpleNamespace(SummaryWriter=refused, summary=real.summary))
    with pytest.warns(UserWarning, match="cannot write .*Permission denied.*goes on without it"):
        with boards.run_log(board, cfg, seed=0, dataset=DATA, steps=8) as log:
            log.scalars(1, torch.tensor(1.0), 1.0, 0.1)
            log.row({"step": 1, "train_seconds": 0.5, "train_loss": 1.0, "train_acc": 0.0, "val_acc": None})
    monkeypatch.setattr(boards, "writer_module", lambda: real)

    class Broken(torch.Tensor):  # a device error met while reading the kept losses on the way out
        def double(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="illegal memory access"):
        with boards.run_log(board, cfg, seed=1, dataset=DATA, steps=8) as log:
            log.scalars(1, torch.tensor(1.0).as_subclass(Broken), 1.0, 0.1)
            raise KeyboardInterrupt


def test_each_command_gets_a_new_folder_and_an_existing_one_is_never_written(tmp_path, monkeypatch):
    class Fixed(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)

    monkeypatch.setattr(boards, "datetime", Fixed)
    earlier = tmp_path / "tb" / "20260102-030405-cifar10-94"
    earlier.mkdir(parents=True)
    (earlier / "kept").write_text("an earlier command's")
    first = boards.open_board(tmp_path / "tb", "cifar10-94")
    second = boards.open_board(tmp_path / "tb", "cifar10-94")
    assert [first.folder.name, second.folder.name] == ["20260102-030405-cifar10-94-2", "20260102-030405-cifar10-94-3"]
    assert (earlier / "kept").read_text() == "an earlier command's" and os.listdir(earlier) == ["kept"]
    second.close()  # no run written: the folder goes
    assert not second.folder.exists() and first.folder.exists()


@pytest.mark.parametrize("name, folder", [("lookahead=false", "lookahead=false"), ("plain (all off)", "plain_all_off"),
                                          ("+ label_smoothing", "+_label_smoothing"), ("k=../../x", "k=.._.._x"),
                                          ("..", "setting"), ("a/b", "a_b"), ("x" * 300, "x" * 100)])
def test_setting_names_become_one_safe_folder_name(name, folder):
    assert boards.folder_name(name, "setting") == folder


def test_two_settings_with_one_folder_name_get_two_folders(tmp_path):
    board = boards.open_board(tmp_path / "tb", "cifar10-94")
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=16)
    for setting in ("k=a/b", "k=a b", "k=a/b"):
        with boards.run_log(board, cfg, seed=0, dataset=DATA, steps=8, setting=setting):
            pass
    assert sorted(p.name for p in board.folder.iterdir()) == ["k=a_b", "k=a_b-2"]


def _refusals(tmp_path: Path) -> list[tuple[str, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [(str(a_file), "a-file is a file, not a folder"), (str(a_file / "sub"), "a-file is a file, not a folder"),
            ("", "is empty"), ("   ", "is empty"), ("tb\0x", "holds a NUL character"),
            ("/proc/speedrun-tb", "cannot create the TensorBoard folder"),
            ("/proc", "cannot create a folder in the TensorBoard folder /proc")]


@pytest.mark.parametrize("command", ["train", "bench", "ablate"])
def test_a_folder_that_cannot_take_the_files_is_refused_in_one_line_before_any_run(command, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setattr(cifar, "train_run", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr(cifar, "load_data", lambda *a, **k: pytest.fail("data was read"))
    extra = ["--vary", "lookahead=false"] if command == "bench" else []
    for directory, fragment in _refusals(tmp_path):
        code = main([command, *TINY, *extra, "--tensorboard", directory, "--json", str(tmp_path / "r.json")])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and "--tensorboard" in err, (directory, err)
        assert err.count("\n") == 1 and err.startswith("speedrun: error: ")
        assert not (tmp_path / "r.json").exists()  # the claimed result file released


def test_the_python_api_refuses_what_is_no_folder_path(tmp_path):
    for bad in (3, ["tb"], b"tb"):
        with pytest.raises(ValueError, match="tensorboard=.* is not a folder path"):
            speedrun.train("cifar10-94", DATA, device="cpu", tensorboard=bad, **SMALL)
    with pytest.raises(ValueError, match="not a folder path"):
        bench(RunRequest("cifar10-94", DATA, "cpu"), vary=[("lookahead", ["false"])], tensorboard=3)


def test_to_target_refuses_tensorboard_in_one_line(tmp_path, capsys):
    assert main(["ablate", *TINY, "--to-target", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "--to-target" in err and err.count("\n") == 1 and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("command", ["train", "bench"])
def test_without_the_package_the_refusal_names_the_install(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import now fails, as when not installed
    monkeypatch.setattr(cifar, "train_run", lambda *a, **k: pytest.fail("a run started"))
    extra = ["--vary", "lookahead=false"] if command == "bench" else []
    code = main([command, *TINY, *extra, "--tensorboard", str(tmp_path / "tb"), "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'speedrun[tensorboard]'" in err and err.count("\n") == 1
    assert not (tmp_path / "tb").exists()


def test_speedrun_imports_no_tensorboard_until_asked():
    code = ("import sys, speedrun, speedrun.run.runner, speedrun.cli.train_commands, speedrun.run.tensorboard; "
            "assert not [m for m in sys.modules if m.startswith('tensorboard') or m == 'torch.utils.tensorboard']")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
