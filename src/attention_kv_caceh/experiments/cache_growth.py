"""What a growing KV cache costs: N decode steps over a DynamicKVCache and a PreallocatedKVCache.

Both caches decode the same N steps from the same inputs (built once, seeded). The Dynamic cache copies
its T old positions into a new array every step (`np.concatenate`), so its per-step time should grow
like a + b_dyn * T with b_dyn above the Preallocated cache's slope, which only pays for attention
reading T positions. The experiment, in the order of the user's notes (6.4):

1. oracle: both caches run in lockstep; every step's output and weights must agree (tolerance from the
   dtype, `oracle.tolerance_for`), and at a few steps both are checked against the float64 reference
   one sequence at a time (`oracle.check_decode_batch`). A mismatch raises OracleMismatch before
   anything is timed.
2. memory (untimed, tracemalloc on): per step, the bytes the cache's append allocated at its peak, the
   whole step's peak, the bytes still held afterwards, the cache's `nbytes` and the theoretical
   B x H_kv x T x D x itemsize x 2 of its T valid positions.
3. warm-up passes (unrecorded), then `repeats` timed passes; in each pass every step is timed on its
   own (`timing.measure` with one repeat: only the decode step sits inside the timed region) and kept.
   The two caches alternate which goes first from one repeat to the next.

Every statistic (per-position medians, fitted slopes with R^2, totals, checkpoints) is computed from
the raw rows by the functions below, which the report calls again on the rows read back from disk.

Shape letters as in `attention.py`: B batch, H query heads, H_kv KV heads, T cached positions, D head
dim, and N steps (T = step + 1 after each append).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.attention import multihead_decode_step, scaled_dot_product_attention
from attention_kv_caceh.cache import make_cache
from attention_kv_caceh.oracle import OracleMismatch, check_close, check_decode_batch, tolerance_for
from attention_kv_caceh.presets import get_preset
from attention_kv_caceh.timing import measure, summarize_samples

__all__ = [
    "CACHE_KINDS",
    "CacheFit",
    "CacheGrowthConfig",
    "CacheGrowthResult",
    "CacheGrowthSummary",
    "CacheMemoryRow",
    "CacheStepSample",
    "check_cache_oracle",
    "fit_line",
    "kv_size_card",
    "measure_cache_memory",
    "per_position_median",
    "rolling_median",
    "run_cache_growth",
    "summarize_cache_growth",
    "theoretical_kv_bytes",
]

CACHE_KINDS: tuple[str, str] = ("dynamic", "preallocated")
DTYPES = ("float32", "float64")
FloatArray = npt.NDArray[np.floating[Any]]


@dataclass(frozen=True)
class CacheGrowthConfig:
    """One cache-growth run. Sizes are counts; `model` is a preset name or "" (recorded, not applied:
    resolve a preset's shape into num_heads / num_kv_heads / head_dim before building the config).

    Defaults (B=2, H=H_kv=8, D=64, N=2048, 1 warm-up pass + 5 timed passes) keep a run near 40 s on a
    2-core machine while the Dynamic cache's copy (16 MiB per step at the end) clearly shows.

    Raises ValueError for non-positive sizes, H not a multiple of H_kv, negative warm-up, an unknown
    dtype or model preset, or oracle steps outside 1..N.
    """

    steps: int = 2048
    batch_size: int = 2
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 5
    warmup: int = 1
    seed: int = 42
    model: str = ""
    oracle_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_heads", "num_kv_heads", "head_dim", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        warmup: Any = self.warmup
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.model:
            get_preset(self.model)  # raises ValueError naming the known presets
        bad = [t for t in self.oracle_steps if not 1 <= t <= self.steps]
        if bad:
            raise ValueError(f"oracle_steps must lie in 1..{self.steps}, got {bad}")

    @property
    def checked_steps(self) -> tuple[int, ...]:
        """Positions T checked against the float64 reference: the given ones, else 1, 2, N/2, N."""
        if self.oracle_steps:
            return tuple(sorted(set(self.oracle_steps)))
        return tuple(sorted({1, min(2, self.steps), max(1, self.steps // 2), self.steps}))

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    def params(self) -> dict[str, Any]:
        """The run's parameters, as recorded on every raw row and in the metadata."""
        return {
            "batch_size": self.batch_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "model": self.model,
            "seed": self.seed,
            "warmup": self.warmup,
            "steps": self.steps,
        }


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass
class CacheGrowthResult:
    """What `run_cache_growth` returns: raw rows and their summary."""

    config: CacheGrowthConfig
    samples: list[CacheStepSample]
    memory: list[CacheMemoryRow]
    checked_steps: tuple[int, ...]
    summary: CacheGrowthSummary | None = field(default=None)


def theoretical_kv_bytes(
    batch_size: int, num_kv_heads: int, positions: int, head_dim: int, itemsize: int
) -> int:
    """Bytes of K and V for `positions` cached positions: B x H_kv x T x D x itemsize x 2."""
    return batch_size * num_kv_heads * positions * head_dim * itemsize * 2


def kv_size_card(config: CacheGrowthConfig) -> dict[str, Any]:
    """KV-cache sizes that relate this run to a real model (bytes).

    Per token for one layer (2 x H_kv x D x itemsize), per token for every layer of `config.model`
    (and at float16, what a served model usually keeps), and per sequence / batch at N tokens.
    """
    per_token_layer = theoretical_kv_bytes(1, config.num_kv_heads, 1, config.head_dim, config.itemsize)
    card: dict[str, Any] = {
        "kv_bytes_per_token_one_layer": per_token_layer,
        "kv_bytes_per_sequence_one_layer": per_token_layer * config.steps,
        "kv_bytes_batch_one_layer": per_token_layer * config.steps * config.batch_size,
    }
    if config.model:
        preset = get_preset(config.model)
        card["model_layers"] = preset.num_layers
        card["kv_bytes_per_token_all_layers"] = preset.kv_bytes_per_token(config.dtype)
        card["kv_bytes_per_token_all_layers_float16"] = preset.kv_bytes_per_token(np.float16)
        card["kv_bytes_per_sequence_all_layers"] = preset.kv_bytes_per_token(config.dtype) * config.steps
    return card


# ------------------------------------------------------------------------------------------ running


def _build_inputs(config: CacheGrowthConfig) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Seeded q `[N, B, H, 1, D]`, k and v `[N, B, H_kv, 1, D]`, built once and shared by both caches."""
    rng = np.random.default_rng(config.seed)
    n, b, h, h_kv, d = (
        config.steps,
        config.batch_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    dtype = np.dtype(config.dtype).type
    q = rng.standard_normal((n, b, h, 1, d), dtype=dtype)  # [N, B, H, 1, D]
    k = rng.standard_normal((n, b, h_kv, 1, d), dtype=dtype)  # [N, B, H_kv, 1, D]
    v = rng.standard_normal((n, b, h_kv, 1, d), dtype=dtype)  # [N, B, H_kv, 1, D]
    return q, k, v


def _new_cache(kind: str, config: CacheGrowthConfig) -> Any:
    return make_cache(
        kind,
        config.batch_size,
        config.num_kv_heads,
        config.head_dim,
        max_seq_len=config.steps,
        dtype=config.dtype,
    )


def check_cache_oracle(
    config: CacheGrowthConfig,
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    progress: Callable[[int], object] | None = None,
) -> tuple[int, ...]:
    """Run both caches in lockstep for N steps and check them; returns the positions T checked
    against the float64 reference. `progress(n)` reports n more decode steps done (both caches).

    Every step: Preallocated output and weights == Dynamic ones within `tolerance_for(dtype, D + T)`.
    At `config.checked_steps`: both caches' keys are equal, and each cache's output passes
    `check_decode_batch` (float64 reference, one sequence at a time). Raises OracleMismatch.
    """
    dynamic, prealloc = _new_cache("dynamic", config), _new_cache("preallocated", config)
    checked = config.checked_steps
    reported = 0
    for i in range(config.steps):
        t = i + 1
        out_d, w_d = multihead_decode_step(q[i], k[i], v[i], dynamic)  # [B, H, 1, D], [B, H, 1, T]
        out_p, w_p = multihead_decode_step(q[i], k[i], v[i], prealloc)
        rtol, atol = tolerance_for(config.dtype, config.head_dim + t)
        check_close(out_p, out_d, rtol=rtol, atol=atol, what=f"preallocated vs dynamic output at T={t}")
        check_close(w_p, w_d, rtol=rtol, atol=atol, what=f"preallocated vs dynamic weights at T={t}")
        if t in checked:
            if not np.array_equal(dynamic.keys, prealloc.keys):
                raise OracleMismatch(f"the two caches hold different keys at T={t}")
            check_decode_batch(q[i], dynamic.keys, dynamic.values, out_d, w_d)
            check_decode_batch(q[i], prealloc.keys, prealloc.values, out_p, w_p)
        if progress is not None and (t % 256 == 0 or t == config.steps):
            progress(2 * (t - reported))  # steps since the last report, both caches
            reported = t
    return checked


def measure_cache_memory(
    kind: str, config: CacheGrowthConfig, q: FloatArray, k: FloatArray, v: FloatArray
) -> list[CacheMemoryRow]:
    """Decode N steps on a fresh `kind` cache under tracemalloc; one CacheMemoryRow per step.

    Not timed (tracemalloc slows allocation). Raises ValueError if tracemalloc is already tracing
    (its numbers would mix with the caller's).
    """
    if tracemalloc.is_tracing():
        raise ValueError("tracemalloc is already tracing; stop it before measuring cache memory")
    cache = _new_cache(kind, config)
    params = config.params()
    del params["warmup"]
    rows: list[CacheMemoryRow] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(config.steps):
            t = i + 1
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            keys, values = cache.append(k[i], v[i])  # [B, H_kv, T, D] each
            mid, append_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            out, weights = scaled_dot_product_attention(q[i], keys, values)  # [B,H,1,D], [B,H,1,T]
            attention_peak = tracemalloc.get_traced_memory()[1]
            fresh = sum(int(a.nbytes) for a in (keys, values) if a.flags.owndata)
            del keys, values, out, weights
            after = tracemalloc.get_traced_memory()[0]
            rows.append(
                CacheMemoryRow(
                    cache=kind,
                    step=i,
                    sequence_length=t,
                    new_buffer_bytes=fresh,
                    append_peak_bytes=append_peak - before,
                    step_peak_bytes=max(append_peak, attention_peak, mid) - before,
                    retained_bytes=after - before,
                    traced_bytes=after - base,
                    cache_nbytes=int(cache.nbytes),
                    theoretical_bytes=theoretical_kv_bytes(
                        config.batch_size, config.num_kv_heads, t, config.head_dim, config.itemsize
                    ),
                    **params,
                )
            )
    finally:
        tracemalloc.stop()
    return rows


def _timed_pass(
    kind: str,
    repeat: int,
    config: CacheGrowthConfig,
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    record: bool,
) -> list[CacheStepSample]:
    """One pass of N decode steps on a fresh cache, each step timed alone; rows only if `record`."""
    cache = _new_cache(kind, config)
    params = config.params()
    rows: list[CacheStepSample] = []
    for i in range(config.steps):
        q_t, k_t, v_t = q[i], k[i], v[i]  # views, made outside the timed region
        elapsed = measure(multihead_decode_step, q_t, k_t, v_t, cache, warmup=0, repeats=1)[0]
        if record:
            rows.append(
                CacheStepSample(
                    cache=kind,
                    step=i,
                    sequence_length=i + 1,
                    elapsed_ms=elapsed,
                    repeat=repeat,
                    **params,
                )
            )
    return rows


def run_cache_growth(
    config: CacheGrowthConfig,
    *,
    samples: list[CacheStepSample] | None = None,
    memory: list[CacheMemoryRow] | None = None,
    progress: Callable[[int], object] | None = None,
    on_pass: Callable[[], None] | None = None,
) -> CacheGrowthResult:
    """Oracle, memory pass, warm-up passes, then `config.repeats` timed passes per cache.

    Rows are appended to `samples` / `memory` when given (so a caller still holds every sample taken
    when this raises or is interrupted), and `on_pass()` runs after each recorded pass and after the
    memory pass (a caller saves the raw files there). `progress(n)` reports n more steps done; the run
    makes `total_steps(config)` steps in all.

    Raises OracleMismatch (before any timing) when a check fails.
    """
    samples = [] if samples is None else samples
    memory = [] if memory is None else memory
    q, k, v = _build_inputs(config)

    def advance(n: int) -> None:
        if progress is not None:
            progress(n)

    checked = check_cache_oracle(config, q, k, v, progress=advance)
    for kind in CACHE_KINDS:
        memory.extend(measure_cache_memory(kind, config, q, k, v))
        advance(config.steps)
    if on_pass is not None:
        on_pass()
    for r in range(config.warmup + config.repeats):
        order = CACHE_KINDS if r % 2 == 0 else CACHE_KINDS[::-1]
        for kind in order:
            record = r >= config.warmup
            samples.extend(_timed_pass(kind, r - config.warmup, config, q, k, v, record))
            advance(config.steps)
            if record and on_pass is not None:
                on_pass()
    result = CacheGrowthResult(config, samples, memory, checked)
    result.summary = summarize_cache_growth(samples, memory)
    return result


def total_steps(config: CacheGrowthConfig) -> int:
    """Decode steps a run makes in all (oracle, memory, warm-up and timed passes, both caches)."""
    return 2 * config.steps * (2 + config.warmup + config.repeats)


# ------------------------------------------------------------------------------------- statistics


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
    - totals: `summarize_samples` of each repeat's N-step total (ms); total_ratio = dynamic P50 total /
      preallocated P50 total.
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
        per_repeat: dict[int, float] = {}
        for s in rows:
            per_repeat[s.repeat] = per_repeat.get(s.repeat, 0.0) + s.elapsed_ms
        totals[kind] = summarize_samples(list(per_repeat.values()))
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
