"""The statistics a speed claim needs: summaries with t-intervals, Welch's test, ratio and difference CIs, the
records rule (a one-sided t-test against the target accuracy), and their text forms in tables (mean_std_text,
interval_text, ratio_text, record_p_text).

The Student-t distribution comes from scipy.stats (a library that is kept up, not hand-written special
functions); it takes fractional degrees of freedom, as Welch's test needs. What stays here is what scipy does not
decide for us: input checks whose messages say the fix, moments summed with math.fsum and scaled so that any
finite floats (1e-300 .. 1e300) neither overflow nor vanish, the conventions for n = 1 and for zero variance,
intervals clipped to the range of the quantity (seconds >= 0, accuracy in [0, 1]), and the interval of a ratio of
means (the delta method on its log). A result out of floating-point range is a ValueError, which callers show as
n/a.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass
from typing import Any, Sequence


def _student_t() -> Any:
    """scipy.stats.t, imported on first use: scipy.stats takes about half a second to import, which a command
    that computes no interval or p-value (a single run, a smoke test, --help) should not pay."""
    import scipy.stats

    return scipy.stats.t


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
    return float(_student_t().cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, e.g. t_quantile(0.975, n - 1) for a 95% two-sided interval."""
    df = _check_df(df)
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie strictly between 0 and 1, got {p}; for a 95% interval use 0.975")
    return float(_student_t().ppf(p, df))


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


def _moments(values: Sequence[float], name: str, min_n: int = 1) -> tuple[int, float, float]:
    """(n, mean, sample std with ddof=1; 0.0 for n = 1), after checking the values.

    Any finite floats, 5e-324 to 1.8e308: the sum and the squares are taken of the values divided by their largest
    magnitude (the deviations by the largest deviation), so that neither overflows (1e300 ** 2) nor underflows to 0
    ((1e-300) ** 2), and the std is kept, not the variance, which would do either. A mean or std that is still out
    of range is a ValueError naming it."""
    xs = [float(v) for v in values]
    if len(xs) < min_n:
        raise ValueError(f"{name} needs at least {min_n} value{'' if min_n == 1 else 's'}, got {len(xs)}; run more "
                         "seeds (--runs)")
    if any(not math.isfinite(v) for v in xs):
        raise ValueError(f"{name} contains NaN or inf: {xs}; drop the failed runs first")
    n = len(xs)
    if min(xs) == max(xs):  # runs alike: their mean is the value itself (fsum / n may round one ulp off it), no spread
        return n, xs[0], 0.0
    try:
        mean = math.fsum(xs) / n
    except OverflowError:  # a partial sum past 1.8e308: the values over their largest magnitude cannot overflow
        top = max(abs(v) for v in xs)
        mean = top * (math.fsum(v / top for v in xs) / n)
    if n == 1:
        return n, mean, 0.0
    deviations = [v - mean for v in xs]  # each within 2 * 1.8e308 only in theory: inf is caught below
    widest = max(abs(d) for d in deviations)
    if not math.isfinite(widest):
        raise ValueError(f"{name}: the values spread past the floating-point range; rescale them (seconds, not ns)")
    if widest == 0.0:
        return n, mean, 0.0
    std = widest * math.sqrt(math.fsum((d / widest) ** 2 for d in deviations) / (n - 1))
    return n, mean, std


# The ranges of the quantities summarized (summarize's bounds): seconds and rates are >= 0, accuracy a fraction.
NON_NEGATIVE = (0.0, math.inf)
FRACTION = (0.0, 1.0)


