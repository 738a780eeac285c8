"""Red team, records round 4: a settings file's "measured" carried into results unbounded, a stored result's summary
trusted over its runs, the records rule blind to diverged runs, and lr settings whose derived optimizer values leave
float32."""

import copy
import dataclasses
import json

import pytest
import test_db
import torch

from speedrun.engine.loop import RunResult
from speedrun.recipes.cifar.config import CifarConfig, cifar10_94_muon
from speedrun.records import db
from speedrun.records.result_file import write_json
from speedrun.records.settings_file import overrides_from, read_settings
from speedrun.run.session import Result
from speedrun.tricks.decoupled_sgd import decoupled_sgd


def settings_file(tmp_path, measured_text: str, **fields) -> str:
    obj = {"speedrun_settings": 1, "recipe": "cifar10-94", "device": "cpu", "settings": {"lr_per_1024": "10"},
           "written_by": "sweep", **fields}
    text = json.dumps(obj)[:-1] + f', "measured": {measured_text}}}'
    path = tmp_path / "s.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("measured", ['{"a":' * 900 + "1" + "}" * 900, '{"a": ' + "[" * 50 + "]" * 50 + "}",
                                      '{"a": {"b": {"c": {"d": {"e": 1}}}}}', "[1, 2]", '"text"', "7",
                                      '{"a": NaN}', '{"a": Infinity}', '{"a": ' + "9" * 30 + "}"])
def test_a_settings_file_whose_measured_is_not_what_tune_or_sweep_writes_is_refused_on_reading(tmp_path, measured):
    path = settings_file(tmp_path, measured)
    with pytest.raises(ValueError, match=r"^settings file .*s\.json: measured .*; write it with") as e:
        read_settings(path)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="measured"):
        overrides_from(path, "cifar10-94", "cpu")


@pytest.mark.parametrize("device_name", [["a"], {"a": 1}, 3, "x" * 201])
def test_a_settings_file_device_name_that_is_not_a_short_name_is_refused(tmp_path, device_name):
    with pytest.raises(ValueError, match="device_name must be null or a name"):
        read_settings(settings_file(tmp_path, "null", device_name=device_name))


def test_what_tune_and_sweep_write_as_measured_is_read_and_carried_into_a_writable_result(tmp_path):
    tune = {"command": "speedrun tune x", "report": "r.json", "stored_as": 3, "utc": "2026-01-01T00:00:00+00:00",
            "against": {"set": {"batch_size": "64"}, "epochs": 0.5}}
    sweep = {"command": "speedrun sweep", "ci95": [0.9, 0.95], "mean": 0.93, "n": 3, "p": None, "trial": 2}
    for measured in (tune, sweep, None):
        path = settings_file(tmp_path, json.dumps(measured), device_name="cpu0")
        _, carried = overrides_from(path, "cifar10-94", "cpu")
        assert carried["measured"] == measured
        write_json(tmp_path / "result.json", {"settings": carried})  # the result that carries it is written


def one_run_claiming_fifty() -> dict:
    result = copy.deepcopy(test_db.make_result(1))
    result["runs"] = [{**result["runs"][0], "accuracy": 0.5}]
    result.update(n=50, mean_accuracy=0.99, std_accuracy=0.001, hit_rate=1.0,
                  train_seconds={**result["train_seconds"], "mean": 0.001, "std": 0.0},
                  target=0.94)  # on the recipe's own data set: hits count (db.identity)
    return result


@pytest.mark.parametrize("change", [
    lambda r: r,
    lambda r: r.update(n=1, mean_accuracy=0.5, std_accuracy=None, hit_rate=None) or r,
    lambda r: r.update(runs=r["runs"] * 3, n=9, std_accuracy=0.5) or r])
def test_a_stored_row_takes_n_mean_std_hit_rate_and_seconds_from_the_runs_not_the_summary(tmp_path, change):
    conn = db.connect(tmp_path / "r.db")
    result = change(one_run_claiming_fifty())
    stored = db.insert_result(conn, result)
    n = len(result["runs"])
    row = conn.execute("SELECT n, mean_accuracy, std_accuracy, hit_rate, mean_seconds, std_seconds FROM results "
                       "WHERE id = ?", (stored,)).fetchone()
    seconds = result["runs"][0]["train_seconds"]
    assert row == (n, 0.5, None if n == 1 else 0.0, 0.0, seconds, None if n == 1 else 0.0)
    board = db.query(conn)[0]
    assert board["n"] == n and board["mean_accuracy"] == 0.5


