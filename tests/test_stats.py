import json
import math

import numpy as np
import pytest
import scipy.stats

from speedrun.records.stats import (Summary, diff_ci95, mean_diff_test, ratio_ci95, summarize, t_cdf, t_quantile,
    welch_df, welch_t_test)

# Welch's t-test example 1 from Wikipedia ("Welch's t-test", Examples): t = -2.46, df = 25.0, p = 0.021.
A1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
A2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]

# Fixed pairs for the comparisons with scipy: equal n, unequal n and variances, n = 2 against a wide sample, and a
# large difference whose p is far out in the tail (~2e-7).
PAIRS = [
    (A1, A2),
    ([3.1, 2.9, 3.4, 3.0], [3.6, 3.3, 4.1, 3.2, 3.9, 3.5, 3.8]),
    ([10.0, 10.5], [7.0, 12.5, 9.1, 14.2, 8.8, 11.0, 6.4, 13.3, 10.9]),
    ([1.01, 1.02, 1.00, 1.03, 1.02], [2.0, 2.1, 1.9, 2.05, 1.95, 2.02]),
]
SAMPLES = [[1, 2, 3, 4], [9.8, 10.1, 10.4, 9.9, 10.3], [0.5, 0.25], A1, [3.0, 3.0, 3.5]]
TOL = dict(rel=1e-9, abs=1e-12)


def _welch_by_hand(a, b):
    a, b = np.asarray(a), np.asarray(b)
    sa, sb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (sa + sb) ** 2 / (sa**2 / (len(a) - 1) + sb**2 / (len(b) - 1))
    return (a.mean() - b.mean()) / math.sqrt(sa + sb), df


def test_textbook_quantiles():
    assert t_quantile(0.975, 10) == pytest.approx(2.228138851986274, rel=1e-12)
    assert t_quantile(0.975, 1) == pytest.approx(12.706204736174698, rel=1e-12)  # tan(0.475 pi), Cauchy
    assert t_quantile(0.95, 2) == pytest.approx(2.919985580353725, rel=1e-12)  # 2 sqrt(2) * 0.9 / sqrt(0.19)
    assert t_quantile(0.975, 1e12) == pytest.approx(1.959963984540054, abs=1e-9)  # the normal's 97.5% point
    assert t_quantile(0.5, 7) == 0.0


@pytest.mark.parametrize("df, expected", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622),
                                          (24, 2.0639), (99, 1.9842)])
def test_t_quantile_matches_printed_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-5)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=5e-5)


@pytest.mark.parametrize("df", [0.6, 1, 2.5, 3.7, 10, 25.02, 150.5, 1e7])
def test_t_cdf_and_quantile_agree_with_scipy(df):
    for t in (-30.0, -2.5, -0.3, 0.0, 0.7, 1.96, 12.7062):
        assert t_cdf(t, df) == pytest.approx(scipy.stats.t.cdf(t, df), **TOL)
    for p in (1e-9, 0.01, 0.3, 0.5, 0.8, 0.975, 1 - 1e-10):
        assert t_quantile(p, df) == pytest.approx(scipy.stats.t.ppf(p, df), **TOL)
        assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, rel=1e-9)


def test_large_df_follows_the_asymptotic_expansion():
    # t_0.975 = z + (z^3 + z) / (4 df) + O(1 / df^2) (A&S 26.7.5): at df = 1e7 the next term is ~3e-14.
    z, df = 1.959963984540054, 1e7
    assert t_quantile(0.975, df) == pytest.approx(z + (z**3 + z) / (4 * df), abs=1e-12)
    assert t_cdf(z + (z**3 + z) / (4 * df), df) == pytest.approx(0.975, abs=1e-12)


@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 1.96, 12.7062, 1e6])
def test_t_cdf_closed_forms(t):
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-12, abs=1e-300)  # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-300)
    assert (t_cdf(math.inf, 3), t_cdf(-math.inf, 3)) == (1.0, 0.0)


def test_far_tail_keeps_precision():
    q = 1e-12  # df = 1 upper tail: t = cot(pi q)
    assert t_quantile(1 - q, 1) == pytest.approx(1 / math.tan(math.pi * (1 - (1 - q))), rel=1e-9)


def test_plain_floats_come_back():
    # Callers put these in JSON and compare with ==; numpy scalars would leak numpy into every result.
    assert type(t_cdf(1.0, 3)) is float and type(t_quantile(0.9, 3)) is float
    assert all(type(x) is float for x in welch_t_test(A1, A2) + diff_ci95(A1, A2) + ratio_ci95(A1, A2))
    fields = summarize(A1).to_dict()
    assert type(fields.pop("n")) is int and all(type(x) is float for x in fields.values())


