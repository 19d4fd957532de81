"""Repeats of one harness run: a mean and a 95 % confidence interval for every headline metric.

One run on a shared machine says little; `harness --repeats N` runs the same load N times (the same
seed, so the same prompts and arrivals; the server's prefix cache emptied before each) and keeps every
run. Over the N values x_1..x_N of a metric (each run's request throughput, its P99 TTFT, ...):

    mean = (1/N) sum x_i,   s = sqrt( sum (x_i - mean)^2 / (N - 1) )   (the sample standard deviation)
    95 % interval = mean -/+ t_{0.975, N-1} * s / sqrt(N)

with t_{0.975, N-1} the 97.5 % quantile of Student's t distribution with N - 1 degrees of freedom (the
interval covers the metric's true mean in 95 % of such experiments if the runs are independent draws of a
normal distribution; Student, 1908). The quantile is found by bisection on the t distribution's
central probability P(|T| <= t), computed exactly for integer degrees of freedom by the finite series
of Abramowitz & Stegun 26.7.3 (odd) and 26.7.4 (even), with theta = atan(t / sqrt(nu)):

    nu = 1:        A = 2 theta / pi
    nu odd >= 3:   A = (2/pi) (theta + sin(theta) (cos(theta) + 2/3 cos^3(theta) + ...
                        + (2*4*...*(nu-3)) / (1*3*...*(nu-2)) cos^(nu-2)(theta)))
    nu even:       A = sin(theta) (1 + 1/2 cos^2(theta) + (1*3)/(2*4) cos^4(theta) + ...
                        + (1*3*...*(nu-3)) / (2*4*...*(nu-2)) cos^(nu-2)(theta))

Fewer than two values give no interval (None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "HEADLINE_METRICS",
    "MAX_REPEATS",
    "confidence_interval",
    "repeat_intervals",
    "t_central_probability",
    "t_quantile",
]

MAX_REPEATS = 1000

# The summary keys every interval is given for (vLLM's names).
HEADLINE_METRICS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def t_central_probability(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` degrees of freedom (A&S 26.7.3 / 26.7.4, module
    docstring). Raises ValueError for df < 1 or t < 0."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd
        if df == 1:
            return 2 * theta / math.pi
        term, total = math.cos(theta), math.cos(theta)
        for k in range(3, df - 1, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
            term *= (k - 1) / k * c2
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * total)
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
        term *= (k - 1) / k * c2
        total += term
    return math.sin(theta) * total


def t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile (in (0.5, 1)) of Student's t with `df` degrees of freedom, by
    bisection to 1e-12 on the central probability. Raises ValueError out of range."""
    if not 0.5 < probability < 1:
        raise ValueError(f"probability must be in (0.5, 1), got {probability}")
    central = 2 * probability - 1
    low, high = 0.0, 1.0
    while t_central_probability(high, df) < central:
        high *= 2
    while high - low > 1e-12 * max(1.0, high):
        mid = (low + high) / 2
        if t_central_probability(mid, df) < central:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def confidence_interval(values: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """Mean, sample std, Student's t interval at `level` (module docstring) of `values`: keys `n`,
    `mean`, `stdev`, `t`, `half_width`, `low`, `high` (None for the last four with fewer than two
    values). Raises ValueError for a level outside (0, 1) or a value that is not finite."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError("values must be finite")
    n = len(values)
    mean = sum(values) / n if n else None
    out: dict[str, Any] = {"n": n, "mean": mean, "stdev": None, "t": None, "half_width": None}
    out |= {"low": None, "high": None, "values": list(values)}
    if n < 2 or mean is None:
        return out
    stdev = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = t_quantile(0.5 + level / 2, n - 1)
    half = t * stdev / math.sqrt(n)
    out |= {"stdev": stdev, "t": t, "half_width": half, "low": mean - half, "high": mean + half}
    return out


def repeat_intervals(
    summaries: Sequence[Mapping[str, Any]], metrics: Sequence[str] = HEADLINE_METRICS
) -> dict[str, dict[str, Any]]:
    """{metric: confidence_interval of its value over `summaries`} for every metric of `metrics` that
    every summary defines (a metric None in some run, such as goodput without an SLO, is left out)."""
    out: dict[str, dict[str, Any]] = {}
    for metric in metrics:
        values = [s.get(metric) for s in summaries]
        if values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[metric] = confidence_interval([float(v) for v in values if v is not None])
    return out