def summarize(values: Sequence[float], bounds: tuple[float, float] | None = None) -> Summary:
    """Summary of a sample; with n == 1 the std and the interval are None (one value has no spread, and a
    zero-width interval would claim certainty).

    bounds: (low, high), the range the quantity lies in (NON_NEGATIVE for seconds, FRACTION for accuracy); the
    t-interval is clipped to it. Clipping keeps the coverage: the true mean lies in the range, so the part of the
    interval outside it never holds the mean; at n = 2 the t-interval of timed seconds reaches far below 0. A value
    outside the range (a file from elsewhere) widens it to that value, so the interval still holds the mean. None:
    a quantity with no range (a difference). An interval whose end is out of floating-point range (values near
    1e308) is None too."""
    n, mean, std = _moments(values, "summarize()")
    xs = [float(v) for v in values]
    low_bound, high_bound = (-math.inf, math.inf) if bounds is None else map(float, bounds)
    low_bound, high_bound = min(low_bound, min(xs)), max(high_bound, max(xs))
    if n == 1:
        return Summary(n=1, mean=mean, std=None, ci95_low=None, ci95_high=None, min=xs[0], max=xs[0])
    half = t_quantile(0.975, n - 1) * std / math.sqrt(n)
    # min/max with the mean: a mean rounded one ulp past a bound still lies in its interval
    low, high = min(max(mean - half, low_bound), mean), max(min(mean + half, high_bound), mean)
    if not (math.isfinite(low) and math.isfinite(high)):
        low = high = None
    return Summary(n=n, mean=mean, std=std, ci95_low=low, ci95_high=high, min=min(xs), max=max(xs))


def _satterthwaite(se_a: float, se_b: float, na: int, nb: int) -> float:
    """Welch-Satterthwaite degrees of freedom of a sum of two variance estimates from na and nb values, given as
    their square roots (for a difference of means se_a = std(a) / sqrt(na)). Needs se_a + se_b > 0.

    The formula (ta + tb)^2 / (ta^2 / (na - 1) + tb^2 / (nb - 1)), ta = se_a^2, does not change when both terms are
    scaled alike, so it is taken of se / max(se_a, se_b): fourth powers of 1e-100 or 1e100 stay in range."""
    top = max(se_a, se_b)
    ta, tb = (se_a / top) ** 2, (se_b / top) ** 2
    return (ta + tb) ** 2 / (ta**2 / (na - 1) + tb**2 / (nb - 1))


def _finite(name: str, *values: float) -> None:
    """The n/a path of a statistic whose inputs were finite but whose result is out of floating-point range (a
    ratio of 1e300 to 1e-300, a difference of -1e308 and 1e308): a ValueError, which callers show as n/a."""
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name}: the result is out of floating-point range for these values; rescale them "
                         "(seconds, not ns)")


