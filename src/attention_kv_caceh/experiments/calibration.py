"""What the roofline prediction is built from, measured before an experiment times anything.

Two figures: the fixed per-call cost of a decode step, taken at the smallest shape (B = 1, T = 1)
with the implementation whose P50s are predicted (NumPy, the fused kernel and torch each have their
own fixed cost), and the read bandwidth of the scan's probe (`np.dot(buf, buf)`, one BLAS read stream). `bytes_moved_per_step` counts what one step moves, so
`prediction` can state P50(B) = overhead + bytes / bandwidth before the first timed sample.

Shape legend as in attention.py: B batch, H query heads, H_kv KV heads, T cached positions, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_kv_caceh.cache import DynamicKVCache, PreallocatedKVCache, make_cache
from attention_kv_caceh.experiments.scan import ScanConfig, ScanInputs, build_inputs, kv_bytes_per_step
from attention_kv_caceh.experiments.scan_impls import check_step, make_step
from attention_kv_caceh.timing import measure, summarize_samples

__all__ = ["Calibration", "bytes_moved_per_step", "calibrate", "read_probe"]


def bytes_moved_per_step(config: ScanConfig, batch_size: int, seq_len: int | None = None) -> int:
    """Bytes one decode step moves through memory at B = batch_size over T = seq_len cached positions.

    Attention reads K and V once: 2 * B * H_kv * (T + 1) * D * itemsize (`kv_bytes_per_step`). A
    Dynamic cache's append also copies: `np.concatenate` reads the T old positions of K and V and
    writes T + 1 new ones, 2 * B * H_kv * (2T + 1) * D * itemsize more. A Preallocated cache writes one
    position (2 * B * H_kv * D * itemsize). Query, output and weights (`[B, H, 1, T+1]`) are left out:
    they are H / H_kv / D times smaller than the cache. T defaults to config.seq_len.
    """
    t = config.seq_len if seq_len is None else seq_len
    per_position = 2 * batch_size * config.num_kv_heads * config.head_dim * np.dtype(config.dtype).itemsize
    append = (2 * t + 1) if config.cache == "dynamic" else 1
    return per_position * (t + 1 + append)


@dataclass(frozen=True)
class Calibration:
    """What the roofline prediction is built from, measured before any batch size is timed.

    overhead_samples_ms: the decode step at the smallest shape (B = 1, T = 1, the scan's H, H_kv, D,
    dtype and cache), which moves `overhead_bytes`; probe_samples_ms: `np.dot(buf, buf)` over a buffer
    of `probe_bytes` (the K/V bytes the largest B reads), as the scan's own probe. Milliseconds.
    """

    overhead_shape: str
    overhead_bytes: int
    overhead_samples_ms: tuple[float, ...]
    probe_bytes: int
    probe_samples_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.overhead_bytes < 0 or self.probe_bytes < 1:
            raise ValueError(
                f"overhead_bytes must be >= 0 and probe_bytes >= 1, got {self.overhead_bytes}, {self.probe_bytes}"
            )
        for name in ("overhead_samples_ms", "probe_samples_ms"):
            summarize_samples(getattr(self, name))  # raises ValueError for empty or non-finite
        if summarize_samples(self.probe_samples_ms)["p50_ms"] <= 0:
            raise ValueError("probe_samples_ms has a P50 of 0 ms: no bandwidth can be derived")

    @property
    def bandwidth_bytes_per_ms(self) -> float:
        """probe_bytes / P50 of the probe samples (bytes per millisecond)."""
        return self.probe_bytes / summarize_samples(self.probe_samples_ms)["p50_ms"]

    @property
    def bandwidth_gb_s(self) -> float:
        """The probe's read bandwidth in GB/s (1e9 bytes/s)."""
        return self.bandwidth_bytes_per_ms * 1000 / 1e9

    @property
    def overhead_ms(self) -> float:
        """Fixed per-call cost: P50 of the smallest shape minus its bytes / bandwidth (never below 0)."""
        p50 = summarize_samples(self.overhead_samples_ms)["p50_ms"]
        return max(0.0, p50 - self.overhead_bytes / self.bandwidth_bytes_per_ms)

    def to_json(self) -> dict[str, Any]:
        """The raw samples and bytes, plus the derived figures (for readers of the file)."""
        return {
            "overhead_shape": self.overhead_shape,
            "overhead_bytes": self.overhead_bytes,
            "overhead_samples_ms": list(self.overhead_samples_ms),
            "probe_bytes": self.probe_bytes,
            "probe_samples_ms": list(self.probe_samples_ms),
            "overhead_ms": self.overhead_ms,
            "bandwidth_gb_s": self.bandwidth_gb_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        """Rebuild from `to_json` output (derived figures are recomputed)."""
        return cls(
            overhead_shape=str(data["overhead_shape"]),
            overhead_bytes=int(data["overhead_bytes"]),
            overhead_samples_ms=tuple(float(x) for x in data["overhead_samples_ms"]),
            probe_bytes=int(data["probe_bytes"]),
            probe_samples_ms=tuple(float(x) for x in data["probe_samples_ms"]),
        )


def calibrate(
    config: ScanConfig,
    inputs: ScanInputs | None = None,
    impl: str = "numpy",
    probe_samples_ms: Sequence[float] | None = None,
) -> Calibration:
    """Measure the per-call overhead and the read bandwidth before the scan times any batch size.

    The overhead is `impl`'s own step (`scan_impls.IMPLS`: the implementation whose P50s are
    predicted) at the smallest shape (B = 1, T = 1): checked first by its oracle (`scan_impls.check_step`,
    OracleMismatch on disagreement), compiled where it needs to be, warmed up and timed like
    `run_batch`. The probe times `np.dot` over kv_bytes_per_step(config, max B) bytes, unless
    `probe_samples_ms` (an earlier probe over those bytes, e.g. another implementation's calibration)
    is given, so several implementations' predictions share one bandwidth. Uses config.warmup and
    config.repeats. Raises ValueError for an unknown impl.
    """
    inputs = build_inputs(config) if inputs is None else inputs
    q_t = np.ascontiguousarray(inputs.q_t[:1])  # [1, H, 1, D]
    k_t = np.ascontiguousarray(inputs.k_t[:1])  # [1, H_kv, 1, D]
    v_t = np.ascontiguousarray(inputs.v_t[:1])
    step = make_step(impl, q_t)

    def one_position() -> DynamicKVCache | PreallocatedKVCache:
        cache = make_cache(
            config.cache, 1, config.num_kv_heads, config.head_dim, max_seq_len=2, dtype=config.dtype
        )
        cache.append(
            np.ascontiguousarray(inputs.k_prefix[:1, :, :1]), np.ascontiguousarray(inputs.v_prefix[:1, :, :1])
        )  # [1, H_kv, 1, D]: T = 1
        return cache

    cache = one_position()
    if step.prepare is not None:
        step.prepare(q_t, k_t, v_t, cache)
    check_step(step, q_t, k_t, v_t, cache, one_position)

    def rewind() -> None:
        cache.truncate(1)

    overhead = measure(
        step.fn,
        q_t,
        k_t,
        v_t,
        cache,
        warmup=config.warmup,
        repeats=config.repeats,
        setup=rewind,
    )
    nbytes = kv_bytes_per_step(config, max(config.batch_sizes))
    if probe_samples_ms is None:
        probe_samples_ms = read_probe(nbytes, config.dtype, warmup=config.warmup, repeats=config.repeats)
    shape = (
        f"B=1, T=1, H={config.num_heads}, H_kv={config.num_kv_heads}, D={config.head_dim}, "
        f"{config.dtype}, {config.cache} cache, {impl} step"
    )
    return Calibration(
        shape, bytes_moved_per_step(config, 1, 1), tuple(overhead), nbytes, tuple(probe_samples_ms)
    )


def read_probe(nbytes: int, dtype: str, *, warmup: int = 3, repeats: int = 30) -> list[float]:
    """Time `np.dot(buf, buf)` over a buffer of `nbytes` (rounded down to whole items); milliseconds.

    The scan's read-bandwidth probe as a function, for measurements taken before an experiment starts
    (the roofline prediction of the scan and of the `cache` experiment). Raises ValueError when
    nbytes holds less than one item of dtype.
    """
    n = nbytes // np.dtype(dtype).itemsize
    if n < 1:
        raise ValueError(f"a probe of {nbytes} bytes holds no {dtype} item")
    buf = np.ones(n, dtype=dtype)
    return measure(np.dot, buf, buf, warmup=warmup, repeats=repeats)
