"""The raw rows of a cache-growth run and every statistic computed from them.

`cache_growth.run_cache_growth` writes these rows (one `CacheStepSample` per timed decode step, one
`CacheMemoryRow` per untimed step under tracemalloc); the functions here turn them into per-position
medians, fitted slopes with R^2, N-step totals, checkpoints and the T from which the Dynamic cache's
copy dominates. The run calls `summarize_cache_growth` on its rows, and the report calls it again on
the rows read back from disk, so both show the same figures; `summary_rows` turns a summary into the
summary CSV's rows (its printed text is `report/cache_text.py`). Nothing here decodes, times or prints.

Shape letters as in `attention.py`: B batch, H query heads, H_kv KV heads, T cached positions, D head
dim, and N steps (T = step + 1 after each append); P is the number of distinct positions T.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.timing import summarize_samples

__all__ = [
    "CACHE_KINDS",
    "SUMMARY_FIELDS",
    "CacheFit",
    "CacheGrowthSummary",
    "CacheMemoryRow",
    "CacheStepSample",
    "fit_line",
    "partial_passes",
    "per_position_median",
    "rolling_median",
    "summarize_cache_growth",
    "summary_rows",
]

CACHE_KINDS: tuple[str, str] = ("dynamic", "preallocated")
FloatArray = npt.NDArray[np.floating[Any]]


@dataclass(frozen=True, slots=True)
class CacheStepSample:
    """One timed decode step: one row of the raw CSV. `elapsed_ms` is wall time (perf_counter_ns)."""

    cache: str
    step: int
    sequence_length: int
    elapsed_ms: float
    repeat: int
    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model: str
    seed: int
    warmup: int
    steps: int


@dataclass(frozen=True, slots=True)
class CacheMemoryRow:
    """One untimed step under tracemalloc (bytes). T = sequence_length positions after the append.

    new_buffer_bytes: the arrays' own accounting: nbytes of the returned keys and values that own
    their data (fresh buffers: the theoretical size for the Dynamic cache, 0 for the Preallocated one's
    views).
    append_peak_bytes: traced peak during `cache.append` above the level before it. The Dynamic cache
    concatenates K, drops the old K, then concatenates V, so its peak is one new array (half of
    new_buffer_bytes); the Preallocated one allocates only a few small view objects.
    step_peak_bytes: the same over the whole step (append, then attention's temporaries).
    retained_bytes: traced bytes held after the step minus before it (what the cache grew by).
    cache_nbytes: `cache.nbytes` (K and V buffers as allocated); theoretical_bytes: B x H_kv x T x D x
    itemsize x 2, the valid positions only.
    """

    cache: str
    step: int
    sequence_length: int
    new_buffer_bytes: int
    append_peak_bytes: int
    step_peak_bytes: int
    retained_bytes: int
    traced_bytes: int
    cache_nbytes: int
    theoretical_bytes: int
    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model: str
    seed: int
    steps: int


@dataclass(frozen=True)
class CacheFit:
    """Least-squares line per-step ms = intercept_ms + slope_ms_per_position * T (np.polyfit, deg 1).

    Fitted to the per-position median over repeats (one point per T); `r2` = 1 - SS_res / SS_tot of
    that fit, `r2_raw` the R^2 of the same line against every raw sample.
    """

    cache: str
    slope_ms_per_position: float
    intercept_ms: float
    r2: float
    r2_raw: float
    points: int


@dataclass(frozen=True)
class CacheGrowthSummary:
    """Statistics of one run, computed from raw rows only (see `summarize_cache_growth`)."""

    fits: dict[str, CacheFit]
    totals: dict[str, dict[str, float]]
    total_ratio: float
    checkpoints: list[dict[str, float]]
    copy_visible_from: int | None
    copy_dominates_from: int | None
    copy_dominates_fitted: float | None
    memory: dict[str, dict[str, float]]


def fit_line(x: Sequence[float] | FloatArray, y: Sequence[float] | FloatArray) -> tuple[float, float, float]:
    """Least squares y = intercept + slope * x with np.polyfit; returns (slope, intercept, R^2).

    R^2 = 1 - SS_res / SS_tot (nan when y is constant). Raises ValueError for fewer than 2 points or
    mismatched lengths.
    """
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1 or xs.size < 2:
        raise ValueError(f"need two 1-D sequences of equal length >= 2, got {xs.shape} and {ys.shape}")
    slope, intercept = (float(c) for c in np.polyfit(xs, ys, 1))
    return slope, intercept, _r2(xs, ys, slope, intercept)


def _r2(xs: FloatArray, ys: FloatArray, slope: float, intercept: float) -> float:
    residual = ys - (intercept + slope * xs)
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    return float("nan") if ss_tot == 0 else 1.0 - float(np.sum(residual**2)) / ss_tot


def per_position_median(
    samples: Iterable[CacheStepSample], cache: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """(T `[P]`, median ms over repeats at each T `[P]`) for one cache, T ascending."""
    by_t: dict[int, list[float]] = {}
    for s in samples:
        if s.cache == cache:
            by_t.setdefault(s.sequence_length, []).append(s.elapsed_ms)
    ts = np.array(sorted(by_t), dtype=np.int64)
    medians = np.array([float(np.median(by_t[int(t)])) for t in ts], dtype=np.float64)
    return ts, medians


def rolling_median(values: Sequence[float] | FloatArray, window: int) -> npt.NDArray[np.float64]:
    """Centred rolling median `[P]` (the window shrinks at the ends). Raises ValueError if window < 1."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    y = np.asarray(values, dtype=np.float64)
    half = window // 2
    return np.array(
        [float(np.median(y[max(0, i - half) : i + half + 1])) for i in range(y.size)],
        dtype=np.float64,
    )


def partial_passes(samples: Iterable[CacheStepSample], memory: Iterable[CacheMemoryRow] = ()) -> list[str]:
    """The passes cut part-way (a run stopped mid-pass keeps their rows): each cache and repeat whose
    timed rows, and each cache whose memory rows, are fewer than the run's `steps`, as "dynamic
    repeat 2" / "dynamic memory pass". Empty when every pass is complete."""
    counts: dict[tuple[str, int], tuple[int, int]] = {}
    for s in samples:
        n, _ = counts.get((s.cache, s.repeat), (0, s.steps))
        counts[(s.cache, s.repeat)] = (n + 1, s.steps)
    out = [f"{cache} repeat {r}" for (cache, r), (n, steps) in sorted(counts.items()) if n < steps]
    mem: dict[str, tuple[int, int]] = {}
    for m in memory:
        n, _ = mem.get(m.cache, (0, m.steps))
        mem[m.cache] = (n + 1, m.steps)
    return out + [f"{cache} memory pass" for cache, (n, steps) in sorted(mem.items()) if n < steps]


def _window(steps: int) -> int:
    return max(1, steps // 64)


def _first_sustained(ts: npt.NDArray[np.int64], condition: npt.NDArray[np.bool_]) -> int | None:
    """Smallest T from which `condition` holds at every later T; None when it fails at the last T."""
    if condition.size == 0 or not condition[-1]:
        return None
    failing = np.flatnonzero(~condition)
    start = 0 if failing.size == 0 else int(failing[-1]) + 1
    return int(ts[start])


def summarize_cache_growth(
    samples: Sequence[CacheStepSample], memory: Sequence[CacheMemoryRow] = ()
) -> CacheGrowthSummary:
    """Fits, totals, checkpoints, copy dominance and memory figures from raw rows.

    - fits: `CacheFit` per cache (per-position median over repeats, np.polyfit degree 1).
    - totals: `summarize_samples` of each complete repeat's N-step total (ms); a pass cut part-way (fewer
      rows than its `steps`) is left out of the totals only, and a cache without a complete pass has
      nan totals; total_ratio = dynamic P50 total / preallocated P50 total.
    - checkpoints: at T = N/16, N/8, N/4, N/2, N: P50 of the samples whose T lies in the window
      (T - N/64, T], all repeats, per cache, and their ratio.
    - copy_visible_from / copy_dominates_from: the first T from which the rolling median (window N/64)
      of the Dynamic step time stays above 1.1x / 2x the Preallocated one to the end (2x: the copy costs
      more than the whole Preallocated step); None when not reached within N. copy_dominates_fitted: T
      where the fitted lines give dynamic = 2 x preallocated (None when they never do for T > 0).
    - memory, per cache: append peak bytes at the first and last step and their fitted slope (bytes
      per position), the same slope for new-buffer bytes, the largest step peak, and nbytes against the theoretical size at T = N.

    Raises ValueError when a cache has no samples or fewer than two positions.
    """
    fits: dict[str, CacheFit] = {}
    totals: dict[str, dict[str, float]] = {}
    medians: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = {}
    for kind in CACHE_KINDS:
        rows = [s for s in samples if s.cache == kind]
        if not rows:
            raise ValueError(f"no samples for the {kind} cache")
        ts, med = per_position_median(rows, kind)
        if ts.size < 2:
            raise ValueError(f"the {kind} cache has samples at {ts.size} position(s); a fit needs 2")
        slope, intercept, r2 = fit_line(ts.astype(np.float64), med)
        raw_t = np.array([s.sequence_length for s in rows], dtype=np.float64)
        raw_y = np.array([s.elapsed_ms for s in rows], dtype=np.float64)
        fits[kind] = CacheFit(kind, slope, intercept, r2, _r2(raw_t, raw_y, slope, intercept), int(ts.size))
        per_repeat: dict[int, list[float]] = {}
        for s in rows:
            per_repeat.setdefault(s.repeat, []).append(s.elapsed_ms)
        complete = [sum(v) for v in per_repeat.values() if len(v) >= rows[0].steps]
        totals[kind] = (
            summarize_samples(complete)
            if complete
            else dict.fromkeys(summarize_samples([0.0]), float("nan")) | {"count": 0.0}
        )
        medians[kind] = (ts, med)

    total_ratio = totals["dynamic"]["p50_ms"] / totals["preallocated"]["p50_ms"]
    n = int(max(medians["dynamic"][0].max(), medians["preallocated"][0].max()))
    w = _window(n)
    checkpoints: list[dict[str, float]] = []
    for t in sorted({max(1, n // 16), max(1, n // 8), max(1, n // 4), max(1, n // 2), n}):
        row: dict[str, float] = {"sequence_length": float(t)}
        for kind in CACHE_KINDS:
            window = [s.elapsed_ms for s in samples if s.cache == kind and t - w < s.sequence_length <= t]
            row[f"{kind}_p50_ms"] = summarize_samples(window)["p50_ms"] if window else float("nan")
        row["ratio"] = row["dynamic_p50_ms"] / row["preallocated_p50_ms"]
        checkpoints.append(row)

    ts_d, med_d = medians["dynamic"]
    ts_p, med_p = medians["preallocated"]
    common, i_d, i_p = np.intersect1d(ts_d, ts_p, return_indices=True)
    ratio = rolling_median(med_d[i_d], w) / rolling_median(med_p[i_p], w)
    common = common.astype(np.int64)
    fd, fp = fits["dynamic"], fits["preallocated"]
    denominator = fd.slope_ms_per_position - 2 * fp.slope_ms_per_position
    crossing = (2 * fp.intercept_ms - fd.intercept_ms) / denominator if denominator > 0 else None
    return CacheGrowthSummary(
        fits=fits,
        totals=totals,
        total_ratio=total_ratio,
        checkpoints=checkpoints,
        copy_visible_from=_first_sustained(common, ratio >= 1.1),
        copy_dominates_from=_first_sustained(common, ratio >= 2.0),
        copy_dominates_fitted=None if crossing is None else max(0.0, crossing),
        memory=_memory_summary(memory),
    )


def _memory_summary(memory: Sequence[CacheMemoryRow]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for kind in CACHE_KINDS:
        rows = sorted((m for m in memory if m.cache == kind), key=lambda m: m.sequence_length)
        if not rows:
            continue
        ts = np.array([m.sequence_length for m in rows], dtype=np.float64)
        append = np.array([m.append_peak_bytes for m in rows], dtype=np.float64)
        fresh = np.array([m.new_buffer_bytes for m in rows], dtype=np.float64)
        slope = fit_line(ts, append)[0] if len(rows) >= 2 else float("nan")
        fresh_slope = fit_line(ts, fresh)[0] if len(rows) >= 2 else float("nan")
        last = rows[-1]
        out[kind] = {
            "append_bytes_first_step": float(rows[0].append_peak_bytes),
            "append_bytes_last_step": float(last.append_peak_bytes),
            "append_bytes_per_position": slope,
            "new_buffer_bytes_last_step": float(last.new_buffer_bytes),
            "new_buffer_bytes_per_position": fresh_slope,
            "max_step_peak_bytes": float(max(m.step_peak_bytes for m in rows)),
            "max_traced_bytes": float(max(m.traced_bytes for m in rows)),
            "final_sequence_length": float(last.sequence_length),
            "final_cache_nbytes": float(last.cache_nbytes),
            "final_theoretical_bytes": float(last.theoretical_bytes),
        }
    return out


# Columns of the summary CSV (`summary_rows`), also its header when no summary exists yet.
SUMMARY_FIELDS: tuple[str, ...] = (
    "cache",
    "slope_ms_per_position",
    "intercept_ms",
    "r2",
    "r2_raw",
    "total_p50_ms",
    "total_ratio_dynamic_over_preallocated",
)


def summary_rows(summary: CacheGrowthSummary) -> list[dict[str, Any]]:
    """One row per cache kind: fitted slope, intercept, R^2 and N-step total (the summary CSV)."""
    rows: list[dict[str, Any]] = []
    for kind in CACHE_KINDS:
        f, t = summary.fits[kind], summary.totals[kind]
        rows.append(
            {
                "cache": kind,
                "slope_ms_per_position": f.slope_ms_per_position,
                "intercept_ms": f.intercept_ms,
                "r2": f.r2,
                "r2_raw": f.r2_raw,
                "total_p50_ms": t["p50_ms"],
                "total_ratio_dynamic_over_preallocated": summary.total_ratio,
            }
        )
    return rows
