import math

import numpy as np
import pytest

from speedrun.stats import Summary, diff_ci95, ratio_ci95, summarize, t_cdf, t_quantile, welch_t_test

# Welch's t-test example 1 from Wikipedia ("Welch's t-test", Examples): t = -2.46, df = 25.0, p = 0.021.
A1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
A2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]


def _t_pdf(x, df):
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    return norm * (1 + x * x / df) ** (-(df + 1) / 2)


def _cdf_by_simpson(t, df, steps=20_000):
    """0.5 + integral of the density from 0 to t, composite Simpson: independent of the incomplete beta."""
    h = t / steps
    s = _t_pdf(0.0, df) + _t_pdf(t, df)
    s += sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, steps))
    return 0.5 + s * h / 3


def _welch_by_hand(a, b):
    a, b = np.asarray(a), np.asarray(b)
    sa, sb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (sa + sb) ** 2 / (sa**2 / (len(a) - 1) + sb**2 / (len(b) - 1))
    return (a.mean() - b.mean()) / math.sqrt(sa + sb), df


@pytest.mark.parametrize("df, expected", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622),
                                          (24, 2.0639), (99, 1.9842)])
def test_t_quantile_matches_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-5)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=5e-5)


def test_t_quantile_tends_to_normal_and_is_continuous_at_the_switch():
    assert t_quantile(0.975, 1e12) == pytest.approx(1.959964, abs=1e-6)
    # Just below and above the df where the code switches from the incomplete beta to the corrected normal, both
    # agree with the asymptotic expansion z + (z^3 + z) / (4 df), whose next term is ~3e-12 here (A&S 26.7.5).
    z = 1.959963984540054
    for df in (0.999e6, 1.001e6):
        assert t_quantile(0.975, df) == pytest.approx(z + (z**3 + z) / (4 * df), abs=1e-9)
    assert t_quantile(0.5, 7) == 0.0


@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 1.96, 12.7062, 1e6])
def test_t_cdf_closed_forms(t):
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-12, abs=1e-300)  # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("t, df", [(2.1, 3.7), (0.4, 0.6), (1.5, 25.02), (3.0, 150.5)])
def test_t_cdf_fractional_df_matches_integrated_density(t, df):
    assert t_cdf(t, df) == pytest.approx(_cdf_by_simpson(t, df), abs=1e-9)


@pytest.mark.parametrize("p", [1e-9, 0.01, 0.3, 0.8, 0.975, 1 - 1e-10])
@pytest.mark.parametrize("df", [0.7, 1, 3.3, 40, 5e5])
def test_quantile_inverts_cdf(p, df):
    t = t_quantile(p, df)
    assert t_cdf(t, df) == pytest.approx(p, rel=1e-9)


def test_far_tail_keeps_precision():
    q = 1e-12  # df = 1 upper tail: t = cot(pi q)
    assert t_quantile(1 - q, 1) == pytest.approx(1 / math.tan(math.pi * (1 - (1 - q))), rel=1e-9)


@pytest.mark.parametrize("p, df", [(0.0, 3), (1.0, 3), (1.2, 3), (0.5, 0), (0.5, -1), (0.5, math.inf)])
def test_quantile_rejects_bad_arguments(p, df):
    with pytest.raises(ValueError):
        t_quantile(p, df)


def test_summarize_known_sample():
    s = summarize([1, 2, 3, 4])
    assert (s.n, s.mean, s.min, s.max) == (4, 2.5, 1.0, 4.0)
    assert s.std == pytest.approx(1.2910, abs=1e-4)
    half = 3.1824 * math.sqrt(5 / 3) / 2
    assert s.ci95_low == pytest.approx(2.5 - half, abs=1e-4)
    assert s.ci95_high == pytest.approx(2.5 + half, abs=1e-4)
    assert s.to_dict() == {"n": 4, "mean": 2.5, "std": s.std, "ci95_low": s.ci95_low, "ci95_high": s.ci95_high,
                           "min": 1.0, "max": 4.0}


def test_summarize_single_value_and_errors():
    assert summarize([3.5]) == Summary(n=1, mean=3.5, std=None, ci95_low=None, ci95_high=None, min=3.5, max=3.5)
    with pytest.raises(ValueError, match="at least 1"):
        summarize([])
    with pytest.raises(ValueError, match="NaN"):
        summarize([1.0, float("nan")])


def test_welch_published_example_and_independent_integration():
    t, p = welch_t_test(A1, A2)
    assert t == pytest.approx(-2.46, abs=0.005)
    assert p == pytest.approx(0.021, abs=0.0005)
    t_hand, df = _welch_by_hand(A1, A2)
    assert df == pytest.approx(24.99, abs=0.01)
    assert t == pytest.approx(t_hand, rel=1e-12)
    assert p == pytest.approx(2 * (1 - _cdf_by_simpson(abs(t_hand), df)), abs=1e-9)
    assert welch_t_test(A2, A1) == pytest.approx((-t, p))


def test_welch_zero_variance():
    assert welch_t_test([2.0, 2.0, 2.0], [2.0, 2.0]) == (0.0, 1.0)
    t, p = welch_t_test([2.0, 2.0], [3.0, 3.0, 3.0])
    assert (t, p) == (-math.inf, 0.0)
    # One noisy sample is a normal case: df = n_noisy - 1.
    t, p = welch_t_test([1.0, 2.0, 3.0], [5.0, 5.0])
    assert t == pytest.approx(-3 / math.sqrt(1 / 3))
    assert p == pytest.approx(2 * t_cdf(t, 2), rel=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        welch_t_test([1.0], [1.0, 2.0])


def test_diff_ci_is_dual_to_welch_test():
    d, lo, hi = diff_ci95(A1, A2)
    assert d == pytest.approx(np.mean(A1) - np.mean(A2))
    _, df = _welch_by_hand(A1, A2)
    se = math.sqrt(np.var(A1, ddof=1) / 15 + np.var(A2, ddof=1) / 15)
    assert hi - d == pytest.approx(d - lo) and hi - d == pytest.approx(t_quantile(0.975, df) * se, rel=1e-12)
    assert hi < 0  # p = 0.021 < 0.05, so 0 is outside
    # Shifting a so that the interval's end sits on 0 makes the test's p exactly 0.05.
    shifted = [x - hi for x in A1]
    assert diff_ci95(shifted, A2)[2] == pytest.approx(0.0, abs=1e-12)
    assert welch_t_test(shifted, A2)[1] == pytest.approx(0.05, rel=1e-9)
    assert diff_ci95([1.0, 1.0], [0.5, 0.5]) == (0.5, 0.5, 0.5)


def test_ratio_ci_reduces_to_t_interval_for_exact_baseline():
    a = [9.8, 10.1, 10.4, 9.9, 10.3]
    r, lo, hi = ratio_ci95(a, [4.0, 4.0, 4.0])
    s = summarize(a)
    assert r == pytest.approx(s.mean / 4.0)
    assert (lo, hi) == pytest.approx((s.ci95_low / 4.0, s.ci95_high / 4.0), rel=1e-12)
    assert ratio_ci95([2 * x for x in A2], A2)[0] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="mean\\(b\\) is 0"):
        ratio_ci95(a, [-1.0, 1.0])


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