@pytest.mark.parametrize("p, df", [(0.0, 3), (1.0, 3), (1.2, 3), (math.nan, 3), (0.5, 0), (0.5, -1),
                                   (0.5, math.inf), (0.5, math.nan)])
def test_quantile_rejects_bad_arguments(p, df):
    with pytest.raises(ValueError, match="strictly between 0 and 1|degrees of freedom"):
        t_quantile(p, df)


def test_cdf_rejects_bad_arguments():
    with pytest.raises(ValueError, match="NaN"):
        t_cdf(math.nan, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)


def test_summarize_known_sample():
    s = summarize([1, 2, 3, 4])
    assert (s.n, s.mean, s.min, s.max) == (4, 2.5, 1.0, 4.0)
    assert s.std == pytest.approx(1.2910, abs=1e-4)
    half = 3.1824 * math.sqrt(5 / 3) / 2
    assert s.ci95_low == pytest.approx(2.5 - half, abs=1e-4)
    assert s.ci95_high == pytest.approx(2.5 + half, abs=1e-4)
    assert s.to_dict() == {"n": 4, "mean": 2.5, "std": s.std, "ci95_low": s.ci95_low, "ci95_high": s.ci95_high,
                           "min": 1.0, "max": 4.0}


@pytest.mark.parametrize("xs", SAMPLES)
def test_summary_interval_agrees_with_scipy(xs):
    s = summarize(xs)
    assert s.std == pytest.approx(np.std(xs, ddof=1), **TOL)
    low, high = scipy.stats.t.interval(0.95, len(xs) - 1, loc=np.mean(xs), scale=scipy.stats.sem(xs))
    assert (s.ci95_low, s.ci95_high) == pytest.approx((low, high), **TOL)


def test_summarize_single_value_and_errors():
    assert summarize([3.5]) == Summary(n=1, mean=3.5, std=None, ci95_low=None, ci95_high=None, min=3.5, max=3.5)
    with pytest.raises(ValueError, match="at least 1"):
        summarize([])
    with pytest.raises(ValueError, match="NaN"):
        summarize([1.0, float("nan")])


def test_welch_published_example():
    t, p = welch_t_test(A1, A2)
    assert t == pytest.approx(-2.46, abs=0.005)
    assert p == pytest.approx(0.021, abs=0.0005)
    assert welch_df(A1, A2) == pytest.approx(24.99, abs=0.01)
    assert welch_t_test(A2, A1) == pytest.approx((-t, p))


@pytest.mark.parametrize("a, b", PAIRS)
def test_welch_agrees_with_scipy(a, b):
    expected = scipy.stats.ttest_ind(a, b, equal_var=False)
    t, p = welch_t_test(a, b)
    assert t == pytest.approx(expected.statistic, **TOL)
    assert p == pytest.approx(expected.pvalue, rel=1e-9, abs=0)  # relative: one pair's p is ~2e-7
    assert welch_t_test(b, a) == pytest.approx((-t, p), rel=1e-12)


@pytest.mark.parametrize("a, b", PAIRS)
def test_welch_satterthwaite_df(a, b):
    _, df = _welch_by_hand(a, b)
    assert welch_df(a, b) == pytest.approx(df, **TOL)
    assert welch_df(b, a) == pytest.approx(df, rel=1e-12)
    assert min(len(a), len(b)) - 1 <= welch_df(a, b) <= len(a) + len(b) - 2