def welch_df(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Welch-Satterthwaite degrees of freedom of mean(a) - mean(b); fractional in general.

    It lies between min(na, nb) - 1 and na + nb - 2, and is n - 1 of the noisy sample when the other has zero
    variance. None when both have zero variance: there is no noise whose degrees of freedom could be counted.
    """
    na, _, sa = _moments(a, "welch_df(a)", 2)
    nb, _, sb = _moments(b, "welch_df(b)", 2)
    se_a, se_b = sa / math.sqrt(na), sb / math.sqrt(nb)
    if se_a == 0.0 and se_b == 0.0:
        return None
    return _satterthwaite(se_a, se_b, na, nb)


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(t, two-sided p) for H0: mean(a) == mean(b), not assuming equal variances (Welch 1947).

    Agrees with scipy.stats.ttest_ind(a, b, equal_var=False), except that when both samples have zero variance
    (where scipy gives NaN) the test is decided by the means: p = 1.0 when they are equal, else 0.0
    (t = 0.0 or +-inf); a t past the floating-point range is +-inf alike, with p = 0.0. A difference of means past
    it (1e308 against -1e308) is a ValueError, the n/a path.
    """
    na, ma, sa = _moments(a, "welch_t_test(a)", 2)
    nb, mb, sb = _moments(b, "welch_t_test(b)", 2)
    se_a, se_b = sa / math.sqrt(na), sb / math.sqrt(nb)
    se = math.hypot(se_a, se_b)  # sqrt(va / na + vb / nb) without squaring
    if se == 0.0:
        if ma == mb:
            return 0.0, 1.0
        return math.copysign(math.inf, ma - mb), 0.0
    d = ma - mb
    _finite("welch_t_test()", d)
    t = d / se
    # The upper tail directly, not 1 - cdf, so that small p-values keep their digits.
    p = 2.0 * float(_student_t().sf(abs(t), _satterthwaite(se_a, se_b, na, nb)))
    return t, p


def diff_ci95(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the Welch 95% interval, d +- t_0.975(df_WS) * sqrt(va/na + vb/nb).

    Zero width when both samples have zero variance. It excludes 0 exactly when welch_t_test's p < 0.05.
    ValueError where an end is out of floating-point range.
    """
    na, ma, sa = _moments(a, "diff_ci95(a)", 2)
    nb, mb, sb = _moments(b, "diff_ci95(b)", 2)
    se_a, se_b = sa / math.sqrt(na), sb / math.sqrt(nb)
    d = ma - mb
    se = math.hypot(se_a, se_b)
    if se == 0.0:
        _finite("diff_ci95()", d)
        return d, d, d
    half = t_quantile(0.975, _satterthwaite(se_a, se_b, na, nb)) * se
    _finite("diff_ci95()", d, d - half, d + half)
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
    positive: a mean <= 0 has no log, and is refused (ValueError; callers show n/a). So is a ratio or an end
    outside the positive floats (1e300 against 1e-300): each term is taken as (std / mean)^2 / n, never var / mean^2,
    whose mean^2 is 0 for a mean of 1e-300.
    """
    na, ma, sa = _moments(a, "ratio_ci95(a)", 2)
    nb, mb, sb = _moments(b, "ratio_ci95(b)", 2)
    for name, mean in (("b", mb), ("a", ma)):
        if not mean > 0.0:
            raise ValueError(f"ratio_ci95: mean({name}) is {mean:g}; a ratio of times or accuracies needs two "
                             "positive means")
    r = ma / mb
    if not 0.0 < r < math.inf:
        raise ValueError(f"ratio_ci95: {ma:g} / {mb:g} is out of floating-point range; rescale the values")
    # the standard errors of log mean(a) and log mean(b): coefficients of variation over sqrt(n)
    se_a, se_b = sa / ma / math.sqrt(na), sb / mb / math.sqrt(nb)
    _finite("ratio_ci95()", se_a, se_b)
    se = math.hypot(se_a, se_b)
    if se == 0.0:
        return r, r, r
    half = t_quantile(0.975, _satterthwaite(se_a, se_b, na, nb)) * se
    try:
        low, high = r * math.exp(-half), r * math.exp(half)
    except OverflowError:
        low = high = math.inf
    if not 0.0 < low <= r <= high < math.inf:
        raise ValueError(f"ratio_ci95: the interval of {r:g} is out of floating-point range for these values")
    return r, low, high


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


def signed_text(value: float, digits: int = 2) -> str:
    """"+0.35", "-1.40", and "0.00" for a value that rounds to zero at `digits` (format's "+.2f" writes -0.004 and
    -0.0 as "-0.00", a loss that is not there)."""
    text = f"{value:+.{digits}f}"
    return text[1:] if float(text) == 0.0 else text


def interval_text(value: float, interval: list[float], scale: float = 1.0) -> str:
    """"+0.35 (-1.40 .. +2.11)": a signed difference and its 95% interval, times `scale` (100: points)."""
    low, high = interval
    return f"{signed_text(value * scale)} ({signed_text(low * scale)} .. {signed_text(high * scale)})"


def ratio_text(test: dict) -> str:
    """"0.812 (0.802 .. 0.822)": mean_diff_test's ratio and its 95% interval; "n/a" where a mean <= 0 left none."""
    if test.get("ratio") is None or test.get("ratio_ci95") is None:
        return "n/a"
    low, high = test["ratio_ci95"]
    return f"{test['ratio']:.3f} ({low:.3f} .. {high:.3f})"


# The records rule (modded-nanogpt's, and Hiverge's 2025 CIFAR-10 record): a result reaches its target accuracy only
# when a one-sided t-test of its runs' accuracies against the target gives p below this threshold.
RECORD_ALPHA = 0.01
RECORD_P_ENV = "SPEEDRUN_RECORD_P"


def record_alpha(value: float | str | None = None, name: str = RECORD_P_ENV) -> float:
    """The records rule's threshold: `value` (named `name` in a refusal) when given, else $SPEEDRUN_RECORD_P when
    set, else RECORD_ALPHA. It must lie in (0, 0.5]: a one-sided p below 0.5 already needs the mean above the
    target, so a larger threshold would let a mean below the target reach it."""
    if value is None:
        text = os.environ.get(RECORD_P_ENV, "").strip()
        if not text:
            return RECORD_ALPHA
        value, name = text, f"{RECORD_P_ENV}={text[:40]}"
    try:
        alpha = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        alpha = math.nan
    if not 0.0 < alpha <= 0.5:  # NaN fails too
        shown = name if name.startswith(f"{RECORD_P_ENV}=") else f"{name} {str(value)[:40]}"
        raise ValueError(f"{shown} is not a p-value threshold in (0, 0.5]; give e.g. 0.01 (the records rule's "
                         "default, modded-nanogpt's)")
    return alpha


def one_sided_p(mean: float, std: float | None, n: int, target: float) -> float | None:
    """p of the one-sided one-sample t-test of H0: true mean <= target against H1: true mean > target, from the
    runs' summary: their mean, sample std (ddof=1, as Summary and the stored rows keep it) and count.

    t = (mean - target) / (std / sqrt(n)), p = P(T_{n-1} >= t): the same number as
    scipy.stats.ttest_1samp(accuracies, target, alternative="greater") on the runs themselves. None for n < 2 (one
    run has no spread, so no test) and for a std that is None (not known). With std = 0 (every run alike, where
    scipy gives NaN) the mean decides: p = 0.0 above the target, 1.0 at or below it."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):  # numpy's integers too
        raise ValueError(f"n must be a whole number of runs, got {n!r:.40}")
    n = int(n)
    if n < 2 or std is None:
        return None
    for label, value in (("mean", mean), ("std", std), ("target", target)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"one_sided_p: {label} must be a finite number, got {value!r:.40}")
    mean, std, target = float(mean), float(std), float(target)
    if std < 0:
        raise ValueError(f"one_sided_p: std must be >= 0, got {std}; give the sample std (ddof=1) of the runs")
    se = std / math.sqrt(n)
    if se == 0.0:  # std 0, or so small that std / sqrt(n) underflows: no noise, the mean alone decides
        return 0.0 if mean > target else 1.0
    # The upper tail directly, not 1 - cdf, so that small p-values keep their digits; a t past the float range is
    # +-inf, whose tail scipy gives as 0 or 1.
    return float(_student_t().sf((mean - target) / se, n - 1))


def reaches_target(mean: float, std: float | None, n: int, target: float,
                   alpha: float | None = RECORD_ALPHA) -> tuple[bool, float | None]:
    """(reached, p): the records rule. Reached only when one_sided_p(mean, std, n, target) < alpha; never with
    n < 2 (p is None). alpha None: the setting (record_alpha: $SPEEDRUN_RECORD_P, else RECORD_ALPHA)."""
    alpha = record_alpha(alpha, "alpha")
    p = one_sided_p(mean, std, n, target)
    return p is not None and p < alpha, p


def record_p_text(p: float | None) -> str:
    """"3.1e-04", "0.0031", "0.12", "0": a records-rule p in a table cell; "-" without one (n < 2, no target)."""
    if p is None:
        return "-"
    return f"{p:.2g}" if p == 0.0 or p >= 0.001 else f"{p:.1e}"
