"""The statistics a speed claim needs: summaries with t-intervals, Welch's test, ratio and difference CIs, and
their text forms in tables (mean_std_text, interval_text, ratio_text).

The Student-t distribution comes from scipy.stats (a library that is kept up, not hand-written special
functions); it takes fractional degrees of freedom, as Welch's test needs. What stays here is what scipy does not
decide for us: input checks whose messages say the fix, moments summed with math.fsum, the conventions for n = 1
and for zero variance, and the interval of a ratio of means (the delta method on its log).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import scipy.stats


def _check_df(df: float) -> float:
    df = float(df)
    if not df > 0 or math.isinf(df):
        raise ValueError(f"degrees of freedom must be a finite number > 0, got {df}; use n - 1 for n samples")
    return df


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom; df may be fractional (Welch)."""
    df = _check_df(df)
    t = float(t)
    if math.isnan(t):
        raise ValueError("t is NaN; check the inputs for NaN or zero variance")
    return float(scipy.stats.t.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, e.g. t_quantile(0.975, n - 1) for a 95% two-sided interval."""
    df = _check_df(df)
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie strictly between 0 and 1, got {p}; for a 95% interval use 0.975")
    return float(scipy.stats.t.ppf(p, df))


@dataclass
class Summary:
    """n runs of one measurement: mean, sample std (ddof=1) and the 95% t-interval of the mean."""

    n: int
    mean: float
    std: float | None  # None for n = 1: one run has no spread
    ci95_low: float | None  # None for n = 1
    ci95_high: float | None
    min: float
    max: float

    def to_dict(self) -> dict:
        return asdict(self)


def _mean_var(values: Sequence[float], name: str, min_n: int = 1) -> tuple[int, float, float]:
    """(n, mean, sample variance with ddof=1; 0.0 for n = 1), after checking the values."""
    xs = [float(v) for v in values]
    if len(xs) < min_n:
        raise ValueError(f"{name} needs at least {min_n} value(s), got {len(xs)}; run more seeds (--runs)")
    if any(not math.isfinite(v) for v in xs):
        raise ValueError(f"{name} contains NaN or inf: {xs}; drop the failed runs first")
    n = len(xs)
    mean = math.fsum(xs) / n
    var = math.fsum((v - mean) ** 2 for v in xs) / (n - 1) if n > 1 else 0.0
    return n, mean, var


def summarize(values: Sequence[float]) -> Summary:
    """Summary of a sample; with n == 1 the std and the interval are None (one value has no spread, and a
    zero-width interval would claim certainty)."""
    n, mean, var = _mean_var(values, "summarize()")
    xs = [float(v) for v in values]
    if n == 1:
        return Summary(n=1, mean=mean, std=None, ci95_low=None, ci95_high=None, min=xs[0], max=xs[0])
    std = math.sqrt(var)
    half = t_quantile(0.975, n - 1) * std / math.sqrt(n)
    return Summary(n=n, mean=mean, std=std, ci95_low=mean - half, ci95_high=mean + half, min=min(xs), max=max(xs))


def _satterthwaite(term_a: float, term_b: float, na: int, nb: int) -> float:
    """Welch-Satterthwaite degrees of freedom of term_a + term_b, two variance estimates from na and nb values
    (for a difference of means the terms are va / na and vb / nb). Needs term_a + term_b > 0."""
    return (term_a + term_b) ** 2 / (term_a**2 / (na - 1) + term_b**2 / (nb - 1))


def welch_df(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Welch-Satterthwaite degrees of freedom of mean(a) - mean(b); fractional in general.

    It lies between min(na, nb) - 1 and na + nb - 2, and is n - 1 of the noisy sample when the other has zero
    variance. None when both have zero variance: there is no noise whose degrees of freedom could be counted.
    """
    na, _, va = _mean_var(a, "welch_df(a)", 2)
    nb, _, vb = _mean_var(b, "welch_df(b)", 2)
    if va == 0.0 and vb == 0.0:
        return None
    return _satterthwaite(va / na, vb / nb, na, nb)


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(t, two-sided p) for H0: mean(a) == mean(b), not assuming equal variances (Welch 1947).

    Agrees with scipy.stats.ttest_ind(a, b, equal_var=False), except that when both samples have zero variance
    (where scipy gives NaN) the test is decided by the means: p = 1.0 when they are equal, else 0.0
    (t = 0.0 or +-inf).
    """
    na, ma, va = _mean_var(a, "welch_t_test(a)", 2)
    nb, mb, vb = _mean_var(b, "welch_t_test(b)", 2)
    se2 = va / na + vb / nb
    if se2 == 0.0:
        if ma == mb:
            return 0.0, 1.0
        return math.copysign(math.inf, ma - mb), 0.0
    t = (ma - mb) / math.sqrt(se2)
    # The upper tail directly, not 1 - cdf, so that small p-values keep their digits.
    p = 2.0 * float(scipy.stats.t.sf(abs(t), _satterthwaite(va / na, vb / nb, na, nb)))
    return t, p


def diff_ci95(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the Welch 95% interval, d +- t_0.975(df_WS) * sqrt(va/na + vb/nb).

    Zero width when both samples have zero variance. It excludes 0 exactly when welch_t_test's p < 0.05.
    """
    na, ma, va = _mean_var(a, "diff_ci95(a)", 2)
    nb, mb, vb = _mean_var(b, "diff_ci95(b)", 2)
    d = ma - mb
    se2 = va / na + vb / nb
    if se2 == 0.0:
        return d, d, d
    half = t_quantile(0.975, _satterthwaite(va / na, vb / nb, na, nb)) * math.sqrt(se2)
    return d, d - half, d + half


def ratio_ci95(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(R, low, high) for R = mean(a) / mean(b), e.g. time ours / time airbench, with a 95% CI that stays above 0.

    Method: the delta method on the log of the ratio, as for the "ratio of means" of Friedrich, Adhikari &
    Beyene (2008, BMC Medical Research Methodology 8:32). For independent samples, the first-order Taylor expansion
    of log R = log mean(a) - log mean(b) gives
        Var(log R) ~ va / (na ma^2) + vb / (nb mb^2)
    (the squared coefficients of variation of the two means). The interval is exp(log R +- t_0.975(df) *
    sqrt(Var(log R))), df from Welch-Satterthwaite applied to those two terms: R times and divided by one factor,
    so 0 < low <= R <= high, whereas R +- t * se(R) (the delta method on R itself) reaches below 0 for noisy
    times. When b has no noise it is the t-interval of mean(a) on the log scale. Times and accuracies are
    positive: a mean <= 0 has no log, and is refused (ValueError; callers show n/a).
    """
    na, ma, va = _mean_var(a, "ratio_ci95(a)", 2)
    nb, mb, vb = _mean_var(b, "ratio_ci95(b)", 2)
    for name, mean in (("b", mb), ("a", ma)):
        if not mean > 0.0:
            raise ValueError(f"ratio_ci95: mean({name}) is {mean:g}; a ratio of times or accuracies needs two "
                             "positive means")
    r = ma / mb
    term_a = va / (na * ma**2)
    term_b = vb / (nb * mb**2)
    if term_a + term_b == 0.0:
        return r, r, r
    half = t_quantile(0.975, _satterthwaite(term_a, term_b, na, nb)) * math.sqrt(term_a + term_b)
    return r, r * math.exp(-half), r * math.exp(half)


def mean_diff_test(a: Sequence[float], b: Sequence[float]) -> dict:
    """One row of an "a against baseline b" table, in the argument order of diff_ci95, ratio_ci95 and
    welch_t_test (a is the candidate, b the baseline; e.g. a = new commit's times, b = base commit's):

        {"diff": mean(a) - mean(b), "ci95": [low, high],   the Welch 95% interval of the difference
         "p": two-sided Welch p,    "df": Welch-Satterthwaite df (None when both samples have zero variance),
         "ratio": mean(a) / mean(b), "ratio_ci95": [low, high]}   the 95% interval of ratio_ci95 (> 0)

    Plain floats, lists and None, so it goes into a result JSON as is. Needs 2+ finite values on each side and
    two positive means (ValueError otherwise).
    """
    diff, low, high = diff_ci95(a, b)
    _, p = welch_t_test(a, b)
    ratio, ratio_low, ratio_high = ratio_ci95(a, b)
    return {"diff": diff, "ci95": [low, high], "p": p, "df": welch_df(a, b), "ratio": ratio,
            "ratio_ci95": [ratio_low, ratio_high]}


def mean_std_text(summary: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """"66.73 ± 0.74": a Summary dict's mean and std times `scale`; the mean alone for one run (no spread), "n/a"
    without runs."""
    if summary is None:
        return "n/a"
    text = f"{scale * summary['mean']:.{digits}f}"
    # n, not std alone: a stored result may carry one run's std as 0.0
    spread = summary["n"] > 1 and summary["std"] is not None
    return text + (f" ± {scale * summary['std']:.{digits}f}" if spread else "")


def interval_text(value: float, interval: list[float], scale: float = 1.0) -> str:
    """"+0.35 (-1.40 .. +2.11)": a signed difference and its 95% interval, times `scale` (100: points)."""
    low, high = interval
    return f"{value * scale:+.2f} ({low * scale:+.2f} .. {high * scale:+.2f})"


def ratio_text(test: dict) -> str:
    """"0.812 (0.802 .. 0.822)": mean_diff_test's ratio and its 95% interval; "n/a" where a mean <= 0 left none."""
    if test.get("ratio") is None or test.get("ratio_ci95") is None:
        return "n/a"
    low, high = test["ratio_ci95"]
    return f"{test['ratio']:.3f} ({low:.3f} .. {high:.3f})"
