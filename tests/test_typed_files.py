"""The one typed loader (records/typed_files.py): its refusals are one line in the project's words, a bool is no
number, and what a hostile file can make it do is bounded (one error for a million bad items or keys)."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from speedrun.recipes import cifar
from speedrun.records import typed_files
from speedrun.records.result_file import check_sweep_report, check_train_result, runs_summary
from speedrun.run import model_files
from speedrun.run.resume import _check_loop_state, _check_run

RUN = {"seed": 0, "accuracy": 0.5, "train_seconds": 2.0, "epochs": 1.0, "steps": 4, "diverged": None, "history": []}
ROW = {"epoch": 1.0, "step": 4, "train_loss": 0.5, "train_acc": 0.5, "val_acc": None, "train_seconds": 1.0}
TRIAL = {"number": 0, "state": "COMPLETE", "params": {}, "n": 3, "mean": 0.5, "value": 0.5, "p": 0.1,
         "ci95": [0.4, 0.6]}


def _card(**changes) -> dict:
    cfg = dataclasses.asdict(dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8)))
    return {"format": "speedrun-model", "version": 1, "recipe": "cifar10-94", "family": "cifar", "config": cfg,
            "classes": ["a", "b"], "image_shape": [3, 32, 32], "mean": [0.5] * 3, "std": [0.25] * 3,
            "tta_level": 0, "dataset": "tiny", "weights_sha256": "0" * 64, **changes}


def _error_count(typed: typed_files.Typed, data, context=None) -> int:
    with pytest.raises(ValidationError) as e:
        typed.adapter.validate_python(data, strict=True, context=context)
    return e.value.error_count()


def test_a_million_bad_items_or_keys_are_one_error():
    bad_runs = {"runs": [{"seed": True, "accuracy": 0.5, "train_seconds": 1.0}] * 1_000_000}
    assert _error_count(typed_files.TRAIN_RESULT, bad_runs) == 1
    with pytest.raises(ValueError, match=r"^run 1 has seed=True, not an integer$"):
        check_train_result(bad_runs)
    assert _error_count(typed_files.SWEEP_REPORT, {"objective": "time", "trials": [{"state": "x"}] * 1_000_000}) == 1
    rows = {**RUN, "history": [{**ROW, "epoch": -1}] * 1_000_000}
    assert _error_count(typed_files.RUN_RECORD, rows, {"seed": 0, "steps": 4}) == 1
    keys = {**RUN, **{f"k{i}": i for i in range(100_000)}}
    assert _error_count(typed_files.RUN_RECORD, keys, {"seed": 0, "steps": 4}) == 1
    with pytest.raises(TypeError, match=r"^not a run record's fields \('k0'\)$"):
        _check_run(keys, 0)
    assert _error_count(model_files.CARD, _card(classes=[1] * 100_000)) == 1


def test_a_card_counts_its_classes_before_it_reads_a_name():
    for classes, why in ((["\x07"], "classes must be a list of 2 to 100,000 names, got ['\\x07']"),
                         ([1] * 100_001, "classes must be a list of 2 to 100,000 names"),
                         (["a", 5] + ["b"] * 10, "class 1 is 5: names are printable")):
        with pytest.raises(model_files.Unusable) as e:
            model_files.parse_card(_card(classes=classes))
        assert str(e.value).startswith(why), str(e.value)


@pytest.mark.parametrize("check, data, why", [
    (check_train_result, {"runs": [{**RUN, "accuracy": True}]}, "run 1 has accuracy=True, not a number in [0, 1]"),
    (check_train_result, {"runs": [{**RUN, "steps": 4.0}]}, "run 1 has steps=4.0, not an integer"),
    (check_sweep_report, {"objective": "accuracy", "trials": [{**TRIAL, "n": False}]},
     "sweep report field 'trials[0].n' is False, not a count of runs"),
    (model_files.parse_card, _card(version=True), "card version True; speedrun"),
    (model_files.parse_card, _card(tta_level=1.0), "tta_level must be 0, 1 or 2, got 1.0"),
    (model_files.parse_card, _card(image_shape=[3, 32, True]), "image_shape must be [C, H, W]"),
    (lambda run: _check_run(run, 0), {**RUN, "seed": False}, "seed=False, not 0"),
])
def test_a_bool_is_no_number_and_a_float_no_integer(check, data, why):
    with pytest.raises((ValueError, TypeError, model_files.Unusable)) as e:
        check(data)
    assert str(e.value).startswith(why), str(e.value)


def test_numbers_past_the_float_range_are_refused_where_a_number_is_due():
    with pytest.raises(ValueError, match=r"^sweep report field 'best.mean' is 1000.*, not a number in \[0, 3.2e\+08\]"):
        check_sweep_report({"objective": "time", "trials": [], "best": {**TRIAL, "mean": 10**400}})
    with pytest.raises(TypeError, match=r"^history row 1: train_seconds=1000.* out of range$"):
        _check_loop_state({"step": 4, "seconds": 1.0, "epochs_done": 1, "history": [{**ROW, "train_seconds": 10**400}]},
                          4)


def test_a_refusal_quoting_a_lone_surrogate_comes_back_whole():
    card = _card(config={**_card()["config"], "epochs": "a\udc80"})
    with pytest.raises(model_files.Unusable) as e:
        model_files.parse_card(card)
    assert str(e.value) == "config: epochs=a\udc80: expected float"


@pytest.mark.parametrize("stated, config, hit_rate", [
    (0.6, {"target_accuracy": 0.4}, 0.5),  # its own target first
    ("0.6", {"target_accuracy": 0.4}, 1.0),  # no number: the config's
    (True, {"target_accuracy": 10**400}, None),  # neither is a number
    (None, [], None),
])
def test_the_summary_reads_a_target_where_it_is_a_number(stated, config, hit_rate):
    result = {"runs": [{**RUN, "accuracy": 0.5}, {**RUN, "accuracy": 0.7}, {"diverged": {}}],
              "target_accuracy": stated, "config": config}
    summary = runs_summary(result)
    assert (summary["n"], summary["mean_accuracy"], summary["hit_rate"]) == (2, pytest.approx(0.6), hit_rate)


@pytest.mark.parametrize("field, value", [
    ("train_loss", "tensor([0.5])"), ("train_acc", "tensor(True)"), ("epoch", "tensor([[2.]])"),
    ("train_seconds", "numpy.float32(1.0)"), ("step", "numpy.int64(4)"), ("train_loss", "Decimal('0.5')")])
def test_only_json_numbers_are_numbers_not_tensors_or_numpy_scalars(field, value):
    """A checkpoint's training state holds tensors beside its numbers; strict pydantic alone would take any object
    with __float__ or __index__ as a number, and the row would become the resumed run's history."""
    import decimal

    import numpy
    import torch

    row = {**ROW, field: eval(value, {"tensor": torch.tensor, "numpy": numpy, "Decimal": decimal.Decimal})}
    with pytest.raises(TypeError, match=field):
        _check_loop_state({"step": 4, "seconds": 1.0, "epochs_done": 1, "history": [row]}, 4)


def test_a_list_longer_than_any_command_makes_is_refused_for_its_length():
    rows = {"step": 4, "seconds": 1.0, "epochs_done": 1, "history": [ROW] * (typed_files.MAX_HISTORY_ROWS + 1)}
    with pytest.raises(TypeError, match="history holds 20,003 rows, more than a run makes"):
        _check_loop_state(rows, 4)
    with pytest.raises(ValueError, match="'runs' holds 10,001 runs, more than one command trains"):
        check_train_result({"runs": [RUN] * (typed_files.MAX_RUNS + 1)})
