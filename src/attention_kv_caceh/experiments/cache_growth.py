"""What a growing KV cache costs: N decode steps over a DynamicKVCache and a PreallocatedKVCache.

Both caches decode the same N steps from the same inputs (built once, seeded). The Dynamic cache copies
its T old positions into a new array every step (`np.concatenate`), so its per-step time should grow
like a + b_dyn * T with b_dyn above the Preallocated cache's slope, which only pays for attention
reading T positions. The experiment, in order:

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
the raw rows by `cache_growth_stats`, which the report calls again on the rows read back from disk.
The row and statistics types are re-exported here, so they stay importable from this module.

Shape letters as in `attention.py`: B batch, H query heads, H_kv KV heads, T cached positions, D head
dim, and N steps (T = step + 1 after each append).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_kv_caceh.attention import multihead_decode_step
from attention_kv_caceh.cache import make_cache
from attention_kv_caceh.experiments.cache_growth_stats import (
    CACHE_KINDS,
    CacheFit,
    CacheGrowthSummary,
    CacheMemoryRow,
    CacheStepSample,
    FloatArray,
    fit_line,
    per_position_median,
    rolling_median,
    summarize_cache_growth,
)
from attention_kv_caceh.experiments.cache_memory import trace_decode_memory
from attention_kv_caceh.experiments.shape import check_shape
from attention_kv_caceh.options import ConfigError, check_options, option
from attention_kv_caceh.oracle import OracleMismatch, check_close, check_decode_batch, tolerance_for
from attention_kv_caceh.presets import get_preset, kv_cache_bytes
from attention_kv_caceh.timing import measure

__all__ = [
    "CACHE_KINDS",
    "CacheFit",
    "CacheGrowthConfig",
    "CacheGrowthResult",
    "CacheGrowthSummary",
    "CacheMemoryRow",
    "CacheStepSample",
    "check_cache_oracle",
    "estimate_run_bytes",
    "fit_line",
    "kv_size_card",
    "measure_cache_memory",
    "per_position_median",
    "rolling_median",
    "run_cache_growth",
    "steps_flag",
    "summarize_cache_growth",
    "total_steps",
]

DTYPES = ("float32", "float64")


def steps_flag(text: str) -> int:
    """`--steps` text -> an integer >= 2 (the summary fits a line over T). Raises ValueError saying why."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if value < 2:
        raise ValueError(f"must be >= 2 (the summary fits a line over T), got {value}")
    return value


@dataclass(frozen=True)
class CacheGrowthConfig:
    """One cache-growth run. Sizes are counts; `model` is a preset name or "" (recorded, not applied:
    resolve a preset's shape into num_heads / num_kv_heads / head_dim before building the config).

    Defaults (B=2, H=H_kv=8, D=64, N=2048, 1 warm-up pass + 5 timed passes) keep a run near 40 s on a
    2-core machine while the Dynamic cache's copy (16 MiB per step at the end) clearly shows.

    The shape fields take their flags from `shape.ShapeOptions`; `steps` below 2 is refused by its flag
    (`steps_flag`: the summary fits a line over T) but allowed here. Raises ConfigError (a ValueError)
    naming the field for non-positive sizes, H not a multiple of H_kv, a negative warm-up or seed, an
    unknown dtype or model preset, or oracle steps outside 1..N.
    """

    steps: int = option(2048, help="decode steps, at least 2", metavar="N", parse=steps_flag, minimum=1)
    batch_size: int = option(2, help="sequences decoded together", metavar="B", minimum=1)
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    dtype: str = option("float32", help="element type", choices=DTYPES)
    repeats: int = option(5, help="timed passes per cache", metavar="N", minimum=1)
    warmup: int = option(1, help="unrecorded passes per cache", metavar="N", minimum=0)
    seed: int = option(42, help="seed of the inputs, >= 0", metavar="N", minimum=0)
    model: str = ""
    oracle_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "repeats", "warmup", "seed"):
            value: Any = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(name, f"must be an integer, got {value!r}")
        check_options(self)
        check_shape(self)
        if self.model:
            try:
                get_preset(self.model)
            except ValueError as exc:
                raise ConfigError("model", str(exc)) from None
        bad = [t for t in self.oracle_steps if not 1 <= t <= self.steps]
        if bad:
            raise ConfigError("oracle_steps", f"must lie in 1..{self.steps}, got {bad}")

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


@dataclass
class CacheGrowthResult:
    """What `run_cache_growth` returns: raw rows and their summary."""

    config: CacheGrowthConfig
    samples: list[CacheStepSample]
    memory: list[CacheMemoryRow]
    checked_steps: tuple[int, ...]
    summary: CacheGrowthSummary | None = field(default=None)


