"""The interval of a ratio of means (stats.ratio_ci95, shown by bench, compare and tune): a ratio of positive
quantities is positive, and so is every value its interval allows, however noisy the samples."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_db import make_result

from speedrun.cli.file_commands import _compare_lines
from speedrun.instruments.compare import compare
from speedrun.records.stats import mean_diff_test, ratio_ci95, ratio_text

POSITIVE = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False)
SAMPLE = st.lists(POSITIVE, min_size=2, max_size=30)


@settings(max_examples=400, deadline=None)
@given(SAMPLE, SAMPLE)
def test_the_interval_of_a_ratio_of_positive_means_is_positive_and_holds_it(a, b):
    r, low, high = ratio_ci95(a, b)
    assert r > 0 and math.isfinite(r)
    assert 0 < low <= r * (1 + 1e-12) and r <= high * (1 + 1e-12), (r, low, high)


@settings(max_examples=200, deadline=None)
@given(SAMPLE, SAMPLE, st.floats(min_value=1e-3, max_value=1e3))
def test_the_interval_scales_with_the_samples_and_inverts_with_their_order(a, b, scale):
    r, low, high = ratio_ci95(a, b)
    rs, ls, hs = ratio_ci95([scale * x for x in a], b)
    assert (rs, ls, hs) == pytest.approx((scale * r, scale * low, scale * high), rel=1e-9)
    ri, li, hi = ratio_ci95(b, a)  # log-symmetric: the interval of b / a is the reciprocal of a / b's
    assert (ri, li, hi) == pytest.approx((1 / r, 1 / high, 1 / low), rel=1e-9)


def test_the_issues_noisy_times_give_a_positive_interval():
    """Timed seconds like the bench that printed `0.946 (-1.535 .. 3.427)`: one noisy setting, two runs."""
    r, low, high = ratio_ci95([0.52, 3.1], [1.9, 1.95])
    assert low > 0 and low <= r <= high
    assert not ratio_text(mean_diff_test([0.52, 3.1], [1.9, 1.95])).split("(")[1].startswith("-")


@pytest.mark.parametrize("a, b, side", [([1.0, 2.0], [0.0, 0.0], "b"), ([1.0, 2.0], [-1.0, 1.0], "b"),
                                        ([1.0, 2.0], [-3.0, -1.0], "b"), ([0.0, 0.0], [1.0, 2.0], "a"),
                                        ([-2.0, 1.0], [1.0, 2.0], "a")])
def test_a_mean_that_is_not_positive_is_refused(a, b, side):
    with pytest.raises(ValueError, match=rf"mean\({side}\) is .*two positive means"):
        ratio_ci95(a, b)
    with pytest.raises(ValueError, match="positive means"):
        mean_diff_test(a, b)


def test_compare_shows_n_a_for_a_ratio_of_a_zero_mean_and_keeps_the_difference():
    """Accuracies of 0 (a net that learned nothing) have no ratio: compare says n/a there, and still gives the
    difference and its p; the time row is untouched."""
    zero = make_result(0)
    zero["runs"] = [{**run, "accuracy": 0.0} for run in zero["runs"]]
    other = make_result(1)
    report = compare(zero, other)
    test = report["metrics"]["accuracy"]["test"]
    assert test["ratio"] is None and test["ratio_ci95"] is None and test["diff"] > 0 and 0 <= test["p"] <= 1
    lines = _compare_lines(report)
    accuracy_row = next(line for line in lines if line.startswith("test acc %"))
    assert accuracy_row.split()[-1] == "n/a" and f"{100 * test['diff']:+.2f}" in accuracy_row
    time_row = next(line for line in lines if line.startswith("timed s"))
    assert "n/a" not in time_row and " .. " in time_row
