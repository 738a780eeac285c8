"""The statistics a speed claim needs: summaries with t-intervals, Welch's test, ratio and difference CIs.

Pure Python (math + statistics from the standard library) so that the core installs without scipy. The Student-t
distribution goes through the regularized incomplete beta function (DLMF 8.17 / Abramowitz & Stegun 26.5.27):
    P(|T| > t) = I_x(df / 2, 1 / 2),  x = df / (df + t^2),
which is defined for fractional df, as Welch's test needs. Checked in tests against closed forms (df = 1, 2),
published quantiles and a numeric integration of the density.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Sequence

# Above this many degrees of freedom lgamma(df / 2) ~ 6e6 carries absolute rounding errors that reach ~1e-9 in
# the tail, while the normal with the first Cornish-Fisher term, t = z + (z^3 + z) / (4 df) (A&S 26.7.5), is off
# by the next term, ~3e-12 at the 97.5% point. So use the corrected normal there, for the cdf and the quantile.
_NORMAL_DF = 1e6
_EPS = 1e-15
_TINY = 1e-300


def _lentz(partial_numerator, max_terms: int = 100_000) -> float:
    """Value of 1 / (1 + d1 / (1 + d2 / (1 + ...))) by the modified Lentz method (Press et al., NR 3rd ed. 5.2).

    partial_numerator(k) gives d_k for k >= 1. Lentz keeps the ratios C_k = f_k / f_{k-1} and D_k = f_{k-1} / f_k
    instead of the convergents, so nothing overflows; _TINY stands in for a zero denominator.
    """
    f, c, d = _TINY, _TINY, 0.0
    for k in range(max_terms):
        a = 1.0 if k == 0 else partial_numerator(k)
        d = 1.0 + a * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + a / c
        c = c if abs(c) > _TINY else _TINY
        f *= c * d
        if abs(c * d - 1.0) < _EPS:
            return f
    raise ArithmeticError(f"incomplete beta continued fraction did not converge in {max_terms} terms")


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """Regularized incomplete beta I_x(a, b), with y = 1 - x passed in so callers keep its precision."""
    assert a > 0 and b > 0 and 0.0 <= x <= 1.0, (a, b, x)
    if x == 0.0 or y == 0.0:
        return 0.0 if x == 0.0 else 1.0
    # The fraction converges fast only for x < (a + 1) / (a + b + 2) (NR 6.4); otherwise use I_x(a,b) = 1 - I_y(b,a).
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, y, x)

    def d(k: int) -> float:  # DLMF 8.17.22: the even and odd partial numerators
        m = k // 2
        if k % 2 == 0:
            return m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m))
        return -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))

    log_front = a * math.log(x) + b * math.log(y) - math.log(a) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    return math.exp(log_front) * _lentz(d)


def _check_df(df: float) -> float:
    df = float(df)
    if not df > 0 or math.isinf(df):
        raise ValueError(f"degrees of freedom must be a finite number > 0, got {df}; use n - 1 for n samples")
    return df


def _t_tail(t: float, df: float) -> float:
    """P(T > t) for t >= 0, computed directly (not as 1 - cdf) so small p-values keep their digits."""
    if df >= _NORMAL_DF:  # invert the quantile's correction to first order: z = t - (t^3 + t) / (4 df)
        return 0.5 * math.erfc((t - (t**3 + t) / (4.0 * df)) / math.sqrt(2.0))
    t2 = t * t
    # x = df / (df + t^2) and 1 - x = t^2 / (df + t^2), each formed without subtracting from 1.
    return 0.5 * _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def _t_pdf(t: float, df: float) -> float:
    log_norm = math.lgamma((df + 1.0) / 2.0) - math.lgamma(df / 2.0) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1.0) / 2.0 * math.log1p(t * t / df))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom; df may be fractional (Welch)."""
    df = _check_df(df)
    t = float(t)
    if math.isnan(t):
        raise ValueError("t is NaN; check the inputs for NaN or zero variance")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = _t_tail(abs(t), df)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, e.g. t_quantile(0.975, n - 1) for a 95% two-sided interval."""
    df = _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie strictly between 0 and 1, got {p}; for a 95% interval use 0.975")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    q = 1.0 - p  # exact for p in [0.5, 1) (Sterbenz); solve tail(t) = q to keep precision far out in the tail
    z = NormalDist().inv_cdf(p)
    guess = z + (z**3 + z) / (4.0 * df)  # Cornish-Fisher start, A&S 26.7.5
    if df >= _NORMAL_DF:
        return guess
    lo, hi = 0.0, 1.0
    while _t_tail(hi, df) > q:  # grow the bracket: df = 1, p = 1 - 1e-12 needs t ~ 3e11
        lo, hi = hi, hi * 2.0
    t = min(max(guess, lo), hi)
    for _ in range(200):
        excess = _t_tail(t, df) - q  # > 0 means t is too small (tail decreases in t)
        if excess == 0.0:
            return t
        if excess > 0:
            lo = t
        else:
            hi = t
        # Newton on the tail (its derivative is -pdf), falling back to bisection when it leaves the bracket.
        step = excess / _t_pdf(t, df)
        new = t + step
        if not lo < new < hi:
            new = 0.5 * (lo + hi)
        if abs(new - t) <= 4 * _EPS * max(1.0, abs(t)):
            return new
        t = new
    return t


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


def _welch(va_n: float, vb_n: float, na: int, nb: int) -> float:
    """Welch-Satterthwaite degrees of freedom for the sum of the squared standard errors va/na + vb/nb."""
    return (va_n + vb_n) ** 2 / (va_n**2 / (na - 1) + vb_n**2 / (nb - 1))


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(t, two-sided p) for H0: mean(a) == mean(b), not assuming equal variances (Welch 1947).

    If both samples have zero variance the test is degenerate: p = 1.0 when the means are equal, else 0.0
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
    df = _welch(va / na, vb / nb, na, nb)
    return t, min(1.0, 2.0 * _t_tail(abs(t), df))


def diff_ci95(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the Welch 95% interval, d +- t_0.975(df_WS) * sqrt(va/na + vb/nb)."""
    na, ma, va = _mean_var(a, "diff_ci95(a)", 2)
    nb, mb, vb = _mean_var(b, "diff_ci95(b)", 2)
    d = ma - mb
    se2 = va / na + vb / nb
    if se2 == 0.0:
        return d, d, d
    half = t_quantile(0.975, _welch(va / na, vb / nb, na, nb)) * math.sqrt(se2)
    return d, d - half, d + half