def test_a_stored_row_of_mixed_runs_counts_only_the_finished_and_hits_against_the_target(tmp_path):
    result = copy.deepcopy(test_db.make_result(2, target=0.94))  # the recipe's own data set
    run = result["runs"][0]
    result["runs"] = [{**run, "accuracy": 0.95}, {**run, "accuracy": 0.93},
                      {**run, "accuracy": None, "train_seconds": None, "diverged": {"step": 3}}]
    conn = db.connect(tmp_path / "r.db")
    stored = db.insert_result(conn, result)
    n, mean, std, hits = conn.execute("SELECT n, mean_accuracy, std_accuracy, hit_rate FROM results WHERE id = ?",
                                      (stored,)).fetchone()
    assert (n, hits) == (2, 0.5) and mean == pytest.approx(0.94) and std == pytest.approx(0.02 / 2 ** 0.5)


def result_of(accuracies: list) -> Result:
    runs = [RunResult(seed=k, accuracy=a, train_seconds=None if a is None else 2.0, epochs=1.0, steps=10,
                      diverged=None if a is not None else {"step": 3}) for k, a in enumerate(accuracies)]
    return Result(recipe="cifar10-94", dataset="cifar10", device="cpu", config={"target_accuracy": 0.94},
                  runs=runs, environment={}, runs_requested=len(runs), complete=True)


@pytest.mark.parametrize("accuracies", [[0.95, 0.951, 0.952] + [None] * 7, [0.96, None, 0.96, 0.961],
                                        [0.95, 0.951, 0.952, 0.953, None]])
def test_the_records_rule_counts_a_diverged_run_as_accuracy_zero(accuracies):
    result = result_of(accuracies)
    record = result.to_dict()["record"]
    assert record["n"] == len(accuracies) and record["diverged"] == accuracies.count(None)
    assert record["reached"] is False and record["p"] > 0.01
    assert "diverged run as 0" in record["test"]
    finished = [a for a in accuracies if a is not None]
    assert result.to_dict()["n"] == len(finished)  # the statistics shown stay the finished runs'
    assert result_of(finished).record()["reached"] is True  # without the diverged runs it would reach


def test_the_records_rule_without_a_diverged_run_is_unchanged():
    record = result_of([0.95, 0.951, 0.952]).record()
    assert record["reached"] is True and record["n"] == 3 and record["diverged"] == 0
    assert result_of([None, None]).record() is None


@pytest.mark.parametrize("changes", [{"lr_per_1024": 1e-300}, {"lr_per_1024": 1e-320}, {"lr_per_1024": 0.0},
                                     {"lr_per_1024": -1.0}, {"bias_lr_mult": 1e-300}, {"muon_bias_lr": 1e-300},
                                     {"muon_head_lr": 1e-320}, {"muon_lr": 1e-300}])
def test_an_lr_setting_whose_optimizer_values_leave_float32_is_refused_naming_it(changes):
    key = next(iter(changes))
    for cfg in (CifarConfig(), cifar10_94_muon()):
        with pytest.raises(ValueError, match=rf"^bad config: {key}=\S+ must be in \[1e-06, 10000\]"):
            dataclasses.replace(cfg, **changes).validate()


@pytest.mark.parametrize("changes", [{}, {"lr_per_1024": 1e-6, "bias_lr_mult": 1e-6, "momentum": 1 - 2 ** -53},
                                     {"muon_lr": 0.0}, {"lr_per_1024": 1e4, "bias_lr_mult": 1e4}])
def test_lr_settings_at_the_ends_of_the_range_build_an_optimizer_that_steps(changes):
    cfg = dataclasses.replace(CifarConfig(), **changes)
    cfg.validate()
    assert all(abs(v) < 3.4e38 for v in cfg.optimizer_values().values())
    weight = torch.nn.Parameter(torch.ones(3))
    opt = decoupled_sgd([{"params": [weight], "lr_mult": cfg.bias_lr_mult}], lr_per_1024=cfg.lr_per_1024,
                        weight_decay_per_1024=cfg.weight_decay_per_1024, momentum=cfg.momentum,
                        batch_size=cfg.batch_size)
    weight.sum().backward()
    opt.step()
    assert torch.isfinite(weight).all()


@pytest.mark.parametrize("lr, mult", [(1e-300, 1.0), (1e-320, 1.0), (0.0, 1.0), (11.5, 1e-320)])
def test_decoupled_sgd_refuses_an_lr_whose_weight_decay_over_lr_leaves_float32(lr, mult):
    with pytest.raises(ValueError, match="too small for float32 weight decay over lr"):
        decoupled_sgd([{"params": [torch.nn.Parameter(torch.ones(2))], "lr_mult": mult}], lr_per_1024=lr,
                      weight_decay_per_1024=0.0153, momentum=0.85, batch_size=64)
