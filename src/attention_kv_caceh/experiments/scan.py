"""The batch-size scan (exercise 9.2 of the notes): how B changes step latency and throughput.

For each batch size B, one decode step is timed: append one position to a KV cache that holds T
positions, then attend a `[B, H, 1, D]` query over the T+1 cached keys and values (`[B, H_kv, T+1, D]`).
Projections are not part of the step: q_t, k_t and v_t are inputs built once, so what is timed is the
attention over the cache and the cache's own append cost (the copy of a Dynamic cache, the slice write
of a Preallocated one).

Order (notes, 6.4): inputs built once from the seed and shared by every B (the first B sequences of one
`[B_max, ...]` set) -> the step's output checked against a float64 per-sequence reference -> warm-up ->
timed raw samples (the cache is rewound to T outside the timed region before every call) -> a read-
bandwidth probe over as many bytes as the step reads from the cache, in the same run.

Shape legend as in attention.py: B batch, H query heads, H_kv KV heads, T cached positions, D head dim.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.attention import multihead_decode_step
from attention_kv_caceh.cache import make_cache
from attention_kv_caceh.oracle import OracleMismatch, check_decode_batch
from attention_kv_caceh.presets import kv_cache_bytes
from attention_kv_caceh.timing import Sample, measure, summarize_samples

__all__ = [
    "SAMPLE_FIELDS",
    "SATURATION_GAIN",
    "SUMMARY_FIELDS",
    "BatchResult",
    "ScanConfig",
    "ScanInputs",
    "build_inputs",
    "doubling_gains",
    "iter_scan",
    "kv_bytes_per_step",
    "run_batch",
    "saturation_point",
    "saturation_verdict",
    "scan_table",
]

FloatArray = npt.NDArray[np.floating[Any]]

SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Sample))
SUMMARY_FIELDS: tuple[str, ...] = (
    "batch_size",
    "sequence_length",
    "count",
    "p50_ms",
    "p95_ms",
    "min_ms",
    "max_ms",
    "mean_ms",
    "stdev_ms",
    "per_sequence_ms",
    "positions_per_s",
    "speedup",
    "kv_bytes_per_step",
    "kv_read_gb_s",
    "probe_read_gb_s",
    "bandwidth_ratio",
)
# Doubling B must raise positions/s by at least this much, or the scan has saturated.
SATURATION_GAIN = 0.10
CACHE_KINDS = ("dynamic", "preallocated")
DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class ScanConfig:
    """One scan: the batch sizes and the attention shape every B shares. Defaults: the notes' M1 scan."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    seq_len: int = 128
    head_dim: int = 64
    num_heads: int = 1
    num_kv_heads: int = 1
    dtype: str = "float32"
    cache: str = "dynamic"
    model: str = ""
    warmup: int = 3
    repeats: int = 30
    seed: int = 42

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ValueError("batch_sizes must not be empty")
        bad = [b for b in self.batch_sizes if b < 1]
        if bad:
            raise ValueError(f"batch_sizes must be positive, got {list(self.batch_sizes)}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"batch_sizes must be distinct, got {list(self.batch_sizes)}")
        for name in ("seq_len", "head_dim", "num_heads", "num_kv_heads", "repeats"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (np.random.default_rng), got {self.seed}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {self.cache!r}")


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
    """What one batch size produced: its raw samples, probe samples and the oracle's verdict."""

    batch_size: int
    samples: tuple[Sample, ...]
    probe_samples_ms: tuple[float, ...]
    kv_bytes_per_step: int
    oracle_max_abs_error: float


def kv_bytes_per_step(config: ScanConfig, batch_size: int) -> int:
    """Bytes of K and V one decode step reads: 2 * B * H_kv * (T + 1) * D * itemsize."""
    itemsize = int(np.dtype(config.dtype).itemsize)
    return kv_cache_bytes(batch_size, config.num_kv_heads, config.seq_len + 1, config.head_dim, itemsize)


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


def run_batch(config: ScanConfig, inputs: ScanInputs, batch_size: int) -> BatchResult:
    """Check, then time, one decode step at `batch_size`; then time the read-bandwidth probe.

    Raises OracleMismatch (an AssertionError) when the batched step disagrees with the per-sequence
    float64 reference or has the wrong shape; nothing is timed in that case.
    """
    b, t = batch_size, config.seq_len
    q_t = np.ascontiguousarray(inputs.q_t[:b])  # [B, H, 1, D]
    k_t = np.ascontiguousarray(inputs.k_t[:b])  # [B, H_kv, 1, D]
    v_t = np.ascontiguousarray(inputs.v_t[:b])
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
    )  # prefill: the cache now holds T positions

    # Oracle and shape checks before any timing.
    output, weights = multihead_decode_step(q_t, k_t, v_t, cache)  # [B, H, 1, D], [B, H, 1, T+1]
    if cache.length != t + 1:
        raise OracleMismatch(f"cache length {cache.length} after one step, expected {t + 1}")
    keys, values = cache.keys, cache.values  # [B, H_kv, T+1, D]
    max_err = check_decode_batch(q_t, keys, values, output, weights)
    if output.dtype != np.dtype(config.dtype):
        raise OracleMismatch(f"output dtype {output.dtype} != input dtype {config.dtype}")

    def rewind() -> None:
        cache.truncate(t)  # O(1): back to T cached positions, so every sample times the same step

    samples_ms = measure(
        multihead_decode_step,
        q_t,
        k_t,
        v_t,
        cache,
        warmup=config.warmup,
        repeats=config.repeats,
        setup=rewind,
    )

    nbytes = kv_bytes_per_step(config, b)
    probe = np.ones(nbytes // np.dtype(config.dtype).itemsize, dtype=config.dtype)
    # A BLAS dot product streams the buffer once: the fastest plain read we found on this machine.
    probe_ms = measure(np.dot, probe, probe, warmup=config.warmup, repeats=config.repeats)

    samples = tuple(
        Sample(
            batch_size=b,
            sequence_length=t,
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
        )
        for i, ms in enumerate(samples_ms)
    )
    return BatchResult(b, samples, tuple(probe_ms), nbytes, max_err)


def iter_scan(config: ScanConfig, inputs: ScanInputs | None = None) -> Iterator[BatchResult]:
    """Run the scan one batch size at a time (in the given order), yielding each result as it is done.

    A generator, so a caller can write every finished B to disk before the next one starts.
    """
    inputs = build_inputs(config) if inputs is None else inputs
    for b in config.batch_sizes:
        yield run_batch(config, inputs, b)


def scan_table(
    samples: Sequence[Sample],
    probe_samples_ms: Mapping[int, Sequence[float]] | None = None,
    kv_bytes: Mapping[int, int] | None = None,
) -> list[dict[str, float]]:
    """The summary table, one row per batch size, recomputed from raw samples only.

    Per B: the statistics of `summarize_samples`; per_sequence_ms = P50 / B (ms); positions_per_s =
    B * T / P50 (T = the cached sequence length); speedup = positions_per_s / that of the smallest B
    (B = 1 in the default scan); kv_read_gb_s = kv bytes per step / P50 (1e9 bytes/s); probe_read_gb_s
    = the same bytes / P50 of the probe; bandwidth_ratio = kv_read / probe_read. Bandwidth columns are
    NaN where the probe samples or byte counts are not given. Rows are sorted by B.

    Raises ValueError for no samples, or for samples of one B with different sequence lengths.
    """
    if not samples:
        raise ValueError("scan_table needs at least one sample")
    by_b: dict[int, list[Sample]] = {}
    for s in samples:
        by_b.setdefault(s.batch_size, []).append(s)
    rows: list[dict[str, float]] = []
    for b in sorted(by_b):
        group = by_b[b]
        lengths = {s.sequence_length for s in group}
        if len(lengths) != 1:
            raise ValueError(f"samples of B={b} mix sequence lengths {sorted(lengths)}")
        t = lengths.pop()
        stats = summarize_samples([s.elapsed_ms for s in group])
        p50_s = stats["p50_ms"] / 1000
        nbytes: float = kv_bytes[b] if kv_bytes and b in kv_bytes else math.nan
        kv_gb_s = nbytes / p50_s / 1e9 if p50_s > 0 else math.nan
        probe = probe_samples_ms.get(b) if probe_samples_ms else None
        probe_gb_s = nbytes / (summarize_samples(probe)["p50_ms"] / 1000) / 1e9 if probe else math.nan
        rows.append(
            {
                "batch_size": b,
                "sequence_length": t,
                "count": int(stats["count"]),
                "p50_ms": stats["p50_ms"],
                "p95_ms": stats["p95_ms"],
                "min_ms": stats["min_ms"],
                "max_ms": stats["max_ms"],
                "mean_ms": stats["mean_ms"],
                "stdev_ms": stats["stdev_ms"],
                "per_sequence_ms": stats["p50_ms"] / b,
                "positions_per_s": b * t / p50_s if p50_s > 0 else math.inf,
                "speedup": math.nan,
                "kv_bytes_per_step": nbytes,
                "kv_read_gb_s": kv_gb_s,
                "probe_read_gb_s": probe_gb_s,
                "bandwidth_ratio": kv_gb_s / probe_gb_s if probe else math.nan,
            }
        )
    base = rows[0]["positions_per_s"]
    for row in rows:
        row["speedup"] = row["positions_per_s"] / base
    return rows


def saturation_verdict(table: Sequence[Mapping[str, float]], gain: float = SATURATION_GAIN) -> str:
    """The first B at which doubling B raises positions/s by less than `gain` (10 %), or "Not reached".

    Consecutive rows of the table (sorted by B) are compared; when B does not exactly double between
    them, the gain is normalised per doubling: (ratio of positions/s) ** (1 / log2(B2 / B1)) - 1.
    """
    gains: list[tuple[int, int, float]] = []
    for b1, b2, per_doubling in doubling_gains(table):
        gains.append((b1, b2, per_doubling))
        if per_doubling < gain:
            return (
                f"Saturated at B = {b1}: going to B = {b2} raised positions/s by "
                f"{100 * per_doubling:.1f} % per doubling (< {100 * gain:.0f} %)"
            )
    if not gains:
        return "Not reached: a scan of one batch size has no doubling to compare"
    b1, b2, g = min(gains, key=lambda x: x[2])
    return (
        f"Not reached: every doubling raised positions/s by >= {100 * gain:.0f} % "
        f"(smallest: {100 * g:.1f} % from B = {b1} to B = {b2})"
    )


def doubling_gains(table: Sequence[Mapping[str, float]]) -> list[tuple[int, int, float]]:
    """(B1, B2, gain per doubling) for consecutive rows sorted by B: the rule of `saturation_verdict`.

    gain = (positions/s at B2 / positions/s at B1) ** (1 / log2(B2 / B1)) - 1, so a step of exactly one
    doubling gives the plain relative gain. Rows need `batch_size` and `positions_per_s`.
    """
    rows = sorted(table, key=lambda r: r["batch_size"])
    out: list[tuple[int, int, float]] = []
    for lo, hi in itertools.pairwise(rows):
        b1, b2 = int(lo["batch_size"]), int(hi["batch_size"])
        out.append((b1, b2, (hi["positions_per_s"] / lo["positions_per_s"]) ** (1 / math.log2(b2 / b1)) - 1))
    return out


def saturation_point(table: Sequence[Mapping[str, float]], gain: float = SATURATION_GAIN) -> int | None:
    """The B that `saturation_verdict` names ("Saturated at B = ..."), or None when not reached."""
    for b1, _, per_doubling in doubling_gains(table):
        if per_doubling < gain:
            return b1
    return None
