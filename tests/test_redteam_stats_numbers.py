"""The statistics at the ends of the floating-point range, intervals kept within their quantity's range, and signed
numbers that round to zero.

- Every statistic of stats.py takes any finite values, 1e-300 to 1e300 and mixed: it returns finite numbers in
  order (low <= estimate <= high) or takes its n/a path (ValueError), never another exception; `compare` of runs
  whose timed seconds are 1e-300 (a legal value) prints its table.
- The interval of the mean of seconds (>= 0) or of an accuracy ([0, 1]) stays within that range, at n = 2 too,
  wherever it is made: summarize, the train summary, bench's JSON, compare.
- "-0.00" is never printed for a difference that rounds to zero.
"""

import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_db import make_result

from speedrun.cli.program import main
from speedrun.engine.loop import RunResult
from speedrun.instruments import compare as comparing
from speedrun.instruments.bench import _stats
from speedrun.records.stats import (FRACTION, NON_NEGATIVE, diff_ci95, interval_text, mean_diff_test, ratio_ci95,
                                    signed_text, summarize, welch_df, welch_t_test)
from speedrun.run.display import Display

# Log-uniform magnitudes 1e-300 .. 1e300, and the plain floats of that range (mostly near its top).
MAGNITUDE = st.one_of(st.floats(min_value=-300, max_value=300).map(lambda e: 10.0**e),
                      st.floats(min_value=1e-300, max_value=1e300))
SIGNED = st.one_of(MAGNITUDE, MAGNITUDE.map(lambda x: -x), st.just(0.0))
POSITIVE_SAMPLE = st.lists(MAGNITUDE, min_size=2, max_size=8)
SIGNED_SAMPLE = st.lists(SIGNED, min_size=2, max_size=8)


def _ordered(low, value, high):
    assert all(math.isfinite(x) for x in (low, value, high)), (low, value, high)
    assert low <= value <= high, (low, value, high)


def _every_statistic(a, b):
    """Each statistic of a against b: its numbers in order, or its n/a path (ValueError) and nothing else."""
    for bounds in (None, NON_NEGATIVE):
        s = summarize(a, bounds if min(a) >= 0 else None)
        if s.ci95_low is not None:
            _ordered(s.ci95_low, s.mean, s.ci95_high)
        assert math.isfinite(s.mean) and math.isfinite(s.std) and s.std >= 0
    df = welch_df(a, b)
    assert df is None or min(len(a), len(b)) - 1 - 1e-9 <= df <= len(a) + len(b) - 2 + 1e-9
    try:
        t, p = welch_t_test(a, b)
        assert not math.isnan(t) and 0.0 <= p <= 1.0
    except ValueError:
        pass
    for interval in (diff_ci95, ratio_ci95):
        try:
            _ordered(*(lambda v, lo, hi: (lo, v, hi))(*interval(a, b)))
        except ValueError as e:
            assert "\n" not in str(e)
    try:
        row = mean_diff_test(a, b)
        assert json.loads(json.dumps(row, allow_nan=False)) == row
        assert row["ratio_ci95"][0] > 0
    except ValueError:
        pass


@settings(max_examples=400, deadline=None)
@given(POSITIVE_SAMPLE, POSITIVE_SAMPLE)
def test_positive_samples_of_any_magnitude_give_numbers_or_n_a(a, b):
    _every_statistic(a, b)


@settings(max_examples=300, deadline=None)
@given(SIGNED_SAMPLE, SIGNED_SAMPLE)
def test_signed_samples_of_any_magnitude_give_numbers_or_n_a(a, b):
    _every_statistic(a, b)


@pytest.mark.parametrize("a, b", [([1e-300, 1e-300], [1e-300, 2e-300]), ([1e-300, 3e-300], [2e-300, 5e-300]),
                                  ([1e300, 3e300], [2e300, 5e300]), ([1e300, 1e300], [1e300, 1e300]),
                                  ([1e-300, 3e-300, 2e-300], [1e300, 2e300])])
def test_the_tiny_and_the_huge_keep_their_ratio(a, b):
    """Relative spreads (std / mean) are taken without squaring a mean: 1e-300 ** 2 is 0, 1e300 ** 2 inf."""
    try:
        r, low, high = ratio_ci95(a, b)
    except ValueError as e:  # 1e-300 / 1e300 is below every float: n/a
        assert "out of floating-point range" in str(e) and sum(a) / sum(b) < 1e-300
        return
    expected = (sum(a) / len(a)) / (sum(b) / len(b))
    assert r == pytest.approx(expected, rel=1e-12) and 0 < low <= r <= high < math.inf
    assert summarize(a).std == pytest.approx(summarize([x / a[0] for x in a]).std * a[0], rel=1e-12)


