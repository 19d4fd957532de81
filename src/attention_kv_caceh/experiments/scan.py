"""The batch-size scan: how the batch size B changes a decode step's latency and throughput.

For each batch size B, one decode step is timed: append one position to a KV cache that holds T
positions, then attend a `[B, H, 1, D]` query over the T+1 cached keys and values (`[B, H_kv, T+1, D]`).
Projections are not part of the step: q_t, k_t and v_t are inputs built once, so what is timed is the
attention over the cache and the cache's own append cost (the copy of a Dynamic cache, the slice write
of a Preallocated one).

Order: inputs built once from the seed and shared by every B (the first B sequences of one
`[B_max, ...]` set) -> per implementation (`scan_impls`: numpy, fused, torch-sdpa, in that order)
the step's output checked against a float64 per-sequence reference -> warm-up -> timed raw samples
(the cache is rewound to T outside the timed region before every call) -> after the last
implementation, a read-bandwidth probe over as many bytes as the step reads from the cache, in the
same run. The summary table and the saturation rule over the raw samples are `scan_stats.py`.

Shape legend as in attention.py: B batch, H query heads, H_kv KV heads, T cached positions, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.cache import DynamicKVCache, PreallocatedKVCache, make_cache
from attention_kv_caceh.experiments.scan_impls import IMPLS, check_step, make_step
from attention_kv_caceh.experiments.shape import check_shape
from attention_kv_caceh.options import ConfigError, check_options, option
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.presets import kv_cache_bytes
from attention_kv_caceh.timing import Sample, measure

__all__ = [
    "SAMPLE_FIELDS",
    "BatchInterrupted",
    "BatchResult",
    "ScanConfig",
    "ScanInputs",
    "batch_size_list",
    "build_inputs",
    "estimate_scan_bytes",
    "iter_scan",
    "kv_bytes_per_step",
    "prefilled_cache",
    "run_batch",
]

FloatArray = npt.NDArray[np.floating[Any]]

SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Sample))
CACHE_KINDS = ("dynamic", "preallocated")
DTYPES = ("float32", "float64")


def batch_size_list(text: str) -> tuple[int, ...]:
    """`--batch-sizes` text -> distinct integers >= 1 ("1,2,4,8"). Raises ValueError saying why."""
    try:
        values = tuple(int(part) for part in text.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"must be positive, got {list(values)}")
    if len(set(values)) != len(values):
        raise ValueError(f"must be distinct, got {list(values)}")
    return values


@dataclass(frozen=True)
class ScanConfig:
    """One scan: the batch sizes and the attention shape every B shares. Defaults: B = 1, 2, 4, 8 at
    T = 128, one head of D = 64. The shape fields take their flags from `shape.ShapeOptions` (a preset
    resolved into H, H_kv and D); `model` records the preset's name. Raises ConfigError naming the field."""

    batch_sizes: tuple[int, ...] = option(
        (1, 2, 4, 8),
        help="batch sizes to scan",
        metavar="B,B,...",
        parse=batch_size_list,
        minimum=1,
        default_text="1,2,4,8",
    )
    seq_len: int = option(128, help="cached positions T before the step", metavar="T", minimum=1)
    head_dim: int = 64
    num_heads: int = 1
    num_kv_heads: int = 1
    dtype: str = option("float32", help="element type", choices=DTYPES)
    cache: str = option(
        "dynamic",
        help="dynamic: np.concatenate each step; preallocated: one buffer, write a slice",
        choices=CACHE_KINDS,
    )
    model: str = ""
    warmup: int = option(3, help="unrecorded calls before timing", metavar="N", minimum=0)
    repeats: int = option(30, help="timed calls per batch size", metavar="N", minimum=1)
    seed: int = option(42, help="seed of np.random.default_rng for all inputs", metavar="SEED", minimum=0)

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ConfigError("batch_sizes", "must not be empty")
        check_options(self)
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ConfigError("batch_sizes", f"must be distinct, got {list(self.batch_sizes)}")
        check_shape(self)


@dataclass(frozen=True)
class ScanInputs:
    """Inputs for the largest B, built once; batch size b uses the first b sequences.

    q_t `[B_max, H, 1, D]`, k_prefix/v_prefix `[B_max, H_kv, T, D]` (the cached positions),
    k_t/v_t `[B_max, H_kv, 1, D]` (the position each step appends). Every sequence has its own data.
    """

    q_t: FloatArray
    k_prefix: FloatArray
    v_prefix: FloatArray
    k_t: FloatArray
    v_t: FloatArray