def kv_size_card(config: CacheGrowthConfig) -> dict[str, Any]:
    """KV-cache sizes that relate this run to a real model (bytes).

    Per token for one layer (2 x H_kv x D x itemsize), per token for every layer of `config.model`
    (and at float16, what a served model usually keeps), and per sequence / batch at N tokens.
    """
    per_token_layer = kv_cache_bytes(1, config.num_kv_heads, 1, config.head_dim, config.itemsize)
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


# Bytes one raw row takes in memory (a dataclass instance with its dict and boxed values) plus its CSV
# text while the file is written: a round figure above what tracemalloc shows on CPython 3.11 (about
# 300 B per timed sample, 530 B per memory row, and about 100 B of CSV text held up to three times).
ROW_BYTES = 1024


def estimate_run_bytes(config: CacheGrowthConfig) -> int:
    """Memory a run needs at its peak, roughly (bytes): what `run_cache_growth` holds at once.

    The seeded inputs for N steps (q `[N, B, H, 1, D]`, k and v `[N, B, H_kv, 1, D]`); during the
    oracle both caches at T = N plus the Dynamic cache's next concatenation (3 x B x H_kv x N x D x
    itemsize x 2) and the float64 copies of K and V the reference makes (counted for the whole batch,
    an upper bound); and every raw row kept (2 x N memory rows and 2 x N x repeats timed samples, at
    ROW_BYTES each). Attention's own temporaries (`[B, H, 1, T]` scores) are small beside these.
    """
    n, b, h, h_kv, d = (
        config.steps,
        config.batch_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    inputs = n * b * (h + 2 * h_kv) * d * config.itemsize
    kv = kv_cache_bytes(b, h_kv, n, d, config.itemsize)  # one cache's K and V at T = N
    reference = kv_cache_bytes(b, h_kv, n, d, 8)  # float64 K and V of the oracle's reference
    rows = 2 * n * (1 + config.repeats) * ROW_BYTES
    return inputs + 3 * kv + reference + rows


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
    kind: str,
    config: CacheGrowthConfig,
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    rows: list[CacheMemoryRow] | None = None,
) -> list[CacheMemoryRow]:
    """Decode N steps on a fresh `kind` cache under tracemalloc; one CacheMemoryRow per step
    (`cache_memory.trace_decode_memory`).

    Each row is appended to `rows` (a new list when None) as soon as it is measured, so a caller
    keeps the rows of a pass cut short; returns that list. Not timed (tracemalloc slows allocation).
    Raises ValueError if tracemalloc is already tracing (its numbers would mix with the caller's).
    """
    params = config.params()
    del params["warmup"]
    return trace_decode_memory(kind, _new_cache(kind, config), q, k, v, params, [] if rows is None else rows)


def _timed_pass(
    kind: str,
    repeat: int,
    config: CacheGrowthConfig,
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    rows: list[CacheStepSample] | None,
) -> None:
    """One pass of N decode steps on a fresh cache, each step timed alone; each step's row is appended
    to `rows` as soon as it is timed (so a pass cut short keeps its steps), none when `rows` is None."""
    cache = _new_cache(kind, config)
    params = config.params()
    for i in range(config.steps):
        q_t, k_t, v_t = q[i], k[i], v[i]  # views, made outside the timed region
        elapsed = measure(multihead_decode_step, q_t, k_t, v_t, cache, warmup=0, repeats=1)[0]
        if rows is not None:
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


def run_cache_growth(
    config: CacheGrowthConfig,
    *,
    samples: list[CacheStepSample] | None = None,
    memory: list[CacheMemoryRow] | None = None,
    progress: Callable[[int], object] | None = None,
    on_pass: Callable[[], None] | None = None,
) -> CacheGrowthResult:
    """Oracle, memory pass, warm-up passes, then `config.repeats` timed passes per cache.

    Rows are appended to `samples` / `memory` (when given) as each step is measured, so a caller
    still holds every sample taken when this raises or is interrupted, those of a pass cut part-way
    included (fewer than N rows for that cache and repeat); and `on_pass()` runs after each recorded pass and after the
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
        measure_cache_memory(kind, config, q, k, v, memory)
        advance(config.steps)
    if on_pass is not None:
        on_pass()
    for r in range(config.warmup + config.repeats):
        order = CACHE_KINDS if r % 2 == 0 else CACHE_KINDS[::-1]
        for kind in order:
            record = r >= config.warmup
            _timed_pass(kind, r - config.warmup, config, q, k, v, samples if record else None)
            advance(config.steps)
            if record and on_pass is not None:
                on_pass()
    result = CacheGrowthResult(config, samples, memory, checked)
    result.summary = summarize_cache_growth(samples, memory)
    return result


def total_steps(config: CacheGrowthConfig) -> int:
    """Decode steps a run makes in all (oracle, memory, warm-up and timed passes, both caches)."""
    return 2 * config.steps * (2 + config.warmup + config.repeats)