def ratio_ci95(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(R, low, high) for R = mean(a) / mean(b), e.g. time ours / time airbench, with a 95% delta-method CI.

    Method: for independent samples the first-order Taylor expansion of R = A / B around the means gives
        Var(R) ~ va / (na mb^2) + ma^2 vb / (nb mb^4)
    (the two terms are the contributions of a and of b). The interval is R +- t_0.975(df) * sqrt(Var(R)), with df
    from Welch-Satterthwaite applied to those two terms, so it reduces to the Welch interval of mean(a) / mb when b
    has no noise. The delta method assumes mean(b) is well away from 0 (coefficient of variation of mean(b) small),
    which holds for wall-clock times; the interval is symmetric, so it is not the Fieller interval.
    """
    na, ma, va = _mean_var(a, "ratio_ci95(a)", 2)
    nb, mb, vb = _mean_var(b, "ratio_ci95(b)", 2)
    if mb == 0.0:
        raise ValueError("ratio_ci95: mean(b) is 0, the ratio is undefined; put the nonzero baseline in b")
    r = ma / mb
    term_a = va / (na * mb**2)
    term_b = ma**2 * vb / (nb * mb**4)
    if term_a + term_b == 0.0:
        return r, r, r
    half = t_quantile(0.975, _welch(term_a, term_b, na, nb)) * math.sqrt(term_a + term_b)
    return r, r - half, r + half
