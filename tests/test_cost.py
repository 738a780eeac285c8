"""cost.py: the price of a device-hour, and what a result says a run cost."""

import json

import pytest

from speedrun.records import cost as cost
from speedrun.cli.program import main

SMALL = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
         "--set", "widths=8,16,16", "--set", "whiten_images=64", "--quiet"]


def test_prices_come_from_the_flag_then_the_table_else_none(monkeypatch):
    monkeypatch.delenv("SPEEDRUN_PRICES", raising=False)
    assert cost.price_for("NVIDIA H100 80GB HBM3").per_hour == 2.49
    assert cost.price_for("NVIDIA A100-SXM4-80GB").per_hour == 1.99
    assert cost.price_for("AMD EPYC 7B13") is None  # no entry: no cost, never a guess
    assert cost.price_for("NVIDIA H100 80GB HBM3", 4.0) == cost.Price(4.0, "--price-per-hour")
    assert cost.dollars(3600, cost.Price(2.0, "x"), devices=8) == pytest.approx(16.0)
    assert cost.dollars(None, cost.Price(2.0, "x")) is None and cost.dollars(10, None) is None


def test_an_edited_table_replaces_the_default(tmp_path, monkeypatch):
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"EPYC": 0.05}))
    monkeypatch.setenv("SPEEDRUN_PRICES", str(table))
    assert cost.price_for("AMD EPYC 7B13").per_hour == 0.05
    assert cost.price_for("NVIDIA H100") is None
    table.write_text('{"H100": -3}')
    with pytest.raises(ValueError, match="H100"):
        cost.price_for("NVIDIA H100")


@pytest.mark.parametrize("value", ["nan", "-1", "1e9", "inf"])
def test_a_bad_price_is_one_line_before_any_run(value, tmp_path, capsys):
    assert main(["train", *SMALL, "--price-per-hour", value, "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dollars per device-hour" in err
    assert not (tmp_path / "r.json").exists()


def test_the_result_carries_its_cost(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_PRICES", raising=False)
    out = tmp_path / "r.json"
    assert main(["train", *SMALL, "--runs", "2", "--price-per-hour", "3.6", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    c, mean_s = result["cost"], result["train_seconds"]["mean"]
    assert c["price_per_hour"] == 3.6 and c["devices"] == 1 and c["price_source"] == "--price-per-hour"
    assert c["timed_usd_per_run"] == pytest.approx(mean_s * 3.6 / 3600)
    assert c["wall_usd"] == pytest.approx(result["wall_seconds"] * 3.6 / 3600)
    assert result["wall_seconds"] > sum(r["train_seconds"] for r in result["runs"])
    assert main(["train", *SMALL, "--json", str(tmp_path / "cpu.json")]) == 0
    assert json.loads((tmp_path / "cpu.json").read_text())["cost"] is None  # no price for this CPU