@dataclass(frozen=True)
class BatchResult:
    """What one batch size produced: its raw samples, probe samples and the oracle's verdict.

    samples: every implementation's, tagged by `Sample.impl`; oracle_max_abs_error: the largest over
    the implementations timed; oracle_errors: (impl, max |error| vs float64) per implementation timed;
    oracle_failures: (impl, message) per implementation whose oracle failed (nothing timed for it).
    """

    batch_size: int
    samples: tuple[Sample, ...]
    probe_samples_ms: tuple[float, ...]
    kv_bytes_per_step: int
    oracle_max_abs_error: float
    oracle_errors: tuple[tuple[str, float], ...] = ()
    oracle_failures: tuple[tuple[str, str], ...] = ()


def kv_bytes_per_step(config: ScanConfig, batch_size: int) -> int:
    """Bytes of K and V one decode step reads: 2 * B * H_kv * (T + 1) * D * itemsize."""
    itemsize = int(np.dtype(config.dtype).itemsize)
    return kv_cache_bytes(batch_size, config.num_kv_heads, config.seq_len + 1, config.head_dim, itemsize)


def estimate_scan_bytes(config: ScanConfig, num_impls: int = 1) -> int:
    """Memory a scan needs at its peak, roughly (bytes): q_t, the prefix and new K/V at the largest B;
    the cache, the oracle's second cache, a concatenation's new arrays and the probe (4 x the K/V
    bytes of a step); ~400 B per raw and probe sample row of every implementation (`num_impls`)."""
    b = max(config.batch_sizes)
    itemsize = 4 if config.dtype == "float32" else 8
    kv = kv_bytes_per_step(config, b)
    inputs = itemsize * b * (config.num_heads * config.head_dim) + kv
    rows = config.repeats * (len(config.batch_sizes) + 1) * 2 * num_impls
    return inputs + 4 * kv + rows * 400


def build_inputs(config: ScanConfig) -> ScanInputs:
    """Draw every input once from `np.random.default_rng(config.seed)`, standard normal, cast to dtype."""
    rng = np.random.default_rng(config.seed)
    b, h, h_kv, t, d = (
        max(config.batch_sizes),
        config.num_heads,
        config.num_kv_heads,
        config.seq_len,
        config.head_dim,
    )
    dtype = np.dtype(config.dtype)

    def draw(*shape: int) -> FloatArray:
        return rng.standard_normal(shape).astype(dtype)  # rng gives float64: cast explicitly

    return ScanInputs(
        q_t=draw(b, h, 1, d),  # [B_max, H, 1, D]
        k_prefix=draw(b, h_kv, t, d),  # [B_max, H_kv, T, D]
        v_prefix=draw(b, h_kv, t, d),
        k_t=draw(b, h_kv, 1, d),  # [B_max, H_kv, 1, D]
        v_t=draw(b, h_kv, 1, d),
    )


def prefilled_cache(
    config: ScanConfig, inputs: ScanInputs, batch_size: int
) -> DynamicKVCache | PreallocatedKVCache:
    """A cache of config.cache kind holding the first `batch_size` sequences' T prefix positions."""
    b, t = batch_size, config.seq_len
    cache = make_cache(
        config.cache,
        b,
        config.num_kv_heads,
        config.head_dim,
        max_seq_len=t + 1,
        dtype=config.dtype,
    )
    cache.append(
        np.ascontiguousarray(inputs.k_prefix[:b]), np.ascontiguousarray(inputs.v_prefix[:b])
    )  # prefill: the cache now holds T positions, [B, H_kv, T, D]
    return cache


class BatchInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt inside `run_batch`; `samples` holds every sample taken at that B before it,
    `stage` what was running when it came: an implementation's name (that one has fewer than `repeats`
    samples, those after it none) or "probe" (every implementation has its samples; the read probe, which
    the table's ratio needs, has none)."""

    def __init__(self, samples: Sequence[Sample], stage: str) -> None:
        super().__init__()
        self.samples: tuple[Sample, ...] = tuple(samples)
        self.stage = stage


def _time_impl(
    config: ScanConfig, inputs: ScanInputs, batch_size: int, impl: str, out: list[float]
) -> tuple[list[float], float]:
    """Oracle, then the timed samples (ms) of one implementation at one B; (samples, max |error|).
    Each sample is appended to `out` as it is taken (kept when a KeyboardInterrupt cuts the timing).

    Raises OracleMismatch (nothing timed) when `scan_impls.check_step` fails.
    """
    b, t = batch_size, config.seq_len
    q_t = np.ascontiguousarray(inputs.q_t[:b])  # [B, H, 1, D]
    k_t = np.ascontiguousarray(inputs.k_t[:b])  # [B, H_kv, 1, D]
    v_t = np.ascontiguousarray(inputs.v_t[:b])
    step = make_step(impl, q_t)
    cache = prefilled_cache(config, inputs, b)
    if step.prepare is not None:
        step.prepare(q_t, k_t, v_t, cache)  # compile outside the oracle and the timed region
    # Oracle and shape checks before any timing.
    max_err = check_step(step, q_t, k_t, v_t, cache, lambda: prefilled_cache(config, inputs, b))

    def rewind() -> None:
        cache.truncate(t)  # O(1): back to T cached positions, so every sample times the same step

    samples_ms = measure(
        step.fn, q_t, k_t, v_t, cache, warmup=config.warmup, repeats=config.repeats, setup=rewind, out=out
    )
    return samples_ms, max_err


def run_batch(
    config: ScanConfig, inputs: ScanInputs, batch_size: int, impls: Sequence[str] = ("numpy",)
) -> BatchResult:
    """Check, then time, one decode step at `batch_size` per implementation; then the read probe.

    The implementations (`scan_impls.IMPLS`) run one after another in the given order, each checked
    by its oracle (`scan_impls.check_step`) before it is timed; one that fails is not timed and is
    listed in `oracle_failures`. Raises OracleMismatch (an AssertionError) when every implementation
    failed (nothing was timed, not even the probe); ValueError for no or unknown implementations;
    BatchInterrupted (a KeyboardInterrupt) with every sample taken so far at this B on a Ctrl-C.
    """
    if not impls or any(i not in IMPLS for i in impls):
        raise ValueError(f"impls must be a non-empty subset of {IMPLS}, got {list(impls)}")
    b = batch_size
    samples: list[Sample] = []
    errors: list[tuple[str, float]] = []
    failures: list[tuple[str, str]] = []
    for impl in impls:
        taken: list[float] = []
        try:
            _, max_err = _time_impl(config, inputs, b, impl, taken)
        except OracleMismatch as exc:
            failures.append((impl, str(exc)))
            continue
        except KeyboardInterrupt:
            raise BatchInterrupted(samples + _samples(config, b, impl, taken), impl) from None
        errors.append((impl, max_err))
        samples += _samples(config, b, impl, taken)
    if not errors:
        raise OracleMismatch("; ".join(message for _, message in failures))

    nbytes = kv_bytes_per_step(config, b)
    probe = np.ones(nbytes // np.dtype(config.dtype).itemsize, dtype=config.dtype)
    # A BLAS dot product streams the buffer once: the fastest plain read we found on this machine.
    try:
        probe_ms = measure(np.dot, probe, probe, warmup=config.warmup, repeats=config.repeats)
    except KeyboardInterrupt:
        raise BatchInterrupted(samples, "probe") from None
    return BatchResult(
        b,
        tuple(samples),
        tuple(probe_ms),
        nbytes,
        max(e for _, e in errors),
        tuple(errors),
        tuple(failures),
    )


def _samples(config: ScanConfig, b: int, impl: str, samples_ms: Sequence[float]) -> list[Sample]:
    """The raw rows of one implementation's timed calls at B = b."""
    return [
        Sample(
            batch_size=b,
            sequence_length=config.seq_len,
            elapsed_ms=ms,
            repeat=i,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=config.dtype,
            cache=config.cache,
            model=config.model,
            seed=config.seed,
            warmup=config.warmup,
            impl=impl,
        )
        for i, ms in enumerate(samples_ms)
    ]


def iter_scan(config: ScanConfig, inputs: ScanInputs | None = None) -> Iterator[BatchResult]:
    """Run the scan one batch size at a time (in the given order), yielding each result as it is done.

    A generator, so a caller can write every finished B to disk before the next one starts.
    """
    inputs = build_inputs(config) if inputs is None else inputs
    for b in config.batch_sizes:
        yield run_batch(config, inputs, b)
