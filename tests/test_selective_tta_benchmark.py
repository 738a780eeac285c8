"""benchmarks/selective_tta.py: full TTA, selective TTA and no TTA scored side by side on saved models; the table
that benchmarks/table.py renders from its report."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from conftest import load_benchmark, save_tiny_cifar_models

from speedrun.recipes import cifar
from speedrun.run import export

DATA = "synthetic:train=256,test=64"
CFG = dataclasses.replace(cifar.cifar10_94(), widths=(8, 8, 8), batch_size=64, epochs=0.5, whiten_images=64,
                          eval_each_epoch=False)


def test_the_settings_are_scored_side_by_side(tmp_path, monkeypatch, capsys):
    paths, data = save_tiny_cifar_models(tmp_path, CFG, DATA, range(2))
    stems = [str(p) for p in paths]
    bench = load_benchmark("selective_tta")
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["selective_tta.py", "--models", *stems, "--dataset", DATA, "--device", "cpu",
                                      "--fractions", "0.25,0.5", "--repeats", "2", "--json", str(out)])
    assert bench.main() == 0
    report = json.loads(out.read_text())
    rows = {r["setting"]: r for r in report["rows"]}
    assert list(rows) == ["full TTA", "selective 0.25", "selective 0.5", "no TTA"]
    # full TTA's accuracies are the saved models' own (speedrun eval's TTA); each row has one per model
    for stem, acc in zip(stems, rows["full TTA"]["accuracies"]):
        model = export.load(stem)
        with torch.no_grad():
            logits = model(data.test_images)
        assert acc == pytest.approx(float((logits.argmax(1) == data.test_labels).float().mean()))
    assert all(len(r["accuracies"]) == 2 and len(r["all_seconds"]) == 4 for r in rows.values())
    diff = rows["selective 0.5"]["accuracy_diff"]
    by_hand = [a - f for a, f in zip(rows["selective 0.5"]["accuracies"], rows["full TTA"]["accuracies"])]
    assert diff["mean"] == pytest.approx(sum(by_hand) / 2)
    assert rows["full TTA"]["time_ratio"] is None and len(rows["no TTA"]["time_ratio"]) == 3
    table = bench.markdown(report)
    assert "| full TTA |" in table and "1 (reference)" in table and "| selective 0.25 |" in table


def test_bad_fractions_and_too_few_models_are_refused(monkeypatch, capsys):
    bench = load_benchmark("selective_tta")
    for argv in (["--models", "a", "b", "--dataset", "x", "--fractions", "0,0.5"],
                 ["--models", "a", "b", "--dataset", "x", "--fractions", "half"],
                 ["--models", "a", "--dataset", "x"]):
        monkeypatch.setattr(sys, "argv", ["selective_tta.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()[-1]) > 0