def test_compare_of_runs_of_a_tiny_time_prints_its_table(tmp_path, capsys):
    """The issue: train_seconds 1e-300 made `compare` an internal error (ZeroDivisionError)."""
    paths = []
    for i, seconds in enumerate(([1e-300, 2e-300, 1e-300], [3e-300, 1e-300, 2e-300])):
        result = make_result(i)
        result["runs"] = [{**result["runs"][0], "train_seconds": s} for s in seconds]
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(result))
    assert main(["compare", *map(str, paths), "--db", str(tmp_path / "r.db")]) == 0
    out = capsys.readouterr().out
    assert "timed s" in out and "Traceback" not in out
    report = comparing.compare(*(json.loads(p.read_text()) for p in paths))
    test = report["metrics"]["train_seconds"]["test"]
    assert test["ratio"] == pytest.approx(1.5) and 0 < test["ratio_ci95"][0] <= 1.5 <= test["ratio_ci95"][1]


WIDE = [([0.0, 0.1562], FRACTION), ([0.9, 0.1], FRACTION), ([0.999, 0.2], FRACTION), ([0.1, 18.6], NON_NEGATIVE),
        ([9.36 - 5, 9.36 + 5], NON_NEGATIVE), ([0.0, 0.0, 7.0], NON_NEGATIVE)]


@pytest.mark.parametrize("values, bounds", WIDE)
def test_an_interval_of_a_bounded_quantity_stays_in_its_range(values, bounds):
    plain, clipped = summarize(values), summarize(values, bounds)
    assert plain.ci95_low < bounds[0] or plain.ci95_high > bounds[1]  # the t-interval reaches outside
    assert bounds[0] <= clipped.ci95_low <= clipped.mean <= clipped.ci95_high <= bounds[1]
    assert clipped.ci95_low == max(plain.ci95_low, bounds[0]) and clipped.ci95_high == min(plain.ci95_high, bounds[1])
    assert (clipped.mean, clipped.std) == (plain.mean, plain.std)


def test_a_value_outside_the_range_widens_it_rather_than_failing():
    s = summarize([-1.0, 3.0], NON_NEGATIVE)  # a file from elsewhere: the interval still holds the mean
    assert s.ci95_low <= s.mean <= s.ci95_high and s.ci95_low >= -1.0


def test_the_train_summary_bench_and_compare_show_no_interval_below_zero(capsys):
    runs = [SimpleNamespace(train_seconds=s) for s in (4.36, 14.36)]
    result = SimpleNamespace(recipe="cifar10-94", dataset="d", device="cpu", finished=runs, runs=runs,
                             accuracies=[0.0, 0.1562], smoke_test=False, target_accuracy=0.94, diverged_runs=0,
                             interrupted=False, runs_requested=2, timed_region="the training steps",
                             data_seconds=0.1, warmup_seconds=0.2)
    Display(verbose=False, summary=True).summary(result)
    out = capsys.readouterr().out
    assert "-" not in "".join(line.replace("─", "") for line in out.splitlines() if "acc" in line or "timed" in line)
    assert "0.00 .. " in out  # the accuracy's interval starts at 0

    stats = _stats([RunResult(seed=i, accuracy=a, train_seconds=s, epochs=1.0, steps=1)
                    for i, (a, s) in enumerate([(0.0, 0.1), (0.1562, 18.6)])])
    assert stats["train_seconds"]["ci95_low"] == 0.0 and stats["accuracy"]["ci95_low"] == 0.0

    a, b = make_result(0), make_result(1)
    for r, seconds in ((a, (0.1, 18.6)), (b, (0.2, 0.3))):
        r["runs"] = [{**r["runs"][0], "train_seconds": s, "accuracy": acc} for s, acc in zip(seconds, (0.0, 0.99))]
    metrics = comparing.compare(a, b)["metrics"]
    assert metrics["train_seconds"]["a"]["ci95_low"] == 0.0 and metrics["accuracy"]["a"]["ci95_high"] == 1.0


@pytest.mark.parametrize("value, text", [(-0.0, "0.00"), (0.0, "0.00"), (-0.004, "0.00"), (0.0049, "0.00"),
                                         (-0.006, "-0.01"), (0.35, "+0.35"), (-1.4, "-1.40")])
def test_a_signed_number_that_rounds_to_zero_has_no_sign(value, text):
    assert signed_text(value) == text


def test_the_ablate_table_prints_no_negative_zero():
    from speedrun.cli.train_commands import _ablate_lines

    report = {"recipe": "r", "dataset": "d", "device": "cpu", "runs": 2,
              "tricks": [{"trick": "lookahead", "off": False, "what": "w", "measured": True, "gain_accuracy": -0.0,
                          "gain_ci95": [-0.00004, 0.0], "p": 1.0, "time_ratio_off": 1.0}]}
    row = _ablate_lines(report)[-1]
    assert "-0.00" not in row and "0.00 (0.00 .. 0.00)" in row
    assert interval_text(-0.0001, [-0.02, 0.00001], 100) == "-0.01 (-2.00 .. 0.00)"
