"""Sweeps: one harness run per point of a grid over the load, the throughput-latency curve, its knee,
and the search for the highest request rate that meets an SLO.

A sweep varies one axis, the client's `concurrency` or the `request_rate`, and keeps every other setting
(seed, prompts, lengths) the same, so each point is exactly the harness run of its settings. Each point
may be repeated (`repeats`); its rows in the summary CSV are one per repeat (`sweep_row`).

The knee is the scan's saturation rule applied to the curve (`experiments.scan_stats.doubling_gains_xy`):
the first point from which doubling the load raises output tokens/s by less than 10 % per doubling
(`SATURATION_GAIN`), over the mean of each point's repeats. An infinite rate cannot be doubled and is left
out of the rule.

The SLO search (vLLM's `sweep serve_sla`) looks for the highest request rate whose goodput (`--goodput`'s
meaning: every set objective met) covers at least SLO_PASS_FRACTION of the requests, failed requests
counting as not good: it doubles (or halves) the rate from a start until one rate passes and one fails,
then bisects between the highest passing and the lowest failing rate, within `max_runs` runs in all.
Every try is returned, so the search can be audited.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from attention_kv_caceh.timing import SATURATION_GAIN, doubling_gains_xy

__all__ = [
    "CSV_FIELDS",
    "SLO_PASS_FRACTION",
    "Axis",
    "Knee",
    "ParetoPoint",
    "SloSearch",
    "SloTry",
    "find_knee",
    "good_fraction",
    "pareto_points",
    "point_means",
    "search_slo_rate",
    "sweep_row",
]

Axis = Literal["concurrency", "request_rate"]
SLO_PASS_FRACTION = 0.99

# One row per point and repeat (the summary CSV).
CSV_FIELDS = (
    "axis",
    "value",
    "repeat",
    "concurrency",
    "request_rate",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "p99_lateness_ms",
    "good_fraction",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate",
    "preemptions",
    "prefix_cache_reset",
    "jsonl",
)


def good_fraction(summary: Mapping[str, Any]) -> float | None:
    """Good requests / all requests of a run (failed ones are not good); None without an SLO."""
    if summary.get("good_requests") is None or not summary.get("num_requests"):
        return None
    return summary["good_requests"] / summary["num_requests"]


def sweep_row(
    axis: Axis,
    concurrency: int,
    request_rate: float,
    repeat: int,
    summary: Mapping[str, Any],
    *,
    reset: str,
    jsonl: str,
) -> dict[str, Any]:
    """The CSV row of one run of a sweep from its harness summary. `reset`: what became of the prefix
    cache reset before it ("yes", "not offered (HTTP 404)", "-" for the simulated backend, ...)."""
    counters: Mapping[str, Any] = summary.get("server_counters") or {}
    row: dict[str, Any] = {
        "axis": axis,
        "value": concurrency if axis == "concurrency" else request_rate,
        "repeat": repeat,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "duration_s": summary["duration"],
        "good_fraction": good_fraction(summary),
        "prefix_cache_queries": counters.get("prefix_cache_queries"),
        "prefix_cache_hits": counters.get("prefix_cache_hits"),
        "prefix_cache_hit_rate": counters.get("prefix_cache_hit_rate"),
        "preemptions": counters.get("preemptions"),
        "prefix_cache_reset": reset,
        "jsonl": jsonl,
    }
    for key in CSV_FIELDS:
        if key not in row:
            row[key] = summary.get(key)
    return row


def point_means(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """(value, mean of `key` over the repeats) for each point of `rows`, in the order of first sight;
    repeats where `key` is None are left out (a point with none is too)."""
    sums: dict[float, list[float]] = {}
    for row in rows:
        if row.get(key) is not None:
            sums.setdefault(float(row["value"]), []).append(float(row[key]))
    return [(value, sum(v) / len(v)) for value, v in sums.items()]


@dataclass(frozen=True)
class ParetoPoint:
    """One grid value of a sweep on the Pareto plot: output tokens/s per user (1000 / median TPOT ms:
    the decode rate of the median request, as each user sees its stream) and total output tokens/s,
    each the mean over the point's repeats; `frontier`: no other point is at least as good on both with
    one strictly better."""

    value: float
    per_user: float
    total: float
    frontier: bool


def pareto_points(rows: Sequence[Mapping[str, Any]]) -> list[ParetoPoint]:
    """The Pareto points of a sweep's rows (one per grid value with a defined median TPOT), in the order
    of first sight. Dominance: a point is dominated when another has per-user and total throughput
    both >= its own and one of them >; the frontier is the points no other dominates."""
    per_user: dict[float, list[float]] = {}
    for row in rows:
        tpot = row.get("median_tpot_ms")
        if tpot is not None and float(tpot) > 0 and row.get("output_throughput") is not None:
            per_user.setdefault(float(row["value"]), []).append(1000.0 / float(tpot))
    totals = dict(point_means(rows, "output_throughput"))
    points = [(v, sum(u) / len(u), totals[v]) for v, u in per_user.items() if v in totals]
    return [
        ParetoPoint(
            v,
            u,
            t,
            not any((u2 >= u and t2 >= t) and (u2 > u or t2 > t) for v2, u2, t2 in points if v2 != v),
        )
        for v, u, t in points
    ]


@dataclass(frozen=True)
class Knee:
    """The knee of a curve: `value` (None: not reached), the gains per doubling between consecutive
    points [(x1, x2, gain)] and a sentence that says it."""

    value: float | None
    gains: list[tuple[float, float, float]]
    verdict: str


def find_knee(rows: Sequence[Mapping[str, Any]], axis: Axis, gain: float = SATURATION_GAIN) -> Knee:
    """The knee of the output tokens/s curve of `rows` (module docstring)."""
    points = [
        (x, y) for x, y in point_means(rows, "output_throughput") if math.isfinite(x) and x > 0 and y > 0
    ]
    gains = doubling_gains_xy(points)
    name = "concurrency" if axis == "concurrency" else "request rate"
    for x1, x2, g in gains:
        if g < gain:
            return Knee(
                x1,
                gains,
                f"knee at {name} {x1:g}: going to {x2:g} raised output tokens/s by {100 * g:.1f} % per "
                f"doubling (< {100 * gain:.0f} %)",
            )
    if not gains:
        return Knee(None, gains, f"knee not reached: fewer than two finite {name} points to compare")
    x1, x2, g = min(gains, key=lambda t: t[2])
    return Knee(
        None,
        gains,
        f"knee not reached: every doubling raised output tokens/s by >= {100 * gain:.0f} % "
        f"(smallest: {100 * g:.1f} % from {x1:g} to {x2:g})",
    )


@dataclass(frozen=True)
class SloTry:
    """One run of the SLO search: its rate, good fraction, whether it passed, and its summary row."""

    rate: float
    good_fraction: float
    passed: bool
    row: Mapping[str, Any]


@dataclass(frozen=True)
class SloSearch:
    """The result: the highest passing rate and the lowest failing one found (None: none), every try."""

    best_rate: float | None
    lowest_failing_rate: float | None
    tries: list[SloTry]


def search_slo_rate(
    try_rate: Callable[[float], tuple[float, Mapping[str, Any]]],
    *,
    start: float = 1.0,
    bracket: tuple[float, float] | None = None,
    max_runs: int = 8,
    pass_fraction: float = SLO_PASS_FRACTION,
) -> SloSearch:
    """Search the highest request rate whose good fraction is >= `pass_fraction` (module docstring).

    `try_rate(rate)` runs the load at `rate` and returns (good fraction, its summary row). Without a
    `bracket` (low, high), the search starts at `start` and doubles after a pass, halves after a fail,
    until it has one of each; then it bisects. Stops after `max_runs` tries. Raises ValueError for a
    rate that is not a finite number > 0, a bracket with low >= high, or max_runs < 1.
    """
    if max_runs < 1:
        raise ValueError(f"--max-runs must be >= 1, got {max_runs}")
    for rate in (start, *(bracket or ())):
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"--request-rate {rate}: the SLO search needs finite rates > 0")
    if bracket is not None and not bracket[0] < bracket[1]:
        raise ValueError(f"--request-rate {bracket[0]:g} {bracket[1]:g}: expected LOW < HIGH")
    tries: list[SloTry] = []
    low: float | None = None  # highest passing
    high: float | None = None  # lowest failing

    def attempt(rate: float) -> bool:
        nonlocal low, high
        fraction, row = try_rate(rate)
        passed = fraction >= pass_fraction
        tries.append(SloTry(rate, fraction, passed, row))
        if passed and (low is None or rate > low):
            low = rate
        if not passed and (high is None or rate < high):
            high = rate
        return passed

    queue = list(bracket) if bracket is not None else [start]
    for rate in queue:
        if len(tries) < max_runs:
            attempt(rate)
    rate = queue[-1]
    while len(tries) < max_runs and (low is None or high is None):
        rate = rate * 2 if high is None else rate / 2
        if high is not None and low is None:
            rate = min(rate, high / 2)
        attempt(rate)
    while len(tries) < max_runs and low is not None and high is not None:
        attempt((low + high) / 2)
    return SloSearch(low, high, tries)