def test_welch_zero_variance():
    assert welch_t_test([2.0, 2.0, 2.0], [2.0, 2.0]) == (0.0, 1.0)
    t, p = welch_t_test([2.0, 2.0], [3.0, 3.0, 3.0])
    assert (t, p) == (-math.inf, 0.0)
    assert welch_df([2.0, 2.0], [3.0, 3.0, 3.0]) is None
    # One noisy sample is a normal case: df = n_noisy - 1.
    t, p = welch_t_test([1.0, 2.0, 3.0], [5.0, 5.0])
    assert t == pytest.approx(-3 / math.sqrt(1 / 3))
    assert p == pytest.approx(2 * scipy.stats.t.cdf(t, 2), rel=1e-12)
    assert welch_df([1.0, 2.0, 3.0], [5.0, 5.0]) == 2.0
    with pytest.raises(ValueError, match="at least 2"):
        welch_t_test([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        welch_df([1.0, 2.0], [1.0])


@pytest.mark.parametrize("a, b", PAIRS)
def test_diff_ci_agrees_with_scipy_t_interval(a, b):
    d, lo, hi = diff_ci95(a, b)
    t_hand, df = _welch_by_hand(a, b)
    se = (np.mean(a) - np.mean(b)) / t_hand
    assert d == pytest.approx(np.mean(a) - np.mean(b), **TOL)
    assert (lo, hi) == pytest.approx(scipy.stats.t.interval(0.95, df, loc=d, scale=se), **TOL)


def test_diff_ci_is_dual_to_welch_test():
    d, lo, hi = diff_ci95(A1, A2)
    assert hi < 0  # p = 0.021 < 0.05, so 0 is outside
    # Shifting a so that the interval's end sits on 0 makes the test's p exactly 0.05.
    shifted = [x - hi for x in A1]
    assert diff_ci95(shifted, A2)[2] == pytest.approx(0.0, abs=1e-12)
    assert welch_t_test(shifted, A2)[1] == pytest.approx(0.05, rel=1e-9)
    assert diff_ci95([1.0, 1.0], [0.5, 0.5]) == (0.5, 0.5, 0.5)


def test_ratio_ci_reduces_to_log_t_interval_for_exact_baseline():
    a = [9.8, 10.1, 10.4, 9.9, 10.3]
    r, lo, hi = ratio_ci95(a, [4.0, 4.0, 4.0])
    s = summarize(a)
    half = scipy.stats.t.ppf(0.975, len(a) - 1) * s.std / (math.sqrt(len(a)) * s.mean)  # the log scale's
    assert r == pytest.approx(s.mean / 4.0)
    assert (lo, hi) == pytest.approx((r * math.exp(-half), r * math.exp(half)), rel=1e-12)
    assert ratio_ci95([2 * x for x in A2], A2)[0] == pytest.approx(2.0)
    assert ratio_ci95([3.0, 3.0], [1.5, 1.5]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="mean\\(b\\) is 0"):
        ratio_ci95(a, [-1.0, 1.0])


def test_ratio_ci_log_delta_method_by_hand():
    a, b = PAIRS[1]
    ma, mb = np.mean(a), np.mean(b)
    term_a, term_b = np.var(a, ddof=1) / (len(a) * ma**2), np.var(b, ddof=1) / (len(b) * mb**2)
    df = (term_a + term_b) ** 2 / (term_a**2 / (len(a) - 1) + term_b**2 / (len(b) - 1))
    log_low, log_high = scipy.stats.t.interval(0.95, df, loc=math.log(ma / mb), scale=math.sqrt(term_a + term_b))
    r, lo, hi = ratio_ci95(a, b)
    assert r == pytest.approx(ma / mb, **TOL)
    assert (lo, hi) == pytest.approx((math.exp(log_low), math.exp(log_high)), **TOL)


def test_ratio_ci_coverage_by_simulation():
    # Timing-like data: ours 3.0 s, baseline 3.5 s, 2-3% noise, 10 runs each. A 95% interval should cover the
    # true ratio in ~95% of experiments; 3000 experiments put the binomial std at 0.4%.
    rng = np.random.default_rng(0)
    true_ratio, hits, trials = 3.0 / 3.5, 0, 3000
    for _ in range(trials):
        a = rng.normal(3.0, 0.09, 10)
        b = rng.normal(3.5, 0.07, 10)
        _, lo, hi = ratio_ci95(a.tolist(), b.tolist())
        hits += lo <= true_ratio <= hi
    assert 0.935 < hits / trials < 0.965


def test_mean_diff_test_is_one_table_row():
    a, b = PAIRS[1]  # a the candidate, b the baseline, as in diff_ci95 and ratio_ci95
    row = mean_diff_test(a, b)
    d, lo, hi = diff_ci95(a, b)
    r, rlo, rhi = ratio_ci95(a, b)
    assert row == {"diff": d, "ci95": [lo, hi], "p": welch_t_test(a, b)[1], "df": welch_df(a, b), "ratio": r,
                   "ratio_ci95": [rlo, rhi]}
    assert row["diff"] < 0 and row["ratio"] < 1 and row["p"] == pytest.approx(0.010953775079229358, rel=1e-9)
    assert json.loads(json.dumps(row, allow_nan=False)) == row
    same = mean_diff_test([2.0, 2.0], [2.0, 2.0])
    assert same == {"diff": 0.0, "ci95": [0.0, 0.0], "p": 1.0, "df": None, "ratio": 1.0, "ratio_ci95": [1.0, 1.0]}
    assert json.loads(json.dumps(same, allow_nan=False)) == same
    with pytest.raises(ValueError, match="at least 2"):
        mean_diff_test([1.0], b)
    with pytest.raises(ValueError, match="mean\\(b\\) is 0"):
        mean_diff_test(a, [-1.0, 1.0])
